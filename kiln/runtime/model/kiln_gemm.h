/* kiln_gemm.h - kiln's own register-blocked GEMM (the "cpp" GEMM backend).
 *
 * C[M][N] (row-major, leading dimension ldc) = A[M][K] * B[K][N] for operands with arbitrary
 * row/column strides. Blocking follows the usual three-level scheme: B is packed into KC x NR
 * panels, A into MR x KC panels, and an MR x NR microkernel keeps MR * NV vector accumulators
 * in registers (NR = NV * vector width) and issues one FMA per accumulator and k.
 * The vector width follows the target (-march): 16 floats with AVX-512, 8 with AVX2/AVX,
 * 4 otherwise; vectors are GCC vector extensions, and the multiply-add is an FMA intrinsic
 * where the target has one (so results round like BLAS, once per multiply-add).
 * Small and skinny problems win here: no call overhead, packing only what is used, and tile
 * shapes the autotuner picks per GEMM (kiln/gemm/cpu.py). Single-threaded per call: the
 * caller (kr::gemm_split) splits the problem over OpenMP threads. */
#ifndef KILN_GEMM_H
#define KILN_GEMM_H
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace kr {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

template <class T>
struct Vec {
  static constexpr int width = kVecBytes / sizeof(T);
  // may_alias: vectors are loaded from and stored to plain T arrays (like __m256_u)
  typedef T type __attribute__((vector_size(kVecBytes), aligned(sizeof(T)), may_alias));
};

template <class T>
inline typename Vec<T>::type vfma(typename Vec<T>::type a, typename Vec<T>::type b,
                                         typename Vec<T>::type c) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) return (typename Vec<T>::type)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
  else return (typename Vec<T>::type)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif defined(__FMA__) && defined(__AVX__)
  if constexpr (sizeof(T) == 4) return (typename Vec<T>::type)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
  else return (typename Vec<T>::type)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
  return a * b + c;
#endif
}

template <class T>
inline typename Vec<T>::type vsplat(T x) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) return (typename Vec<T>::type)_mm512_set1_ps(x);
  else return (typename Vec<T>::type)_mm512_set1_pd(x);
#elif defined(__AVX__)
  if constexpr (sizeof(T) == 4) return (typename Vec<T>::type)_mm256_set1_ps(x);
  else return (typename Vec<T>::type)_mm256_set1_pd(x);
#else
  typename Vec<T>::type v;
  for (int i = 0; i < Vec<T>::width; ++i) v[i] = x;
  return v;
#endif
}

/* Pack rows [0, mc) x cols [0, kc) of A (strides ar, ac) into MR-row panels, k-major:
 * dst[p][k][r] = A[p*MR + r][k], rows past mc are zero. */
template <class T, int MR>
inline void pack_a(int64_t mc, int64_t kc, const T *a, int64_t ar, int64_t ac, T *dst) {
  for (int64_t p = 0; p < mc; p += MR) {
    const int64_t rows = std::min<int64_t>(MR, mc - p);
    for (int64_t k = 0; k < kc; ++k) {
      for (int64_t r = 0; r < rows; ++r) dst[k * MR + r] = a[(p + r) * ar + k * ac];
      for (int64_t r = rows; r < MR; ++r) dst[k * MR + r] = T(0);
    }
    dst += kc * MR;
  }
}

/* Pack rows [0, kc) x cols [0, nc) of B into NR-column panels: dst[p][k][c] = B[k][p*NR + c]. */
template <class T, int NR>
inline void pack_b(int64_t kc, int64_t nc, const T *b, int64_t br, int64_t bc, T *dst) {
  for (int64_t p = 0; p < nc; p += NR) {
    const int64_t cols = std::min<int64_t>(NR, nc - p);
    if (br == 1 && bc != 1) {  // B transposed (a Linear weight): read along its columns
      for (int64_t c = 0; c < cols; ++c) {
        const T *src = b + (p + c) * bc;
        for (int64_t k = 0; k < kc; ++k) dst[k * NR + c] = src[k];
      }
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t c = cols; c < NR; ++c) dst[k * NR + c] = T(0);
      dst += kc * NR;
      continue;
    }
    for (int64_t k = 0; k < kc; ++k) {
      const T *src = b + k * br + p * bc;
      T *d = dst + k * NR;
      if (bc == 1 && cols == NR) {
        std::memcpy(d, src, sizeof(T) * NR);
      } else {
        for (int64_t c = 0; c < cols; ++c) d[c] = src[c * bc];
        for (int64_t c = cols; c < NR; ++c) d[c] = T(0);
      }
    }
    dst += kc * NR;
  }
}

/* The register tile: c[0:mr, 0:nr] (+)= a (MR x kc) * b (kc x NR). Element (i, k) of a is
 * a[i * ars + k * aks] (a packed panel: ars = 1, aks = MR; else A itself, read by broadcasts),
 * row k of b starts at b + k * bks (a packed panel: bks = NR; else B's rows, when contiguous). */
template <class T, int MR, int NV>
inline void micro_tile(int64_t kc, const T *__restrict__ a, int64_t ars, int64_t aks,
                       const T *__restrict__ b, int64_t bks, T *__restrict__ c, int64_t ldc,
                       int64_t mr, int64_t nr, bool accumulate) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::width;
  V acc[MR][NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[i][v] = V{};
  for (int64_t k = 0; k < kc; ++k) {
    V bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = *reinterpret_cast<const V *>(b + k * bks + v * W);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const V av = vsplat<T>(a[i * ars + k * aks]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma<T>(av, bv[v], acc[i][v]);
    }
  }
  const bool full = mr == MR && nr == NV * W;
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      T *dst = c + i * ldc + v * W;
      if (full) {
        V *d = reinterpret_cast<V *>(dst);
        *d = accumulate ? *d + acc[i][v] : acc[i][v];
      } else if (i < mr) {  // (through a copy: indexing acc keeps it in memory)
        T part[W];
        const V t = acc[i][v];
        std::memcpy(part, &t, sizeof part);
        for (int64_t j = 0; j < W && v * W + j < nr; ++j)
          dst[j] = accumulate ? dst[j] + part[j] : part[j];
      }
    }
}

/* One single-threaded GEMM block with tiles MR x (NV * vector width), K blocked by KC and
 * N by NC. A is read in place by broadcasts (only a last panel of fewer than MR rows is
 * packed, zero-padded); B is packed into NR-wide panels unless its rows are contiguous and
 * all of M fits one MC block (each B panel is then used by one sweep over M only). */
template <class T, int MR, int NV, int KC, int NC>
inline void ukr_gemm_block(int64_t M, int64_t N, int64_t K, const T *a, int64_t ar, int64_t ac,
                           const T *b, int64_t br, int64_t bc, T *c, int64_t ldc) {
  constexpr int NR = NV * Vec<T>::width;
  constexpr int MC = ((256 + MR - 1) / MR) * MR;
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = T(0);
    return;
  }
  alignas(64) static thread_local T bpack[KC * ((NC + NR - 1) / NR) * NR];
  alignas(64) static thread_local T btail[KC * NR];
  alignas(64) static thread_local T apack[KC * MR];
  const bool pack_all_b = !(bc == 1 && M <= MC);
  for (int64_t jc = 0; jc < N; jc += NC) {
    const int64_t nc = std::min<int64_t>(NC, N - jc);
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = std::min<int64_t>(KC, K - pc);
      if (pack_all_b) pack_b<T, NR>(kc, nc, b + pc * br + jc * bc, br, bc, bpack);
      for (int64_t ic = 0; ic < M; ic += MC) {
        const int64_t mc = std::min<int64_t>(MC, M - ic);
        const int64_t mfull = mc / MR * MR;
        if (mc > mfull) pack_a<T, MR>(mc - mfull, kc, a + (ic + mfull) * ar + pc * ac, ar, ac, apack);
        for (int64_t jr = 0; jr < nc; jr += NR) {
          const int64_t nr = std::min<int64_t>(NR, nc - jr);
          const T *bp = bpack + jr * kc;
          int64_t bks = NR;
          if (!pack_all_b) {
            if (nr == NR) {
              bp = b + pc * br + jc + jr;
              bks = br;
            } else {
              pack_b<T, NR>(kc, nr, b + pc * br + (jc + jr) * bc, br, bc, btail);
              bp = btail;
            }
          }
          T *ct = c + ic * ldc + jc + jr;
          for (int64_t ir = 0; ir < mfull; ir += MR)
            micro_tile<T, MR, NV>(kc, a + (ic + ir) * ar + pc * ac, ar, ac, bp, bks,
                                  ct + ir * ldc, ldc, MR, nr, pc > 0);
          if (mc > mfull)
            micro_tile<T, MR, NV>(kc, apack, 1, MR, bp, bks, ct + mfull * ldc, ldc, mc - mfull,
                                  nr, pc > 0);
        }
      }
    }
  }
}


/* -- Prepacked B ("cpp" with a constant B, packed at compile time by passes/pack_cpu.py) ----
 * The packed layout of a K x N operand B with panel width NR: ceil(N / NR) panels, each
 * K x NR contiguous and k-major, columns past N zero:
 *     packed[p][k][c] = B[k][p * NR + c]    (p < ceil(N / NR), k < K, c < NR)
 * It does not depend on the K blocking: K block [k0, k0 + kc) of panel p starts at
 * packed + p * K * NR + k0 * NR. The kernel streams each panel once per sweep over M, so for
 * small M (a GEMV) the weight is read exactly once, at memory bandwidth. */

template <class T, int NR>
struct PanelVec {  // the vector of a panel row: the target's width, or NR when narrower
  static constexpr int lanes = Vec<T>::width < NR ? Vec<T>::width : NR;
  static constexpr int per_row = NR / lanes;
  static_assert(NR % lanes == 0, "panel width must be a multiple of the vector width");
  typedef T type __attribute__((vector_size(lanes * sizeof(T)), aligned(sizeof(T)), may_alias));
  static type fma(type a, type b, type c) {
    if constexpr (lanes == Vec<T>::width)
      return (type)vfma<T>((typename Vec<T>::type)a, (typename Vec<T>::type)b,
                           (typename Vec<T>::type)c);
    else
      return a * b + c;
  }
  static type splat(T x) {
    if constexpr (lanes == Vec<T>::width) {
      return (type)vsplat<T>(x);
    } else {
      type v;
      for (int i = 0; i < lanes; ++i) v[i] = x;
      return v;
    }
  }
};

/* Pack B (element (k, n) at b[k * br + n * bc]) into `dst` (ceil(N / NR) * K * NR elements). */
template <class T, int NR>
inline void pack_b_panels(int64_t K, int64_t N, const T *b, int64_t br, int64_t bc, T *dst) {
  for (int64_t p = 0; p * NR < N; ++p) {
    const int64_t n0 = p * NR, cols = std::min<int64_t>(NR, N - n0);
    T *d = dst + p * K * NR;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < NR; ++c)
        d[k * NR + c] = c < cols ? b[k * br + (n0 + c) * bc] : T(0);
  }
}

/* The epilogue of a GEMM without one (kiln/gemm/fuse_cpu.py fuses pointwise consumers as
 * `epi(r0, r1, c0, c1)`: rows [r0, r1), columns [c0, c1) of C are final, rewrite them). */
struct NoEpilogue {
  void operator()(int64_t, int64_t, int64_t, int64_t) const {}
};

/* Accumulator vectors a register tile may hold (the rest: B vectors and the broadcast). */
constexpr int kTileAccs = kVecBytes == 64 ? 24 : 12;

/* Panels a tile of MR rows spans: enough independent accumulators to hide the FMA latency
 * when MR is small (a GEMV reads 4 panels at once), within the register file. */
template <class T, int NR, int MR>
constexpr int panels_per_tile() {
  constexpr int per = MR * PanelVec<T, NR>::per_row;
  constexpr int np = per >= kTileAccs ? 1 : kTileAccs / per;
  return np > 4 ? 4 : np;
}

#if defined(__GNUC__) && !defined(__clang__)
#define KILN_NOCLONE __attribute__((noclone))
#else
#define KILN_NOCLONE
#endif

/* (noclone: one body per instantiation; GCC's constant-propagation clones of it, one per
 * caller's pattern of constant arguments, doubled the 12-row kernel and added 2 s of compile
 * to every package once packed_cols_panels called it too.)
 * c[0:mrows][0:ncols] (+)= a (MR rows x kc) times NP consecutive K-blocks of panels (panel
 * q's block at b + q * pstride, row k at + k * NR); `ncols` (<= NP * NR) columns of c are
 * stored. Element (i, k) of a is a[k * MR + i] (packed, rows past mrows zero), or with
 * DirectA A itself, a[i * ars + k] (rows of contiguous k, read in place). `pfn` lines from
 * `pf` on are prefetched (hint T0) one every second k, the rest after the loop. */
template <class T, int NR, int MR, int NP, bool DirectA = false>
KILN_NOCLONE inline void packed_tile(int64_t kc, const T *__restrict__ a,
                                     const T *__restrict__ b, int64_t pstride,
                                     T *__restrict__ c, int64_t ldc, int64_t mrows,
                                     int64_t ncols, bool accumulate, int64_t ars = 0,
                                     const char *pf = nullptr, int64_t pfn = 0) {
  typedef PanelVec<T, NR> P;
  typedef typename P::type V;
  constexpr int L = P::lanes, NV = P::per_row;
  V acc[MR][NP * NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 32
    for (int v = 0; v < NP * NV; ++v) acc[i][v] = V{};
  // DirectA: rows in groups of 3, each group's first row a pointer stepped along k and the
  // others at +1 and +2 row strides (addressing [base + stride * 1 | 2]): 12 row pointers
  // would not fit the general registers next to the loop's own
  constexpr int NG = (MR + 2) / 3;
  const char *rows[NG];
  const int64_t rs = ars * int64_t(sizeof(T));
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) rows[g] = reinterpret_cast<const char *>(a) + 3 * g * rs;
  for (int64_t k = 0; k < kc; ++k) {
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      V bv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v)
        bv[v] = *reinterpret_cast<const V *>(b + q * pstride + k * NR + v * L);
#pragma GCC unroll 32
      for (int i = 0; i < MR; ++i) {
        T ai;
        if constexpr (DirectA)
          std::memcpy(&ai, rows[i / 3] + (i % 3) * rs, sizeof(T));
        else
          ai = a[k * MR + i];
        const V av = P::splat(ai);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[i][q * NV + v] = P::fma(av, bv[v], acc[i][q * NV + v]);
      }
    }
    if constexpr (DirectA) {
#pragma GCC unroll 8
      for (int g = 0; g < NG; ++g) rows[g] += sizeof(T);
    }
    if ((k & 1) && pfn > 0) {
      __builtin_prefetch(pf, 0, 3);
      pf += 64;
      --pfn;
    }
  }
  for (; pfn > 0; --pfn, pf += 64) __builtin_prefetch(pf, 0, 3);
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i) {
    if (i >= mrows) break;
#pragma GCC unroll 32
    for (int v = 0; v < NP * NV; ++v) {
      T *dst = c + i * ldc + v * L;
      if ((v + 1) * L <= ncols) {
        V *d = reinterpret_cast<V *>(dst);
        *d = accumulate ? *d + acc[i][v] : acc[i][v];
      } else {  // (through a copy: indexing acc itself would keep every accumulator in memory)
        T part[L];
        const V t = acc[i][v];
        std::memcpy(part, &t, sizeof part);
        for (int64_t j = 0; j < L && v * L + j < ncols; ++j)
          dst[j] = accumulate ? dst[j] + part[j] : part[j];
      }
    }
  }
}

/* Rows [0, mrows) (<= MR; A packed for MR rows, or with DirectA MR rows of A read in place
 * at row stride ars) of one K block over panels [p0, p1): groups of panels_per_tile panels,
 * then single panels. */
template <class T, int NR, int MR, bool DirectA = false>
inline void packed_rows(int64_t kc, const T *a, const T *bk, int64_t pstride, int64_t p0,
                        int64_t p1, int64_t N, T *c, int64_t ldc, int64_t mrows,
                        bool accumulate, int64_t ars = 0) {
  constexpr int NP = panels_per_tile<T, NR, MR>();
  int64_t p = p0;
  if constexpr (NP > 1)
    for (; p + NP <= p1; p += NP)
      packed_tile<T, NR, MR, NP, DirectA>(kc, a, bk + p * pstride, pstride, c + p * NR, ldc,
                                          mrows, std::min<int64_t>(NP * NR, N - p * NR),
                                          accumulate, ars);
  for (; p < p1; ++p)
    packed_tile<T, NR, MR, 1, DirectA>(kc, a, bk + p * pstride, pstride, c + p * NR, ldc, mrows,
                                       std::min<int64_t>(NR, N - p * NR), accumulate, ars);
}

/* Whether a full tile of MR rows of A (row stride `ar` elements, k contiguous) may be read in
 * place by its broadcasts: its rows must spread over at least 4 sets of a 64-set L1 (32 KiB
 * 8-way, 48 KiB 12-way), else they evict each other (a row stride of 2 KiB or a multiple of
 * 4 KiB: K = 512, 1024, 3072 floats) and A is packed into one stream first. Packing costs a
 * pass over A per K block, about 16 / N of the products' time (8% at N = 256). */
template <class T>
inline bool direct_a_ok(int64_t ar, int64_t ac) {
  if (ac != 1) return false;
  const int64_t bytes = ar * int64_t(sizeof(T));
  if (bytes % 64) return true;
  int64_t s = (bytes / 64) % 64, g = 64;  // line stride mod the sets; gcd(s, 64)
  while (s) { const int64_t t = g % s; g = s; s = t; }
  return g <= 16;
}

/* Pack rows [0, mr) x cols [0, kc) of A k-major for a tile of h >= mr rows, rows past mr
 * zero: dst[k * h + i] = A[i][k] (the tile then reads its broadcasts from one stream, not
 * from mr rows that may alias in L1). */
template <class T>
inline void pack_a_rows(int64_t mr, int64_t h, int64_t kc, const T *a, int64_t ar, int64_t ac,
                        T *dst) {
  if (mr == 1 && h == 1 && ac == 1) {
    std::memcpy(dst, a, sizeof(T) * kc);
    return;
  }
#if defined(__SSE__)
  if constexpr (std::is_same_v<T, float>) {
    // 4 x 4 blocks (4 rows, 4 k) transposed in registers: a quarter of the loads and stores
    // of the element loop below
    if (ac == 1 && mr % 4 == 0 && h == mr) {
      const int64_t k4 = kc / 4 * 4;
      for (int64_t i = 0; i < mr; i += 4) {
        const float *r0 = a + i * ar, *r1 = r0 + ar, *r2 = r1 + ar, *r3 = r2 + ar;
        for (int64_t k = 0; k < k4; k += 4) {
          __m128 x0 = _mm_loadu_ps(r0 + k), x1 = _mm_loadu_ps(r1 + k),
                 x2 = _mm_loadu_ps(r2 + k), x3 = _mm_loadu_ps(r3 + k);
          _MM_TRANSPOSE4_PS(x0, x1, x2, x3);
          _mm_storeu_ps(dst + k * h + i, x0);
          _mm_storeu_ps(dst + (k + 1) * h + i, x1);
          _mm_storeu_ps(dst + (k + 2) * h + i, x2);
          _mm_storeu_ps(dst + (k + 3) * h + i, x3);
        }
        for (int64_t k = k4; k < kc; ++k)
          for (int64_t r = 0; r < 4; ++r) dst[k * h + i + r] = a[(i + r) * ar + k];
      }
      return;
    }
  }
#endif
  // row by row: reading the rows k by k would touch mr lines at the row stride per k, lines
  // that share L1 sets when the stride is a multiple of 4 KiB (the reason A is packed)
  for (int64_t i = 0; i < mr; ++i) {
    const T *src = a + i * ar;
    for (int64_t k = 0; k < kc; ++k) dst[k * h + i] = src[k * ac];
  }
  for (int64_t i = mr; i < h; ++i)
    for (int64_t k = 0; k < kc; ++k) dst[k * h + i] = T(0);
}

/* (Not inlined: compiled once per (T, NR, MR), not into each GEMM's epilogue instantiation.)
 * mr rows (<= MR) of one K block: a full tile of MR rows reads A in place where its rows do
 * not alias in L1 (direct_a_ok), else A is packed first: a tile of 1, 2, 4 or 8 rows when mr
 * fits one (small M: B is swept once whatever M), else of MR rows, zero-padded. */
template <class T, int NR, int MR>
__attribute__((noinline)) void packed_row_block(int64_t mr, int64_t kc, const T *a, int64_t ar,
                                                int64_t ac, const T *bk, int64_t pstride,
                                                int64_t p0, int64_t p1, int64_t N, T *c,
                                                int64_t ldc, bool accumulate, T *apack) {
  if (mr == MR && MR > 1 && direct_a_ok<T>(ar, ac))
    return packed_rows<T, NR, MR, true>(kc, a, bk, pstride, p0, p1, N, c, ldc, mr, accumulate,
                                        ar);
  const int64_t h = mr == MR ? MR : mr <= 1 ? 1 : mr <= 2 ? 2 : mr <= 4 ? 4 : mr <= 8 && MR > 8 ? 8 : MR;
  pack_a_rows<T>(mr, h, kc, a, ar, ac, apack);
  if (h == MR)
    return packed_rows<T, NR, MR>(kc, apack, bk, pstride, p0, p1, N, c, ldc, mr, accumulate);
  if constexpr (MR > 8)
    if (h == 8)
      return packed_rows<T, NR, 8>(kc, apack, bk, pstride, p0, p1, N, c, ldc, mr, accumulate);
  if constexpr (MR > 4)
    if (h == 4)
      return packed_rows<T, NR, 4>(kc, apack, bk, pstride, p0, p1, N, c, ldc, mr, accumulate);
  if constexpr (MR > 2)
    if (h == 2)
      return packed_rows<T, NR, 2>(kc, apack, bk, pstride, p0, p1, N, c, ldc, mr, accumulate);
  if constexpr (MR > 1)
    packed_rows<T, NR, 1>(kc, apack, bk, pstride, p0, p1, N, c, ldc, mr, accumulate);
}

/* One GEMM C[M][N] = A * B (B packed, `bp`) over panels [p0, p1): K blocked by `kc_block`
 * (each K block of the panels is reused by every row block while it is in L2; the caller
 * passes K itself for a GEMM of at most MR rows: C written once, B streamed once). The caller
 * chooses the block for the whole GEMM, not per part of its rows: a row's sums then run in the
 * same order whichever part or thread count computes it. `apack`: MR * K elements
 * (`packed_apack_size`). */
template <class T, int NR, int MR, int KC, class RowEpi = NoEpilogue>
inline void packed_block(int64_t M, int64_t N, int64_t K, const T *a, int64_t ar, int64_t ac,
                         const T *bp, int64_t p0, int64_t p1, T *c, int64_t ldc, T *apack,
                         RowEpi epi = {}, int64_t kc_block = KC) {
  if (M == 0 || p0 >= p1) return;
  const int64_t j0 = p0 * NR, j1 = std::min<int64_t>(N, p1 * NR);
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = j0; j < j1; ++j) c[i * ldc + j] = T(0);
    epi(int64_t(0), M, j0, j1);
    return;
  }
  const int64_t kcb = kc_block, pstride = K * NR;
  for (int64_t pc = 0; pc < K; pc += kcb) {
    const int64_t kc = std::min<int64_t>(kcb, K - pc);
    for (int64_t ir = 0; ir < M; ir += MR) {
      const int64_t mr = std::min<int64_t>(MR, M - ir);
      packed_row_block<T, NR, MR>(mr, kc, a + ir * ar + pc * ac, ar, ac, bp + pc * NR, pstride,
                                  p0, p1, N, c + ir * ldc, ldc, pc > 0, apack);
      if (pc + kc == K) epi(ir, ir + mr, j0, j1);  // these rows are final: epilogue in cache
    }
  }
}

/* Rows of A one K block of `packed_block_cols` packs at once (MR-row tiles): 132 at MR 12, so
 * that M = 128 (a transformer's sequence) is one chunk and each panel's K block enters L1
 * once per K block (with chunks of 96 it entered twice; 132 took 0.92-0.96 of their time at
 * 2 threads at M = 128 on the device's Xeon, BENCHMARKS.md s13gemm). With KC = 256 floats,
 * 132 KiB of A, which stays in L2 beside the thread's K block of B panels. */
template <int MR>
constexpr int64_t packed_cols_mc() {
  return int64_t((128 + MR - 1) / MR) * MR;
}

/* Height of the tile `packed_block_cols` gives the last mr (<= MR) rows of a chunk: MR, or
 * 4 or 8 when that covers them (fewer zero rows multiplied). */
template <int MR>
constexpr int packed_cols_h(int64_t mr) {
  return mr == MR ? MR : mr <= 4 && MR > 4 ? 4 : mr <= 8 && MR > 8 ? 8 : MR;
}

/* Which K block of which panel the sweep of panel p asks into the caches (`packed_cols_panels`'s
 * prefetch). A thread's sweeps visit, per K block and chunk of rows, panels [p0, p1) of its
 * part: the target is the next panel of this K block (`inner`: in the first chunk only; later
 * chunks find the block's panels in L2, where the first chunk left them), and from the last
 * panel on, the first panel of the next K block (`wrap`, `kcw` rows; null after the last K
 * block or before the last chunk). */
template <class T>
struct PanelPrefetch {
  const T *bk = nullptr, *wrap = nullptr;
  int64_t p0 = 0, p1 = 0, kc = 0, kcw = 0;
  bool inner = true;
  const char *target(int64_t p, int64_t pstride, int64_t &rows) const {
    if (p + 1 < p1) {
      rows = kc;
      return inner ? reinterpret_cast<const char *>(bk + (p + 1) * pstride) : nullptr;
    }
    rows = kcw;
    return wrap ? reinterpret_cast<const char *>(wrap + p0 * pstride) : nullptr;
  }
};

/* Rows [0, mc) of a chunk times the K block of panels [pg, pe): the full row tiles read A
 * packed by `packed_cols_pack` (`apack`), or with `adirect` in place (its rows at stride ar:
 * the broadcasts of MLAS's and oneDNN brgemm's fp32 kernels; the tail tile is still packed).
 * Per panel, every full row tile while the panel's K block (KC x NR) stays in L1,
 * the tiles' A streaming from L2, and the last mr < MR rows, if any, in a tile of 8 or MR
 * rows; a tail of 4 rows runs after the sweep, over groups of 3 panels (packed_block's 4-row
 * tile: 8 accumulators a panel would wait on the FMA latency). Not inlined: compiled
 * once per (T, NR, MR), not once per GEMM and epilogue of a package (each fused epilogue is
 * its own instantiation of the loop around it). The call costs nothing next to its at least
 * MR x NR x kc multiply-adds.
 * prefetch: while the full tiles sweep panel p, the K block `pf` names (the next panel's, or
 * the next K block's first: kc x NR, 512 lines of 64 bytes at KC 256) is asked into the
 * caches in even slices, one slice per tile, a line every second k of the tile's loop
 * (`packed_tile`'s pf / pfn; lines left at its end asked then). The slice asked all at once
 * before the tile instead (the tree before the eighteenth session) stalled the tile behind
 * its ~100 misses: with the weight in L3 (mlp's 64 x 1024 x 1024) 0.78-0.83 of that time
 * on the Zen 5 box at 1 and 2 threads, 0.93-0.97 with it cached (BENCHMARKS.md, s18cpu).
 * The block starts a new run of 4 KiB pages (pstride away), which the L2 streamer only
 * follows after its first misses in each page: without it the first tile of each panel waits
 * for memory (a weight read once per call, from DRAM or L3 in a model). Hint T0 (all
 * levels): on the Zen 5 box's 2 threads, 2-8% faster than T1 with the weight in DRAM or L3
 * and 1% slower with it in L2 (BENCHMARKS.md, s17enc). (s17enc's line per k in every tile,
 * not a slice of the next block's, was 13-20% slower with the weight cached.) */
template <class T, int NR, int MR>
__attribute__((noinline)) void packed_cols_panels(int64_t mc, int64_t kc, const T *apack,
                                                  const T *bk, int64_t pstride, int64_t pg,
                                                  int64_t pe, int64_t N, T *c, int64_t ldc,
                                                  bool accumulate, bool prefetch,
                                                  const T *adirect, int64_t ar,
                                                  const PanelPrefetch<T> &pf) {
  const int64_t full = mc / MR * MR, tiles = full / MR;
  const int64_t mr = mc - full;
  const int h = packed_cols_h<MR>(mr);
  const T *ap = apack + full * kc;  // the last mr rows' tile
  for (int64_t p = pg; p < pe; ++p) {
    const T *b = bk + p * pstride;
    const int64_t ncols = std::min<int64_t>(NR, N - p * NR);
    T *cp = c + p * NR;
    int64_t rows = 0;
    const char *next = prefetch ? pf.target(p, pstride, rows) : nullptr;
    const int64_t lines = rows * NR * int64_t(sizeof(T)) / 64;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t l0 = next ? lines * t / tiles : 0, l1 = next ? lines * (t + 1) / tiles : 0;
      const char *pt = next ? next + l0 * 64 : nullptr;
      if (adirect)
        packed_tile<T, NR, MR, 1, true>(kc, adirect + t * MR * ar, b, pstride,
                                        cp + t * MR * ldc, ldc, MR, ncols, accumulate, ar, pt,
                                        l1 - l0);
      else
        packed_tile<T, NR, MR, 1>(kc, apack + t * MR * kc, b, pstride, cp + t * MR * ldc, ldc,
                                  MR, ncols, accumulate, 0, pt, l1 - l0);
    }
    if (mr == 0 || (MR > 4 && h == 4)) continue;
    if constexpr (MR > 8)
      if (h == 8) {
        packed_tile<T, NR, 8, 1>(kc, ap, b, pstride, cp + full * ldc, ldc, mr, ncols,
                                 accumulate);
        continue;
      }
    if (h != MR) __builtin_trap();  // a height packed_cols_h never gives
    packed_tile<T, NR, MR, 1>(kc, ap, b, pstride, cp + full * ldc, ldc, mr, ncols, accumulate);
  }
  if constexpr (MR > 4)
    if (mr > 0 && h == 4)  // 8 accumulators a panel: 3 panels at once, after the sweep
      packed_rows<T, NR, 4>(kc, ap, bk, pstride, pg, pe, N, c + full * ldc, ldc, mr,
                            accumulate);
}

/* Pack rows [0, mc) x one K block of A for `packed_cols_panels`: k-major tiles of MR rows,
 * the last one of packed_cols_h rows (rows past mc zero). */
template <class T, int MR>
inline void packed_cols_pack(int64_t mc, int64_t kc, const T *a, int64_t ar, int64_t ac,
                             T *apack, bool tail_only = false) {
  for (int64_t ir = tail_only ? mc / MR * MR : 0; ir < mc; ir += MR) {
    const int64_t mr = std::min<int64_t>(MR, mc - ir);
    pack_a_rows<T>(mr, packed_cols_h<MR>(mr), kc, a + ir * ar, ar, ac, apack + ir * kc);
  }
}

/* The K block of `packed_block_cols` for M rows: KC, or from 8 row tiles up the largest
 * that keeps a panel's K block within 16 KiB (128 rows of a 32-float panel; AVX2's 16-float
 * panels keep KC 256), so that the K block being swept and the next one, prefetched during
 * the sweep, fit L1 (48 KiB) together. With the weight in DRAM or L3 (a model's) 0.87-0.93 of
 * KC 256's time at M 128-197 on the Zen 5 box, and no faster where the panel is cached; with
 * 5 row tiles (M = 64) it was 6% slower at 2 threads (BENCHMARKS.md, s17enc). */
template <class T, int NR, int MR, int KC>
constexpr int64_t packed_cols_kc(int64_t M) {
  constexpr int64_t fit = int64_t(16384) / (NR * int64_t(sizeof(T)));
  constexpr int64_t small = fit < KC ? (fit < 32 ? 32 : fit) : KC;
  return M >= 8 * MR ? small : KC;
}

/* The same GEMM as `packed_block` for several row blocks, loops in the order of BLIS's
 * macro-kernel: per K block and chunk of up to packed_cols_mc rows, A is packed once
 * (k-major MR-row tiles, rows past M zero) unless its full tiles may read it in place
 * (direct_a_ok: rows that do not alias in L1; only the tail tile is packed then, which saves
 * each thread a pass over A per K block: 2-6% at M = 750, K = 384), then each panel's K block (KC x NR, 32 KiB) is
 * swept by every row tile of the chunk while it stays in L1, and the tiles' A streams from
 * L2. `packed_block`'s order (row tile outer) keeps a tile's A in L1 instead and streams the
 * panels from L2 once per row tile: 2.7 times the L2 bytes per multiply-add for a 12 x 32
 * tile (2 B vectors per k against 12 broadcasts). The epilogue runs per chunk and panel
 * group once their last K block is done. `apack`: `packed_apack_size` elements. Only this
 * loop is instantiated per epilogue; the tiles are in `packed_cols_panels`. */
template <class T, int NR, int MR, int KC, class RowEpi = NoEpilogue>
inline void packed_block_cols(int64_t M, int64_t N, int64_t K, const T *a, int64_t ar,
                              int64_t ac, const T *bp, int64_t p0, int64_t p1, T *c,
                              int64_t ldc, T *apack, RowEpi epi = {}, bool prefetch = true,
                              int64_t kc_block = KC) {
  if (K == 0)  // C = 0, then the epilogue
    return packed_block<T, NR, MR, KC>(M, N, K, a, ar, ac, bp, p0, p1, c, ldc, apack, epi);
  constexpr int64_t MC = packed_cols_mc<MR>();
  constexpr int PG = 4;  // panels per epilogue call
  // K blocks of `kc_block`, which the caller chooses for the whole GEMM (packed_cols_kc of
  // all its rows: a thread's rows then sum in the same order whatever the thread count)
  const int64_t pstride = K * NR, kcb = kc_block;
  const bool direct = MR > 1 && direct_a_ok<T>(ar, ac);
  for (int64_t pc = 0; pc < K; pc += kcb) {
    const int64_t kc = std::min<int64_t>(kcb, K - pc);
    const bool last = pc + kc == K;
    for (int64_t ic = 0; ic < M; ic += MC) {
      const int64_t mc = std::min<int64_t>(MC, M - ic);
      const T *ablk = a + ic * ar + pc * ac;
      packed_cols_pack<T, MR>(mc, kc, ablk, ar, ac, apack, direct);
      const T *adirect = direct ? ablk : nullptr;
      PanelPrefetch<T> pf;
      pf.bk = bp + pc * NR;
      pf.p0 = p0;
      pf.p1 = p1;
      pf.kc = kc;
      pf.inner = ic == 0;
      if (ic + mc == M && !last) {
        pf.wrap = bp + (pc + kc) * NR;
        pf.kcw = std::min<int64_t>(kcb, K - pc - kc);
      }
      if (!last) {
        packed_cols_panels<T, NR, MR>(mc, kc, apack, bp + pc * NR, pstride, p0, p1, N,
                                      c + ic * ldc, ldc, pc > 0, prefetch, adirect, ar, pf);
        continue;
      }
      for (int64_t pg = p0; pg < p1; pg += PG) {
        const int64_t pe = std::min<int64_t>(p1, pg + PG);
        packed_cols_panels<T, NR, MR>(mc, kc, apack, bp + pc * NR, pstride, pg, pe, N,
                                      c + ic * ldc, ldc, pc > 0, prefetch, adirect, ar, pf);
        epi(ic, ic + mc, pg * NR, std::min<int64_t>(N, pe * NR));
      }
    }
  }
}

/* Elements of the A buffer `packed_block` (MR rows of the whole K) and `packed_block_cols`
 * (a chunk of rows of one K block) need. */
template <int MR, int KC>
inline int64_t packed_apack_size(int64_t M, int64_t K) {
  (void)M;
  return std::max<int64_t>(std::max<int64_t>(int64_t(MR) * K, packed_cols_mc<MR>() * KC), 1);
}

}  // namespace kr
#endif
