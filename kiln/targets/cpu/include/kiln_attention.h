/* kiln_attention.h - fused scaled-dot-product attention on the CPU (the `attention` Extern of
 * kiln/lowering/attention.py; the CUDA target runs the same step as a Triton kernel):
 *
 *   out[b, h, i, :] = softmax_j(scale * q[b, h, i] . k[b, h / G, j] + mask[b, h, i, j])
 *                     @ v[b, h / G]
 *
 * with causal (top-left aligned: key j kept for query i when j <= i), a bool mask (key kept
 * where true) or a float mask (added), and G query heads per key/value head (grouped-query
 * attention, passes/gqa_attention.py). A query row with no allowed key gives zeros (eager's
 * _safe_softmax, the decomposed path of aten_high.py); a NaN score gives NaN, as in eager.
 *
 * Flash-style: a task is (batch, head, part of the query rows; parts only where the heads are
 * fewer than twice the threads). It packs the keys it needs once, transposed in blocks of BN
 * ([E, BN] each: BN keys across the vector lanes), and the values ([S, Ev padded to the
 * vector]), then for each chunk of QC query rows walks the key blocks: the [QC, BN] scores
 * with a register-tiled micro-kernel (RM query rows x CV vectors of keys, query values
 * broadcast), causal / mask applied, each row's running maximum and sum updated (online
 * softmax: earlier contributions rescaled by exp(m_old - m_new)), P @ V accumulated into a
 * [QC, Ev] float accumulator (each row's sum kept as a vector until the end). A partial last
 * key block computes only the vectors holding its keys (S = 197: 13 vectors, not 16). The
 * [L, S] scores are never stored; causal tiles stop at their last row's key. Tasks are cut
 * into one contiguous share per thread of kr::parallel_for (kiln's pool), each share
 * allocating its scratch once. Up to ROWS_DIRECT query rows (a
 * decode step) packing would cost more than the products: `run_rows` takes one (batch, head,
 * row) per task and reads the keys and values in place (dot products along E, 4 keys at a
 * time; the output in registers while the keys are walked), its [S] scores in scratch
 * (bench/cpu_attention_shapes.py --queries 1, 8 heads: packed, 2-5x slower than the decomposed
 * path; this way 0.2-0.8x with a mask or at S = 2048). Unmasked, the four dot products are
 * summed across lanes by a shuffle tree (`sum4`) and the row's maximum taken without the mask
 * pass: 1.01-1.05x of the decomposed path at S = 128 and 512 (bench/cpu_attention_decode.py,
 * one thread, loaded box; 1.19x / 1.25x with per-lane scalar sums).
 *
 * Operands are float32 strided views (q/k/v sliced and transposed out of a QKV projection are
 * read in place); bfloat16 keys and values are read as they are stored (a bf16 KV cache is
 * not widened whole each decode step; passes/widen_half.py keeps them bf16): `run_rows`
 * widens each vector as it loads it, `run` packs float32 copies. q and other float16 /
 * bfloat16 operands are widened to float32 by the compiler, so all is computed in float32.
 * With a bool mask, `run_rows` skips the keys it drops: no dot product, no value row read
 * (a NaN / inf value of a dropped key does not reach the output there; eager's 0 * inf
 * would give NaN). The output is a contiguous [B, H, L, Ev]
 * float32 buffer. Vectors are GCC vector extensions of W floats (16 with AVX-512, 8 with
 * AVX, else 4). The definitions compile only where KILN_ATTENTION_IMPL is defined (the generated
 * attention.cpp, with the kernels' flags); the wrapper sees the declarations. The numpy twin
 * is kiln/ir/interp.py's `_lib_attention`. */
#ifndef KILN_ATTENTION_H
#define KILN_ATTENTION_H
#include <cstdint>

#include "kiln_lib.h"

namespace kl {

// mask: 0 none, 1 bool, 2 float (kiln/lowering/attention.py MASK_KINDS)
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<float> k, View<float> v);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<float> k, View<float> v, View<bool> m);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<float> k, View<float> v, View<float> m);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<float> k, View<float> v);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<float> k, View<float> v,
              View<bool> m);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<float> k, View<float> v,
              View<float> m);

// bfloat16 keys and values (a bf16 KV cache read in place, converted as they are loaded;
// q and the output float32)
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<kr::bfloat16> k, View<kr::bfloat16> v);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<kr::bfloat16> k, View<kr::bfloat16> v,
              View<bool> m);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<kr::bfloat16> k, View<kr::bfloat16> v,
              View<float> m);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<kr::bfloat16> k,
              View<kr::bfloat16> v);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<kr::bfloat16> k,
              View<kr::bfloat16> v, View<bool> m);
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<kr::bfloat16> k,
              View<kr::bfloat16> v, View<float> m);

}  // namespace kl

#ifdef KILN_ATTENTION_IMPL
#pragma GCC diagnostic ignored "-Wpsabi"
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kiln_pool.h"
#include <immintrin.h>

namespace kl {
namespace attn {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;  // SSE
#endif
typedef float vec __attribute__((vector_size(W * 4), aligned(4), may_alias));
typedef int32_t ivec __attribute__((vector_size(W * 4), aligned(4), may_alias));
typedef uint8_t bvec __attribute__((vector_size(W), aligned(1), may_alias));

constexpr int BN = 128;          // keys per block (a multiple of W)
constexpr int RM = W == 16 ? 6 : 2;  // rows of a micro-kernel tile
constexpr int QC = W == 16 ? 48 : 32;  // query rows of a chunk (a multiple of RM)
constexpr int CV = 4;            // vectors of a micro-kernel tile
constexpr int64_t ROWS_DIRECT = 4;  // up to this many query rows: run_rows (no packing)

inline vec load(const float *p) { return *reinterpret_cast<const vec *>(p); }
inline void store(float *p, vec x) { *reinterpret_cast<vec *>(p) = x; }
inline vec splat(float x) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vec)_mm256_set1_ps(x);
#else
  return (vec)_mm_set1_ps(x);
#endif
}

/* keeps a loaded vector in a register: without it GCC folds the load into each row's FMA,
 * loading it RM times (the loads, not the FMAs, would bound the micro-kernels) */
inline void in_register(vec &x) { asm("" : "+x"(x)); }

// W keys / values as floats: float32 loaded, bfloat16 widened in registers (bits << 16)
inline vec load_kv(const float *p) { return load(p); }
inline vec load_kv(const kr::bfloat16 *p) {
  typedef uint16_t hvec __attribute__((vector_size(W * 2), aligned(2), may_alias));
  typedef uint32_t uvec __attribute__((vector_size(W * 4)));
  const uvec u = __builtin_convertvector(*reinterpret_cast<const hvec *>(p), uvec) << 16;
  vec r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

#if defined(__AVX512F__)
/* exp of each lane, 2^n * 2^f with n = round(x log2 e) (vrndscaleps), f = x log2 e - n in
 * [-1/2, 1/2] (log2 e in two parts, by FMAs), 2^f a degree-5 minimax polynomial (relative
 * error 7.5e-8) and 2^n applied by vscalefps: within 3 ulp of exp over [-87.3, 88.7] (the
 * float64 reference, every float32 of [-87.3, 0] checked), 12 instructions against the 16
 * of the integer-exponent form below (at head size 64, exp was a quarter of the operations
 * of a score). 0 below -87.3 (so -inf gives 0), NaN for NaN, +inf above 88.7. */
inline vec exp_v(vec x) {
  const vec hi = splat(88.72283935546875f), lo = splat(-87.33654022216797f);
  vec xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  const vec n = (vec)_mm512_roundscale_ps((__m512)(xc * 1.442695022e+00f),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // FMAs by intrinsics (x log2 e - n unrounded, whatever -ffp-contract says): a * b + c
  const auto fma = [](vec a, vec b, float c) {
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, _mm512_set1_ps(c));
  };
  vec f = (vec)_mm512_fmsub_ps((__m512)xc, _mm512_set1_ps(1.442695022e+00f), (__m512)n);
  f = (vec)_mm512_fmadd_ps((__m512)xc, _mm512_set1_ps(1.925963034e-08f), (__m512)f);
  vec y = fma(f, splat(1.327647129e-03f), 9.675540961e-03f);
  y = fma(y, f, 5.550713092e-02f);
  y = fma(y, f, 2.402212024e-01f);
  y = fma(y, f, 6.931469440e-01f);
  y = fma(y, f, 1.000000119e+00f);
  y = (vec)_mm512_scalef_ps((__m512)y, (__m512)n);  // 2^128 overflows to inf
  return x < lo ? splat(0.0f) : y;
}
#else
/* exp of each lane (Cephes' expf polynomial, about 1 ulp): 0 below -87.3 (so -inf gives 0),
 * NaN for NaN, +inf above 88.7. */
inline vec exp_v(vec x) {
  const vec hi = splat(88.72283935546875f), lo = splat(-87.33654022216797f);
  vec xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  const vec magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vec t = xc * 1.44269504088896341f + magic;
  const vec n = t - magic;
  const ivec ni = reinterpret_cast<const ivec &>(t) - reinterpret_cast<const ivec &>(magic);
  vec r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vec y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const ivec bits = (ni + 127) << 23;
  y = y * reinterpret_cast<const vec &>(bits);
  y = x > hi ? splat(std::numeric_limits<float>::infinity()) : y;
  return x < lo ? splat(0.0f) : y;
}
#endif

struct Shape {
  int64_t B, H, L, S, E, Ev, G;
};

template <class M> struct Mask {
  const M *data;
  const int64_t *st;  // strides of the [B, H, L, S] view
};

/* x with lanes l and l ^ H exchanged (H a power of two below W: the halves, quarters, ...) */
template <int H> inline vec swap_lanes(vec x) {
  ivec m;
  for (int l = 0; l < W; ++l) m[l] = l ^ H;
  return __builtin_shuffle(x, m);
}

/* the sum / maximum of x's lanes by a tree of log2(W) shuffles (a scalar loop over the lanes
 * is a chain of W dependent adds, paid once per row and key block) */
template <int H = W / 2> inline float lane_sum(vec x) {
  if constexpr (H == 0) {
    return x[0];
  } else {
    return lane_sum<H / 2>(x + swap_lanes<H>(x));
  }
}
template <int H = W / 2> inline float lane_max(vec x) {
  if constexpr (H == 0) {
    return x[0];
  } else {
    const vec y = swap_lanes<H>(x);
    return lane_max<H / 2>(y > x ? y : x);
  }
}

/* the maximum of s[0, n) (n a multiple of W); NaN when some element is NaN */
inline float row_max(const float *s, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  // NaN lanes gathered in a mask register: one lane reduction (the maximum), not two
  __m512 top = _mm512_set1_ps(ninf);
  __mmask16 nan = 0;
  for (int64_t c = 0; c < n; c += W) {
    const __m512 x = _mm512_loadu_ps(s + c);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    top = _mm512_max_ps(x, top);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : lane_max((vec)top);
#else
  vec top = splat(ninf), nan = splat(0.0f);
  for (int64_t c = 0; c < n; c += W) {
    const vec x = load(s + c);
    top = x > top ? x : top;
    nan = x != x ? x : nan;
  }
  const float any_nan = lane_sum(nan);  // lanes 0 or NaN: NaN when one is
  return any_nan != any_nan ? any_nan : lane_max(top);
#endif
}

/* s[rows][0, ncols) = Qp[rows][E] . Kt[E][0, ncols) for a tile of RM rows (ncols a multiple
 * of W, at most BN: a partial last key block computes only the vectors holding its keys),
 * CV * W keys a pass, then the rest in one pass of fewer vectors (inlined: as a call, the
 * passes of S = 128 were 3% slower than the loop they replaced) */
template <int C>
__attribute__((always_inline)) inline void scores_pass(const float *qp, int64_t E,
                                                       const float *kt, float *s) {
  vec acc[RM][C];
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = splat(0.0f);
  for (int64_t e = 0; e < E; ++e) {
    vec kv[C];
    for (int c = 0; c < C; ++c) {
      kv[c] = load(kt + e * BN + c * W);
      in_register(kv[c]);
    }
    for (int r = 0; r < RM; ++r) {
      const vec qb = splat(qp[r * E + e]);
      for (int c = 0; c < C; ++c) acc[r][c] += qb * kv[c];
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < C; ++c) store(s + r * BN + c * W, acc[r][c]);
}

inline void scores_tile(const float *qp, int64_t E, const float *kt, float *s, int64_t ncols) {
  int64_t c0 = 0;
  for (; c0 + CV * W <= ncols; c0 += CV * W) scores_pass<CV>(qp, E, kt + c0, s + c0);
  const int64_t left = (ncols - c0) / W;  // 0 to CV - 1 vectors
  if (left == 3) scores_pass<3>(qp, E, kt + c0, s + c0);
  if (left == 2) scores_pass<2>(qp, E, kt + c0, s + c0);
  if (left == 1) scores_pass<1>(qp, E, kt + c0, s + c0);
}

/* o[rows][evp] += p[rows][:nb] @ vp[:nb][evp] for a tile of RM rows */
inline void pv_tile(const float *p, int64_t nb, const float *vp, int64_t evp, float *o) {
  int64_t c0 = 0;
  for (; c0 + CV * W <= evp; c0 += CV * W) {
    vec acc[RM][CV];
    for (int r = 0; r < RM; ++r)
      for (int c = 0; c < CV; ++c) acc[r][c] = load(o + r * evp + c0 + c * W);
    for (int64_t j = 0; j < nb; ++j) {
      vec vv[CV];
      for (int c = 0; c < CV; ++c) {
        vv[c] = load(vp + j * evp + c0 + c * W);
        in_register(vv[c]);
      }
      for (int r = 0; r < RM; ++r) {
        const vec pb = splat(p[r * BN + j]);
        for (int c = 0; c < CV; ++c) acc[r][c] += pb * vv[c];
      }
    }
    for (int r = 0; r < RM; ++r)
      for (int c = 0; c < CV; ++c) store(o + r * evp + c0 + c * W, acc[r][c]);
  }
  for (; c0 < evp; c0 += W) {  // the last vectors, one at a time
    vec acc[RM];
    for (int r = 0; r < RM; ++r) acc[r] = load(o + r * evp + c0);
    for (int64_t j = 0; j < nb; ++j) {
      const vec vv = load(vp + j * evp + c0);
      for (int r = 0; r < RM; ++r) acc[r] += splat(p[r * BN + j]) * vv;
    }
    for (int r = 0; r < RM; ++r) store(o + r * evp + c0, acc[r]);
  }
}

/* the block's scores s of query row i (global), keys [j0, j0 + ncols) (ncols a multiple of W,
 * at most BN): causal and mask applied (a dropped key becomes -inf), keys past `nb` -inf;
 * returns the block's maximum (NaN when a score is NaN: the row then becomes NaN, as eager's
 * softmax) */
template <class M>
inline float mask_row(float *s, int64_t i, int64_t j0, int64_t nb, int64_t ncols, bool causal,
                      int kind, const M *mr, int64_t ms) {
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t lim = nb;  // keys [0, lim) of the block may be kept
  if (causal) lim = i - j0 + 1 < nb ? i - j0 + 1 : nb;
  if (lim < 0) lim = 0;
  if (kind == 1 && ms == 1) {  // W bools at a time (also in a partial block), then the rest
    const vec drop = splat(ninf);
    int64_t c = 0;
    for (; c + W <= lim; c += W) {
      const ivec keep = __builtin_convertvector(*reinterpret_cast<const bvec *>(mr + c), ivec);
      store(s + c, keep != 0 ? load(s + c) : drop);
    }
    for (; c < lim; ++c) s[c] = mr[c] ? s[c] : ninf;
  } else if (kind == 1) {
    for (int64_t c = 0; c < lim; ++c) s[c] = mr[c * ms] ? s[c] : ninf;
  } else if (kind == 2 && ms == 1) {
#pragma omp simd
    for (int64_t c = 0; c < lim; ++c) s[c] += float(mr[c]);
  } else if (kind == 2) {
    for (int64_t c = 0; c < lim; ++c) s[c] += float(mr[c * ms]);
  }
  for (int64_t c = lim; c < ncols; ++c) s[c] = ninf;
  return row_max(s, ncols);
}

template <class M>
bool run(const Shape &sh, float *out, bool causal, float scale, const View<float> &q,
         const View<float> &k, const View<float> &v, int kind, const Mask<M> &mask) {
  std::atomic<bool> failed{false};
  const int64_t E = sh.E, Ev = sh.Ev, evp = (Ev + W - 1) / W * W, L = sh.L, S = sh.S;
  const int64_t chunks = (L + QC - 1) / QC, heads = sh.B * sh.H;
  const double work = double(heads) * double(L) * double(S) * double(E + Ev);
  const int nt = work > 65536.0 ? kr::max_threads() : 1;
  // a task is (batch, head, part of the query chunks): parts only where the heads are fewer
  // than twice the threads; a task packs its keys and values once for all of its chunks
  int64_t parts = (2 * nt + heads - 1) / heads;
  if (parts > chunks) parts = chunks;
  if (parts < 1) parts = 1;
  const int64_t blocks = (S + BN - 1) / BN;
  const float ninf = -std::numeric_limits<float>::infinity();
  kr::parallel_for(heads * parts, nt, [&](int64_t t0, int64_t t1) {
    // scratch of this share: Kt [blocks][E][BN], Vp [blocks * BN][evp], Qp [QC, E],
    // P [QC, BN], O [QC, evp], row maxima [QC] and sums [QC][W]
    const size_t n =
        size_t(blocks * BN * (E + evp) + QC * E + QC * BN + QC * evp + QC + QC * W);
    float *buf = static_cast<float *>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64));
    if (!buf) {
      failed = true;
      return;
    }
    float *kt = buf, *vp = kt + blocks * BN * E, *qp = vp + blocks * BN * evp,
          *pp = qp + QC * E, *o = pp + QC * BN, *mx = o + QC * evp, *sum = mx + QC;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / parts, part = t % parts, b = bh / sh.H, h = bh % sh.H;
      const int64_t c0 = chunks * part / parts, c1 = chunks * (part + 1) / parts;
      const int64_t last = c1 * QC < L ? c1 * QC : L;  // the task's rows: [c0 QC, last)
      const int64_t hk = h / sh.G;
      const float *qb = q.data + b * q.stride(0) + h * q.stride(1);
      const float *kb = k.data + b * k.stride(0) + hk * k.stride(1);
      const float *vb = v.data + b * v.stride(0) + hk * v.stride(1);
      const int64_t kend = causal ? (last < S ? last : S) : S;
      const int64_t kpad = (kend + BN - 1) / BN * BN;
      for (int64_t j = 0; j < kpad; ++j) {  // keys transposed per block: [E][BN]
        float *dst = kt + j / BN * BN * E + j % BN;
        const float *src = kb + j * k.stride(2);
        if (j < kend)
          for (int64_t e = 0; e < E; ++e) dst[e * BN] = src[e * k.stride(3)];
        else
          for (int64_t e = 0; e < E; ++e) dst[e * BN] = 0.0f;
      }
      for (int64_t j = 0; j < kpad; ++j) {
        float *dst = vp + j * evp;
        const float *src = vb + j * v.stride(2);
        int64_t d = 0;
        if (j < kend && v.stride(3) == 1) {
          std::memcpy(dst, src, sizeof(float) * size_t(Ev));
          d = Ev;
        } else if (j < kend) {
          for (; d < Ev; ++d) dst[d] = src[d * v.stride(3)];
        }
        for (; d < evp; ++d) dst[d] = 0.0f;
      }
      for (int64_t ch = c0; ch < c1; ++ch) {
        const int64_t i0 = ch * QC;
        const int64_t rows = L - i0 < QC ? L - i0 : QC, tiles = (rows + RM - 1) / RM;
        std::memset(qp, 0, sizeof(float) * size_t(QC * E));
        for (int64_t r = 0; r < rows; ++r) {
          const float *src = qb + (i0 + r) * q.stride(2);
          if (q.stride(3) == 1) {
#pragma omp simd
            for (int64_t e = 0; e < E; ++e) qp[r * E + e] = src[e] * scale;
          } else {
            for (int64_t e = 0; e < E; ++e) qp[r * E + e] = src[e * q.stride(3)] * scale;
          }
        }
        std::memset(o, 0, sizeof(float) * size_t(QC * evp));
        for (int64_t r = 0; r < QC; ++r) mx[r] = ninf;
        std::memset(sum, 0, sizeof(float) * size_t(QC * W));
        // causal: the chunk's last row sees keys [0, i0 + rows)
        const int64_t cend = causal ? (i0 + rows < S ? i0 + rows : S) : S;
        // one key block [j0, j0 + nb): ncols = the vectors holding its keys, a constant BN
        // (the loops over the row unrolled) for every block but a partial last one
        auto block = [&](int64_t j0, int64_t nb, auto ncols) {
          const float *ktb = kt + j0 * E, *vpb = vp + j0 * evp;
          // causal: a tile's rows see the block's keys [0, tile_keys(tl)); none: skipped
          auto tile_keys = [&](int64_t tl) {
            const int64_t n = i0 + tl * RM + RM - j0;
            return !causal || n > nb ? nb : n;
          };
          for (int64_t tl = 0; tl < tiles; ++tl)
            if (tile_keys(tl) > 0)
              scores_tile(qp + tl * RM * E, E, ktb, pp + tl * RM * BN, ncols);
          // online softmax of each row over this block: pp becomes the block's probabilities
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            float *s = pp + r * BN;
            const M *mr = kind ? mask.data + b * mask.st[0] + h * mask.st[1] +
                                     i * mask.st[2] + j0 * mask.st[3] : nullptr;
            const float top = mask_row(s, i, j0, nb, ncols, causal, kind, mr, mask.st[3]);
            const float m_new = mx[r] > top ? mx[r] : top;
            if (m_new == ninf) {  // no key kept so far: nothing to add
              for (int64_t c = 0; c < ncols; ++c) s[c] = 0.0f;
              continue;
            }
            vec total = splat(0.0f);
            const vec mv = splat(m_new);
            for (int64_t c = 0; c < ncols; c += W) {
              const vec p = exp_v(load(s + c) - mv);
              store(s + c, p);
              total += p;
            }
            // the row's running sum stays a vector (one lane reduction at the end); alpha
            // rescales the earlier keys' sum and output where the maximum grew (NaN stays)
            float *sr = sum + r * W;
            if (mx[r] != m_new) {
              const float alpha = mx[r] == ninf ? 0.0f : exp_v(splat(mx[r] - m_new))[0];
              float *orow = o + r * evp;
              for (int64_t d = 0; d < evp; d += W) store(orow + d, load(orow + d) * alpha);
              store(sr, load(sr) * alpha);
            }
            store(sr, load(sr) + total);
            mx[r] = m_new;
          }
          for (int64_t r = rows; r < tiles * RM; ++r)
            for (int64_t c = 0; c < BN; ++c) pp[r * BN + c] = 0.0f;
          for (int64_t tl = 0; tl < tiles; ++tl)
            if (tile_keys(tl) > 0)
              pv_tile(pp + tl * RM * BN, tile_keys(tl), vpb, evp, o + tl * RM * evp);
        };
        for (int64_t j0 = 0; j0 < cend; j0 += BN) {
          if (cend - j0 >= BN)
            block(j0, BN, std::integral_constant<int64_t, BN>());
          else
            block(j0, cend - j0, (cend - j0 + W - 1) / W * W);
        }
        float *ob = out + ((b * sh.H + h) * L + i0) * Ev;
        for (int64_t r = 0; r < rows; ++r) {
          // no key kept: zeros (eager); a NaN sum stays NaN
          const float total = lane_sum(load(sum + r * W));
          const float inv = total == 0.0f ? 0.0f : 1.0f / total;
          for (int64_t d = 0; d < Ev; ++d) ob[r * Ev + d] = o[r * evp + d] * inv;
        }
      }
    }
    std::free(buf);
  });
  return !failed;
}

/* out[0..3] = the sums of the lanes of a0..a3: two steps that fold two vectors' halves into
 * one vector, then log2(W / 4) steps within it (the W = 16 tree: 6 shuffles, 6 adds; a scalar
 * loop over the lanes took 4 * W adds and lane extractions, most of a decode row's time). */
inline void sum4(vec a0, vec a1, vec a2, vec a3, float *out) {
  ivec lo, hi;  // lo = x[0, W/2) ++ y[0, W/2); hi = x[W/2, W) ++ y[W/2, W)
  for (int l = 0; l < W; ++l) {
    const int h = W / 2;
    lo[l] = l < h ? l : W + (l - h);
    hi[l] = l < h ? h + l : W + h + (l - h);
  }
  const vec t01 = __builtin_shuffle(a0, a1, lo) + __builtin_shuffle(a0, a1, hi);
  const vec t23 = __builtin_shuffle(a2, a3, lo) + __builtin_shuffle(a2, a3, hi);
  // quarters: lanes [q*r, q*(r+1)) of u hold W/4 partial sums of a_r
  ivec lo2, hi2;
  for (int l = 0; l < W; ++l) {
    const int q = W / 4, r = l / q, c = l % q;  // r: which accumulator, c: its lane
    const int base = (r & 1) * (W / 2) + (r >> 1) * W;  // its half in t01 ++ t23
    lo2[l] = base + c;
    hi2[l] = base + q + c;
  }
  vec u = __builtin_shuffle(t01, t23, lo2) + __builtin_shuffle(t01, t23, hi2);
  for (int w = W / 8; w >= 1; w /= 2) {  // fold each group of W/4 lanes to its first lane
    ivec m;
    for (int l = 0; l < W; ++l) m[l] = l ^ w;
    u += __builtin_shuffle(u, m);
  }
  for (int r = 0; r < 4; ++r) out[r] = u[r * (W / 4)];
}

/* Few query rows (a decode step): packing the keys would cost more than the products, so each
 * task is one (batch, head, query row): its scores against every key (dot products along E,
 * the keys read in place) in an [S] row of scratch, softmax, then the rows of v summed with
 * their weights. Same results as `run` (no key kept: zeros; NaN stays NaN). */
template <class M, class T>
bool run_rows(const Shape &sh, float *out, bool causal, float scale, const View<float> &q,
              const View<T> &k, const View<T> &v, int kind, const Mask<M> &mask) {
  std::atomic<bool> failed{false};
  const int64_t E = sh.E, Ev = sh.Ev, L = sh.L, S = sh.S, spad = (S + W - 1) / W * W;
  const int64_t tasks = sh.B * sh.H * L;
  const double work = double(tasks) * double(S) * double(E + Ev);
  const int nt = work > 65536.0 ? kr::max_threads() : 1;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t ks = k.stride(3), vs = v.stride(3), qs = q.stride(3);
  kr::parallel_for(tasks, nt, [&](int64_t t0, int64_t t1) {
    // scratch: the row's scores [spad], the scaled query [E], the output accumulator [Ev],
    // the keys a bool mask keeps [spad] (int32)
    const size_t n = size_t(2 * spad + E + Ev);
    float *buf = static_cast<float *>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64));
    if (!buf) {
      failed = true;
      return;
    }
    float *sc = buf, *qv = sc + spad, *acc = qv + E;
    int32_t *kept = reinterpret_cast<int32_t *>(acc + Ev);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t % L, bh = t / L, b = bh / sh.H, h = bh % sh.H, hk = h / sh.G;
      const float *qr = q.data + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
      const T *kb = k.data + b * k.stride(0) + hk * k.stride(1);
      const T *vb = v.data + b * v.stride(0) + hk * v.stride(1);
      // a bool mask: keys it drops get no dot product (their score becomes -inf either way)
      const M *mrow = kind == 1 ? mask.data + b * mask.st[0] + h * mask.st[1] + i * mask.st[2]
                                : nullptr;
      const int64_t mst = mask.st[3];
      for (int64_t e = 0; e < E; ++e) qv[e] = qr[e * qs] * scale;
      const int64_t lim = causal ? (i + 1 < S ? i + 1 : S) : S;
      int64_t j = 0;
      if (ks == 1 && E % W == 0) {  // 4 keys at a time, vectors along E
        const int64_t kst = k.stride(2);
        for (; j + 4 <= lim; j += 4) {
          if (std::is_same<M, bool>::value && mrow && !mrow[j * mst] && !mrow[(j + 1) * mst] &&
              !mrow[(j + 2) * mst] && !mrow[(j + 3) * mst]) {
            sc[j] = sc[j + 1] = sc[j + 2] = sc[j + 3] = 0.0f;
            continue;
          }
          const T *k0 = kb + j * kst, *k1 = k0 + kst, *k2 = k1 + kst, *k3 = k2 + kst;
          vec a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t e = 0; e < E; e += W) {
            const vec x = load(qv + e);
            a0 += x * load_kv(k0 + e);
            a1 += x * load_kv(k1 + e);
            a2 += x * load_kv(k2 + e);
            a3 += x * load_kv(k3 + e);
          }
          sum4(a0, a1, a2, a3, sc + j);
        }
      }
      for (; j < lim; ++j) {
        const T *kr_ = kb + j * k.stride(2);
        float d = 0.0f;
        if (!(std::is_same<M, bool>::value && mrow && !mrow[j * mst]))
          for (int64_t e = 0; e < E; ++e) d += qv[e] * float(kr_[e * ks]);
        sc[j] = d;
      }
      float top = ninf;
      if (!kind) {  // no mask: the maximum of the kept keys, the rest of the row -inf
        for (int64_t j = lim; j < spad; ++j) sc[j] = ninf;
        top = row_max(sc, spad);
      } else {
        for (int64_t j0 = 0; j0 < spad; j0 += BN) {  // mask and maximum, BN keys at a time
          const int64_t nb = lim - j0 < BN ? lim - j0 : BN;
          float blk[BN];
          const int64_t len = spad - j0 < BN ? spad - j0 : BN;
          for (int64_t c = 0; c < BN; ++c) blk[c] = c < nb ? sc[j0 + c] : ninf;
          const M *mr = mask.data + b * mask.st[0] + h * mask.st[1] + i * mask.st[2] +
                        j0 * mask.st[3];
          const float m = mask_row(blk, i, j0, nb < 0 ? 0 : nb, BN, false, kind, mr,
                                   mask.st[3]);
          for (int64_t c = 0; c < len; ++c) sc[j0 + c] = blk[c];
          top = (m > top || m != m) ? m : top;
        }
      }
      for (int64_t d = 0; d < Ev; ++d) acc[d] = 0.0f;
      float total = 0.0f;
      if (top != ninf) {
        const vec mv = splat(top);
        vec tv = splat(0.0f);
        for (int64_t j = 0; j < spad; j += W) {
          const vec p = exp_v(load(sc + j) - mv);
          store(sc + j, p);
          tv += p;
        }
        total = lane_sum(tv);
        // the keys P @ V sums: those a bool mask keeps (a dropped key's weight is 0; its
        // value row is not read, so a non-finite value there does not reach the output,
        // where eager's 0 * inf gives NaN), else all of [0, lim)
        int64_t nk = lim;
        const bool listed = std::is_same<M, bool>::value && mrow != nullptr;
        if (listed) {
          nk = 0;
          for (int64_t j = 0; j < lim; ++j)
            if (mrow[j * mst]) kept[nk++] = int32_t(j);
        }
        auto key = [&](int64_t jj) { return listed ? int64_t(kept[jj]) : jj; };
        int64_t d0 = 0;
        if (vs == 1)  // CV vectors of the output in registers, the keys walked for each
          for (; d0 + CV * W <= Ev; d0 += CV * W) {
            // two keys at a time in their own accumulators: 2 CV independent FMA chains
            vec a[CV], a1[CV];
            for (int c = 0; c < CV; ++c) a[c] = a1[c] = splat(0.0f);
            int64_t jj = 0;
            for (; jj + 2 <= nk; jj += 2) {
              const int64_t j = key(jj), j1 = key(jj + 1);
              const T *vr = vb + j * v.stride(2) + d0, *vr1 = vb + j1 * v.stride(2) + d0;
              const vec p = splat(sc[j]), p1 = splat(sc[j1]);
              for (int c = 0; c < CV; ++c) {
                a[c] += p * load_kv(vr + c * W);
                a1[c] += p1 * load_kv(vr1 + c * W);
              }
            }
            for (; jj < nk; ++jj) {
              const int64_t j = key(jj);
              const T *vr = vb + j * v.stride(2) + d0;
              const vec p = splat(sc[j]);
              for (int c = 0; c < CV; ++c) a[c] += p * load_kv(vr + c * W);
            }
            for (int c = 0; c < CV; ++c) store(acc + d0 + c * W, a[c] + a1[c]);
          }
        for (int64_t jj = 0; jj < nk && d0 < Ev; ++jj) {  // the rest of the columns
          const int64_t j = key(jj);
          const float p = sc[j];
          const T *vr = vb + j * v.stride(2);
          for (int64_t d = d0; d < Ev; ++d) acc[d] += p * float(vr[d * vs]);
        }
      }
      float *o = out + t * Ev;
      const float inv = total == 0.0f ? 0.0f : 1.0f / total;
      for (int64_t d = 0; d < Ev; ++d) o[d] = acc[d] * inv;
    }
    std::free(buf);
  });
  return !failed;
}

// k, v [B, Hk, S, E] of any strides -> float32 copies, contiguous (`dims` their sizes and
// strides): the packed path's operands when the keys and values are bfloat16
template <class T>
View<float> widened(const View<T> &x, std::vector<float> &buf, int64_t *dims) {
  buf.resize(size_t(x.numel()));
  for (int64_t f = 0; f < x.numel(); ++f) buf[size_t(f)] = float(x.at(f));
  int64_t st = 1;
  for (int d = 3; d >= 0; --d) {
    dims[d] = x.size(d);
    dims[4 + d] = st;
    st *= x.size(d);
  }
  return View<float>{buf.data(), 4, dims};
}

template <class M, class T>
int call(kr::Err &e, const char *where, float *out, bool causal, double scale, int64_t kind,
         int64_t group, const View<float> &q, const View<T> &k, const View<T> &v,
         const View<M> *m) {
  if (q.rank != 4 || k.rank != 4 || v.rank != 4 || (m && m->rank != 4))
    return e.fail("%s: attention takes 4-D q, k, v (and mask) views", where);
  const Shape sh{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3),
                 group > 1 ? group : 1};
  if (k.size(3) != sh.E || v.size(2) != sh.S || k.size(1) * sh.G != sh.H ||
      v.size(1) != k.size(1) || k.size(0) != sh.B || v.size(0) != sh.B)
    return e.fail("%s: attention operands of inconsistent shapes (q [%lld, %lld, %lld, %lld], "
                  "k [%lld, %lld, %lld, %lld], group %lld)", where, (long long)q.size(0),
                  (long long)q.size(1), (long long)q.size(2), (long long)q.size(3),
                  (long long)k.size(0), (long long)k.size(1), (long long)k.size(2),
                  (long long)k.size(3), (long long)sh.G);
  const int64_t zero[4] = {0, 0, 0, 0};
  const Mask<M> mk{m ? m->data : nullptr, m ? m->dims + 4 : zero};
  bool ok;
  if (sh.L <= ROWS_DIRECT) {
    ok = run_rows<M, T>(sh, out, causal, float(scale), q, k, v, m ? int(kind) : 0, mk);
  } else if constexpr (std::is_same<T, float>::value) {
    ok = run<M>(sh, out, causal, float(scale), q, k, v, m ? int(kind) : 0, mk);
  } else {  // many query rows: the keys are packed as float32 anyway, from float32 copies
    std::vector<float> kf, vf;
    int64_t kd[8], vd[8];
    ok = run<M>(sh, out, causal, float(scale), q, widened(k, kf, kd), widened(v, vf, vd),
                m ? int(kind) : 0, mk);
  }
  if (!ok) return e.fail("%s: out of memory for the attention's scratch", where);
  return 0;
}

}  // namespace attn

int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<float> k, View<float> v) {
  return attn::call<float>(e, where, out, causal, scale, mask, 1, q, k, v, nullptr);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<float> k, View<float> v, View<bool> m) {
  return attn::call<bool>(e, where, out, causal, scale, mask, 1, q, k, v, &m);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<float> k, View<float> v, View<float> m) {
  return attn::call<float>(e, where, out, causal, scale, mask, 1, q, k, v, &m);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<float> k, View<float> v) {
  return attn::call<float>(e, where, out, causal, scale, mask, group, q, k, v, nullptr);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<float> k, View<float> v,
              View<bool> m) {
  return attn::call<bool>(e, where, out, causal, scale, mask, group, q, k, v, &m);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<float> k, View<float> v,
              View<float> m) {
  return attn::call<float>(e, where, out, causal, scale, mask, group, q, k, v, &m);
}

using bf16 = kr::bfloat16;
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<bf16> k, View<bf16> v) {
  return attn::call<float>(e, where, out, causal, scale, mask, 1, q, k, v, nullptr);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<bf16> k, View<bf16> v, View<bool> m) {
  return attn::call<bool>(e, where, out, causal, scale, mask, 1, q, k, v, &m);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, View<float> q, View<bf16> k, View<bf16> v, View<float> m) {
  return attn::call<float>(e, where, out, causal, scale, mask, 1, q, k, v, &m);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<bf16> k, View<bf16> v) {
  return attn::call<float>(e, where, out, causal, scale, mask, group, q, k, v, nullptr);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<bf16> k, View<bf16> v,
              View<bool> m) {
  return attn::call<bool>(e, where, out, causal, scale, mask, group, q, k, v, &m);
}
int attention(kr::Err &e, const char *where, float *out, bool causal, double scale,
              int64_t mask, int64_t group, View<float> q, View<bf16> k, View<bf16> v,
              View<float> m) {
  return attn::call<float>(e, where, out, causal, scale, mask, group, q, k, v, &m);
}

}  // namespace kl

#endif  // KILN_ATTENTION_IMPL
#endif  // KILN_ATTENTION_H
