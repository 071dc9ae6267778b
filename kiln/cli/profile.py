"""``kiln profile PKG``: time each step of a package (CPU, or CUDA on a GPU).

The package's own run (the C++ wrapper in lib/model.so, through libkiln) is timed end to end
with profiling off. Per step, a CPU package times itself: its C++ wrapper has profiling hooks
around every step (kiln/targets/cpu/wrapper_prof.py), turned on through libkiln
(kiln.runtime.profiling; from C kiln_model_set_profiling or KILN_PROFILE=1), and each step's
median over the profiled runs is reported with its share of the end-to-end median (the rest,
"other", is the wrapper's own work: input checks, output allocation, the call from Python).

A package compiled before the hooks is timed the old way: kiln runs the package's Python
wrapper (src/model.py: the same Program IR printed
as Python, calling the same kernels of lib/model.so through ctypes) under a line tracer that
times each generated line: one line is one step (a kernel, a GEMM, a library routine). The
Python wrapper runs GEMMs through torch.matmul (the package links the backend the manifest
names; its own timings are the autotuning ones) and library routines through their numpy
twins, so those rows are marked as stand-ins.

A CUDA package is timed on the device by CUPTI (torch.profiler's CUDA activity trace): every
kernel the package launches (kiln's Triton kernels, named after their graph nodes, and the
library kernels of cuBLAS/cuBLASLt/CUTLASS it calls) is recorded with its device start and end,
CUDA-graph replays included. The trace of `repeat` runs is cut into runs (each run launches the
same kernels in the same order) and each kernel's device time is the median over runs. Library
kernels carry the library's own name; they are listed under that name."""

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
from torch.profiler import ProfilerActivity, profile

from kiln.cli.manifest_view import entries, random_inputs
from kiln.errors import UnsupportedError
from kiln.package.reader import read_package
from kiln.runtime import load, profiling

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
    if str(manifest.get("device", "cpu")).startswith("cuda"):
        return _profile_cuda(path, manifest, repeat, warmup, seed)
    args, kwargs = random_inputs(manifest, seed)
    runner = load(path)
    try:
        with torch.no_grad():
            for _ in range(warmup):
                runner(*args, **kwargs)
            totals = []
            for _ in range(max(repeat, 1)):
                t = time.perf_counter()
                runner(*args, **kwargs)
                totals.append(time.perf_counter() - t)
            hooked = profiling.available(runner)
            runs = _hooked_runs(runner, args, kwargs, repeat) if hooked else []
    finally:
        runner.close()
    head = {"package": str(path), "device": "cpu", "threads": torch.get_num_threads(),
            "repeat": max(repeat, 1), "warmup": warmup,
            "package_run_median_s": statistics.median(totals), "package_run_min_s": min(totals)}
    if hooked:
        return {**head, **_hooked_steps(manifest, runs, head["package_run_median_s"])}
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
            "method": "end to end: the package (lib/model.so's C++ wrapper); per step: "
                      "src/model.py's lines under a tracer (the same kernels, called "
                      "through ctypes)"}


def _hooked_runs(runner, args, kwargs, repeat: int) -> list[list]:
    """`repeat` runs with the package's own profiling hooks on: the steps of each."""
    profiling.enable(runner)
    try:
        out = []
        for _ in range(max(repeat, 1)):
            runner(*args, **kwargs)
            out.append(profiling.steps(runner))
        return out
    finally:
        profiling.enable(runner, False)


def _hooked_steps(manifest: dict[str, Any], runs: list[list], total_s: float) -> dict:
    """Per-step medians over the profiled runs, in the manifest's kernel order (steps it does
    not list, e.g. ATen fallback calls, after), each with its share of the end-to-end
    median."""
    kernels = {str(k.get("name")): i for i, k in enumerate(entries(manifest.get("kernels")))}
    first = runs[0]
    order = sorted(range(len(first)), key=lambda i: (kernels.get(first[i].name, len(kernels)), i))
    steps = []
    for i in order:
        med = statistics.median(r[i].last_s for r in runs)
        steps.append({"name": first[i].name, "kind": first[i].kind,
                      "source_ops": list(first[i].source_ops), "median_s": med,
                      "share": med / total_s if total_s > 0 else 0.0,
                      "timed_as": "package (C++ hooks)"})
    other = total_s - sum(s["median_s"] for s in steps)
    return {"steps": steps, "other_s": max(other, 0.0),
            "method": "end to end: the package's run (lib/model.so through libkiln), profiling "
                      "off; per step: the package's own profiling hooks (a clock read before "
                      "and after each step in the C++ wrapper), median over the profiled runs; "
                      "share: of the end-to-end median; other: the wrapper's own work "
                      "(checks, output allocation, the call)"}


def _source(module) -> tuple[list[str], int]:
    return inspect.getsourcelines(module.run)


def _profile_cuda(path, manifest: dict[str, Any], repeat: int, warmup: int,
                  seed: int) -> dict[str, Any]:
    """Per-kernel device times of a CUDA package (see the module's docstring)."""
    if not torch.cuda.is_available():
        raise UnsupportedError(f"{path} is a CUDA package; profiling it needs a GPU and "
                               f"torch.cuda.is_available() is False here")
    repeat = max(repeat, 1)
    args, kwargs = random_inputs(manifest, seed)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    runner = load(path, device="cuda")
    try:
        with torch.no_grad():
            for _ in range(warmup):
                runner(*args, **kwargs)
            torch.cuda.synchronize()
            totals = []
            for _ in range(repeat):
                t = time.perf_counter()
                runner(*args, **kwargs)
                torch.cuda.synchronize()
                totals.append(time.perf_counter() - t)
            kernels_seen = _cupti_kernels(lambda: runner(*args, **kwargs), repeat)
    finally:
        runner.close()
    named = {str(k.get("name")): k for k in entries(manifest.get("kernels"))}
    steps = [_cuda_step(name, times, named) for name, times in kernels_seen.items()]
    return {"package": str(path), "device": "cuda", "threads": 0, "repeat": repeat,
            "warmup": warmup, "package_run_median_s": statistics.median(totals),
            "package_run_min_s": min(totals), "steps": steps,
            "device_total_median_s": sum(s["median_s"] for s in steps),
            "method": "end to end: the package's run with a device synchronise after each; "
                      "per kernel: device start/end from CUPTI (torch.profiler), median "
                      "over runs"}


def _cuda_step(name: str, times: list[float], named: dict[str, Any]) -> dict:
    k = named.get(name) or next((v for n, v in named.items() if name.startswith(n)), None)
    return {"name": name, "kind": str(k.get("kind", "triton")) if k else "library",
            "source_ops": list(k.get("source_ops", [])) if k else [],
            "median_s": statistics.median(times),
            "timed_as": "device time (CUPTI)" if k else "device time (CUPTI), library kernel"}


def _cupti_kernels(run_once, repeat: int) -> dict[str, list[float]]:
    """Kernel name -> device seconds per run (a kernel launched several times in one run is
    summed within the run), for `repeat` runs traced in one profiler session."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            run_once()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if _is_kernel(e)),
                    key=lambda e: e.time_range.start)
    if not events:
        raise UnsupportedError("the CUDA profiler recorded no kernels (CUPTI unavailable "
                               "or kernels in CUDA-graph replays not traced by this driver)")
    out: dict[str, list[float]] = {}
    if len(events) % repeat:  # runs differ in kernel count: one mean per kernel
        for e in events:
            out.setdefault(e.name, [0.0])[0] += e.time_range.elapsed_us() * 1e-6 / repeat
        return out
    per_run = len(events) // repeat
    for r in range(repeat):
        run: dict[str, float] = {}
        for e in events[r * per_run:(r + 1) * per_run]:
            run[e.name] = run.get(e.name, 0.0) + e.time_range.elapsed_us() * 1e-6
        for name, t in run.items():
            out.setdefault(name, []).append(t)
    return out


def _is_kernel(event) -> bool:
    kind = getattr(event, "device_type", None)
    return kind is not None and str(kind).endswith("CUDA") and \
        not event.name.startswith(("Memcpy", "Memset", "cudaGraph"))
