"""cuBLASLt algorithms as "blas" candidates on CUDA: besides cuBLAS's own choice ("blas",
`BlasConfig`, JSON {}), the first `ALGOS` results of `cublasLtMatmulAlgoGetHeuristic` for the
GEMM ("blaslt_<i>", backend "blas", `BlasLtConfig(i)`, JSON {"algo": i}), so max_autotune can
link an algorithm faster than cuBLAS's default where the heuristic offers one.

Input: the problem's dtype (float16 / bfloat16 / float32) and the C++ toolchain of CUDA
packages. Output: the candidates, and a small shared library (`HELPER`, built from
kiln_cuda_rt.h with kiln's host compiler, cached by content like a model) exposing
`kiln_lt_run`, which the profiling child (kiln/gemm/gpu_child.py) calls through ctypes: the
same `kc::lt_blas_gemm` a package calls for a `BlasLtConfig` choice, on the child's
stream, so each candidate is timed as it would run.

Invariants: a candidate index beyond what the heuristic returns for the problem runs result
0 in a package (never fails); the child drops such candidates (`kiln_lt_algos` tells it how
many there are) so no algorithm is timed twice. Without a GPU the heuristic stays plain
"blas" (gpu.heuristic)."""

from __future__ import annotations

from pathlib import Path

from kiln.gemm.configs import BlasLtConfig
from kiln.toolchain.cuda import cuda_toolchain
from kiln.toolchain.cxx import build_shared
import ctypes
import torch

ALGOS = 8  # heuristic results profiled (kc::kLtAlgos asks for as many)
DTYPES = ("float16", "bfloat16", "float32")
# the dtype argument of kiln_lt_run: cudaDataType_t values (kc::kR16F, kc::kR16BF, kc::kR32F)
DTYPE_CODE = {"float16": 2, "bfloat16": 14, "float32": 0}

HELPER = r"""// kiln: cuBLASLt GEMMs for the autotuner's profiling child (kiln/gemm/blaslt.py).
#include "kiln_cuda_rt.h"

namespace {
struct Lib {
  kc::cublasLtHandle_t lt = nullptr;
  kc::cublasHandle_t blas = nullptr;
  kc::LtGemmPlan plan[64];  // one per algorithm index, as each GEMM of a package has one
};

Lib *lib(kr::Err &e) {
  static Lib *l = nullptr;
  if (l) return l;
  if (kc::blaslt().error) { e.fail("%s", kc::blaslt().error); return nullptr; }
  if (kc::blas().error) { e.fail("%s", kc::blas().error); return nullptr; }
  Lib *n = new Lib();
  if (kc::blaslt().create(&n->lt) != 0 || kc::blas().create(&n->blas) != 0) {
    e.fail("cublasLtCreate / cublasCreate failed");
    return nullptr;
  }
  return l = n;
}

template <class T>
int run(kr::Err &e, Lib *l, int64_t m, int64_t n, int64_t k, int64_t batch, uint64_t a,
        int64_t a_rs, int64_t a_cs, int64_t sa, uint64_t b, int64_t b_rs, int64_t b_cs,
        int64_t sb, uint64_t c, int algo, uint64_t ws, size_t ws_bytes, CUstream s) {
  if (kc::blas_bind(e, l->blas, s, ws, ws_bytes)) return 1;
  return kc::lt_blas_gemm<T>(e, l->lt, l->blas, s, "blaslt", algo, batch, 1, m, n, k, a, sa, 0,
                             a_rs, a_cs, b, sb, 0, b_rs, b_cs, c, ws, ws_bytes,
                             &l->plan[algo < 0 ? 0 : algo % 64]);
}
}  // namespace

/* C[batch] (m x n, contiguous) = A[batch] (m x k) @ B[batch] (k x n), strides in elements;
 * dtype: 2 float16, 14 bfloat16, 0 float32. Returns 0, or 1 with a message in err. */
extern "C" __attribute__((visibility("default"))) int kiln_lt_run(
    int64_t m, int64_t n, int64_t k, int64_t batch, uint64_t a, int64_t a_rs, int64_t a_cs,
    int64_t sa, uint64_t b, int64_t b_rs, int64_t b_cs, int64_t sb, uint64_t c, int dtype,
    int algo, uint64_t ws, size_t ws_bytes, void *stream, char *err, size_t errlen) {
  kr::Err e{err, errlen};
  Lib *l = lib(e);
  if (!l) return 1;
  CUstream s = static_cast<CUstream>(stream);
  switch (dtype) {
    case kc::kR16F:
      return run<kc::f16>(e, l, m, n, k, batch, a, a_rs, a_cs, sa, b, b_rs, b_cs, sb, c, algo,
                          ws, ws_bytes, s);
    case kc::kR16BF:
      return run<kc::bf16>(e, l, m, n, k, batch, a, a_rs, a_cs, sa, b, b_rs, b_cs, sb, c, algo,
                           ws, ws_bytes, s);
    case kc::kR32F:
      return run<float>(e, l, m, n, k, batch, a, a_rs, a_cs, sa, b, b_rs, b_cs, sb, c, algo,
                        ws, ws_bytes, s);
  }
  return e.fail("kiln_lt_run: dtype %d is not float16, bfloat16 or float32", dtype);
}

/* How many algorithms the heuristic offered for the last kiln_lt_run with index `algo`
 * (-1 before any). */
extern "C" __attribute__((visibility("default"))) int kiln_lt_algos(int algo) {
  kr::Err e{nullptr, 0};
  Lib *l = lib(e);
  if (!l) return -1;
  const kc::LtGemmPlan &p = l->plan[algo < 0 ? 0 : algo % 64];
  return p.key[0] < 0 ? -1 : p.found;
}
"""


def candidates(dtype: str) -> list[tuple[str, BlasLtConfig]]:
    """(name, config) of the cuBLASLt candidates of a problem of `dtype` (none for others)."""
    return [(f"blaslt_{i}", BlasLtConfig(i)) for i in range(ALGOS)] if dtype in DTYPES else []


def build_helper(opts) -> Path:
    """The helper library (kiln_lt_run, kiln_lt_algos), built with the CUDA packages'
    toolchain (`Options` `opts`: compiler, flags, cuda.h), cached by content like a model."""
    lib, _ = build_shared(cuda_toolchain(opts), {"kiln_blaslt.cpp": HELPER})
    return lib


def runner(so: str, algo: int, dtype: str, a, b, c, ws):
    """(run, count) for the profiling child: `run()` computes c = a @ b (3-D torch tensors of
    `dtype`, any strides) with algorithm `algo` on the current stream; `count()` is the
    number of algorithms the heuristic offered (after a run)."""

    lib = ctypes.CDLL(so)
    f = lib.kiln_lt_run
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int64] * 4 + ([ctypes.c_uint64] + [ctypes.c_int64] * 3) * 2 + [
        ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t,
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    n_algos = lib.kiln_lt_algos
    n_algos.restype = ctypes.c_int
    n_algos.argtypes = [ctypes.c_int]
    nb, m, k = a.shape
    n = b.shape[2]
    err = ctypes.create_string_buffer(512)

    def run():
        rc = f(m, n, k, nb, a.data_ptr(), a.stride(1), a.stride(2), a.stride(0), b.data_ptr(),
               b.stride(1), b.stride(2), b.stride(0), c.data_ptr(), DTYPE_CODE[dtype], algo,
               ws.data_ptr(), ws.numel(), torch.cuda.current_stream().cuda_stream, err,
               len(err))
        if rc:
            raise RuntimeError(f"kiln_lt_run: {err.value.decode(errors='replace')}")
    return run, lambda: n_algos(algo)
