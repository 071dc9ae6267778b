"""Shared libraries a package opens by soname, loaded into the process from the pip wheels that
ship them before the package is opened (kiln/runtime/loader.py): cuBLAS for CUDA packages,
oneDNN for CPU packages whose convolutions use it (kiln_dnnl.h)."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib

from kiln.toolchain.onednn import find_library

__all__ = ["preload_cublas", "preload_dnnl"]


@functools.lru_cache(maxsize=None)
def preload_dnnl() -> str | None:
    """Loads oneDNN (libdnnl.so.3) from its installed OpenMP wheel (kiln/toolchain/onednn.py
    finds it: the library is a wheel data file in the environment's lib/), so a package whose
    convolutions use it opens it by soname. Returns the path, or None when no wheel has it or
    it does not load (the package then tries the standard paths and the build machine's path,
    and fails to load with an error naming libdnnl.so.3). As libkiln does before opening a
    model that links libgomp (runtime/src/cpu.cpp), OpenMP's idle spinning is bounded first
    (GOMP_SPINCOUNT, unless set or libgomp is already loaded): oneDNN's idle threads must
    not hold cores that kiln's pool needs."""
    if not (os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT")):
        try:
            ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        except OSError:  # not loaded yet: libgomp reads it when libdnnl brings it in
            os.environ["GOMP_SPINCOUNT"] = "1000"  # runtime/src/cpu.h kSpinCount
    found = find_library()
    if found is None:
        return None
    try:
        ctypes.CDLL(str(found[0]), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    return str(found[0])


@functools.lru_cache(maxsize=None)
def preload_cublas() -> str | None:
    """Loads cuBLAS from the nvidia pip packages (torch's CUDA wheels) into the process, so a
    CUDA model's dlopen("libcublas.so.N") finds it by soname. Returns the path, or None when
    there is no such package (then the model searches the standard library paths)."""
    try:
        # deferred: NVIDIA's CUDA wheels are optional (CPU-only installs have none)
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for lib in sorted(pathlib.Path(root).glob("*/lib/libcublas.so*"), reverse=True):
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                return str(lib)
            except OSError:
                continue
    return None
