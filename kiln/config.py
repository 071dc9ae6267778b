"""The one module that reads the environment.

KILN_CACHE_DIR  where compiled objects and libraries are cached (default: $XDG_CACHE_HOME/kiln,
                else ~/.cache/kiln)
KILN_CXX        the C++ compiler (default: $CXX, else c++)
KILN_PCH        "1": compile generated C++ with a precompiled header of each file's leading
                #include lines (GCC only; the same object code, built faster when many small
                packages share one cache: `kiln fuzz` sets it; kiln/toolchain/cxx.py)
KILN_CONV_EPIS  "all": the CPU direct convolution's conv.cpp specialises the stores of every
                (activation, residual) pair, not only its package's, so the packages of one
                target level share one conv.cpp object (many small convolution packages
                built into one cache, as the test suite does; kiln/targets/cpu/conv.py)"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    explicit = os.environ.get("KILN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kiln"


def cxx() -> str:
    return os.environ.get("KILN_CXX") or os.environ.get("CXX") or "c++"


def pch() -> bool:
    return os.environ.get("KILN_PCH", "") == "1"


def conv_all_epilogues() -> bool:
    return os.environ.get("KILN_CONV_EPIS", "") == "all"


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
