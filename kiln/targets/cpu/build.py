"""The CPU target's own stages and toolchain: from a planned Program to model.so for the host.

Stages (listed in targets/cpu/stages.py): the refusal of user Triton kernels; the passes only
the CPU needs (low-precision types as float32 storage); per-thread rows for fused
intermediates; the GEMM choice (BLAS or kiln's own "cpp" GEMM, profiled with this
toolchain); the printers (C++ kernels split into files for parallel builds, the GEMM file,
the C++ wrapper that is the artifact and the Python wrapper for debugging); the C++ build
(parallel, cached by content hash; kiln/toolchain/cxx.py), for a portable build
(Options.march="portable") one library per -march level of Options.cpu_levels
(`compile_levels`).

The toolchain (`toolchain(opts)`): the host C++ compiler with OpenBLAS (scipy-openblas32) and
OpenMP, the shared runtime headers (kiln/runtime) and this target's own (include/:
kiln_lib.h, the library routines behind Loop IR `Extern` steps)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from kiln import config
from kiln.errors import UnsupportedError
from kiln.gemm import choose_gemms
from kiln.gemm.configs import CppConfig
from kiln.gemm.select import cpu_device_id
from kiln.gemm.cpu import cpp_configs, packable, packed_nr, vector_registers
from kiln.gemm.fuse_cpu import fuse_epilogues
from kiln.ir import loop as L
from kiln.memory.inplace import program_aliases
from kiln.options import GemmBackend, Options
from kiln.passes.dce import dce
from kiln.passes.gqa_attention import fold_repeat_kv
from kiln.passes.lowp_cpu import expand_lowp
from kiln.passes.pack_cpu import pack_weights
from kiln.passes.widen_half import widen_half
from kiln.schedule import Kernel, localize_rows
from kiln.targets.cpu.conv import conv_source
from kiln.targets.cpu import dnnl, dnnl_gemm
from kiln.targets.cpu.gemm import declaration, epilogue_declaration, print_gemm_file
from kiln.targets.cpu.kernel import print_kernel
from kiln.targets.cpu.quant import qgemm_source
from kiln.targets.cpu.wrapper import declare_kernel, print_wrapper
from kiln.targets.cpu.wrapper_py import print_python_wrapper
from kiln.targets.stages import Build, CpuLevel, ticker
from kiln.toolchain.cxx import (INCLUDE_DIRS, Toolchain, build_shared, compile_objects,
                                cpu_features, link_shared)

#: the CPU target's model-side headers (kiln_lib.h), next to the shared ones in kiln/runtime
INCLUDE = Path(__file__).resolve().parent / "include"


@dataclass(frozen=True)
class CpuBuild(Build):
    decls: tuple[str, ...] = ()  # the kernels' and cpp GEMMs' declarations, for the wrapper


def _blas() -> tuple[Path, Path]:
    try:
        # deferred: OpenBLAS's wheel is needed by CPU builds only (a GPU-only install may lack it)
        import scipy_openblas32 as blas
    except ImportError as e:
        raise UnsupportedError(
            "a CPU package links OpenBLAS from the scipy-openblas32 wheel, a dependency of "
            "kiln that this Python lacks: pip install scipy-openblas32") from e
    return Path(blas.get_include_dir()), Path(blas.get_lib_dir())


def host_level(opts: Options) -> str:
    """The -march the build machine's own code is compiled for: Options.march, or for a
    portable build the best of Options.cpu_levels this machine runs (the compiler's view of
    -march=native holds every extension the level enables); GEMMs are chosen (and profiled)
    for it."""
    if opts.march != "portable":
        return opts.march
    cxx = opts.cxx or config.cxx()
    have = set(cpu_features(cxx, ("-march=native",)))
    for level in opts.cpu_levels:
        if set(cpu_features(cxx, (f"-march={level}",))) <= have:
            return level
    return opts.cpu_levels[-1]


def toolchain(opts: Options, march: str | None = None) -> Toolchain:
    """The C++ toolchain for code compiled with -march=`march` (default: host_level(opts))."""
    inc, lib = _blas()
    jobs = opts.jobs or config.cpu_count()
    cflags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-fno-math-errno", "-fno-trapping-math",
              "-DKILN_WITH_BLAS",
              f"-I{inc}", *opts.opt_flags]
    march = host_level(opts) if march is None else march
    if march:
        cflags.append(f"-march={march}")
    ldflags = [f"-L{lib}", "-lscipy_openblas", f"-Wl,-rpath,{lib}"]
    # `#pragma omp simd` only: threads come from kiln's own pool (kiln_pool.h), no libgomp.
    # Options.openmp=False builds serial code (KILN_SERIAL: every region on the caller).
    cflags += ["-fopenmp-simd", "-pthread"]
    ldflags.append("-pthread")
    if not opts.openmp:
        cflags.append("-DKILN_SERIAL")
    if opts.sanitize:  # ASan/UBSan builds (Options.sanitize)
        cflags += [f"-fsanitize={opts.sanitize}", "-fno-omit-frame-pointer"]
        ldflags.append(f"-fsanitize={opts.sanitize}")
    cache = Path(opts.cache_dir) if opts.cache_dir else config.cache_dir()
    return Toolchain(opts.cxx or config.cxx(), cache / "build", tuple(cflags), tuple(ldflags),
                     (*INCLUDE_DIRS, INCLUDE), jobs)


def kernel_sources(steps, buffers, opts: Options, aliases=None) -> tuple[dict[str, str], list[str]]:
    """Kernel files (split for parallel builds) and their declarations. `aliases`: kernel ->
    the parameters that share bytes through in-place reuse (they lose `__restrict__`)."""
    aliases = aliases or {}
    kernels = [s for s in L.flat_steps(steps) if isinstance(s, Kernel)]
    n_files = max(1, min(len(kernels), opts.kernel_files or opts.jobs or config.cpu_count()))
    files = [["// Generated by kiln: fused kernels.", '#include "kiln_kernels.h"', ""]
             for _ in range(n_files)]
    decls = []
    for i, k in enumerate(kernels):
        text, params, status = print_kernel(k, buffers, opts.num_threads,
                                            aliases.get(k.name, frozenset()))
        files[i * n_files // max(len(kernels), 1)].append(text + "\n")
        decls.append(declare_kernel(k.name, params, status,
                                    {b: buffers[b].dtype for b in buffers}))
    return {f"kernels_{j}.cpp": "\n".join(f) for j, f in enumerate(files)}, decls


# -- stages ----------------------------------------------------------------------------------


def check_user_kernels(state: Build) -> Build:
    """User Triton kernels need a GPU. A triton_op's CPU kernel (register_kernel("cpu")) is
    Python, which a package cannot run, so a CPU build with a user kernel is refused."""
    names = [f"{n.attr('spec').name} (node {n.name})" for n in state.graph.nodes
             if n.op == "user_kernel"]
    if names:
        raise UnsupportedError(f"user Triton kernel {', '.join(names)} needs a GPU: compile "
                               "with device=\"cuda\" (CPU packages cannot run Triton kernels)")
    return state


def expand_low_precision(state: Build) -> Build:
    """Low-precision GEMMs as float32 / int32 GEMMs (passes/lowp_cpu.py)."""
    return replace(state, graph=expand_lowp(state.graph))


def widen_half_types(state: Build) -> Build:
    """float16 / bfloat16 are storage types: ops compute in float32 and round on store."""
    return replace(state, graph=widen_half(state.graph))


def gemm_epilogues_enabled(state: Build) -> bool:
    return state.options.cpu_gemm_epilogue


def fuse_gemm_epilogues(state: Build) -> Build:
    """Pointwise consumers of GEMM results fused into the GEMMs (kiln/gemm/fuse_cpu.py)."""
    kept = set(state.loop.outputs) | {src for _, src in state.loop.mutations}
    return replace(state, steps=fuse_epilogues(state.steps, kept))


def localize(state: Build) -> Build:
    """Fused intermediates as per-thread rows."""
    return replace(state, steps=localize_rows(state.steps, state.loop))


def gemm_options(opts: Options) -> Options:
    """The options GEMMs are chosen with: a portable build's for the level the build machine
    runs."""
    return replace(opts, march=host_level(opts)) if opts.march == "portable" else opts


def conv_backends(state: Build) -> Build:
    """Each direct convolution's backend: kiln_conv.h, or oneDNN where Options.cpu_conv_backends
    allows it and (with max_autotune) it was measured faster (targets/cpu/dnnl.py)."""
    opts = gemm_options(state.options)
    if dnnl.ONEDNN not in opts.cpu_conv_backends:
        return state
    steps, _ = dnnl.choose(list(state.steps), opts, lambda: toolchain(opts),
                           cpu_device_id(opts), progress=state.progress)
    return replace(state, steps=type(state.steps)(steps))


def packable_gemms(state: Build) -> set[str]:
    """The GEMMs whose constant B may be packed at compile time (kiln/gemm/cpu.py `packable`).
    None in a portable build: the panel width follows the vector width, which differs between
    the levels whose kernels one package carries, and the weights are stored once."""
    if state.options.march == "portable":
        return set()
    constants = {w.name for w in state.program.weights if not w.mutable}
    return packable(state.steps, constants - set(state.graph.outputs))


def gemm_autotune(state: Build) -> Build:
    """GEMM backends: profiled (max_autotune), cached, or by heuristic (kiln/gemm)."""
    opts = gemm_options(state.options)
    gemms = choose_gemms(state.steps, state.graph.symbols, opts, "cpu", toolchain(opts),
                         packable=packable_gemms(state),
                         progress=state.progress)
    return replace(state, gemms=gemms)


def onednn_gemms_enabled(state: Build) -> bool:
    return dnnl_gemm.ONEDNN.value in state.options.cpu_gemm_backends and bool(state.gemms)


def onednn_gemms(state: Build) -> Build:
    """GEMMs with a constant B given to oneDNN's matmul where Options.cpu_gemm_backends allows
    it and (with max_autotune) it was measured faster than kiln's choice
    (targets/cpu/dnnl_gemm.py)."""
    opts = gemm_options(state.options)
    constants = {w.name for w in state.program.weights if not w.mutable}
    gemms, _ = dnnl_gemm.choose(state.steps, state.gemms, constants - set(state.graph.outputs),
                                opts, lambda: toolchain(opts), cpu_device_id(opts),
                                progress=state.progress)
    return replace(state, gemms=gemms)


def pack_constant_b(state: Build) -> Build:
    """The B weights of GEMMs given to the packed "cpp" kernel, packed (passes/pack_cpu.py)."""
    pack = {name: packed_nr(_gemm_dtype(state.steps, name), state.options.march)
            for name, c in state.gemms.items() if getattr(c.config, "packed", False)}
    program, steps, weights = pack_weights(state.program, state.steps, dict(state.weights), pack)
    return replace(state, program=program, steps=steps, weights=weights)


def _gemm_dtype(steps, name: str) -> str:
    return next(s.dtype.name for s in steps if getattr(s, "name", None) == name)


ATTENTION_FILE = ("// Generated by kiln: fused attention (kiln_attention.h), compiled with the "
                  "kernels' flags.\n#define KILN_ATTENTION_IMPL\n#include \"kiln_attention.h\"\n")


def gqa_attention(state: Build) -> Build:
    """Fused attention reads the kv heads of grouped-query attention in place, not their
    repeat_kv copies (passes/gqa_attention.py); the dead views are dropped."""
    return replace(state, graph=dce(fold_repeat_kv(state.graph)))


def has_attention(state: Build) -> bool:
    return any(n.op == "attention" for n in state.graph.nodes)


def codegen(state: CpuBuild) -> CpuBuild:
    """The C++ kernel files and the GEMM file (kiln's own GEMMs), with their declarations."""
    steps, gemms = state.steps, state.gemms
    sources, decls = kernel_sources(steps, L.all_buffers(state.loop), state.options,
                                    program_aliases(state.program))
    sources.update(conv_source(steps))  # the direct convolution (kiln_conv.h), in parts
    qgemm_file = qgemm_source(steps)
    if qgemm_file is not None:  # quantised / bf16 weight GEMMs (kiln_qgemm.h)
        sources["qgemm.cpp"] = qgemm_file
    if any(isinstance(s, L.Extern) and s.routine == "attention" for s in L.flat_steps(steps)):
        sources["attention.cpp"] = ATTENTION_FILE  # fused attention (kiln_attention.h)
    gemm_file = print_gemm_file(steps, gemms)
    if gemm_file is not None:
        sources["gemm.cpp"] = gemm_file
        decls += [declaration(s) for s in steps
                  if isinstance(s, L.Gemm) and gemms[s.name].backend is GemmBackend.CPP]
        decls += [epilogue_declaration(s) for s in steps
                  if isinstance(s, L.Gemm) and s.epilogue is not None]
    return replace(state, sources=sources, decls=tuple(decls))


def codegen_wrapper(state: CpuBuild) -> CpuBuild:
    """The C++ wrapper (the artifact) and the Python wrapper (debugging), both printing the
    planned Program."""
    program = state.program
    wrapper = print_wrapper(program, list(state.decls), state.gemms, state.options.check_finite)
    python = print_python_wrapper(program, state.steps, L.all_buffers(state.loop))
    return replace(state, sources={**state.sources, "model.cpp": wrapper, "model.py": python})


def compile_library(state: Build) -> Build:
    """The C++ compiler: parallel, cached by content hash. A portable build compiles the
    kernels and the GEMM file once per level (compile_levels)."""
    if state.options.march == "portable":
        return compile_levels(state)
    cpp = {k: v for k, v in state.sources.items() if k.endswith(".cpp")}
    # the wrapper is straight-line glue around kernels and BLAS calls: -O1 compiles it faster
    tc = toolchain(state.options)
    lib, times = build_shared(tc, cpp, {"model.cpp": ("-O1",)},
                              progress=ticker(state, "C++ files built"))
    march = tuple(f for f in tc.cflags if f.startswith("-march="))
    # what the code may execute: the loader refuses a CPU without it (before mapping the code)
    features = cpu_features(tc.cxx, march)
    return replace(state, library=lib, times=times,
                   cpu_features=features)


def fit_gemms(gemms: dict, march: str) -> dict:
    """The GEMM choices for code compiled with -march=`march`: a "cpp" tile that needs more
    vector registers than the level has (chosen for a wider level) becomes the level's default
    tile, keeping its K and N blocking; every other choice is kept."""
    regs = vector_registers(march)
    out = {}
    for name, c in gemms.items():
        cfg = c.config
        if isinstance(cfg, CppConfig) and cfg.mr * cfg.nv + cfg.nv + 1 > regs:
            d = cpp_configs(march)[0]
            c = replace(c, config=replace(cfg, mr=d.mr, nv=d.nv),
                        how=f"{c.how}, tile fitted to -march={march}")
        out[name] = c
    return out


def compile_levels(state: Build) -> Build:
    """A portable build (Options.march="portable"): the kernel files and the GEMM file
    compiled once per level of Options.cpu_levels, the wrapper (model.cpp: glue, not hot) once
    at the last level, all in one parallel pool; each level's objects linked with the one
    wrapper object into its own library. The last level's library is `library` (the
    package's lib/model.so, which a libkiln without level support loads)."""
    opts = state.options
    levels = opts.cpu_levels
    tcs = {lv: toolchain(opts, lv) for lv in levels}
    cpp = {k: v for k, v in state.sources.items() if k.endswith(".cpp")}
    wrapper = cpp.pop("model.cpp")
    per_level = {}
    for lv in levels:
        files = dict(cpp)
        if "gemm.cpp" in files:
            files["gemm.cpp"] = print_gemm_file(state.steps, fit_gemms(state.gemms, lv))
        per_level[lv] = sorted(files.items())
    jobs = [(tcs[lv], name, text, ()) for lv in levels for name, text in per_level[lv]]
    jobs.append((tcs[levels[-1]], "model.cpp", wrapper, ("-O1",)))
    t0 = time.perf_counter()
    objs = compile_objects(jobs, max(1, opts.jobs or config.cpu_count()),
                           ticker(state, "C++ files built"))
    t1 = time.perf_counter()
    out, k = [], 0
    for lv in levels:
        n = len(per_level[lv])
        # the level's own objects first: its copies of shared inline functions win
        lib = link_shared(tcs[lv], [*objs[k:k + n], objs[-1]])
        k += n
        out.append(CpuLevel(lv, lib, cpu_features(tcs[lv].cxx, (f"-march={lv}",))))
    times = {"compile": t1 - t0, "link": time.perf_counter() - t1}
    return replace(state, library=out[-1].library, cpu_features=out[-1].cpu_features,
                   cpu_levels=tuple(out), times=times)


def libraries(steps, gemms) -> list[str]:
    """The shared libraries a CPU package loads besides libkiln (the manifest's `requires`)."""
    libs = ["libscipy_openblas.so (scipy-openblas32)"]
    # opened with dlopen when an instance is created (kiln_dnnl.h)
    if dnnl.dnnl_steps(steps) or dnnl_gemm.uses_dnnl(gemms or {}):
        libs.append(dnnl.LIBRARY)
    return libs
