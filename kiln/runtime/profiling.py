"""Per-step times of a CPU package measured by its own compiled code (kiln.h, ABI minor 6).

Every CPU package's C++ wrapper brackets each step (a fused kernel, a GEMM, a library routine,
an ATen fallback call) with profiling hooks that cost one branch when off
(kiln/targets/cpu/wrapper_prof.py). `enable(runner)` turns them on for a loaded model; after
each run `steps(runner)` gives every step's seconds in that run (`last_s`) and summed over the
profiled runs (`total_s`), with its name (the manifest's kernel name), kind and source ops.
From C: kiln_model_set_profiling and kiln_model_profile_step, or KILN_PROFILE=1 in the
environment (a summary on stderr when the model is freed)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from kiln.errors import KilnError, UnsupportedError
from kiln.runtime.loader import Runner, last_error

__all__ = ["StepTime", "available", "enable", "runs", "steps", "write_summary"]

_MINOR = 6  # the libkiln minor that has the profiling functions


@dataclass(frozen=True)
class StepTime:
    name: str
    kind: str
    source_ops: tuple[str, ...]
    last_s: float  # in the last profiled run
    total_s: float  # summed over the profiled runs


def _fn(runner: Runner, name: str, res, args):
    lib = runner._lib
    if lib.kiln_abi_minor() < _MINOR:
        raise UnsupportedError(f"this libkiln (ABI minor {lib.kiln_abi_minor()}) has no "
                               f"profiling functions (minor {_MINOR}); rebuild it with "
                               "python -m kiln.runtime")
    fn = lib[name]  # a fresh function object: its own prototype
    fn.restype, fn.argtypes = res, args
    return fn


def _handle(runner: Runner) -> ctypes.c_void_p:
    runner._check_open()
    return runner._handle


def _entry(entry: str | None) -> bytes | None:
    return entry.encode() if entry is not None else None


def available(runner: Runner, entry: str | None = None) -> bool:
    """Whether the package has the hooks (a CPU package compiled with them) and this libkiln
    the functions."""
    if runner._lib.kiln_abi_minor() < _MINOR:
        return False
    n = _fn(runner, "kiln_model_profile_num_steps", ctypes.c_int64,
            [ctypes.c_void_p, ctypes.c_char_p])(_handle(runner), _entry(entry))
    if n < 0:
        raise KilnError(last_error())
    return n > 0


def enable(runner: Runner, on: bool = True) -> None:
    """Profiling on (counters cleared when it was off) or off for every entry point."""
    if _fn(runner, "kiln_model_set_profiling", ctypes.c_int,
           [ctypes.c_void_p, ctypes.c_int])(_handle(runner), int(bool(on))):
        raise UnsupportedError(last_error())


def runs(runner: Runner, entry: str | None = None) -> int:
    """Profiled runs that succeeded since profiling was turned on."""
    n = _fn(runner, "kiln_model_profile_runs", ctypes.c_int64,
            [ctypes.c_void_p, ctypes.c_char_p])(_handle(runner), _entry(entry))
    if n < 0:
        raise KilnError(last_error())
    return int(n)


def steps(runner: Runner, entry: str | None = None) -> list[StepTime]:
    """Every step of the entry point (None: the default one), in program order."""
    h, e = _handle(runner), _entry(entry)
    cp, dp = ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_double)
    count = _fn(runner, "kiln_model_profile_num_steps", ctypes.c_int64,
                [ctypes.c_void_p, ctypes.c_char_p])
    step = _fn(runner, "kiln_model_profile_step", ctypes.c_int,
               [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, cp, cp, cp, dp, dp])
    n = count(h, e)
    if n < 0:
        raise KilnError(last_error())
    out = []
    name, kind, src = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_char_p()
    last, total = ctypes.c_double(), ctypes.c_double()
    for i in range(n):
        if step(h, e, i, ctypes.byref(name), ctypes.byref(kind), ctypes.byref(src),
                ctypes.byref(last), ctypes.byref(total)):
            raise KilnError(last_error())
        ops = tuple(s for s in (src.value or b"").decode().split(", ") if s)
        out.append(StepTime(name.value.decode(), kind.value.decode(), ops, last.value,
                            total.value))
    return out


def write_summary(runner: Runner, path: str | os.PathLike[str] | None = None) -> None:
    """The C runtime's text summary (kiln_model_profile_write): stderr, or appended to path."""
    if _fn(runner, "kiln_model_profile_write", ctypes.c_int,
           [ctypes.c_void_p, ctypes.c_char_p])(
               _handle(runner), os.fsencode(path) if path is not None else None):
        raise KilnError(last_error())
