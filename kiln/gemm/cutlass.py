"""CUTLASS 3.x GEMM candidates (Hopper, sm_90a) from the `nvidia-cutlass` wheel.

Enumeration: `cutlass_library`'s own generator (the one CUTLASS's CMake build uses) fills a
manifest with the sm_90 16-bit WGMMA kernels; kiln keeps the warp-specialised TMA kernels
(cooperative, ping-pong, and cooperative with the stream-K tile scheduler; cp.async ones when
rows are not 16-byte aligned, which TMA needs) whose element types,
layouts and alignment fit the problem, then applies the Options: `cutlass_op_allowlist_regex`,
`cutlass_op_denylist_regex` (re.search on the kernel name), `cutlass_min_gemm_size` and
`cutlass_max_profiling_configs` (the first N by kernel name).

Layouts: kiln's C is row-major; CUTLASS's problem is column-major. kiln computes
C[M, N] = A @ B as the column-major C^T[N, M] = B^T @ A^T, so CUTLASS's A is kiln's B and the
layout letters map as (CUTLASS A, CUTLASS B, C) = (kiln B, kiln A, "n"), where "n" is
column-major for CUTLASS and "columns contiguous" for kiln (both: the leading dimension is the
second index's stride).

Rendering: `cutlass_library`'s emitter gives the kernel type; kiln adds an `extern "C"`
entry `kiln_cutlass_run(...)` that builds the arguments for a (batched) GEMM with arbitrary
leading dimensions and runs it through `GemmUniversalAdapter`, and `kiln_cutlass_workspace`.
A candidate with an epilogue visitor tree (`evt`, kiln/gemm/cutlass_evt.py) renders the
same kernel with the tree as its epilogue (`_render_evt`). Sources compile with nvcc in
parallel (`compile_all`)."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kiln.gemm.problem import GemmProblem
from kiln.errors import CompileError, UnsupportedError
from kiln.gemm.cutlass_evt import render_types
import copy
from importlib import metadata

_DTYPES = {"float16": "f16", "bfloat16": "bf16"}


def available() -> bool:
    try:
        # deferred: CUTLASS is optional (the cutlass GEMM backend only)
        import cutlass_library  # noqa: F401
    except ImportError:
        return False
    return True


def include_dirs() -> list[Path]:
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    import cutlass_library
    root = Path(cutlass_library.__file__).parent / "source"
    return [root / "include", root / "tools" / "util" / "include"]


@lru_cache(maxsize=2)
def _sm90_operations(cuda_version: str = "12.8") -> tuple:
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library import generator
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library import library as lib
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library import manifest as mf
    args = argparse.Namespace(
        operations="gemm", architectures="90a", kernels="", ignore_kernels="",
        exclude_kernels="", kernel_filter_file=None, curr_build_dir=".", filter_by_cc="True",
        selected_kernel_list=None, interface_dir=None, generator_target="library",
        disable_full_archs_compilation=False, instantiation_level="0",
        cuda_version=cuda_version, log_level="warning")
    manifest = mf.Manifest(args)
    generator.GenerateSM90_TensorOp_16b_WGMMA_gemm(manifest, cuda_version)
    generator.GenerateSM90_TensorOp_16b_WGMMA_alignx_gemm(manifest, cuda_version)
    ops = []
    for by_name in manifest.operations.get(lib.OperationKind.Gemm, {}).values():
        for lst in by_name.values():
            ops.extend(lst)
    # by name: the generator's order depends on the interpreter's string hashing (sets), and
    # the heuristic's "first kernel" and prebuilt objects must not change between processes
    return tuple(sorted(ops, key=lambda op: op.procedural_name()))


@dataclass(frozen=True)
class CutlassCandidate:
    name: str
    op: object  # cutlass_library GemmOperation
    reads_c: bool = False  # D = A @ B + C (beta 1); else beta 0 and C is never read
    evt: object = None  # a cutlass_evt.Evt: the epilogue fused as a visitor tree

    @property
    def schedule(self) -> str:
        n = self.name
        kind = "stream-K" if "stream_k" in n else "ping-pong" if "pingpong" in n else \
            "cooperative" if "cooperative" in n else "warp-specialised"
        return f"cp.async {kind}" if "cpasync" in n else kind


def _layout(letter: str):
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library import library as lib
    return lib.LayoutType.ColumnMajor if letter == "n" else lib.LayoutType.RowMajor


def _hi(v) -> int:
    return v[1] if isinstance(v, (tuple, list)) else v


def enumerate_candidates(problem: GemmProblem, opts, with_c: bool = False, evt=None
                         ) -> list[CutlassCandidate]:
    """CUTLASS kernels valid for `problem` (a 16-bit GEMM), filtered by the Options.
    `with_c`: the kernel reads a C operand (addmm: D = A @ B + C); else C is void.
    `evt` (a cutlass_evt.Evt): candidates fusing that epilogue, i.e. the kernels with a TMA
    epilogue (the visitor trees run in the warp-specialised TMA epilogue only), rendered with
    the tree in place of the linear combination (C becomes the tree's full-size operand, D
    its output dtype)."""
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library import library as lib
    if problem.dtype not in _DTYPES:
        raise UnsupportedError(f"CUTLASS GEMM of dtype {problem.dtype}: kiln enumerates "
                               f"CUTLASS kernels for {sorted(_DTYPES)} only")
    size = 1
    for v in (*problem.batch, problem.m, problem.n, problem.k):
        size *= _hi(v) if not isinstance(_hi(v), str) else 1 << 62
    if size < opts.cutlass_min_gemm_size:
        return []
    el = getattr(lib.DataType, _DTYPES[problem.dtype])
    want_a, want_b = _layout(problem.layout_b), _layout(problem.layout_a)
    # TMA needs 16-byte aligned rows; below that, the cp.async warp-specialised kernels
    schedules = {lib.KernelScheduleType.TmaWarpSpecializedCooperative,
                 lib.KernelScheduleType.TmaWarpSpecializedPingpong} if problem.alignment >= 8 \
        else {lib.KernelScheduleType.CpAsyncWarpSpecializedCooperative,
              lib.KernelScheduleType.CpAsyncWarpSpecialized}
    allow = re.compile(opts.cutlass_op_allowlist_regex) if opts.cutlass_op_allowlist_regex \
        else None
    deny = re.compile(opts.cutlass_op_denylist_regex) if opts.cutlass_op_denylist_regex \
        else None
    out = []
    for op in _sm90_operations():
        if (op.A.element, op.B.element, op.D.element) != (el, el, el) or \
                op.accumulator_type() != lib.DataType.f32:
            continue
        if with_c and op.C.element == lib.DataType.void:
            continue  # (a kernel with a C operand also runs plain GEMMs: beta 0 skips C)
        if (op.A.layout, op.B.layout, op.D.layout) != (want_a, want_b,
                                                       lib.LayoutType.ColumnMajor):
            continue
        if op.kernel_schedule not in schedules:
            continue
        if evt is not None and (op.C.element != lib.DataType.void or not _tma_epilogue(op)):
            continue  # (C's type and alignment are the tree's; the void-C kernels list each
            # configuration once)
        if max(op.A.alignment, op.B.alignment) > problem.alignment or \
                max(op.C.alignment if with_c else 1, op.D.alignment) > problem.alignment_out:
            continue
        name = op.procedural_name()
        if allow is not None and not allow.search(name):
            continue
        if deny is not None and deny.search(name):
            continue
        out.append(CutlassCandidate(name, op, with_c, evt))
    if opts.cutlass_max_profiling_configs:
        out = out[:opts.cutlass_max_profiling_configs]
    return out


def _tma_epilogue(op) -> bool:
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library import library as lib
    return op.epilogue_schedule in (lib.EpilogueScheduleType.TmaWarpSpecialized,
                                    lib.EpilogueScheduleType.TmaWarpSpecializedCooperative)


def render(cand: CutlassCandidate) -> str:
    """A .cu source: the kernel type from cutlass_library's emitter, plus the C entry points."""
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library.gemm_operation import EmitGemmUniversal3xInstance
    if cand.evt is not None:
        return _render_evt(cand)
    kernel = EmitGemmUniversal3xInstance().emit(cand.op)
    return _TEMPLATE.replace("@ADAPTER@", _ADAPTER).replace("@KERNEL@", kernel).replace(
        "@NAME@", cand.name).replace(
        "@SCHEDULE@", cand.schedule).replace("@BETA@", "1" if cand.reads_c else "0")


# the adapter type and the stride helper both entry-point templates open with
_ADAPTER = r'''namespace {
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<@NAME@>;
using Kernel = typename Gemm::GemmKernel;

// A stride with leading dimension `ld` and batch stride `bs` (the unit stride stays static).
template <class Stride>
Stride strided(int64_t ld, int64_t bs) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  cute::get<2>(s) = bs;
  return s;
}
'''

_TEMPLATE = r'''// Generated by kiln (kiln/gemm/cutlass.py): CUTLASS kernel @NAME@ (@SCHEDULE@)
// Computes kiln's row-major C[b][M][N] = A[b] @ B[b] (+ C) as CUTLASS's column-major
// C^T = B^T @ A^T: CUTLASS's (M, N) are kiln's (N, M).
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

@KERNEL@

@ADAPTER@
typename Gemm::Arguments arguments(int64_t m, int64_t n, int64_t k, int64_t batch,
                                   const void *a, int64_t lda, int64_t sa, const void *b,
                                   int64_t ldb, int64_t sb, const void *c, void *d, int64_t ldd,
                                   int64_t sd) {
  using EA = typename Kernel::ElementA;
  using EB = typename Kernel::ElementB;
  using ED = typename Kernel::ElementD;
  using EC = typename Kernel::ElementC;
  typename Gemm::Arguments args{
      batch > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
                : cutlass::gemm::GemmUniversalMode::kGemm,
      {int(m), int(n), int(k), int(batch)},
      {static_cast<const EA *>(a), strided<typename Kernel::StrideA>(lda, sa),
       static_cast<const EB *>(b), strided<typename Kernel::StrideB>(ldb, sb)},
      {{1.0f, float(@BETA@)}, static_cast<const EC *>(c),
       strided<typename Kernel::StrideC>(ldd, sd), static_cast<ED *>(d),
       strided<typename Kernel::StrideD>(ldd, sd)}};
  return args;
}
}  // namespace

// Workspace bytes for this problem (kiln's sizes: C[batch][M][N] = A[M][K] @ B[K][N]).
extern "C" size_t kiln_cutlass_workspace(int64_t M, int64_t N, int64_t K, int64_t batch) {
  auto args = arguments(N, M, K, batch, nullptr, 0, 0, nullptr, 0, 0, nullptr, nullptr, N, M * N);
  return Gemm::get_workspace_size(args);
}

// 0 on success; 1: this kernel cannot run the problem; 2: initialisation failed; 3: launch.
// lda / ldb: leading dimensions of kiln's A and B; sa / sb / sc: batch strides; C may be null.
extern "C" int kiln_cutlass_run(int64_t M, int64_t N, int64_t K, int64_t batch, const void *A,
                                int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                                const void *C, void *D, void *workspace, cudaStream_t stream) {
  auto args = arguments(N, M, K, batch, B, ldb, sb, A, lda, sa, C, D, N, M * N);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 2;
  return gemm.run(stream) == cutlass::Status::kSuccess ? 0 : 3;
}
'''


class _EvtDecl:
    """Stands for the epilogue functor in cutlass_library's emitter: its declaration is the
    name of the visitor tree type printed before the kernel."""

    def emit_declaration(self) -> str:
        return "KilnEvt"


_LIB_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def evt_name(cand: CutlassCandidate) -> str:
    """The kernel type's name for a candidate fusing `cand.evt`: the base kernel's name and a
    hash of the tree (one type per distinct epilogue)."""
    return f"{cand.name}_evt_{hashlib.sha256(cand.evt.key.encode()).hexdigest()[:10]}"


def _render_evt(cand: CutlassCandidate) -> str:
    """The .cu source of `cand` with its epilogue visitor tree (kiln/gemm/cutlass_evt.py):
    the emitter's kernel with C / D retyped to the tree's source and output dtypes and the
    tree as the epilogue's fusion callbacks; entries take the tree's other operands as an
    array of pointers, `ext`."""

    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library import library as lib
    # deferred: CUTLASS is optional (the cutlass GEMM backend only)
    from cutlass_library.gemm_operation import EmitGemmUniversal3xInstance

    evt = cand.evt
    op = copy.copy(cand.op)
    src = evt.src
    c_el = getattr(lib.DataType, _LIB_DTYPES[src.dtype]) if src else lib.DataType.void
    d_el = getattr(lib.DataType, _LIB_DTYPES[evt.out_dtype])
    op.C = lib.TensorDescription(c_el, op.C.layout, lib.get_tma_alignment(c_el) or 1)
    op.D = lib.TensorDescription(d_el, op.D.layout, lib.get_tma_alignment(d_el))
    name = evt_name(cand)
    op.__dict__["_procedural_name"] = name
    op.epilogue_functor = _EvtDecl()
    emitter = EmitGemmUniversal3xInstance()
    emitter.epilogue_functor = _EvtDecl()  # (the emitter reads it from itself, not from op)
    kernel = emitter.emit(op)
    tm, tn, tk = op.get_collective_tile_shape()
    tile = f"cute::Shape<cute::_{tm}, cute::_{tn}, cute::_{tk}>"
    defs, ty, args = render_types(evt, tile)
    return (_EVT_TEMPLATE.replace("@ADAPTER@", _ADAPTER).replace("@FUNCTORS@", defs)
            .replace("@EVT@", ty)
            .replace("@ARGS@", args).replace("@KERNEL@", kernel).replace("@NAME@", name)
            .replace("@BASE@", cand.name).replace("@SCHEDULE@", cand.schedule)
            .replace("@KEY@", evt.key).replace("@NEXT@", str(max(1, len(evt.ext))))
            .replace("@OPERANDS@", "; ".join(f"ext[{k}]: {o.role} {o.dtype}"
                                               for k, o in enumerate(evt.ext)) or "none"))


_EVT_TEMPLATE = r"""// Generated by kiln (kiln/gemm/cutlass.py): CUTLASS kernel @BASE@
// (@SCHEDULE@)
// with its epilogue fused as a visitor tree (kiln/gemm/cutlass_evt.py):
//   @KEY@
// Computes kiln's row-major D[b][M][N] = epilogue(A[b] @ B[b], ...) as CUTLASS's column-major
// D^T: CUTLASS's (M, N) are kiln's (N, M); kiln's vectors over N are CUTLASS column vectors.
// Operands: C = the tree's full-size operand (if any); @OPERANDS@.
#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace kiln_evt {
@FUNCTORS@
}  // namespace kiln_evt

using KilnEvt = @EVT@;

@KERNEL@

@ADAPTER@
typename Gemm::Arguments arguments(int64_t m, int64_t n, int64_t k, int64_t batch,
                                   const void *a, int64_t lda, int64_t sa, const void *b,
                                   int64_t ldb, int64_t sb, const void *c, void *d, int64_t ldd,
                                   int64_t sd, const void *const *ext) {
  using EA = typename Kernel::ElementA;
  using EB = typename Kernel::ElementB;
  using ED = typename Kernel::ElementD;
  using EC = typename Kernel::ElementC;
  typename Gemm::Arguments args{
      batch > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
                : cutlass::gemm::GemmUniversalMode::kGemm,
      {int(m), int(n), int(k), int(batch)},
      {static_cast<const EA *>(a), strided<typename Kernel::StrideA>(lda, sa),
       static_cast<const EB *>(b), strided<typename Kernel::StrideB>(ldb, sb)},
      {{}, static_cast<const EC *>(c), strided<typename Kernel::StrideC>(ldd, sd),
       static_cast<ED *>(d), strided<typename Kernel::StrideD>(ldd, sd)}};
  args.epilogue.thread = @ARGS@;
  return args;
}
}  // namespace

// Workspace bytes for this problem (kiln's sizes: D[batch][M][N] = A[M][K] @ B[K][N]).
extern "C" size_t kiln_cutlass_workspace(int64_t M, int64_t N, int64_t K, int64_t batch) {
  const void *none[@NEXT@] = {};
  auto args = arguments(N, M, K, batch, nullptr, 0, 0, nullptr, 0, 0, nullptr, nullptr, N, M * N,
                        none);
  return Gemm::get_workspace_size(args);
}

// 0 on success; 1: this kernel cannot run the problem; 2: initialisation failed; 3: launch.
// lda / ldb: leading dimensions of kiln's A and B; sa / sb: batch strides; C: the tree's
// full-size operand (null when it has none); ext: its other operands, in the order above.
extern "C" int kiln_cutlass_run(int64_t M, int64_t N, int64_t K, int64_t batch, const void *A,
                                int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                                const void *C, void *D, const void *const *ext, void *workspace,
                                cudaStream_t stream) {
  auto args = arguments(N, M, K, batch, B, ldb, sb, A, lda, sa, C, D, N, M * N, ext);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 2;
  return gemm.run(stream) == cutlass::Status::kSuccess ? 0 : 3;
}
"""


def _version() -> str:
    try:
        return "cutlass " + metadata.version("nvidia-cutlass")
    except metadata.PackageNotFoundError:
        return "cutlass (unknown version)"


@lru_cache(maxsize=4)
def exe_version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else exe


def nvcc() -> str:
    found = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path(
        "/usr/local/cuda/bin/nvcc").exists() else None)
    if found is None:
        raise CompileError("nvcc not found (needed to compile CUTLASS GEMM candidates)")
    return found


def compile_all(sources: dict[str, str], out_dir: Path, arch: str = "90a", jobs: int = 0,
                shared: bool = False) -> dict[str, Path | str]:
    """Compile each named .cu source with nvcc, in parallel: name -> object (or shared
    library) path, or the error text for a source that failed (dropped, not fatal). Cached by
    content hash in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = nvcc()
    flags = ["-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3",
             "--expt-relaxed-constexpr", "-DNDEBUG", "-Xcompiler=-fPIC",
             *[f"-I{d}" for d in include_dirs()]]

    # the key names the headers by cutlass_library's version, not by where they are
    # installed, so objects built on one machine are found on another
    portable = [f for f in flags if not f.startswith("-I")] + [_version(), exe_version(exe)]

    def one(item):
        name, src = item
        key = hashlib.sha256((src + " ".join(portable) + str(shared)).encode()).hexdigest()[:20]
        out = out_dir / f"{name}_{key}{'.so' if shared else '.o'}"
        if out.exists():
            return name, out
        cu = out_dir / f"{name}_{key}.cu"
        cu.write_text(src)
        tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
        cmd = [exe, *flags, *(["-shared"] if shared else ["-c"]), str(cu), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return name, f"nvcc failed: {proc.stderr[-2000:]}"
        tmp.replace(out)
        return name, out

    jobs = jobs or max(1, min(len(sources), os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        return dict(pool.map(one, sources.items()))
