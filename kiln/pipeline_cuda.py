"""The CUDA half of the pipeline: from a planned Program to model.so for NVIDIA GPUs.

Input: the schedule (kernels and GEMMs), the Loop IR buffers, the planned Program, the size
hints (example sizes) and the Options. Output: (sources, library path, info) where sources hold
`kernels_triton.py` (every kernel as Triton) and `model_cuda.cpp` (the wrapper), the library is
the linked model.so and info records the architectures and each kernel's launch config for the
manifest. Stages (timed by the caller's `_Run`): Triton codegen, cubins (parallel, cached by
content hash), wrapper codegen, C++ build against cuda.h only (no CUDA library is linked).

Invariants: the cubin blob is content-addressed (`<cache>/cubins/<sha256>.bin`), so the
wrapper's text, and with it the object cache key, changes whenever any cubin does."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

from kiln import config
from kiln.codegen.triton_gemm_kernel import print_gemm_kernel
from kiln.codegen.triton_kernel import choose_config, print_triton_kernel, print_triton_module
from kiln.codegen.wrapper_cuda import cubin_blob, print_cuda_wrapper
from kiln.errors import CompileError
from kiln.ir import loop as L
from kiln.options import Options
from kiln.schedule import Kernel
from kiln.schedule.gemm_fuse import GemmKernel
from kiln.toolchain.cxx import Toolchain, build_shared
from kiln.toolchain.autotune import device_available, tune
from kiln.toolchain.triton_aot import compile_cubins

RUNTIME = Path(__file__).parent / "runtime"
INCLUDE_DIRS = (RUNTIME / "include", RUNTIME / "model", RUNTIME / "src")


def default_archs() -> tuple[int, ...]:
    """The local GPU's architecture when torch sees a CUDA device, else sm_90."""
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return (major * 10 + minor,)
    except Exception:  # no usable CUDA: build for the default target
        pass
    return (90,)


def cuda_include_dir(opts: Options) -> Path:
    """A directory holding cuda.h: the option, else Triton's bundled copy, else CUDA's."""
    cands = [opts.cuda_include] if opts.cuda_include else []
    try:
        import triton
        cands.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "include"))
    except ImportError:
        pass
    cands.append("/usr/local/cuda/include")
    for c in cands:
        if c and (Path(c) / "cuda.h").is_file():
            return Path(c)
    raise CompileError(f"cuda.h not found (looked in {', '.join(c for c in cands if c)}); set "
                       "Options(cuda_include=...)")


def toolchain(opts: Options) -> Toolchain:
    jobs = opts.jobs or config.cpu_count()
    cflags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", *opts.opt_flags,
              f"-I{cuda_include_dir(opts)}"]
    cache = Path(opts.cache_dir) if opts.cache_dir else config.cache_dir()
    return Toolchain(opts.cxx or config.cxx(), cache / "build", tuple(cflags), ("-ldl",),
                     INCLUDE_DIRS, jobs)


def _write_blob(data: bytes, cache: Path) -> Path:
    path = cache / "cubins" / f"{hashlib.sha256(data).hexdigest()}.bin"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def build_cuda(run, steps, buffers, program, hints: dict[str, int], opts: Options,
               gemms: dict | None = None) -> tuple[dict[str, str], Path, dict]:
    archs = tuple(opts.cuda_archs) or default_archs()
    cache = Path(opts.cache_dir) if opts.cache_dir else config.cache_dir()
    kernels = [s for s in L.flat_steps(steps) if isinstance(s, Kernel)]  # regions' too

    configs = {k.name: choose_config(k, hints, opts.triton_max_rblock, opts.triton_num_warps)
               for k in kernels}
    tuned: dict = {}
    if opts.autotune and not opts.triton_num_warps and kernels and device_available() and \
            default_archs()[0] in archs:  # measure on the local GPU, for its architecture
        best, tuned = run.stage("autotune", lambda _: tune(
            kernels, buffers, hints, configs, default_archs()[0], cache, opts.jobs), None)
        configs.update(best)

    def codegen(_):
        return [print_gemm_kernel(k, buffers) if isinstance(k, GemmKernel) else
                print_triton_kernel(k, buffers, hints, configs[k.name]) for k in launched]
    launched = [s for s in L.flat_steps(steps) if isinstance(s, (Kernel, GemmKernel))]
    tks = run.stage("codegen_triton", codegen, None)
    module = print_triton_module(tks)
    cubins, tt = run.stage("cubins", lambda m: compile_cubins(m, tks, archs, cache, opts.jobs),
                           module)
    run.timings.update({f"cubins.{k}": v for k, v in tt.items()})
    names = [k.name for k in tks]
    blob, where = cubin_blob(cubins, names, archs)
    blob_path = _write_blob(blob, cache)
    by_name = {k.name: k for k in tks}
    cutlass = {n: c for n, c in (gemms or {}).items() if c.backend == "cutlass"}
    objects: list[Path] = []
    if cutlass:
        from kiln.autotune.cutlass_link import build_objects
        objects, cut_sources = run.stage("cutlass", lambda c: build_objects(
            steps, c, opts, cache / "cutlass"), cutlass)
    wrapper = run.stage("codegen_wrapper", lambda p: print_cuda_wrapper(
        p, by_name, cubins, archs, str(blob_path), where, opts.cuda_graphs, cutlass), program)
    sources = {"kernels_triton.py": module, "model_cuda.cpp": wrapper}
    if cutlass:
        sources.update(cut_sources)
    if opts.dump_dir:
        for name, text in sources.items():
            (Path(opts.dump_dir) / name).write_text(text)
    tc = toolchain(opts)
    if objects:
        from kiln.autotune.cutlass_link import cudart_static
        tc = dataclasses.replace(tc, ldflags=(*tc.ldflags, *map(str, objects),
                                              *cudart_static()))
    lib, ct = run.stage("compile", lambda s: build_shared(tc, s), {"model_cuda.cpp": wrapper})
    run.timings.update({f"compile.{k}": v for k, v in ct.items()})
    info = {"archs": list(archs), "cubin_bytes": len(blob), "autotuned": tuned,
            "cutlass_objects": [p.name for p in objects],
            "graphs": opts.cuda_graphs, "kernels": {
        k.name: {"xblock": k.config.xblock, "rblock": k.config.rblock,
                 "num_warps": k.config.num_warps,
                 "shared": {str(a): cubins[(k.name, a)].shared for a in archs}} for k in tks}}
    return sources, lib, info
