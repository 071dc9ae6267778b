"""CPU GEMM candidates: OpenBLAS ("blas") and kiln's register-blocked GEMM ("cpp",
runtime/model/kiln_gemm.h) with a few register tiles, and the benchmark driver that times them.

A "cpp" configuration is (MR, NV, KC, NC): an MR x (NV * vector width) register tile, K
blocked by KC, N by NC. Tiles must fit the vector register file with room for the B vectors
and the broadcast A value: MR * NV + NV + 1 <= registers (16 with AVX2, 32 with AVX-512).

Heuristic without profiling (`Options.max_autotune` off and no cache entry): "cpp" for small
or skinny GEMMs whose B has contiguous rows - at most 64^3 multiply-adds per batch element or
min(M, N) <= 16 - where BLAS's call and packing overheads dominate; "blas" otherwise, and for a
transposed B (a Linear weight), which "cpp" must gather while packing and where it was not
reliably faster (BENCHMARKS.md, "GEMM autotuning").

A GEMM whose B is a constant (a weight no other step reads, shared by the batch: `packable`)
has a third kind of candidate, "cpp" with `packed`: B is packed at compile time into panels of
NV vectors (passes/pack_cpu.py) and `kr::gemm_cpp_packed` streams them once per sweep over M
(a GEMV reads the weight once). The heuristic picks it for every constant B of at least two
panels' width; BLAS keeps narrower ones (BENCHMARKS.md, "CPU GEMM with prepacked weights")."""

from __future__ import annotations

from pathlib import Path

import sympy

from kiln.gemm.configs import BlasConfig, CppConfig
from kiln.gemm.problem import GemmProblem
from kiln.ir import loop as L
from kiln.ir.loop import node_reads
from kiln.schedule import Kernel
from kiln.ir import dtypes
from kiln.options import GemmBackend
from kiln.toolchain.cxx import build_executable


def vector_registers(march: str) -> int:
    """Vector registers of the target: 32 with AVX-512, else 16 (AVX2, AVX, SSE)."""
    return 32 if _has_avx512(march) else 16


def _has_avx512(march: str) -> bool:
    if not march:
        return False
    if march == "native":
        try:
            return "avx512f" in Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(t in march for t in ("avx512", "skylake-avx512", "icelake", "sapphirerapids",
                                    "cascadelake", "cooperlake", "tigerlake", "znver4",
                                    "znver5", "x86-64-v4"))


def vector_bytes(march: str) -> int:
    """Bytes of the target's vector registers as kiln_gemm.h sees them (kVecBytes)."""
    if _has_avx512(march):
        return 64
    if march == "native":
        try:
            return 32 if " avx " in Path("/proc/cpuinfo").read_text() else 16
        except OSError:
            return 16
    return 32 if any(t in march for t in ("avx", "x86-64-v3", "haswell", "skylake", "znver",
                                           "broadwell", "alderlake")) else 16


PACKED_NV = 2  # vectors per panel row of a packed B


def packed_nr(dtype: str, march: str) -> int:
    """Panel width (columns) of a packed B of `dtype` for the target."""
    return PACKED_NV * vector_bytes(march) // dtypes.dtype(dtype).itemsize


def packed_configs(march: str) -> list[CppConfig]:
    """The packed "cpp" candidates: row tiles MR over panels of PACKED_NV vectors (rows of
    fewer than MR take the tile of their exact height, kiln_gemm.h)."""
    mrs = (12, 8, 6, 4) if vector_registers(march) == 32 else (6, 4, 3)
    return [CppConfig(mr, PACKED_NV, kc, packed=True) for mr in mrs for kc in (256, 128)]


def packable(steps, constants: set[str]) -> set[str]:
    """Top-level GEMMs of `steps` whose B can be packed at compile time: a constant of
    `constants` (a weight, not state) that no other step reads, shared by every batch element,
    of static size, float32 or float64."""
    readers: dict[str, int] = {}
    for s in steps:  # (a read inside a control region counts as the control node's)
        reads = ({ld.buf for m in s.members for ld in L.loads(m.body)}
                 if isinstance(s, Kernel) else set(node_reads(s)))
        for b in reads:
            readers[b] = readers.get(b, 0) + 1
    out = set()
    for g in steps:
        if not isinstance(g, L.Gemm) or g.lowp is not None or g.mixed is not None:
            continue
        b = g.b
        static = all(sympy.sympify(x).is_Integer for x in (g.n, g.k, b.offset, b.rows, b.cols))
        if (b.buf in constants and readers.get(b.buf) == 1 and b.buf != g.a.buf and static
                and all(sympy.sympify(x) == 0 for x in b.batch_strides)
                and g.dtype.name in ("float32", "float64")):
            out.add(g.name)
    return out


def cpp_configs(march: str) -> list[CppConfig]:
    """The "cpp" configuration space for the target (tiles that fit the register file)."""
    regs = vector_registers(march)
    tiles = [(6, 2), (4, 3), (8, 1), (4, 2), (2, 4), (1, 4)] if regs == 16 else \
        [(8, 3), (12, 2), (6, 4), (14, 1), (4, 2), (1, 4)]
    out = []
    for mr, nv in tiles:
        assert mr * nv + nv + 1 <= regs, (mr, nv)
        for kc in (256, 128):
            out.append(CppConfig(mr, nv, kc))
    return out


def heuristic(problem: GemmProblem, backends: tuple[GemmBackend, ...], march: str
              ) -> tuple[GemmBackend, BlasConfig | CppConfig]:
    """(backend, config) without profiling; see the module docstring."""
    def hi(v):
        return v[1] if isinstance(v, (tuple, list)) else v
    m, n, k = (hi(x) for x in (problem.m, problem.n, problem.k))
    if (problem.const_b and GemmBackend.CPP in backends and isinstance(n, int)
            and (n >= 2 * packed_nr(problem.dtype, march) or GemmBackend.BLAS not in backends)):
        return GemmBackend.CPP, packed_configs(march)[0]
    small = all(isinstance(x, int) for x in (m, n, k)) and (m * n * k <= 64 ** 3 or
                                                            min(m, n) <= 16) \
        and problem.layout_b == "n"
    if GemmBackend.CPP in backends and (small or GemmBackend.BLAS not in backends):
        cfg = cpp_configs(march)[0] if min(m, n) > 16 or not isinstance(m, int) else \
            (CppConfig(1, 4) if m <= 2 else CppConfig(6, 2))
        return GemmBackend.CPP, cfg
    return GemmBackend.BLAS, BlasConfig()


def driver_source(dtype: str, configs: list[CppConfig], nr: int = 0) -> str:
    """A benchmark program over every candidate: `driver CAND NB M N K LA LB MIN_SECONDS
    [CONST_B]`. With CONST_B "c" every batch element shares one B (as a weight is shared), and
    the packed candidates (panel width `nr`) read it packed once before timing, as the
    package's are packed at compile time."""
    T = dtypes.dtype(dtype).c_type
    cases = ["    case 0: return kr::gemm<T>(e, \"blas\", nb, 1, M, N, K, A, sa, 0, ar, ac, "
             "B, sb, 0, br, bc, C);"]
    for i, c in enumerate(configs, 1):
        if c.packed:
            cases.append(f"    case {i}: return kr::gemm_cpp_packed<T, {nr}, {c.mr}, {c.kc}>"
                         f"(nb, 1, M, N, K, A, sa, 0, ar, ac, Bp, C);  // {c.name}")
        else:
            cases.append(f"    case {i}: return kr::gemm_cpp<T, {c.mr}, {c.nv}, {c.kc}, {c.nc}>"
                         f"(nb, 1, M, N, K, A, sa, 0, ar, ac, B, sb, 0, br, bc, C);  // {c.name}")
    pack = f"kr::pack_b_panels<T, {nr}>(K, N, B, br, bc, Bp);" if nr else ""
    packed_size = f"(N + {nr} - 1) / {nr} * {nr} * K + 1" if nr else "1"
    return (_DRIVER.replace("@T@", T).replace("@CASES@", "\n".join(cases))
            .replace("@PACK@", pack).replace("@PACKED_SIZE@", packed_size))


_DRIVER = r'''// Generated by kiln (kiln/gemm/cpu.py): times one GEMM candidate.
#include "kiln_model_rt.h"
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>
using T = @T@;
static int run(int cand, kr::Err &e, int64_t nb, int64_t M, int64_t N, int64_t K, const T *A,
               int64_t sa, int64_t ar, int64_t ac, const T *B, int64_t sb, int64_t br,
               int64_t bc, const T *Bp, T *C) {
  switch (cand) {
@CASES@
    default: return e.fail("no candidate %d", cand);
  }
}
static void pack(int64_t N, int64_t K, const T *B, int64_t br, int64_t bc, T *Bp) {
  (void)N; (void)K; (void)B; (void)br; (void)bc; (void)Bp;
  @PACK@
}
int main(int argc, char **argv) {
  if (argc != 9 && argc != 10) {
    std::fprintf(stderr, "usage: CAND NB M N K LA LB MIN_SECONDS [CONST_B]\n");
    return 2;
  }
  const int cand = std::atoi(argv[1]);
  const int64_t nb = std::atoll(argv[2]), M = std::atoll(argv[3]), N = std::atoll(argv[4]),
                K = std::atoll(argv[5]);
  const bool ta = argv[6][0] == 't', tb = argv[7][0] == 't';
  const double min_s = std::atof(argv[8]);
  const bool const_b = argc == 10 && argv[9][0] == 'c';
  kr::blas_single_threaded();
  kr::Pool pool;  // as a package run: kiln's pool, OMP_NUM_THREADS (or all CPUs) threads
  kr::RunScope pool_scope(&pool);
  const int64_t sb = const_b ? 0 : K * N;
  std::vector<T> A(nb * M * K + 1), B((const_b ? 1 : nb) * K * N + 1), C(nb * M * N + 1),
      Bp(@PACKED_SIZE@);
  uint64_t s = 88172645463325252ull;
  auto rnd = [&]() {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    return T((s >> 11) * 0x1p-53 - 0.5);
  };
  for (auto &x : A) x = rnd();
  for (auto &x : B) x = rnd();
  const int64_t ar = ta ? 1 : K, ac = ta ? M : 1, br = tb ? 1 : N, bc = tb ? K : 1;
  if (const_b) pack(N, K, B.data(), br, bc, Bp.data());
  char msg[256] = "";
  kr::Err e{msg, sizeof msg};
  if (run(cand, e, nb, M, N, K, A.data(), M * K, ar, ac, B.data(), sb, br, bc, Bp.data(),
          C.data())) {
    std::fprintf(stderr, "%s\n", msg);
    return 3;
  }
  double err = 0, tol = 0;
  for (int t = 0; t < 64 && nb * M * N > 0; ++t) {
    const int64_t b = (t * 7919) % nb, i = (t * 104729) % M, j = (t * 1299709) % N;
    long double ref = 0, mag = 0;
    for (int64_t k = 0; k < K; ++k) {
      const long double p =
          (long double)A[b * M * K + i * ar + k * ac] * B[b * sb + k * br + j * bc];
      ref += p;
      mag += std::fabs(p);
    }
    const double d = std::fabs((double)(C[b * M * N + i * N + j] - ref));
    err = std::isnan(d) || d > err ? d : err;
    tol = std::max(tol, (double)(2 * (K + 2) * std::numeric_limits<T>::epsilon() * mag) + 1e-30);
  }
  using clk = std::chrono::steady_clock;
  double best = 1e30, total = 0;
  for (int rep = 0; rep < 1000 && (rep < 3 || total < min_s); ++rep) {
    const auto t0 = clk::now();
    int64_t it = 0;
    do {
      run(cand, e, nb, M, N, K, A.data(), M * K, ar, ac, B.data(), sb, br, bc, Bp.data(),
          C.data());
      ++it;
    } while (std::chrono::duration<double>(clk::now() - t0).count() < min_s / 10);
    const double dt = std::chrono::duration<double>(clk::now() - t0).count();
    total += dt;
    best = std::min(best, dt / it);
  }
  std::printf("KILN_PROFILE %.9g %.9g %.9g\n", best, err, tol);
  return 0;
}
'''


def build_driver(tc, dtype: str, configs: list[CppConfig], nr: int = 0) -> Path:
    """Compile the driver with the model's own flags (cached by content hash)."""
    return build_executable(tc, driver_source(dtype, configs, nr), f"gemm_{dtype}",
                            "the GEMM benchmark driver's compile")
