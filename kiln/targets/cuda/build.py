"""The CUDA target's own stages: from Graph IR to model.so for NVIDIA GPUs.

Stages (listed in targets/cuda/stages.py): GEMMs of int8 tensors converted to float read the
int8 tensor (passes/mixed_gemm.py); the GEMM choice (cuBLAS / cuBLASLt, the Triton template,
CUTLASS; profiled on the local GPU) and the fusion of epilogues into the GEMMs that absorb
them; the refusal of library routines CUDA has no version of; the launch configs (each
kernel's heuristic; with Options.autotune, those the cost model says can matter measured on a
local GPU of a target architecture, with attention block sizes and convolution tiles, all
compiled in one pass: `launch_autotune`); Triton codegen (every kernel, GEMM template
and attention call as Triton: `kernels_triton.py`); cubins (parallel, cached by content
hash); user Triton kernels (a config each, then cubins: targets/cuda/user_triton.py; their
source is kept as `user_triton.py`); CUTLASS objects (nvcc); wrapper codegen
(`model_cuda.cpp`, and the manifest's record: architectures and each kernel's launch config);
the C++ build against cuda.h only (no CUDA library is linked; kiln/toolchain/cuda.py, with
this target's header include/kiln_cuda_rt.h).

Invariants: the cubin blob is content-addressed (`<cache>/cubins/<sha256>.bin`), so the
wrapper's text, and with it the object cache key, changes whenever any cubin does."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from kiln import config
from kiln.errors import UnsupportedError
from kiln.gemm import choose_gemms
from kiln.gemm.cutlass_link import build_objects, cudart_static
from kiln.gemm.fuse import fuse_gemms
from kiln.ir import loop as L
from kiln.ir.sym import UNBOUNDED_NOMINAL, evaluate, unbounded
from kiln.gemm.configs import BlasLtConfig
from kiln.options import GemmBackend, Options
from kiln.passes.mixed_gemm import mixed_gemms
from kiln.schedule import Kernel
from kiln.schedule.puts import fuse_puts
from kiln.schedule.steps import GemmKernel, PutKernel
from kiln.targets.cuda import user_triton
from kiln.targets.cuda.attention import (attention_candidates, attention_kernels,
                                         choose_attention_config, print_attention_kernel)
from kiln.targets.cuda.attention_decode import fuse_decode_puts, fused_puts_attention_kernels
from kiln.targets.cuda.conv_template import ROUTINE as CONV_ROUTINE
from kiln.targets.cuda.conv_template import (choose_conv_config, conv_candidates,
                                             print_conv_kernel)
from kiln.targets.cuda.conv_tune import cudnn_ms
from kiln.targets.cuda.conv_tune import worth_tuning as conv_worth_tuning
from kiln.targets.cuda import tune_plan as TP
from kiln.passes.conv_nhwc import conv_nhwc
from kiln.targets.cuda.gemm_candidates import build as build_candidates
from kiln.targets.cuda.gemv_template import (gemv_candidates, gemv_steps, print_gemv_candidate,
                                              print_template_kernel)
from kiln.targets.cuda.kernel import (choose_config, print_triton_kernel, print_triton_module,
                                      with_pdl)
from kiln.passes.dce import dce
from kiln.passes.gqa_attention import fold_repeat_kv
from kiln.targets.cuda.put import print_fused_puts, print_put_kernels
from kiln.frontend.aten_library import ACC_PUT_DTYPES
from kiln.targets.cuda.bag_mask import BAG_MASK_ROUTINES, print_bag_mask_kernel
from kiln.targets.cuda.put_reduce import is_reducing_put, print_put_reduce_kernels
from kiln.targets.cuda.scan import (NONZERO_ROUTINE, SCAN_ROUTINES, is_complex_product,
                                    print_cput_kernel, print_nonzero_kernel, print_scan_kernels)
from kiln.targets.cuda.sort import SORT_ROUTINES, print_sort_kernels
from kiln.targets.cuda.launch_tune import (device_available, kernel_family, template_family,
                                           tune_all, warm_context)
from kiln.targets.cuda.ops import PRELUDE
from kiln.targets.cuda.wrapper import (blaslt_choices, capturable, cubin_blob, not_capturable,
                                       print_cuda_wrapper)
from kiln.targets.collectives import COLLECTIVES
from kiln.targets.stages import Build, ticker
from kiln.toolchain.cuda import SHARED_PER_BLOCK, cuda_toolchain, default_archs
from kiln.toolchain.cxx import build_shared, prebuild_header
from kiln.toolchain.triton_aot import Workers, compile_cubins, warm_driver, warm_key

# Extern routines CUDA builds run: attention, the NHWC convolution, index_put / scatter, scans,
# nonzero, sorts, masked_scatter and embedding_bag (generated Triton kernels), the collectives
# (NCCL)
CUDA_ROUTINES = ("attention", CONV_ROUTINE, "put", "put_mean", *SCAN_ROUTINES, NONZERO_ROUTINE,
                 *SORT_ROUTINES, *BAG_MASK_ROUTINES, *COLLECTIVES)


@dataclass(frozen=True)
class CudaBuild(Build):
    configs: Mapping[str, Any] = field(default_factory=dict)  # measured launch configs
    tuned: Mapping[str, Any] = field(default_factory=dict)  # the timings behind them
    triton: tuple = ()  # the TritonKernel of every kernel, GEMM template and attention call
    cubins: Mapping[Any, Any] = field(default_factory=dict)  # (kernel, arch) -> Cubin
    launches: tuple = ()  # user Triton kernels: their UserLaunch
    measured: Mapping[str, Any] = field(default_factory=dict)  # user kernel -> ms by config
    objects: tuple[Path, ...] = ()  # CUTLASS objects linked into model.so
    cutlass_sources: Mapping[str, str] = field(default_factory=dict)
    workers: Any = None  # compile workers started ahead (triton_aot.Workers), until cubins
    header: Any = None  # the thread precompiling the wrapper's includes (wrapper_header)
    early: Any = None  # what `prestart` started before the export (Early), until workers


# -- facts the stages derive from the state --------------------------------------------------


def _archs(opts: Options) -> tuple[int, ...]:
    return tuple(opts.cuda_archs) or default_archs()


def _pdl(opts: Options) -> bool:
    """Kernels launched with programmatic dependent launch (Options.cuda_pdl): only where
    every target architecture has it (sm_90+)."""
    return bool(opts.cuda_pdl) and min(_archs(opts)) >= 90


def _cache(opts: Options) -> Path:
    return Path(opts.cache_dir) if opts.cache_dir else config.cache_dir()


def _workers(opts: Options) -> int:
    return opts.jobs or config.cpu_count()  # Triton compile processes (triton_aot.Workers)


def _local(opts: Options) -> bool:
    """A GPU of a target architecture is here to measure on."""
    return device_available() and default_archs()[0] in _archs(opts)


def _kept(loop) -> set[str]:
    """The buffers a GEMM's absorbed epilogue must still store."""
    return set(loop.outputs) | {src for _, src in loop.mutations}


def _kernels(steps) -> list[Kernel]:
    return [s for s in L.flat_steps(steps) if isinstance(s, Kernel)]  # regions' too


def _user_kernels(steps) -> list[L.UserKernel]:
    return [s for s in L.flat_steps(steps) if isinstance(s, L.UserKernel)]


def _hints(state: Build) -> dict[str, int]:
    """Example sizes; data-dependent sizes at their bounds (launch configs for the bounds)."""
    hints = {s.name: s.example for s in state.graph.symbols}
    for name, bound in state.program.unbacked:  # (a nominal size where there is no bound)
        hints[name] = UNBOUNDED_NOMINAL if unbounded(name, bound) else evaluate(bound, hints)
    return hints


def _heuristic_configs(state: Build) -> dict:
    opts, buffers, hints = state.options, L.all_buffers(state.loop), _hints(state)
    configs = {k.name: choose_config(k, hints, opts.triton_max_rblock, opts.triton_num_warps)
               for k in _kernels(state.steps)}
    configs.update({a.name: choose_attention_config(a, buffers, hints)
                    for a in attention_steps(state.steps)})
    configs.update({c.name: choose_conv_config(c, buffers, hints)
                    for c in conv_steps(state.steps)})
    return configs


# -- when stages run -------------------------------------------------------------------------


def triton_allowed(state: Build) -> bool:
    return GemmBackend.TRITON in state.options.gemm_backends


def tunes(state: Build) -> bool:
    """Options.autotune, a local GPU of a target architecture, and something to tune."""
    o = state.options
    return bool(o.autotune and ((_kernels(state.steps) and not o.triton_num_warps) or
                                attention_steps(state.steps) or conv_steps(state.steps) or
                                gemv_steps(state.steps))
                and _local(o))


def has_user_kernels(state: Build) -> bool:
    return bool(_user_kernels(state.steps))


def has_cutlass(state: Build) -> bool:
    return any(c.backend is GemmBackend.CUTLASS for c in state.gemms.values())


# -- stages ----------------------------------------------------------------------------------


def triton_key(state: CudaBuild) -> CudaBuild:
    """Triton's cache key of its installation (a hash of libtriton, about 0.5 s) computed in a
    thread while the front end runs: the compile workers of launch_autotune and cubins need
    it before they start (triton_aot.warm_key); already started where `prestart` ran."""
    if state.early is None:
        warm_key()
    return state


def nhwc_conv_enabled(state: Build) -> bool:
    o = state.options
    return o.cuda_conv == "implicit" and o.fold_constants


def nhwc_conv(state: Build) -> Build:
    """2-D convolutions as channels-last kiln kernels, epilogues (batch norm, bias, residual,
    activation) fused."""
    graph, weights = conv_nhwc(state.graph, dict(state.weights),
                               gemm_1x1=bool(state.options.max_autotune))
    return replace(state, graph=graph, weights=weights)


def mixed_gemm(state: Build) -> Build:
    """GEMMs of int8 tensors converted to float read the int8 tensor (the Triton template
    converts tiles as it loads them; cuBLAS has no float16 x int8 GEMM)."""
    return replace(state, graph=mixed_gemms(state.graph))


def gemm_autotune(state: Build) -> Build:
    """GEMM backends (kiln/gemm), candidates printed as the package would print them."""
    gemms = choose_gemms(state.steps, state.graph.symbols, state.options, "cuda",
                         outputs=_kept(state.loop), buffers=L.all_buffers(state.loop),
                         printer=build_candidates, progress=state.progress)
    return replace(state, gemms=gemms)


def gqa_attention(state: Build) -> Build:
    """Fused attention reads the kv heads of grouped-query attention in place, not their
    repeat_kv copies (passes/gqa_attention.py); the dead views are dropped."""
    return replace(state, graph=dce(fold_repeat_kv(state.graph)))


def has_attention(state: Build) -> bool:
    return any(n.op == "attention" for n in state.graph.nodes)


def fuse_gemm_epilogues(state: Build) -> Build:
    """Triton (and CUTLASS visitor-tree) GEMMs absorb their epilogue."""
    return replace(state, steps=fuse_gemms(state.steps, state.gemms, _kept(state.loop)))


def fusing(state: Build) -> bool:
    return bool(state.options.fuse)


def fuse_put_calls(state: Build) -> Build:
    """KV-cache writes (small `put` calls) in one launch with the one-row kernel before them
    (schedule/puts.py)."""
    steps = fuse_puts(state.steps)
    hints = {s.name: s.example for s in state.graph.symbols}
    return replace(state, steps=fuse_decode_puts(steps, L.all_buffers(state.loop), hints,
                                                 _kept(state.loop)))


def check_routines(state: Build) -> Build:
    """Library routines (regions' included) that have no CUDA version are refused. (The fnuz
    float8 types are bytes converted by kiln's own Triton helpers: targets/cuda/ops.py.)"""
    for s in L.flat_steps(state.steps):
        if isinstance(s, L.Extern) and s.routine not in CUDA_ROUTINES:
            raise UnsupportedError(f"library routine {s.routine} (for {', '.join(s.source)}) "
                                   "has no CUDA version yet; compile for the CPU")
        if isinstance(s, L.Extern) and s.routine in ("put", "put_mean"):
            dt = L.all_buffers(state.loop)[s.name].dtype
            if dt.is_complex and s.attr("mode") != 0 and not is_complex_product(s, dt):
                raise UnsupportedError(f"complex index_put / scatter with accumulation (for "
                                       f"{', '.join(s.source)}) has no CUDA routine; enable "
                                       "aten_fallback or compile for the CPU")
            if is_reducing_put(s, dt) and dt.name not in ACC_PUT_DTYPES:
                raise UnsupportedError(f"index_put / scatter with accumulation of {dt.name} "
                                       f"(for {', '.join(s.source)}) has no CUDA routine; "
                                       "enable aten_fallback or compile for the CPU")
    return state


def tuning_families(state: Build, reference=None) -> list:
    """What launch_autotune tunes, as launch_tune.Family lists (pure: no GPU; the counts of
    bench/compile_time.py --plan): the schedule kernels, attention calls and convolutions the
    pruning rules keep (targets/cuda/tune_plan.py), each with its candidates; with
    Options.max_autotune or tune_prune=False, every kernel past the size thresholds with every
    candidate (the full search). `reference(call)`: report entries beside a convolution's
    candidates (cuDNN's time), timed with the full search only."""
    o, buffers, hints = state.options, L.all_buffers(state.loop), _hints(state)
    full = bool(o.max_autotune or not o.tune_prune)
    fams = []
    if not o.triton_num_warps and _kernels(state.steps):
        base = _heuristic_configs(state)
        select = None if full else (lambda k: TP.tune_kernel(
            TP.kernel_us(k, buffers, hints, base[k.name])))
        fams.append(kernel_family(_kernels(state.steps), buffers, hints, base, select))
    calls = attention_steps(state.steps)
    if calls:
        if not full:
            calls = [c for c in calls if TP.tune_kernel(TP.attention_call_us(c, buffers, hints))]
        fams.append(template_family(calls, attention_candidates, print_attention_kernel,
                                    buffers, hints, "attn"))
    gemvs = gemv_steps(state.steps)
    if not full:
        gemvs = [g for g in gemvs if TP.tune_kernel(TP.gemv_us(g, hints))]
    if gemvs:  # the GEMV template's BLOCK_N / BLOCK_K / warps (decode's weight streaming)
        fams.append(template_family(gemvs, gemv_candidates, print_gemv_candidate, buffers,
                                    hints, "gemv"))
    convs = [c for c in conv_steps(state.steps) if conv_worth_tuning(c, buffers, hints)]
    if convs:
        if full:
            cands = conv_candidates
        else:
            convs = [c for c in convs if TP.tune_conv(TP.conv_us(
                c, buffers, hints, choose_conv_config(c, buffers, hints)))]

            def cands(c, b, h):
                return TP.keep_conv(c, b, h, conv_candidates(c, b, h))
        fams.append(template_family(convs, cands, print_conv_kernel, buffers, hints, "conv",
                                    reference if full else None))
    fams = [f for f in fams if f.items]
    if _pdl(o):  # timed as built (the winner's cubin is kept under its source)
        fams = [replace(f, kernels_of=_pdl_kernels(f.kernels_of)) for f in fams]
    return fams


def _pdl_kernels(kernels_of):
    def of(step):
        cands, tks = kernels_of(step)
        return cands, [with_pdl(k) for k in tks]
    return of


def _launched(steps) -> list:
    """The steps codegen_triton prints, in its order."""
    return ([s for s in L.flat_steps(steps) if isinstance(s, (Kernel, GemmKernel, PutKernel))] +
            attention_steps(steps) + conv_steps(steps) + put_steps(steps) +
            [s for s in L.flat_steps(steps) if isinstance(s, L.Extern) and
             s.routine in (*SCAN_ROUTINES, NONZERO_ROUTINE, *SORT_ROUTINES, *BAG_MASK_ROUTINES)])


def untuned_kernels(state: Build, families) -> list:
    """The TritonKernels of the build's steps that `families` do not tune, with their
    heuristic configs: what codegen_triton prints for them whatever the tuning finds, so the
    tuner's workers compile them (into the cubin cache) while it times."""
    tuned = {s.name for f in families for s in f.items}
    return triton_kernels([s for s in _launched(state.steps) if s.name not in tuned],
                          L.all_buffers(state.loop), _hints(state), _heuristic_configs(state),
                          _pdl(state.options))


class Early:
    """What a CUDA build starts before its program is exported (`prestart`, kiln.compile), so
    that it runs beside torch.export (seconds of Python on one core, most of them importing
    torch's tracer): Triton's cache key hashed (triton_aot.warm_key), the wrapper's header
    precompiled (`wrapper_header`), and, in a thread, the CUDA driver initialised and, where
    launch-config tuning will run (Options.autotune, a local GPU of a target architecture),
    the compile workers started (one per core, triton_aot.Workers) with Triton's driver
    utilities built (triton_aot.warm_driver), then the CUDA context created
    (launch_tune.warm_context). Before, these started after the export; the
    first tuning compiles then waited for the workers and Triton's key (ResNet-18 on the
    H100, under cProfile: 1.6 s of its tuning). `workers()` joins the thread: the Workers,
    or None where tuning will not run (the `workers` stage then sizes them by the graph)."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self._workers: Workers | None = None
        warm_key()
        self.header = (prebuild_header(cuda_toolchain(opts), list(WRAPPER_INCLUDES),
                                       WRAPPER_FLAGS) if _workers(opts) >= 4 else None)
        self._thread = threading.Thread(target=self._start, name="kiln-prestart", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        o = self.opts
        try:
            if o.autotune and _local(o):
                warm_driver()
                n = _workers(o) if _workers(o) >= 2 else 0  # (one: tuning compiles here)
                self._workers = Workers(n) if n >= 1 else None
                # the CUDA context, which the tuning's first buffer paid (0.3 s): now here,
                # beside the export (the driver's work, the GIL released), once the workers'
                # spawning thread is going
                warm_context()
        except Exception:  # noqa: BLE001 - no usable CUDA: the stages decide without it
            self._workers = None

    def workers(self) -> Workers | None:
        self._thread.join()
        return self._workers

    def close(self) -> None:
        """Ends the workers (the export failed: no build follows)."""
        w = self.workers()
        if w is not None:
            w.close(kill=True)


def prestart(opts: Options) -> Early:
    """The CUDA target's `prestart`: `Early`."""
    return Early(opts)


def start_workers(state: CudaBuild) -> CudaBuild:
    """Triton compile workers (triton_aot.Workers) started while the front end runs, so that
    launch_autotune and cubins find them running (each takes about half a second to start:
    Python, then Triton's import): as many as launch_autotune uses where it will run (a local
    GPU, Options.autotune), else one fewer than the cubins stage's processes (it compiles too)
    and about one per 4 graph nodes (a kernel fuses a few; a small graph's kernels compile in
    this process), none for fewer than 8 nodes (the stages then start their own). Where
    launch_autotune will run, Triton's CUDA driver utilities are built meanwhile too
    (triton_aot.warm_driver)."""
    o, nodes = state.options, len(state.graph.nodes)
    early = state.early.workers() if state.early is not None else None
    state = replace(state, early=None)
    if early is not None:  # started before the export (`prestart`)
        return replace(state, workers=early)
    if o.autotune and _local(o):
        warm_driver()  # the first launch's C extension, built meanwhile
        n = _workers(o) if _workers(o) >= 2 else 0  # (one: tuning compiles in this process)
    else:
        n = min(_workers(o) - 1, nodes // 4) if nodes >= 8 else 0
    return replace(state, workers=Workers(n)) if n >= 1 else state


#: the leading includes of every wrapper (targets/cuda/wrapper_parts.py `_tables`; models with
#: ATen fallbacks or collectives add more and compile without the precompiled header) and the
#: wrapper's own compile flags
WRAPPER_INCLUDES = ("#include <cstring>", '#include "kiln_cuda_rt.h"', '#include "kiln_plan.h"')
WRAPPER_FLAGS = ("-O1",)
#: the longest the compile stage waits for the precompiled header still being built: about
#: what it saves (H100 machine: the wrapper 1.1 s whole, 0.5 s after the header)
HEADER_WAIT_S = 0.5


def wrapper_header(state: CudaBuild) -> CudaBuild:
    """The wrapper's includes (WRAPPER_INCLUDES: the CUDA runtime support, most of the
    wrapper's compile) precompiled by a compiler process started now, while the front end
    runs, so that the compile stage compiles only the model's own code (toolchain/cxx.py
    `prebuild_header`; where it is not ready then, within HEADER_WAIT_S, the whole wrapper
    is compiled, as before). Only with at least 4 cores (Options.jobs): a spare core runs
    it."""
    if state.early is not None and state.early.header is not None:
        return replace(state, header=state.early.header)  # started before the export
    if _workers(state.options) < 4:
        return state
    return replace(state, header=prebuild_header(cuda_toolchain(state.options),
                                                 list(WRAPPER_INCLUDES), WRAPPER_FLAGS))


def launch_autotune(state: CudaBuild) -> CudaBuild:
    """Kernels' launch configs, attention block sizes and convolution tiles measured on the
    local GPU, for its architecture: every candidate compiled by one set of worker processes
    while this one times those ready (launch_tune.tune_all). Timed as launch_autotune, with
    the counts launch_autotune.steps / .timed / .candidates / .workers / .prebuilt (the
    untuned kernels the same workers compiled for the cubins stage) and the seconds
    launch_autotune.wait spent waiting for compiles."""
    o = state.options
    buffers, hints = L.all_buffers(state.loop), _hints(state)

    def reference(c) -> dict[str, float]:
        peer = cudnn_ms(c, buffers, hints)  # for the report only: packages do not call cuDNN
        return {} if peer is None else {"cudnn_reference": round(peer, 5)}

    stats: dict[str, float] = {}
    fams = tuning_families(state, reference)
    best, tuned = tune_all(fams, buffers, hints, default_archs()[0], _cache(o), _workers(o),
                           progress=ticker(state, "kernels' launch configs timed"), stats=stats,
                           extra=untuned_kernels(state, fams), started=state.workers)
    return replace(state, configs={**state.configs, **best}, tuned={**state.tuned, **tuned},
                   times=stats)


def codegen_triton(state: CudaBuild) -> CudaBuild:
    """Every kernel, GEMM template kernel and attention call as Triton, in one module."""
    configs = {**_heuristic_configs(state), **state.configs}
    tks = triton_kernels(_launched(state.steps), L.all_buffers(state.loop), _hints(state),
                         configs, _pdl(state.options))
    return replace(state, triton=tuple(tks),
                   sources={"kernels_triton.py": print_triton_module(tks)})


def cubins(state: CudaBuild) -> CudaBuild:
    """The Triton module compiled for every architecture (parts timed by kernel)."""
    o = state.options
    try:
        out, times = compile_cubins(state.sources["kernels_triton.py"], list(state.triton),
                                    _archs(o), _cache(o), _workers(o), prelude=PRELUDE,
                                    progress=ticker(state, "Triton kernels built"),
                                    started=state.workers)
    finally:
        if state.workers is not None:  # their last use: they exit as their stdin closes
            state.workers.close()
    _check_shared(out)
    return replace(state, cubins=out, times=times, workers=None)


def _check_shared(cubins: Mapping) -> None:
    """A kernel whose compiled shared memory exceeds what a block of its architecture may use
    would fail when the model instance is created ("invalid argument"): refused here, named."""
    for (name, arch), c in cubins.items():
        limit = SHARED_PER_BLOCK.get(arch)
        if limit is not None and c.shared > limit:
            raise UnsupportedError(
                f"kernel {name} needs {c.shared} bytes of shared memory per block; sm_{arch} "
                f"allows {limit}: its launch config is too large for this architecture "
                f"(set Options.cuda_archs to the GPUs the package will run on)")


def user_kernel_configs(state: CudaBuild) -> CudaBuild:
    """User-written Triton kernels (triton_op / wrap_triton): a config each (measured on a
    local GPU with Options.autotune, else the first)."""
    o = state.options
    buffers, hints = L.all_buffers(state.loop), _hints(state)
    measure = bool(o.autotune) and _local(o)
    launches, measured = [], {}
    for u in _user_kernels(state.steps):
        best, ms = user_triton.choose_config(u, buffers, hints, measure, _cache(o))
        launches.append(user_triton.prepare(u, best, buffers))
        if ms:
            measured[u.name] = ms
    return replace(state, launches=tuple(launches), measured=measured)


def cubins_user(state: CudaBuild) -> CudaBuild:
    o = state.options
    user = user_triton.user_cubins(list(state.launches), _archs(o), _cache(o))
    return replace(state, cubins={**state.cubins, **user})


def cutlass(state: CudaBuild) -> CudaBuild:
    """The chosen CUTLASS kernels as objects (nvcc), with their sources."""
    chosen = {n: c for n, c in state.gemms.items() if c.backend is GemmBackend.CUTLASS}
    objects, sources = build_objects(state.steps, chosen, state.options,
                                     _cache(state.options) / "cutlass")
    return replace(state, objects=tuple(objects), cutlass_sources=sources)


def codegen_wrapper(state: CudaBuild) -> CudaBuild:
    """The cubin blob (content-addressed in the cache), the C++ wrapper that embeds it, the
    sources kept in the package and the manifest's record of the build."""
    o, program, tks, launches = state.options, state.program, state.triton, state.launches
    archs, cubins = _archs(o), state.cubins
    names = [k.name for k in tks] + [u.name for u in launches]
    blob, where = cubin_blob(cubins, names, archs)
    blob_path = _write_blob(blob, _cache(o))
    by_name = {**{k.name: k for k in tks}, **{u.name: u for u in launches}}
    chosen = {n: c for n, c in state.gemms.items() if c.backend is GemmBackend.CUTLASS}
    wrapper = print_cuda_wrapper(program, by_name, cubins, archs, str(blob_path), where,
                                 o.cuda_graphs, chosen, blaslt_choices(state.gemms),
                                 o.cuda_sync_checks)
    sources = {"kernels_triton.py": state.sources["kernels_triton.py"],
               "model_cuda.cpp": wrapper}
    if launches:
        sources["user_triton.py"] = user_sources(launches)
    if chosen:
        sources.update(state.cutlass_sources)
    attn = {f"attn_{a.name}" for a in attention_steps(state.steps)}
    convs = {f"conv_{c.name}" for c in conv_steps(state.steps)}
    info = {"archs": list(archs), "cubin_bytes": len(blob), "autotuned": dict(state.tuned),
            "cutlass_objects": [p.name for p in state.objects],
            "graphs": o.cuda_graphs and capturable(program),
            **({"graphs_off": not_capturable(program)} if o.cuda_graphs and
               not capturable(program) else {}), "kernels": {
        k.name: {"xblock": k.config.xblock, "rblock": k.config.rblock,
                 "num_warps": k.config.num_warps,
                 "shared": {str(a): cubins[(k.name, a)].shared for a in archs}}
        for k in tks if k.name not in attn | convs}, "conv": {
        k.name: {"block_m": k.config.xblock, "block_n": k.config.rblock,
                 "num_warps": k.config.num_warps, "num_stages": k.config.num_stages,
                 "source_ops": list(k.source_ops),
                 "shared": {str(a): cubins[(k.name, a)].shared for a in archs}}
        for k in tks if k.name in convs}, "attention": {
        k.name: {"block_m": k.config.xblock, "block_n": k.config.rblock,
                 "num_warps": k.config.num_warps, "num_stages": k.config.num_stages,
                 "source_ops": list(k.source_ops),
                 "shared": {str(a): cubins[(k.name, a)].shared for a in archs}}
        for k in tks if k.name in attn},
        "user_kernels": {u.name: {
            "kernel": u.call.kernel, "config": u.config, "constexprs": {
                k: repr(v) for k, v in u.constexprs.items()}, "num_warps": u.num_warps,
            "num_stages": u.num_stages, "grid": [str(g) for g in u.grid],
            "measured_ms": state.measured.get(u.name, {})} for u in launches}}
    return replace(state, sources=sources, info=info)


def compile_library(state: CudaBuild) -> CudaBuild:
    """The wrapper compiled against cuda.h and linked (with the CUTLASS objects and CUDA's
    static runtime when there are any)."""
    tc = cuda_toolchain(state.options)
    t0 = time.perf_counter()
    if state.header is not None:
        state.header.join(timeout=HEADER_WAIT_S)
    waited = time.perf_counter() - t0
    if state.objects:
        tc = dataclasses.replace(tc, ldflags=(*tc.ldflags, *map(str, state.objects),
                                              *cudart_static()))
    # the wrapper is host glue around launches (replayed as a CUDA graph where it can be):
    # -O1 compiles it in about 2/3 of -O3's time, as the CPU target's wrapper
    lib, times = build_shared(tc, {"model_cuda.cpp": state.sources["model_cuda.cpp"]},
                              {"model_cuda.cpp": WRAPPER_FLAGS})
    return replace(state, library=lib, times={**times, "header_wait": waited}, header=None)


# -- helpers ---------------------------------------------------------------------------------


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


def attention_steps(steps) -> list[L.Extern]:
    """The fused attention calls of `steps` (regions' too), in program order."""
    return [s for s in L.flat_steps(steps) if isinstance(s, L.Extern) and
            s.routine == "attention"]


def conv_steps(steps) -> list[L.Extern]:
    """The NHWC convolution calls of `steps` (regions' too), in program order."""
    return [s for s in L.flat_steps(steps) if isinstance(s, L.Extern) and
            s.routine == CONV_ROUTINE]


def put_steps(steps) -> list[L.Extern]:
    """The index_put / scatter calls of `steps` (regions' too) that CUDA prints
    (targets/cuda/put.py, put_reduce.py)."""
    return [s for s in L.flat_steps(steps) if isinstance(s, L.Extern) and
            s.routine in ("put", "put_mean")]


def triton_kernels(steps, buffers, hints: dict[str, int], configs: dict | None = None,
                   pdl: bool = False) -> list:
    """The TritonKernel of every schedule kernel, GEMM template kernel and attention call in
    `steps` (configs by step name; the heuristic where none is given); `pdl`: each for a
    programmatic dependent launch (kernel.with_pdl)."""
    configs = configs or {}
    out = []
    for s in steps:
        if isinstance(s, GemmKernel) and getattr(s.config, "gemv", False):
            out.append(print_gemv_candidate(s, buffers, hints, configs.get(s.name)))
        elif isinstance(s, GemmKernel):  # the GEMM template with its epilogue
            out.append(print_template_kernel(s, buffers))
        elif isinstance(s, Kernel):
            out.append(print_triton_kernel(s, buffers, hints, configs.get(s.name)))
        elif isinstance(s, PutKernel) and s.attention is not None:  # decode attention
            out.extend(fused_puts_attention_kernels(s, buffers, hints))
            out.extend(print_put_kernels(p, buffers)[0] for p in s.puts)  # copies
        elif isinstance(s, PutKernel):  # one program: a kernel, then the scatters
            out.append(print_fused_puts(s, buffers, hints, configs.get(s.name)))
            out.extend(print_put_kernels(p, buffers)[0] for p in s.puts)  # copies
        elif isinstance(s, L.Extern) and s.routine == "attention":
            out.extend(attention_kernels(s, buffers, hints, configs.get(s.name)))
        elif isinstance(s, L.Extern) and s.routine == CONV_ROUTINE:
            out.append(print_conv_kernel(s, buffers, hints, configs.get(s.name)))
        elif isinstance(s, L.Extern) and is_complex_product(s, buffers[s.name].dtype):
            out.append(print_cput_kernel(s, buffers))  # (targets/cuda/scan.py)
        elif isinstance(s, L.Extern) and is_reducing_put(s, buffers[s.name].dtype):
            out.extend(print_put_reduce_kernels(s, buffers))  # (targets/cuda/put_reduce.py)
        elif isinstance(s, L.Extern) and s.routine == "put":
            out.extend(print_put_kernels(s, buffers))
        elif isinstance(s, L.Extern) and s.routine in SCAN_ROUTINES:
            out.extend(print_scan_kernels(s, buffers, hints))
        elif isinstance(s, L.Extern) and s.routine == NONZERO_ROUTINE:
            out.append(print_nonzero_kernel(s, buffers))
        elif isinstance(s, L.Extern) and s.routine in SORT_ROUTINES:
            out.extend(print_sort_kernels(s, buffers, hints))
        elif isinstance(s, L.Extern) and s.routine in BAG_MASK_ROUTINES:
            out.append(print_bag_mask_kernel(s, buffers, hints))  # (targets/cuda/bag_mask.py)
    return [with_pdl(k) for k in out] if pdl else out


def libraries(steps, gemms) -> list[str]:
    """The shared libraries a CUDA package opens at load (the manifest's `requires`): the
    driver and cuBLAS always, cuBLASLt for low-precision GEMMs and profiled algorithms."""
    libs = ["libcuda.so.1 (NVIDIA driver, opened at load)",
            "libcublas.so (cuBLAS, opened at load when the model has GEMMs)"]
    if any(g.lowp is not None or (gemms.get(g.name) is not None and
                                  isinstance(gemms[g.name].config, BlasLtConfig))
           for g in L.flat_steps(steps) if isinstance(g, L.Gemm)):
        libs.append("libcublasLt.so (cuBLASLt, opened at load: low-precision GEMMs and GEMMs "
                    "with a profiled cuBLASLt algorithm)")
    return libs
