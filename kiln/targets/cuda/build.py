"""The CUDA half of the pipeline: from a planned Program to model.so for NVIDIA GPUs.

Input: the schedule (kernels and GEMMs), the Loop IR buffers, the planned Program, the size
hints (example sizes) and the Options. Output: (sources, library path, info) where sources hold
`kernels_triton.py` (every kernel as Triton) and `model_cuda.cpp` (the wrapper), the library is
the linked model.so and info records the architectures and each kernel's launch config for the
manifest. Stages (timed by the caller's `_Run`): Triton codegen, cubins (parallel, cached by
content hash), user Triton kernels (a config each, then cubins: targets/cuda/user_triton.py; their
source is kept as `user_triton.py`), wrapper codegen, C++ build against cuda.h only (no CUDA
library is linked).

Invariants: the cubin blob is content-addressed (`<cache>/cubins/<sha256>.bin`), so the
wrapper's text, and with it the object cache key, changes whenever any cubin does."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

from kiln import config
from kiln.targets.cuda.attention import choose_attention_config, print_attention_kernel
from kiln.targets.cuda.gemm_template import print_gemm_kernel
from kiln.targets.cuda.ops import PRELUDE
from kiln.targets.cuda.kernel import choose_config, print_triton_kernel, print_triton_module
from kiln.targets.cuda.wrapper import (blaslt_choices, capturable, cubin_blob,
                                       print_cuda_wrapper)
from kiln.ir import loop as L
from kiln.options import Options
from kiln.schedule import Kernel
from kiln.schedule.steps import GemmKernel
from kiln.toolchain.cxx import build_shared
from kiln.targets.cuda.launch_tune import device_available, tune, tune_attention
from kiln.toolchain.cuda import cuda_toolchain, default_archs
from kiln.toolchain.triton_aot import compile_cubins
from kiln.targets.cuda import user_triton
from kiln.gemm.cutlass_link import build_objects
from kiln.gemm.cutlass_link import cudart_static


def user_sources(launches) -> str:
    """The user kernels' Triton source, each headed by the config and grid compiled."""
    out = ["# User-written Triton kernels compiled into this package (source as written)."]
    for u in launches:
        out += ["", f"# {u.name} <- {', '.join(u.source_ops)}: config {u.config} "
                f"{u.constexprs}, num_warps={u.num_warps}, num_stages={u.num_stages}, "
                f"grid=({', '.join(map(str, u.grid))})", u.call.spec.fn.src]
    return "\n".join(out) + "\n"

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
    attns = attention_steps(steps)

    configs = {k.name: choose_config(k, hints, opts.triton_max_rblock, opts.triton_num_warps)
               for k in kernels}
    configs.update({a.name: choose_attention_config(a, buffers, hints) for a in attns})
    tuned: dict = {}
    workers = opts.jobs or config.cpu_count()  # Triton compile processes (triton_aot.prewarm)
    local = device_available() and default_archs()[0] in archs
    if opts.autotune and not opts.triton_num_warps and kernels and local:
        # measure on the local GPU, for its architecture
        best, tuned = run.stage("autotune", lambda _: tune(
            kernels, buffers, hints, configs, default_archs()[0], cache, workers), None)
        configs.update(best)
    if opts.autotune and attns and local:
        best, t_att = run.stage("autotune_attention", lambda _: tune_attention(
            attns, buffers, hints, default_archs()[0], cache, workers), None)
        configs.update(best)
        tuned.update(t_att)

    def codegen(_):
        return triton_kernels(launched + attns, buffers, hints, configs)
    launched = [s for s in L.flat_steps(steps) if isinstance(s, (Kernel, GemmKernel))]
    tks = run.stage("codegen_triton", codegen, None)
    module = print_triton_module(tks)
    cubins, tt = run.stage("cubins", lambda m: compile_cubins(m, tks, archs, cache, workers,
                                                                 prelude=PRELUDE),
                           module)
    run.timings.update({f"cubins.{k}": v for k, v in tt.items()})
    # user-written Triton kernels (triton_op / wrap_triton): a config each, then cubins
    measure = bool(opts.autotune) and device_available() and default_archs()[0] in archs
    launches, measured = [], {}
    for u in (s for s in L.flat_steps(steps) if isinstance(s, L.UserKernel)):
        best, ms = user_triton.choose_config(u, buffers, hints, measure, cache)
        launches.append(user_triton.prepare(u, best, buffers))
        if ms:
            measured[u.name] = ms
    cubins.update(run.stage("cubins_user",
                            lambda ls: user_triton.user_cubins(ls, archs, cache), launches))
    names = [k.name for k in tks] + [u.name for u in launches]
    blob, where = cubin_blob(cubins, names, archs)
    blob_path = _write_blob(blob, cache)
    by_name = {**{k.name: k for k in tks}, **{u.name: u for u in launches}}
    cutlass = {n: c for n, c in (gemms or {}).items() if c.backend == "cutlass"}
    objects: list[Path] = []
    if cutlass:
        objects, cut_sources = run.stage("cutlass", lambda c: build_objects(
            steps, c, opts, cache / "cutlass"), cutlass)
    wrapper = run.stage("codegen_wrapper", lambda p: print_cuda_wrapper(
        p, by_name, cubins, archs, str(blob_path), where, opts.cuda_graphs, cutlass,
        blaslt_choices(gemms)), program)
    sources = {"kernels_triton.py": module, "model_cuda.cpp": wrapper}
    if launches:
        sources["user_triton.py"] = user_sources(launches)
    if cutlass:
        sources.update(cut_sources)
    if opts.dump_dir:
        for name, text in sources.items():
            (Path(opts.dump_dir) / name).write_text(text)
    tc = cuda_toolchain(opts)
    if objects:
        tc = dataclasses.replace(tc, ldflags=(*tc.ldflags, *map(str, objects),
                                              *cudart_static()))
    lib, ct = run.stage("compile", lambda s: build_shared(tc, s), {"model_cuda.cpp": wrapper})
    run.timings.update({f"compile.{k}": v for k, v in ct.items()})
    attn = {f"attn_{a.name}" for a in attns}
    info = {"archs": list(archs), "cubin_bytes": len(blob), "autotuned": tuned,
            "cutlass_objects": [p.name for p in objects],
            "graphs": opts.cuda_graphs and capturable(program), "kernels": {
        k.name: {"xblock": k.config.xblock, "rblock": k.config.rblock,
                 "num_warps": k.config.num_warps,
                 "shared": {str(a): cubins[(k.name, a)].shared for a in archs}}
        for k in tks if k.name not in attn}, "attention": {
        k.name: {"block_m": k.config.xblock, "block_n": k.config.rblock,
                 "num_warps": k.config.num_warps, "num_stages": k.config.num_stages,
                 "source_ops": list(k.source_ops),
                 "shared": {str(a): cubins[(k.name, a)].shared for a in archs}}
        for k in tks if k.name in attn},
        "user_kernels": {u.name: {
            "kernel": u.call.kernel, "config": u.config, "constexprs": {
                k: repr(v) for k, v in u.constexprs.items()}, "num_warps": u.num_warps,
            "num_stages": u.num_stages, "grid": [str(g) for g in u.grid],
            "measured_ms": measured.get(u.name, {})} for u in launches}}
    return sources, lib, info


def attention_steps(steps) -> list[L.Extern]:
    """The fused attention calls of `steps` (regions' too), in program order."""
    return [s for s in L.flat_steps(steps) if isinstance(s, L.Extern) and
            s.routine == "attention"]


def triton_kernels(steps, buffers, hints: dict[str, int], configs: dict | None = None) -> list:
    """The TritonKernel of every schedule kernel, GEMM template kernel and attention call in
    `steps` (configs by step name; the heuristic where none is given)."""
    configs = configs or {}
    out = []
    for s in steps:
        if isinstance(s, GemmKernel):  # the GEMM template with its epilogue
            out.append(print_gemm_kernel(s, buffers))
        elif isinstance(s, Kernel):
            out.append(print_triton_kernel(s, buffers, hints, configs.get(s.name)))
        elif isinstance(s, L.Extern) and s.routine == "attention":
            out.append(print_attention_kernel(s, buffers, hints, configs.get(s.name)))
    return out
