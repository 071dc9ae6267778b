"""kr::gemm_cpp_packed's two loop orders (kiln_gemm.h): `packed_block` (row tile outer: small
M, and A read in place) and `packed_block_cols` (BLIS order: per K block a chunk of rows
packed once, or its full tiles reading A in place where its rows do not alias in L1, each
panel swept by every row tile; MR-row tiles and a 4- or 8-row tail), with and without its
prefetch of the next panel or of the next K block's first (Order 0 automatic, 1 row tile
outer, 2 BLIS order, 3 BLIS order with the prefetch). A C++ program calls both at ragged M
(chunk boundaries at 132 rows), N (partial panels), K (partial K blocks, 3 K blocks, K = 0),
a strided A (row stride past K, and of 4 KiB), KC 256 (the smaller K block of the BLIS
order from 8 row tiles up), 1 and 2 threads, with an epilogue that must
see each element of C exactly once and after its last K block; checked against a long double
reference; and the same bits at 1 to 7 threads. Built for the host's best level (AVX-512
where it has it), x86-64-v3 (AVX2) and plain x86-64 (SSE2)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kiln import config
from kiln.toolchain.cxx import cpu_features

RT = Path(__file__).resolve().parents[2] / "kiln" / "runtime"

SOURCE = r'''
#include "kiln_model_rt.h"
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

template <class T, int NR, int MR, int KC, int Order>
static int check(int64_t M, int64_t N, int64_t K, int64_t ar) {
  std::vector<T> A(M * ar + 1), W(N * K), C(M * N, T(-7)), Bp((N + NR - 1) / NR * NR * K);
  std::vector<int> seen(M * N, 0);
  uint64_t s = 88172645463325252ull + M * 31 + N * 7 + K;
  auto rnd = [&]() {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    return T((s >> 11) * 0x1p-53 - 0.5);
  };
  for (auto &x : A) x = rnd();
  for (auto &x : W) x = rnd();
  kr::pack_b_panels<T, NR>(K, N, W.data(), 1, K, Bp.data());  // B = W^T (a Linear weight)
  T *c = C.data();
  int *sn = seen.data();
  kr::gemm_cpp_packed<T, NR, MR, KC, Order>(1, 1, M, N, K, A.data(), 0, 0, ar, 1, Bp.data(), c,
      [=](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t j = c0; j < c1; ++j) {
            c[r * N + j] = 2 * c[r * N + j] + 1;
            ++sn[r * N + j];
          }
      });
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      long double ref = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        ref += (long double)A[i * ar + k] * W[j * K + k];
        mag += std::fabs((long double)A[i * ar + k] * W[j * K + k]);
      }
      ref = 2 * ref + 1;
      const double err = std::fabs((double)(C[i * N + j] - ref));
      const double tol =
          4 * (K + 2) * (double)std::numeric_limits<T>::epsilon() * (double)mag + 1e-6;
      if (!(err <= tol) || seen[i * N + j] != 1) {
        std::printf("FAIL NR %d MR %d KC %d order %d M %ld N %ld K %ld ar %ld at (%ld, %ld): "
                    "%g vs %Lg, epilogue ran %d times\n", NR, MR, KC, Order, (long)M, (long)N,
                    (long)K, (long)ar, (long)i, (long)j, (double)C[i * N + j], ref,
                    seen[i * N + j]);
        return 1;
      }
    }
  return 0;
}

template <class T, int NR, int MR, int KC>
static int shapes() {
  int bad = 0;
  const int64_t Ms[] = {1, MR - 2, MR + 1, 2 * MR - 1, 23, 64, 97, 130, 133, 270};
  const int64_t NKs[][2] = {{NR + 1, 5}, {3 * NR - 3, KC + 17}, {100, 2 * KC},
                            {2 * NR + 5, 3 * KC + 5}, {NR, 0}};
  for (int64_t M : Ms) {
    if (M < 1) continue;
    for (auto nk : NKs)
      // row strides: K; K + 3; 1024 elements (4 KiB of floats: rows alias in L1, so the BLIS
      // order packs A; at the others its full tiles read A in place)
      for (int64_t ar : {nk[1], nk[1] + 3, int64_t(1024)}) {
        bad |= check<T, NR, MR, KC, 1>(M, nk[0], nk[1], ar);
        bad |= check<T, NR, MR, KC, 2>(M, nk[0], nk[1], ar);
        bad |= check<T, NR, MR, KC, 0>(M, nk[0], nk[1], ar);
        bad |= check<T, NR, MR, KC, 3>(M, nk[0], nk[1], ar);
      }
  }
  return bad;
}

// KC 256 (the packages' float tile): from 8 row tiles up the BLIS order blocks K by
// packed_cols_kc's smaller block (128 with 32-float panels), a K of 2 and 3 such blocks plus a
// part, rows past one chunk
template <class T, int NR, int MR, int KC>
static int shapes_small_kc() {
  int bad = 0;
  for (int64_t M : {int64_t(8 * MR), int64_t(133), int64_t(270)})
    for (int64_t K : {int64_t(KC + 17), int64_t(3 * KC / 2 + 5)})
      for (int64_t ar : {K, int64_t(1024)}) {
        bad |= check<T, NR, MR, KC, 0>(M, 3 * NR - 3, K, ar);
        bad |= check<T, NR, MR, KC, 2>(M, 3 * NR - 3, K, ar);
      }
  return bad;
}

// The same GEMM at 1, 2, 3, 5 and 7 threads gives the same bits: the K block is chosen for the
// whole GEMM, not per row group (mlp's 64 x 256 x 1024, cut into row groups of 12 at 2 threads,
// once summed K in one block there and in KC blocks at 1 thread).
template <class T, int NR, int MR, int KC>
static int same_at_every_thread_count(int64_t M, int64_t N, int64_t K) {
  std::vector<T> A(M * K), W(N * K), Bp((N + NR - 1) / NR * NR * K);
  uint64_t s = 2463534242ull + M * 131 + N * 17 + K;
  for (auto *v : {&A, &W})
    for (auto &x : *v) {
      s ^= s << 13; s ^= s >> 7; s ^= s << 17;
      x = T((s >> 11) * 0x1p-53 - 0.5);
    }
  kr::pack_b_panels<T, NR>(K, N, W.data(), 1, K, Bp.data());
  // 5 and 7 threads: a member's static share then holds a lone row group of MR rows
  const int counts[] = {1, 2, 3, 5, 7};
  std::vector<T> C[5];
  for (int i = 0; i < 5; ++i) {
    kr::tls().requested = counts[i];  // the run's budget, as libkiln sets it
    kr::RunScope run(kr::tls().pool);
    C[i].assign(M * N, T(0));
    kr::gemm_cpp_packed<T, NR, MR, KC>(1, 1, M, N, K, A.data(), 0, 0, K, 1, Bp.data(),
                                       C[i].data());
  }
  kr::tls().requested = 0;
  for (int i = 1; i < 5; ++i)
    if (std::memcmp(C[0].data(), C[i].data(), sizeof(T) * M * N)) {
      const int nt = counts[i];
      std::printf("FAIL threads %d differ from 1 thread: NR %d MR %d KC %d M %ld N %ld K %ld\n",
                  nt, NR, MR, KC, (long)M, (long)N, (long)K);
      return 1;
    }
  return 0;
}

int main() {
  kr::Pool pool;
  kr::RunScope scope(&pool);
  constexpr int NR = 2 * kr::Vec<float>::width, NRD = 2 * kr::Vec<double>::width;
  // MR 12: AVX-512's default (tails of 4 and 8 rows); MR 6:
  // AVX2's; doubles at MR 8
  int bad = shapes<float, NR, 12, 64>() | shapes<float, NR, 6, 64>() |
            shapes<double, NRD, 8, 64>() | shapes_small_kc<float, NR, 12, 256>();
  for (auto mnk : {std::array<int64_t, 3>{64, 8 * NR, 1024}, {24, 2 * NR, 2048},
                   {64, 2 * NR + 3, 3 * 256 + 5}, {133, 8 * NR, 600}, {12, 4 * NR, 1024}})
    bad |= same_at_every_thread_count<float, NR, 12, 256>(mnk[0], mnk[1], mnk[2]);
  std::printf(bad ? "FAILED\n" : "OK\n");
  return bad;
}
'''


def _levels() -> list[str]:
    cxx = config.cxx()
    have = set(cpu_features(cxx, ("-march=native",)))
    best = "x86-64-v4" if set(cpu_features(cxx, ("-march=x86-64-v4",))) <= have else None
    return [lv for lv in (best, "x86-64-v3", "x86-64") if lv and
            set(cpu_features(cxx, (f"-march={lv}",))) <= have]


def test_packed_orders_vs_reference(tmp_path):
    src = tmp_path / "packed_cols.cpp"
    src.write_text(SOURCE)
    levels = _levels()

    def build(level: str) -> Path:
        exe = tmp_path / f"packed_cols_{level}"
        subprocess.run([config.cxx(), "-std=c++17", "-O1", f"-march={level}", "-fopenmp-simd",
                        "-pthread", f"-I{RT / 'model'}", f"-I{RT / 'include'}", str(src),
                        "-o", str(exe)], check=True, capture_output=True, text=True)
        return exe

    with ThreadPoolExecutor(len(levels)) as ex:
        exes = list(ex.map(build, levels))
    for level, exe in zip(levels, exes):
        for threads in ("1", "2"):
            r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                               env={"OMP_NUM_THREADS": threads})
            assert r.returncode == 0 and "OK" in r.stdout, (level, threads, r.stdout, r.stderr)
