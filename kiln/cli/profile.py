"""``kiln profile PKG``: time each step of a CPU package.

The package's own run (the C++ wrapper in lib/model.so, through libkiln) is timed end to end.
Per step, kiln runs the package's Python wrapper (src/model.py: the same Program IR printed
as Python, calling the same kernels of lib/model.so through ctypes) under a line tracer that
times each generated line: one line is one step (a kernel, a GEMM, a library routine). The
Python wrapper runs GEMMs through torch.matmul (the package links the backend the manifest
names; its own timings are the autotuning ones) and library routines through their numpy
twins, so those rows are marked as stand-ins. CUDA packages are not profiled (a CUDA event
per launch would be needed): the command says so."""

from __future__ import annotations

import importlib.util
import inspect
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kiln.cli.manifest_view import entries, random_inputs
from kiln.errors import UnsupportedError
from kiln.package.reader import read_package
from kiln.runtime import load

__all__ = ["profile_package"]

_CALL = re.compile(r"^\s*(?:lib\.(\w+)\(|torch\.matmul\(|_lib\(|torch\.ops\.)")
_COMMENT = re.compile(r"^\s*#\s*(?:gemm\s+)?(\w+)")


def _steps(source_lines: list[str], first: int) -> dict[int, str]:
    """Line number -> step name for the lines of the wrapper's `run` that run a step: the
    kernel a `lib.NAME(...)` line calls, else the name its comment line gives."""
    out, comment = {}, None
    for k, text in enumerate(source_lines):
        m = _COMMENT.match(text)
        if m:
            comment = m.group(1)
            continue
        m = _CALL.match(text)
        if m:
            out[first + k] = m.group(1) or comment or text.strip().split("(")[0]
    return out


def _load_wrapper(pkg, directory: Path):
    (directory / "model.py").write_bytes(pkg.read("src/model.py"))
    (directory / "model.so").write_bytes(pkg.read("lib/model.so"))
    spec = importlib.util.spec_from_file_location(f"kiln_profile_{id(directory)}",
                                                  directory / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.Model(directory / "model.so", pkg.weights())


def _traced_run(module, model, flat: list[Any], lines: dict[int, str]) -> dict[str, float]:
    """One run of the Python wrapper, seconds per step name."""
    code = module.run.__code__
    spent: dict[str, float] = {}
    state = {"line": None, "t": 0.0}

    def local(frame, event, arg):
        now = time.perf_counter()
        name = lines.get(state["line"])
        if name is not None:
            spent[name] = spent.get(name, 0.0) + now - state["t"]
        state["line"] = frame.f_lineno if event == "line" else None
        state["t"] = time.perf_counter()
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is code else None

    sys.settrace(tracer)
    try:
        model(*flat)
    finally:
        sys.settrace(None)
    return spent


def profile_package(path: str | Path, repeat: int = 20, warmup: int = 3,
                    seed: int = 0) -> dict[str, Any]:
    """Per-step median times of a CPU package (see the module's docstring)."""
    pkg = read_package(path)
    manifest = pkg.manifest
    if manifest.get("device", "cpu") != "cpu":
        raise UnsupportedError(f"kiln profile times CPU packages; {path} is a "
                               f"{manifest.get('device')} package (CUDA profiling is not "
                               f"implemented)")
    args, kwargs = random_inputs(manifest, seed)
    runner = load(path)
    with torch.no_grad():
        for _ in range(warmup):
            runner(*args, **kwargs)
        totals = []
        for _ in range(max(repeat, 1)):
            t = time.perf_counter()
            runner(*args, **kwargs)
            totals.append(time.perf_counter() - t)
    runner.close()
    flat = [*args, *kwargs.values()]
    with tempfile.TemporaryDirectory(prefix="kiln-profile-") as d:
        module, model = _load_wrapper(pkg, Path(d))
        source, first = _source(module)
        lines = _steps(source, first)
        for _ in range(warmup):
            model(*flat)
        runs = [_traced_run(module, model, flat, lines) for _ in range(max(repeat, 1))]
    kernels = {str(k.get("name")): k for k in entries(manifest.get("kernels"))}
    steps = []
    for name in dict.fromkeys(lines.values()):
        k = kernels.get(name, {})
        kind = str(k.get("kind", "?"))
        stand_in = ("torch.matmul stand-in" if kind.endswith("_gemm") and "lib." not in kind
                    else "numpy twin" if kind.startswith("lib.") else "")
        steps.append({"name": name, "kind": kind, "source_ops": list(k.get("source_ops", [])),
                      "median_s": statistics.median(r.get(name, 0.0) for r in runs),
                      "timed_as": stand_in or "package kernel"})
    return {"package": str(path), "device": "cpu", "threads": torch.get_num_threads(),
            "repeat": max(repeat, 1), "warmup": warmup,
            "package_run_median_s": statistics.median(totals),
            "package_run_min_s": min(totals),
            "steps": steps,
            "cuda": "not profiled: kiln profile times CPU packages only",
            "method": "end to end: the package (lib/model.so's C++ wrapper); per step: "
                      "src/model.py's lines under a tracer (the same kernels, called "
                      "through ctypes)"}


def _source(module) -> tuple[list[str], int]:
    return inspect.getsourcelines(module.run)
