/* kiln_qgemm.h - GEMMs whose B operand is a weight stored quantised or bf16-packed
 * (passes/quant_weights.py; layouts in kiln/ir/quant.py; numpy twin: ir/quant.py `routine`):
 *
 *   out[M, N] = x[M, K] @ B[K, N]
 *
 * B is stored in panels of 16 output columns; inside a panel, for each step of KSTEP values
 * of K, one 32-bit lane per column holding its KSTEP values (int8: 4, int4: 8 nibbles, bf16: 2).
 *
 * Kernels (mode):
 *   0 int8       weight-only: each panel's int8 values are converted in registers and
 *                multiplied with fp32 x (fp32 accumulate), the column scale applied once
 *   1 int4       weight-only, group-wise along K: fp32 partial sums per group, times the
 *                group's scale
 *   2 int8_vnni  x quantised per row (symmetric int8, offset to uint8) and multiplied as
 *                integers: vpdpbusd where the compiler targets AVX-512 VNNI
 *                (__AVX512VNNI__); y = sx * s[n] * (acc - 128 * wsum[n])
 *   3 bf16       bf16 x and B, fp32 accumulate (vdpbf16ps where __AVX512BF16__), the result
 *                rounded to bf16 once
 * Small M (up to QGEMM_BLAS_M - 1 rows) streams every panel once per 8 rows, dequantising in
 * registers (the weights of a panel stay in L1/L2 between row blocks). Larger M (int8 / int4,
 * with BLAS) dequantises chunks of panels to fp32 and multiplies them with BLAS sgemm.
 * Panels are shared among OpenMP threads. Every ISA-specific path is guarded by the
 * compiler's feature macros, with a portable loop otherwise: code built for any -march runs
 * only instructions of that level.
 *
 * The definitions are compiled only where KILN_QGEMM_IMPL is defined (the generated qgemm.cpp,
 * compiled with the kernels' flags, once per level in portable builds); the wrapper sees the
 * declarations. */
#ifndef KILN_QGEMM_H
#define KILN_QGEMM_H
#include <cstdint>

#include "kiln_lib.h"

namespace kl {

int qgemm(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
          int64_t group, int64_t threads, View<float> x, View<int8_t> q, View<float> s);
int qgemm(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
          int64_t group, int64_t threads, View<float> x, View<int8_t> q, View<float> s,
          View<int32_t> wsum);
int qgemm(kr::Err &e, const char *where, kr::bfloat16 *out, int64_t mode, int64_t k, int64_t n,
          int64_t group, int64_t threads, View<kr::bfloat16> x, View<kr::bfloat16> q);
// the same with a bias [N] added to each row (before a bf16 result is rounded)
int qgemm(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
          int64_t group, int64_t threads, View<float> x, View<int8_t> q, View<float> s,
          View<float> bias);
int qgemm(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
          int64_t group, int64_t threads, View<float> x, View<int8_t> q, View<float> s,
          View<int32_t> wsum, View<float> bias);
int qgemm(kr::Err &e, const char *where, kr::bfloat16 *out, int64_t mode, int64_t k, int64_t n,
          int64_t group, int64_t threads, View<kr::bfloat16> x, View<kr::bfloat16> q,
          View<kr::bfloat16> bias);

}  // namespace kl

#ifdef KILN_QGEMM_IMPL
#include <cstdlib>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include "kiln_pool.h"

namespace kl {
namespace qg {

constexpr int NB = 16;      // columns per panel
constexpr int MB = 8;       // rows per register block (the weights converted once for them)
constexpr int QGEMM_BLAS_M = 16;  // rows from which int8 / int4 dequantise panels for sgemm
constexpr int CHUNK = 8;    // panels per dequantised chunk (128 columns)

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int nthreads(int64_t threads, int64_t tasks) {
  int64_t nt = threads > 0 ? threads : kr::max_threads();
  if (nt > tasks) nt = tasks;
  return nt < 1 ? 1 : static_cast<int>(nt);
}

// y[m, n0 + l] (l < nv) = acc[m][l] * scale[l]
inline void store_rows(float *y, int64_t ys, int rows, int nv, const float (*acc)[NB]) {
  for (int m = 0; m < rows; ++m)
    for (int l = 0; l < nv; ++l) y[m * ys + l] = acc[m][l];
}

// y[m, n0 + l] += bias[n0 + l] for `rows` rows of `cols` columns (fp32 results)
inline void add_bias(float *y, int64_t ys, int64_t rows, int64_t cols, const float *bias) {
  if (!bias) return;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t l = 0; l < cols; ++l) y[m * ys + l] += bias[l];
}

/* -- int8 / int4 weight-only, one panel, `rows` (<= MB) rows of x (padded to Kp, fp32) -- */

template <int R>
inline void panel_i8(const float *x, int64_t kp, const int8_t *w, const float *s, float *y,
                     int64_t ys, int nv) {
  float out[MB][NB];
#if defined(__AVX512F__)
  // A independent accumulators a row (the 4 products of a step alternate among them), so a
  // row's FMAs do not wait on each other's latency when few rows share the loop
  constexpr int A = R == 1 ? 4 : R == 2 ? 2 : 1;
  __m512 acc[R][A];
  for (int m = 0; m < R; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kp / 4; ++kk) {
    const __m512i v = _mm512_loadu_si512(w + kk * 64);
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
    const __m512 w2 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24));
    const __m512 w3 = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
    for (int m = 0; m < R; ++m) {
      const float *xm = x + m * kp + kk * 4;
      acc[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(xm[0]), w0, acc[m][0]);
      acc[m][1 % A] = _mm512_fmadd_ps(_mm512_set1_ps(xm[1]), w1, acc[m][1 % A]);
      acc[m][2 % A] = _mm512_fmadd_ps(_mm512_set1_ps(xm[2]), w2, acc[m][2 % A]);
      acc[m][3 % A] = _mm512_fmadd_ps(_mm512_set1_ps(xm[3]), w3, acc[m][3 % A]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int a = 1; a < A; ++a) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][a]);
  const __m512 sv = _mm512_loadu_ps(s);
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out[m], _mm512_mul_ps(acc[m][0], sv));
#else
  float acc[R][NB] = {};
  for (int64_t kk = 0; kk < kp / 4; ++kk) {
    const int8_t *wk = w + kk * 64;
    for (int j = 0; j < 4; ++j) {
      float wj[NB];
      for (int l = 0; l < NB; ++l) wj[l] = static_cast<float>(wk[l * 4 + j]);
      for (int m = 0; m < R; ++m) {
        const float xv = x[m * kp + kk * 4 + j];
        for (int l = 0; l < NB; ++l) acc[m][l] += xv * wj[l];
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int l = 0; l < NB; ++l) out[m][l] = acc[m][l] * s[l];
#endif
  store_rows(y, ys, R, nv, out);
}

template <int R>
inline void panel_i4(const float *x, int64_t kp, int64_t group, const int8_t *w,
                     const float *s, float *y, int64_t ys, int nv) {
  float out[MB][NB];
  const int64_t groups = kp / group, steps = group / 8;
#if defined(__AVX512F__)
  // the 16 int4 values as floats, by their nibble (two's complement)
  const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    constexpr int A = R == 1 ? 4 : R == 2 ? 2 : 1;  // independent partial sums a row
    __m512 part[R][A];
    for (int m = 0; m < R; ++m)
      for (int a = 0; a < A; ++a) part[m][a] = _mm512_setzero_ps();
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t kk = g * steps + t;
      const __m512i v = _mm512_loadu_si512(w + kk * 64);
      // nibble j of each lane (its low 4 bits after a shift) picks its value from `lut`
      __m512 wj[8];
      wj[0] = _mm512_permutexvar_ps(v, lut);
      wj[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
      wj[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), lut);
      wj[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), lut);
      wj[4] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 16), lut);
      wj[5] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 20), lut);
      wj[6] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 24), lut);
      wj[7] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 28), lut);
      for (int m = 0; m < R; ++m) {
        const float *xm = x + m * kp + kk * 8;
        for (int j = 0; j < 8; ++j)
          part[m][j % A] = _mm512_fmadd_ps(_mm512_set1_ps(xm[j]), wj[j], part[m][j % A]);
      }
    }
    const __m512 sv = _mm512_loadu_ps(s + g * NB);
    for (int m = 0; m < R; ++m) {
      for (int a = 1; a < A; ++a) part[m][0] = _mm512_add_ps(part[m][0], part[m][a]);
      acc[m] = _mm512_fmadd_ps(part[m][0], sv, acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out[m], acc[m]);
#else
  float acc[R][NB] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float part[R][NB] = {};
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t kk = g * steps + t;
      const int8_t *wk = w + kk * 64;
      for (int j = 0; j < 8; ++j) {
        float wj[NB];
        for (int l = 0; l < NB; ++l) {
          const int32_t lane = static_cast<int32_t>(
              static_cast<uint32_t>(static_cast<uint8_t>(wk[l * 4])) |
              static_cast<uint32_t>(static_cast<uint8_t>(wk[l * 4 + 1])) << 8 |
              static_cast<uint32_t>(static_cast<uint8_t>(wk[l * 4 + 2])) << 16 |
              static_cast<uint32_t>(static_cast<uint8_t>(wk[l * 4 + 3])) << 24);
          wj[l] = static_cast<float>(static_cast<int32_t>(
                      static_cast<uint32_t>(lane) << (28 - 4 * j)) >> 28);
        }
        for (int m = 0; m < R; ++m) {
          const float xv = x[m * kp + kk * 8 + j];
          for (int l = 0; l < NB; ++l) part[m][l] += xv * wj[l];
        }
      }
    }
    for (int m = 0; m < R; ++m)
      for (int l = 0; l < NB; ++l) acc[m][l] += part[m][l] * s[g * NB + l];
  }
  for (int m = 0; m < R; ++m)
    for (int l = 0; l < NB; ++l) out[m][l] = acc[m][l];
#endif
  store_rows(y, ys, R, nv, out);
}

/* -- int8 x int8 (VNNI): x as uint8 (xq + 128), padded to Kp -- */

template <int R>
inline void panel_vnni(const uint8_t *xu, int64_t kp, const float *sx, const int8_t *w,
                       const float *s, const int32_t *wsum, float *y, int64_t ys, int nv) {
  int32_t acc[MB][NB];
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  __m512i a[R];
  for (int m = 0; m < R; ++m) a[m] = _mm512_setzero_si512();
  for (int64_t kk = 0; kk < kp / 4; ++kk) {
    const __m512i v = _mm512_loadu_si512(w + kk * 64);
    for (int m = 0; m < R; ++m) {
      int32_t quad;
      std::memcpy(&quad, xu + m * kp + kk * 4, 4);
      a[m] = _mm512_dpbusd_epi32(a[m], _mm512_set1_epi32(quad), v);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_si512(acc[m], a[m]);
#else
  for (int m = 0; m < R; ++m)
    for (int l = 0; l < NB; ++l) acc[m][l] = 0;
  for (int64_t kk = 0; kk < kp / 4; ++kk) {
    const int8_t *wk = w + kk * 64;
    for (int m = 0; m < R; ++m) {
      const uint8_t *xm = xu + m * kp + kk * 4;
      for (int l = 0; l < NB; ++l)
        acc[m][l] += int32_t(xm[0]) * wk[l * 4] + int32_t(xm[1]) * wk[l * 4 + 1] +
                     int32_t(xm[2]) * wk[l * 4 + 2] + int32_t(xm[3]) * wk[l * 4 + 3];
    }
  }
#endif
  float out[MB][NB];
  for (int m = 0; m < R; ++m)
    for (int l = 0; l < NB; ++l)
      out[m][l] = static_cast<float>(acc[m][l] - 128 * wsum[l]) * (sx[m] * s[l]);
  store_rows(y, ys, R, nv, out);
}

/* -- int4 x int8 (mode 4): x quantised per row to int8, each step of 8 values stored as
 * (x0, x2, x4, x6, x1, x3, x5, x7) to meet the lanes' low nibbles (even k) and high nibbles
 * (odd k); the nibbles flipped to unsigned w + 8 (nibble ^ 8), so u8 weights times s8 x;
 * xsum[m, g] = sum of row m's quantised x over group g (the offset's correction) -- */

#if defined(__AVX512BW__)
// 16 int32 sums of 4 u8 x s8 products each, added to acc (vpdpbusd, or its AVX-512BW twin:
// u8 <= 15 and |s8| <= 127, so the 16-bit pair sums of vpmaddubsw cannot saturate)
inline __m512i dot4(__m512i acc, __m512i u8, __m512i s8) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8),
                                                 _mm512_set1_epi16(1)));
#endif
}
#endif

template <int R>
inline void panel_i4_vnni(const int8_t *xa, int64_t kp, int64_t group, const int32_t *xsum,
                          const float *sx, const int8_t *w, const float *s, float *y,
                          int64_t ys, int nv) {
  float out[MB][NB];
  const int64_t groups = kp / group, steps = group / 8;
#if defined(__AVX512BW__)
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x88));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 facc[R];
  for (int m = 0; m < R; ++m) facc[m] = _mm512_setzero_ps();
  // low and high nibbles in their own sums; a single row also splits even and odd steps
  // (4 independent vpdpbusd chains, not 2 bound by its latency)
  constexpr int A = R == 1 ? 2 : 1;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i even[R][A], odd[R][A];
    for (int m = 0; m < R; ++m)
      for (int a = 0; a < A; ++a) even[m][a] = odd[m][a] = _mm512_setzero_si512();
    auto step = [&](int64_t kk, int a) {
      const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(w + kk * 64), flip);
      const __m512i lo = _mm512_and_si512(v, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int m = 0; m < R; ++m) {
        int32_t xe, xo;
        std::memcpy(&xe, xa + m * kp + kk * 8, 4);
        std::memcpy(&xo, xa + m * kp + kk * 8 + 4, 4);
        even[m][a] = dot4(even[m][a], lo, _mm512_set1_epi32(xe));
        odd[m][a] = dot4(odd[m][a], hi, _mm512_set1_epi32(xo));
      }
    };
    int64_t t = 0;
    for (; t + A <= steps; t += A)
      for (int a = 0; a < A; ++a) step(g * steps + t + a, a);
    for (; t < steps; ++t) step(g * steps + t, 0);
    const __m512 sv = _mm512_loadu_ps(s + g * NB);
    for (int m = 0; m < R; ++m) {
      __m512i a = _mm512_add_epi32(even[m][0], odd[m][0]);
      for (int b = 1; b < A; ++b)
        a = _mm512_add_epi32(a, _mm512_add_epi32(even[m][b], odd[m][b]));
      a = _mm512_sub_epi32(a, _mm512_set1_epi32(8 * xsum[m * groups + g]));
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), sv, facc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out[m], _mm512_mul_ps(facc[m], _mm512_set1_ps(sx[m])));
#else
  float facc[R][NB] = {};
  for (int64_t g = 0; g < groups; ++g) {
    int32_t acc[R][NB] = {};
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t kk = g * steps + t;
      const uint8_t *wk = reinterpret_cast<const uint8_t *>(w + kk * 64);
      for (int j = 0; j < 8; ++j) {  // value j of the step: byte j / 2, nibble j % 2
        const int pos = (j % 2) * 4 + j / 2;  // where xa holds it
        for (int m = 0; m < R; ++m) {
          const int32_t xv = xa[m * kp + kk * 8 + pos];
          for (int l = 0; l < NB; ++l) {
            const uint8_t byte = wk[l * 4 + j / 2];
            const int32_t u = ((j % 2 ? byte >> 4 : byte) & 0xF) ^ 8;
            acc[m][l] += u * xv;
          }
        }
      }
    }
    for (int m = 0; m < R; ++m)
      for (int l = 0; l < NB; ++l)
        facc[m][l] += static_cast<float>(acc[m][l] - 8 * xsum[m * groups + g]) * s[g * NB + l];
  }
  for (int m = 0; m < R; ++m)
    for (int l = 0; l < NB; ++l) out[m][l] = facc[m][l] * sx[m];
#endif
  store_rows(y, ys, R, nv, out);
}

/* -- bf16: x bf16 bits padded to Kp (even), and the same rows widened to float (xf, read by
 * the paths without vdpbf16ps: one broadcast a product, no conversion in the loop) -- */

template <int R>
inline void panel_bf16(const uint16_t *x, const float *xf, int64_t kp, const uint16_t *w,
                       kr::bfloat16 *y, int64_t ys, int nv, const kr::bfloat16 *bias) {
  float out[MB][NB];
  // A independent accumulators a row: with one or two rows, a single chain of dependent
  // vdpbf16ps / FMAs would be bound by their latency, not by the weights' stream
  constexpr int A = R == 1 ? 4 : R == 2 ? 2 : 1;
  const int64_t steps = kp / 2;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  (void)xf;
  __m512 acc[R][A];
  for (int m = 0; m < R; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
  auto step = [&](int64_t kk, int a) {
    const __m512i v = _mm512_loadu_si512(w + kk * 32);
    for (int m = 0; m < R; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * kp + kk * 2, 4);
      acc[m][a] = _mm512_dpbf16_ps(acc[m][a], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)v);
    }
  };
  int64_t kk = 0;
  for (; kk + A <= steps; kk += A)
    for (int a = 0; a < A; ++a) step(kk + a, a);
  for (; kk < steps; ++kk) step(kk, 0);
  for (int m = 0; m < R; ++m) {
    for (int a = 1; a < A; ++a) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][a]);
    _mm512_storeu_ps(out[m], acc[m][0]);
  }
#elif defined(__AVX512F__)
  (void)x;
  constexpr int A2 = A < 2 ? 2 : A;  // the even and odd products in their own chains
  __m512 acc[R][A2];
  for (int m = 0; m < R; ++m)
    for (int a = 0; a < A2; ++a) acc[m][a] = _mm512_setzero_ps();
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  auto step = [&](int64_t kk, int a) {  // a: even chain; a + 1: odd chain
    const __m512i v = _mm512_loadu_si512(w + kk * 32);
    const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
    for (int m = 0; m < R; ++m) {
      const float *xm = xf + m * kp + kk * 2;
      acc[m][a] = _mm512_fmadd_ps(_mm512_set1_ps(xm[0]), w0, acc[m][a]);
      acc[m][a + 1] = _mm512_fmadd_ps(_mm512_set1_ps(xm[1]), w1, acc[m][a + 1]);
    }
  };
  int64_t kk = 0;
  for (; kk + A2 / 2 <= steps; kk += A2 / 2)
    for (int a = 0; a < A2 / 2; ++a) step(kk + a, 2 * a);
  for (; kk < steps; ++kk) step(kk, 0);
  for (int m = 0; m < R; ++m) {
    for (int a = 1; a < A2; ++a) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][a]);
    _mm512_storeu_ps(out[m], acc[m][0]);
  }
#else
  (void)x;
  float acc[R][NB] = {};
  for (int64_t kk = 0; kk < steps; ++kk) {
    const uint16_t *wk = w + kk * 32;
    for (int j = 0; j < 2; ++j) {
      float wj[NB];
      for (int l = 0; l < NB; ++l) wj[l] = kr::bf16_to_float(wk[l * 2 + j]);
      for (int m = 0; m < R; ++m) {
        const float xv = xf[m * kp + kk * 2 + j];
        for (int l = 0; l < NB; ++l) acc[m][l] += xv * wj[l];
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int l = 0; l < NB; ++l) out[m][l] = acc[m][l];
#endif
  for (int m = 0; m < R; ++m)  // the bias joins the fp32 sum: one rounding, as eager's addmm
    for (int l = 0; l < nv; ++l)
      y[m * ys + l] = kr::bfloat16(bias ? out[m][l] + static_cast<float>(bias[l]) : out[m][l]);
}

// rows m0.. of a row-blocked sweep: calls F<R>(m0) with R = MB, then the remainder
template <class F> inline void row_blocks(int64_t M, F &&f) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB) f(std::integral_constant<int, MB>(), m);
  switch (M - m) {
    case 7: f(std::integral_constant<int, 7>(), m); break;
    case 6: f(std::integral_constant<int, 6>(), m); break;
    case 5: f(std::integral_constant<int, 5>(), m); break;
    case 4: f(std::integral_constant<int, 4>(), m); break;
    case 3: f(std::integral_constant<int, 3>(), m); break;
    case 2: f(std::integral_constant<int, 2>(), m); break;
    case 1: f(std::integral_constant<int, 1>(), m); break;
    default: break;
  }
}

inline bool check(kr::Err &e, const char *where, int64_t k, int64_t n, int64_t kp, int64_t xk,
                  int64_t xstride, int64_t qbytes, int64_t want) {
  if (xk != k || xstride != 1) {
    e.fail("%s: qgemm expects x rows of %lld contiguous values, got %lld (stride %lld)", where,
           (long long)k, (long long)xk, (long long)xstride);
    return true;
  }
  if (qbytes != want) {
    e.fail("%s: qgemm expects %lld stored weight values for K=%lld (padded %lld), N=%lld, got "
           "%lld", where, (long long)want, (long long)k, (long long)kp, (long long)n,
           (long long)qbytes);
    return true;
  }
  return false;
}

// x rows [M, k] (row stride xs) -> zero-padded [M, kp]
template <class T>
inline std::vector<T> padded_rows(const View<T> &x, int64_t M, int64_t k, int64_t kp) {
  std::vector<T> xp(static_cast<size_t>(M * kp));
  std::memset(static_cast<void *>(xp.data()), 0, xp.size() * sizeof(T));
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(static_cast<void *>(xp.data() + m * kp), x.data + m * x.stride(0),
                static_cast<size_t>(k) * sizeof(T));
  return xp;
}

#ifdef KILN_WITH_BLAS
/* larger M: chunks of CHUNK panels dequantised to fp32 [kp, 16 * CHUNK], times x by sgemm */
inline void dequant_chunk(int64_t mode, const int8_t *q, const float *s, int64_t kp,
                          int64_t group, int64_t p0, int64_t np, float *buf) {
  const int64_t ld = np * NB;
  for (int64_t pp = 0; pp < np; ++pp) {
    const int64_t p = p0 + pp;
    if (mode == 0) {
      const int8_t *w = q + p * kp * NB;
      const float *sp = s + p * NB;
      for (int64_t kk = 0; kk < kp / 4; ++kk)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < NB; ++l)
            buf[(kk * 4 + j) * ld + pp * NB + l] = w[kk * 64 + l * 4 + j] * sp[l];
    } else {
      const int8_t *w = q + p * (kp / 2) * NB;
      const float *sp = s + p * (kp / group) * NB;
      for (int64_t kk = 0; kk < kp / 8; ++kk) {
        const float *sg = sp + (kk * 8 / group) * NB;
        for (int l = 0; l < NB; ++l)
          for (int b = 0; b < 4; ++b) {
            const uint8_t byte = static_cast<uint8_t>(w[kk * 64 + l * 4 + b]);
            const int lo = (byte & 0xF) >= 8 ? (byte & 0xF) - 16 : (byte & 0xF);
            const int hi = (byte >> 4) >= 8 ? (byte >> 4) - 16 : (byte >> 4);
            buf[(kk * 8 + 2 * b) * ld + pp * NB + l] = lo * sg[l];
            buf[(kk * 8 + 2 * b + 1) * ld + pp * NB + l] = hi * sg[l];
          }
      }
    }
  }
}
#endif

inline int weight_only(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k,
                       int64_t n, int64_t group, int64_t threads, View<float> x,
                       View<int8_t> q, View<float> s, const float *bias) {
  const int64_t kp = mode == 1 ? cdiv(k, group) * group : cdiv(k, 4) * 4;
  const int64_t P = cdiv(n, NB), M = x.size(0);
  if (check(e, where, k, n, kp, x.size(1), x.stride(1), q.numel(),
            mode == 1 ? P * kp * NB / 2 : P * kp * NB))
    return 1;
  if (M == 0) return 0;
  const std::vector<float> xp = padded_rows(x, M, k, kp);
  const float *X = xp.data();
  const int8_t *Q = q.data;
  const float *S = s.data;
  const int64_t pstride = mode == 1 ? kp * NB / 2 : kp * NB;  // bytes a panel
  const int64_t sstride = mode == 1 ? (kp / group) * NB : NB;
#ifdef KILN_WITH_BLAS
  if (M >= QGEMM_BLAS_M) {
    const int64_t chunks = cdiv(P, CHUNK);
    kr::parallel_for(chunks, nthreads(threads, chunks), [&](int64_t c0, int64_t c1) {
      std::vector<float> buf(static_cast<size_t>(kp * CHUNK * NB));
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t p0 = c * CHUNK, np = std::min<int64_t>(CHUNK, P - p0);
        dequant_chunk(mode, Q, S, kp, group, p0, np, buf.data());
        const int64_t cols = std::min<int64_t>(np * NB, n - p0 * NB);
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)cols, (int)k,
                          1.0f, X, (int)kp, buf.data(), (int)(np * NB), 0.0f, out + p0 * NB,
                          (int)n);
        add_bias(out + p0 * NB, n, M, cols, bias ? bias + p0 * NB : nullptr);
      }
    });
    return 0;
  }
#endif
  kr::parallel_for(P, nthreads(threads, P), [&](int64_t p0_, int64_t p1_) {
  for (int64_t p = p0_; p < p1_; ++p) {
    const int nv = static_cast<int>(std::min<int64_t>(NB, n - p * NB));
    row_blocks(M, [&](auto r, int64_t m0) {
      constexpr int R = decltype(r)::value;
      if (mode == 1)
        panel_i4<R>(X + m0 * kp, kp, group, Q + p * pstride, S + p * sstride,
                    out + m0 * n + p * NB, n, nv);
      else
        panel_i8<R>(X + m0 * kp, kp, Q + p * pstride, S + p * sstride, out + m0 * n + p * NB,
                    n, nv);
    });
    add_bias(out + p * NB, n, M, nv, bias ? bias + p * NB : nullptr);
  }
  });
  return 0;
}

// row m of x [M, k] quantised to int8 (symmetric, round half to even, the VNNI kernels'
// rounding): q[i], returned scale
inline float quantise_row(const float *xm, int64_t k, int8_t *q) {
  float lanes[16] = {};  // 16 running maxima (one vector), then theirs
  int64_t i = 0;
  for (; i + 16 <= k; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], std::fabs(xm[i + l]));
  float amax = 0.f;
  for (; i < k; ++i) amax = std::max(amax, std::fabs(xm[i]));
  for (int l = 0; l < 16; ++l) amax = std::max(amax, lanes[l]);
  const float sc = amax > 0.f ? amax / 127.f : 1.f;
  for (int64_t i = 0; i < k; ++i) {
    float v = std::nearbyint(xm[i] / sc);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
  return sc;
}

inline int int4_vnni(kr::Err &e, const char *where, float *out, int64_t k, int64_t n,
                     int64_t group, int64_t threads, View<float> x, View<int8_t> q,
                     View<float> s, const float *bias) {
  const int64_t kp = cdiv(k, group) * group, P = cdiv(n, NB), M = x.size(0);
  const int64_t groups = kp / group;
  if (check(e, where, k, n, kp, x.size(1), x.stride(1), q.numel(), P * kp * NB / 2)) return 1;
  if (M == 0) return 0;
  // x rows quantised, zero-padded to kp, each step of 8 reordered (evens, then odds)
  std::vector<int8_t> xa(static_cast<size_t>(M * kp), 0), row(static_cast<size_t>(kp), 0);
  std::vector<float> sx(static_cast<size_t>(M));
  std::vector<int32_t> xsum(static_cast<size_t>(M * groups), 0);
  for (int64_t m = 0; m < M; ++m) {
    sx[m] = quantise_row(x.data + m * x.stride(0), k, row.data());
    int8_t *am = xa.data() + m * kp;
    for (int64_t i = 0; i < k; ++i) am[(i / 8) * 8 + (i % 2) * 4 + (i % 8) / 2] = row[i];
    for (int64_t g = 0; g < groups; ++g) {  // (no division by the run-time group per value)
      int32_t sum = 0;
      const int64_t end = std::min(k, (g + 1) * group);
      for (int64_t i = g * group; i < end; ++i) sum += row[i];
      xsum[m * groups + g] = sum;
    }
  }
  const int8_t *Q = q.data;
  const float *S = s.data;
  kr::parallel_for(P, nthreads(threads, P), [&](int64_t p0_, int64_t p1_) {
  for (int64_t p = p0_; p < p1_; ++p) {
    const int nv = static_cast<int>(std::min<int64_t>(NB, n - p * NB));
    row_blocks(M, [&](auto r, int64_t m0) {
      constexpr int R = decltype(r)::value;
      panel_i4_vnni<R>(xa.data() + m0 * kp, kp, group, xsum.data() + m0 * groups,
                       sx.data() + m0, Q + p * (kp * NB / 2), S + p * groups * NB,
                       out + m0 * n + p * NB, n, nv);
    });
    add_bias(out + p * NB, n, M, nv, bias ? bias + p * NB : nullptr);
  }
  });
  return 0;
}

inline int int8_int4(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k,
                     int64_t n, int64_t group, int64_t threads, View<float> x, View<int8_t> q,
                     View<float> s, const float *bias) {
  if (mode != 0 && mode != 1 && mode != 4)
    return e.fail("%s: qgemm mode %lld takes other operands", where, (long long)mode);
  if (mode != 0 && (group <= 0 || group % 8))
    return e.fail("%s: int4 group size %lld is not a positive multiple of 8", where,
                  (long long)group);
  if (mode == 4) return int4_vnni(e, where, out, k, n, group, threads, x, q, s, bias);
  return weight_only(e, where, out, mode, k, n, group, threads, x, q, s, bias);
}

inline int vnni(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
                int64_t threads, View<float> x, View<int8_t> q, View<float> s,
                View<int32_t> wsum, const float *bias) {
  if (mode != 2) return e.fail("%s: qgemm mode %lld takes other operands", where, (long long)mode);
  const int64_t kp = cdiv(k, 4) * 4, P = cdiv(n, NB), M = x.size(0);
  if (check(e, where, k, n, kp, x.size(1), x.stride(1), q.numel(), P * kp * NB)) return 1;
  if (M == 0) return 0;
  // each row quantised: symmetric int8 (round half to even), offset to uint8
  std::vector<uint8_t> xu(static_cast<size_t>(M * kp), 128);
  std::vector<float> sx(static_cast<size_t>(M));
  std::vector<int8_t> row(static_cast<size_t>(k));
  for (int64_t m = 0; m < M; ++m) {
    sx[m] = quantise_row(x.data + m * x.stride(0), k, row.data());
    for (int64_t i = 0; i < k; ++i)
      xu[m * kp + i] = static_cast<uint8_t>(static_cast<int>(row[i]) + 128);
  }
  const int8_t *Q = q.data;
  const float *S = s.data;
  const int32_t *W = wsum.data;
  kr::parallel_for(P, nthreads(threads, P), [&](int64_t p0_, int64_t p1_) {
  for (int64_t p = p0_; p < p1_; ++p) {
    const int nv = static_cast<int>(std::min<int64_t>(NB, n - p * NB));
    row_blocks(M, [&](auto r, int64_t m0) {
      constexpr int R = decltype(r)::value;
      panel_vnni<R>(xu.data() + m0 * kp, kp, sx.data() + m0, Q + p * kp * NB, S + p * NB,
                    W + p * NB, out + m0 * n + p * NB, n, nv);
    });
    add_bias(out + p * NB, n, M, nv, bias ? bias + p * NB : nullptr);
  }
  });
  return 0;
}

inline int bf16(kr::Err &e, const char *where, kr::bfloat16 *out, int64_t mode, int64_t k,
                int64_t n, int64_t threads, View<kr::bfloat16> x, View<kr::bfloat16> q,
                const kr::bfloat16 *bias) {
  if (mode != 3) return e.fail("%s: qgemm mode %lld takes other operands", where, (long long)mode);
  const int64_t kp = cdiv(k, 2) * 2, P = cdiv(n, NB), M = x.size(0);
  if (check(e, where, k, n, kp, x.size(1), x.stride(1), q.numel(), P * kp * NB)) return 1;
  if (M == 0) return 0;
  const std::vector<kr::bfloat16> xp = padded_rows(x, M, k, kp);
  const uint16_t *X = reinterpret_cast<const uint16_t *>(xp.data());
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const std::vector<float> xw;  // vdpbf16ps reads the bf16 rows
#else
  std::vector<float> xw(xp.size());
  for (size_t i = 0; i < xp.size(); ++i) xw[i] = kr::bf16_to_float(X[i]);
#endif
  const float *XF = xw.data();
  const uint16_t *Q = reinterpret_cast<const uint16_t *>(q.data);
  kr::parallel_for(P, nthreads(threads, P), [&](int64_t p0_, int64_t p1_) {
  for (int64_t p = p0_; p < p1_; ++p) {
    const int nv = static_cast<int>(std::min<int64_t>(NB, n - p * NB));
    row_blocks(M, [&](auto r, int64_t m0) {
      constexpr int R = decltype(r)::value;
      panel_bf16<R>(X + m0 * kp, XF ? XF + m0 * kp : nullptr, kp, Q + p * kp * NB,
                    out + m0 * n + p * NB, n, nv, bias ? bias + p * NB : nullptr);
    });
  }
  });
  return 0;
}

}  // namespace qg

int qgemm(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
          int64_t group, int64_t threads, View<float> x, View<int8_t> q, View<float> s) {
  return qg::int8_int4(e, where, out, mode, k, n, group, threads, x, q, s, nullptr);
}

int qgemm(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
          int64_t /*group*/, int64_t threads, View<float> x, View<int8_t> q, View<float> s,
          View<int32_t> wsum) {
  return qg::vnni(e, where, out, mode, k, n, threads, x, q, s, wsum, nullptr);
}

int qgemm(kr::Err &e, const char *where, kr::bfloat16 *out, int64_t mode, int64_t k, int64_t n,
          int64_t /*group*/, int64_t threads, View<kr::bfloat16> x, View<kr::bfloat16> q) {
  return qg::bf16(e, where, out, mode, k, n, threads, x, q, nullptr);
}

// with a bias: the stored contiguous [N] vector (bias.stride(0) == 1, checked)
int qgemm(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
          int64_t group, int64_t threads, View<float> x, View<int8_t> q, View<float> s,
          View<float> bias) {
  if (bias.numel() != n || bias.stride(0) != 1)
    return e.fail("%s: qgemm expects a contiguous bias of %lld values", where, (long long)n);
  return qg::int8_int4(e, where, out, mode, k, n, group, threads, x, q, s, bias.data);
}

int qgemm(kr::Err &e, const char *where, float *out, int64_t mode, int64_t k, int64_t n,
          int64_t /*group*/, int64_t threads, View<float> x, View<int8_t> q, View<float> s,
          View<int32_t> wsum, View<float> bias) {
  if (bias.numel() != n || bias.stride(0) != 1)
    return e.fail("%s: qgemm expects a contiguous bias of %lld values", where, (long long)n);
  return qg::vnni(e, where, out, mode, k, n, threads, x, q, s, wsum, bias.data);
}

int qgemm(kr::Err &e, const char *where, kr::bfloat16 *out, int64_t mode, int64_t k, int64_t n,
          int64_t /*group*/, int64_t threads, View<kr::bfloat16> x, View<kr::bfloat16> q,
          View<kr::bfloat16> bias) {
  if (bias.numel() != n || bias.stride(0) != 1)
    return e.fail("%s: qgemm expects a contiguous bias of %lld values", where, (long long)n);
  return qg::bf16(e, where, out, mode, k, n, threads, x, q, bias.data);
}

}  // namespace kl
#endif  // KILN_QGEMM_IMPL
#endif  // KILN_QGEMM_H
