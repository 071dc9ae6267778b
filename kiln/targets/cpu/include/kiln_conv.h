/* kiln_conv.h - direct 2-D convolution in the blocked channel layout NCHWc (CPU target).
 *
 * Layout: an activation [N, C, H, W] is stored as [N, C/B, H, W, B] (channels padded to a
 * multiple of B with zeros), B = 16 floats (AVX-512) or 8 (AVX2 and below); the compiler pass
 * (kiln/passes/conv_nchwc.py) picks B and packs the weights at compile time:
 *   dense      [OC/B, IC/B, KH, KW, ICB, B]  (ICB = B, or IC itself for an NCHW input: a stem
 *              convolution with fewer than B input channels reads the plain NCHW tensor)
 *   depthwise  [C/B, KH, KW, B]
 * Bias [OC/B * B]; folded batch norm is already part of weight and bias.
 *
 * Epilogue, in the store: out = act(acc + bias [+ residual]), act 0 none, 1 relu,
 * 2 clamp(lo, hi) (relu6, hardtanh), 3 silu.
 *
 * Threads: where a convolution's activations outweigh its weights (the early, wide layers),
 * thread t computes every output channel of the t-th contiguous share of the (image, row)
 * units, and depthwise convolutions split the same way, so consecutive kernels hand each
 * thread the part of the image it wrote itself (in its own core's L2); otherwise (the late,
 * weight-heavy layers) the tasks below go to the threads dynamically.
 *
 * Dense kernel: a task is (batch, group of OB output-channel blocks, block of output rows);
 * input channel blocks are walked in chunks whose weights stay in L2, and for each chunk every
 * output row of the task is swept in tiles of PX pixels with OB x PX vector accumulators in
 * registers (each input value broadcast once per tile and channel, each weight vector loaded
 * once per tile; with B = 16 and OB = 4, PX = 7 where 7- and 6-pixel tiles cover the row with
 * no narrower one). Tiles whose windows leave the input (padding) take a checked variant. A
 * 1x1 stride-1 convolution without padding sees its pixels as one flat row (a GEMM over
 * channel blocks, no im2col). Depthwise: B channels per vector, PX pixels per tile; stride-1
 * rows of kernel width 3, 5, 7 keep each kernel row's input vectors in registers for its KW
 * taps, edge tiles loading zeros for the columns outside the input.
 *
 * Vectors are GCC vector extensions of B floats, so the same source compiles for any -march
 * (without AVX a vector is split into SSE registers). The definitions are compiled only where
 * KILN_CONV_IMPL is defined (the generated conv.cpp, at the kernels' optimisation level); the
 * wrapper (model.cpp) sees the declarations. KILN_CONV_B16 / KILN_CONV_B8 select the channel
 * blocks compiled (conv.cpp defines those its calls use). The numpy twin is kiln/ir/interp.py's
 * `_lib_conv2d_nchwc`. */
#ifndef KILN_CONV_H
#define KILN_CONV_H
#include <cstdint>

#include "kiln_lib.h"

namespace kl {

int conv2d_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow, int64_t sh,
                 int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, bool depthwise,
                 int64_t act, double lo, double hi, int64_t threads, View<float> x,
                 View<float> w, View<float> b);
int conv2d_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow, int64_t sh,
                 int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, bool depthwise,
                 int64_t act, double lo, double hi, int64_t threads, View<float> x,
                 View<float> w, View<float> b, View<float> res);

/* MobileNetV2's inverted residual block as one call: out = project(depthwise(expand(x)))
 * [+ res], each stage a direct convolution with its own epilogue (act code, lo, hi as
 * conv2d_nchwc's): expand a 1x1 stride-1 dense convolution x [N, ICb, H, W, B] -> [N, HCb, H,
 * W, B] (w1 [HCb, ICb, 1, 1, B, B]), depthwise w2 [HCb, KH, KW, B] (stride, padding,
 * dilation below) -> [N, HCb, oh, ow, B], project a 1x1 dense convolution (w3 [OCb, HCb, 1, 1,
 * B, B]) -> out [N, OCb, oh, ow, B]. Computed in bands of output rows whose expanded and
 * depthwise rows stay in per-thread buffers (L2): the expanded tensor is never stored whole. */
int conv2d_block_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t act1, double lo1, double hi1, int64_t act2, double lo2,
                       double hi2, int64_t act3, double lo3, double hi3, int64_t threads,
                       View<float> x, View<float> w1, View<float> b1, View<float> w2,
                       View<float> b2, View<float> w3, View<float> b3);
int conv2d_block_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t act1, double lo1, double hi1, int64_t act2, double lo2,
                       double hi2, int64_t act3, double lo3, double hi3, int64_t threads,
                       View<float> x, View<float> w1, View<float> b1, View<float> w2,
                       View<float> b2, View<float> w3, View<float> b3, View<float> res);

/* The block without an expand (MobileNetV2's first, expand ratio 1): depthwise w2 of x itself
 * ([N, HCb, H, W, B]) -> project w3 [+ res], in the same row bands (act1, lo1, hi1 unused). */
int conv2d_block_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t act1, double lo1, double hi1, int64_t act2, double lo2,
                       double hi2, int64_t act3, double lo3, double hi3, int64_t threads,
                       View<float> x, View<float> w2, View<float> b2, View<float> w3,
                       View<float> b3);
int conv2d_block_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t act1, double lo1, double hi1, int64_t act2, double lo2,
                       double hi2, int64_t act3, double lo3, double hi3, int64_t threads,
                       View<float> x, View<float> w2, View<float> b2, View<float> w3,
                       View<float> b3, View<float> res);

/* 2-D max pooling of an NCHWc value x [N, Cb, H, W, B] into out [N, Cb, oh, ow, B]: the
 * window (kh x kw, stride, padding, dilation; padding never wins) of each output pixel, B
 * channels per vector; NaN propagates (as torch's max_pool2d). */
int max_pool2d_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                     int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                     int64_t dh, int64_t dw, int64_t threads, View<float> x);

}  // namespace kl

#ifdef KILN_CONV_IMPL
// vectors wider than the target's registers (B = 8 or 16 without AVX) are passed in memory
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC would version the channel loops for a unit stride, and the copies spill the OB x P
// accumulators (a store per FMA: half speed)
#pragma GCC optimize("no-version-loops-for-strides")
#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include "kiln_pool.h"
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace kl {
namespace conv {

template <int B> struct V {
  typedef float type __attribute__((vector_size(B * 4), aligned(4), may_alias));
};

template <int B> inline typename V<B>::type load(const float *p) {
  return *reinterpret_cast<const typename V<B>::type *>(p);
}
template <int B> inline void store(float *p, typename V<B>::type v) {
  *reinterpret_cast<typename V<B>::type *>(p) = v;
}
template <int B> inline typename V<B>::type splat(float x) {
  typename V<B>::type v = {};
  return v + x;
}
// *p in every lane, straight from memory (a broadcast load, or an FMA's broadcast operand)
template <int B> inline typename V<B>::type splat_at(const float *p) {
#if defined(__AVX512F__)
  if constexpr (B == 16) return (typename V<B>::type)_mm512_set1_ps(*p);
#endif
#if defined(__AVX__)
  if constexpr (B == 8) return (typename V<B>::type)_mm256_broadcast_ss(p);
#endif
  return splat<B>(*p);
}
template <int B>
inline typename V<B>::type fma(typename V<B>::type a, typename V<B>::type b,
                               typename V<B>::type c) {
#if defined(__AVX512F__)
  if constexpr (B == 16) return (typename V<B>::type)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
#if defined(__FMA__) && defined(__AVX__)
  if constexpr (B == 8) return (typename V<B>::type)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
  return a * b + c;
}

struct Epi {
  int act;
  float lo, hi;
};

template <int B>
inline typename V<B>::type activate(typename V<B>::type v, const Epi &ep) {
  typedef typename V<B>::type vec;
  if (ep.act == 1) {
    const vec z = {};
    return v > z ? v : z;
  }
  if (ep.act == 2) {
    const vec l = splat<B>(ep.lo), h = splat<B>(ep.hi);
    v = v < l ? l : v;
    return v > h ? h : v;
  }
  if (ep.act == 3) {
    for (int i = 0; i < B; ++i) v[i] = v[i] / (1.0f + std::exp(-v[i]));
  }
  return v;
}

// the problem of one dense or depthwise convolution, sizes in elements
struct Shape {
  int64_t n, icb, ih, iw, icn;  // icn: input channels per block (B, or IC for NCHW input)
  int64_t ocb, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t xs_blk, xs_row, xs_pix, xs_ch, xs_img;  // input strides: block, row, pixel, channel
  // a band of a larger tensor (conv2d_block_nchwc's row bands; 0: the whole tensor): the
  // output's block stride (dense and depthwise), the depthwise input's block stride, and the
  // first input / output row the depthwise pointers hold
  int64_t os_blk, y0, o0;
  // channels of the last input block that the 1x1 tile reads (0: all B): the channels above
  // it carry a zero weight for every output (an input of 24 channels padded to 32), and
  // kiln's layout keeps such padded input channels zero, so they add nothing. A real input
  // channel whose weights are all zero is skipped only while its values are finite
  // (`tail_finite`): an Inf / NaN there makes the outputs NaN, as 0 * Inf does in eager.
  int64_t icl;
  // dense weights larger than an L2 (a model reads them from L3 or DRAM once per call): the
  // tap loop prefetches each output block's weight stream this many floats ahead (0: none)
  int64_t wpf;
};

/* The 1x1 tile's s.icl for dense weights [OCb][ICb][KHW][B][B]: 1 + the highest channel of
 * the last input block with a nonzero weight for some output, 0 where that is channel B - 1
 * (the usual full block: found at the first nonzero). Scans only the all-zero channels. */
template <int B>
inline int64_t active_channels(const float *w, int64_t ocb, int64_t icb, int64_t khw) {
  for (int64_t c = B - 1; c > 0; --c)
    for (int64_t ob = 0; ob < ocb; ++ob)
      for (int64_t k = 0; k < khw; ++k) {
        const float *p = w + (((ob * icb + icb - 1) * khw + k) * B + c) * B;
        for (int o = 0; o < B; ++o)
          if (p[o] != 0.0f) return c + 1 == B ? 0 : c + 1;
      }
  return 1;
}

/* Whether channels [c0, B) of the last channel block of a contiguous NCHWc tensor
 * [n][cb][hw][B] hold only finite values (bit tests: no float compare that fast-math could
 * fold away); the 1x1 tile skips those channels (all-zero weights) only then. One pass over
 * the block, vectorised: about 1% of a 1x1 layer's time. */
template <int B>
inline bool tail_finite(const float *x, int64_t n, int64_t cb, int64_t hw, int64_t c0) {
  typedef uint32_t __attribute__((__may_alias__)) bits;  // the floats' bits, aliasing them
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bits *p = reinterpret_cast<const bits *>(x + (i * cb + cb - 1) * hw * B);
    for (int64_t q = 0; q < hw * B; ++q) {
      const uint32_t tail = (q % B) >= c0, inf_nan = (p[q] & 0x7f800000u) == 0x7f800000u;
      bad |= tail & inf_nan;
    }
  }
  return bad == 0;
}

/* KILN_CONV_EPIS: bit act * 2 + (residual) set for each (activation, residual) pair whose
 * tile stores are specialised below (unrolled, the accumulators kept in registers). conv.cpp
 * defines it to the pairs of its package's calls: each pair is one more copy of every tile's
 * store, unrolled (ResNet's 3 pairs of 8 compile in 17-18 s instead of 29-36 s on a 2-core
 * Zen 4); undefined, all 8 are. A pair outside it stores through a plain loop (correct,
 * slower; a call whose pair conv.cpp did not list, which kiln does not generate). */
#ifndef KILN_CONV_EPIS
#define KILN_CONV_EPIS 0xff
#endif
constexpr bool epi_specialised(int code) { return (KILN_CONV_EPIS >> code) & 1; }
// the pairs as (code, ACT, RES), for the stores' switches
#define KILN_CONV_EPI_PAIRS(X)                                                              \
  X(0, 0, false) X(1, 0, true) X(2, 1, false) X(3, 1, true)                                \
  X(4, 2, false) X(5, 2, true) X(6, 3, false) X(7, 3, true)

/* The stores' activation as a template argument (0 none, 1 relu, 2 clamp to [l, h], 3 the
 * runtime `activate`), so the unrolled stores keep the accumulators in registers. */
template <int B, int ACT>
__attribute__((always_inline)) inline typename V<B>::type act_as(typename V<B>::type v,
                                                                 typename V<B>::type l,
                                                                 typename V<B>::type h,
                                                                 const Epi &ep) {
  typedef typename V<B>::type vec;
  if constexpr (ACT == 1) {
    const vec z = {};
    v = v > z ? v : z;
  }
  if constexpr (ACT == 2) {
    v = v < l ? l : v;
    v = v > h ? h : v;
  }
  if constexpr (ACT == 3) v = activate<B>(v, ep);
  return v;
}

/* The store of an OB x P tile of accumulators (output block o at out + o * ostride, pixel p at
 * p * B): with `bias` (the last input chunk) out = act(acc + bias [+ res]), else the partial
 * sums as they are. The activation and the residual are template arguments and every loop
 * is unrolled, so the accumulators stay in registers (a loop over a runtime activation code
 * spilled all of them to the stack and splat the bounds once per vector). */
template <int B, int OB, int P, int ACT, bool RES>
__attribute__((always_inline)) inline void tile_store_as(typename V<B>::type (&acc)[OB][P],
                                                         float *out, int64_t ostride,
                                                         const float *bias, const float *res,
                                                         const Epi &ep) {
  typedef typename V<B>::type vec;
  const vec l = splat<B>(ep.lo), h = splat<B>(ep.hi);
#pragma GCC unroll 8
  for (int o = 0; o < OB; ++o) {
    const vec bv = load<B>(bias + o * B);
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      vec v = acc[o][p] + bv;
      if constexpr (RES) v += load<B>(res + o * ostride + p * B);
      store<B>(out + o * ostride + p * B, act_as<B, ACT>(v, l, h, ep));
    }
  }
}

template <int B, int OB, int P>
__attribute__((always_inline)) inline void tile_store(typename V<B>::type (&acc)[OB][P],
                                                      float *out, int64_t ostride,
                                                      const float *bias, const float *res,
                                                      const Epi &ep) {
  if (!bias) {
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o)
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) store<B>(out + o * ostride + p * B, acc[o][p]);
    return;
  }
  // only the (activation, residual) pairs of KILN_CONV_EPIS are specialised (unrolled);
  // another pair (none in a build whose conv.cpp lists its calls' pairs) takes the loop
#define KILN_EPI(code, ACT, RES)                                                        \
  case code:                                                                              \
    if constexpr (epi_specialised(code))                                                  \
      return tile_store_as<B, OB, P, ACT, RES>(acc, out, ostride, bias, res, ep);        \
    break;
  switch (ep.act * 2 + (res != nullptr)) { KILN_CONV_EPI_PAIRS(KILN_EPI) }
#undef KILN_EPI
#pragma GCC unroll 1
  for (int o = 0; o < OB; ++o)
#pragma GCC unroll 1
    for (int p = 0; p < P; ++p) {
      typename V<B>::type v = acc[o][p] + load<B>(bias + o * B);
      if (res) v += load<B>(res + o * ostride + p * B);
      store<B>(out + o * ostride + p * B, activate<B>(v, ep));
    }
}

/* A depthwise tile's store: out[p] = act(acc[p] [+ res[p]]), as tile_store_as (the bias is
 * already in the accumulators). */
template <int B, int P, int ACT, bool RES>
__attribute__((always_inline)) inline void dw_store_as(typename V<B>::type (&acc)[P],
                                                       float *out, const float *res,
                                                       const Epi &ep) {
  typedef typename V<B>::type vec;
  const vec l = splat<B>(ep.lo), h = splat<B>(ep.hi);
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    vec v = acc[p];
    if constexpr (RES) v += load<B>(res + p * B);
    store<B>(out + p * B, act_as<B, ACT>(v, l, h, ep));
  }
}

template <int B, int P>
__attribute__((always_inline)) inline void dw_store(typename V<B>::type (&acc)[P], float *out,
                                                    const float *res, const Epi &ep) {
#define KILN_EPI(code, ACT, RES)                                                        \
  case code:                                                                              \
    if constexpr (epi_specialised(code)) return dw_store_as<B, P, ACT, RES>(acc, out, res, ep); \
    break;
  switch (ep.act * 2 + (res != nullptr)) { KILN_CONV_EPI_PAIRS(KILN_EPI) }
#undef KILN_EPI
#pragma GCC unroll 1
  for (int p = 0; p < P; ++p) {
    typename V<B>::type v = acc[p];
    if (res) v += load<B>(res + p * B);
    store<B>(out + p * B, activate<B>(v, ep));
  }
}

/* One kernel tap (ky, kx) of an OB x P tile, for its pixels [L, P - R) (the first L and last R
 * pixels' windows leave the input at this tap): per input channel, OB weight vectors and one
 * broadcast per pixel; no per-pixel test in the channel loop. */
template <int B, int OB, int P, int L, int R, int ST = 0>
__attribute__((always_inline)) inline void dense_tap(typename V<B>::type (&acc)[OB][P],
                                                     const float *wk, int64_t wstride,
                                                     const float *xp, int64_t step_, int64_t icn,
                                                     int64_t xs_ch, int64_t wpf) {
  typedef typename V<B>::type vec;
  // ST: the pixel step as a constant (the broadcasts' addresses then differ by immediate
  // displacements, not P index registers that GCC spilled and reloaded)
  const int64_t step = ST ? ST : step_;
  for (int64_t c = 0; c < icn; ++c) {
    vec wv[OB];
    if (wpf)  // (Shape::wpf; an address past the weights' end is only prefetched: no fault)
      for (int o = 0; o < OB; ++o)
        __builtin_prefetch(reinterpret_cast<const void *>(
            reinterpret_cast<uintptr_t>(wk + o * wstride + c * B) + wpf * sizeof(float)), 0, 3);
    for (int o = 0; o < OB; ++o) wv[o] = load<B>(wk + o * wstride + c * B);
    const float *xc = xp + c * xs_ch;
    for (int p = L; p < P - R; ++p) {
      const vec xv = splat_at<B>(xc + p * step);
      for (int o = 0; o < OB; ++o) acc[o][p] = fma<B>(wv[o], xv, acc[o][p]);
    }
  }
}

/* Accumulate the OB x P tile at output (row oh, columns ow0..ow0+P) over input channel blocks
 * [ib0, ib1) into `out` (first: start from zero; last: apply the epilogue). CHECK: some
 * window positions leave the input along the width: those pixels are a prefix and / or a
 * suffix of the tile at each tap (L and R of them); one pixel each side (3x3, padding 1, the
 * rows of small maps that are one tile) take branch-free taps, others a test per pixel. */
template <int B, int OB, int P, bool CHECK>
inline void dense_tile(const Shape &s, const float *x, const float *w, int64_t wstride,
                       float *out, int64_t ostride, const float *bias, const float *res,
                       int64_t oh, int64_t ow0, int64_t ib0, int64_t ib1, bool first, bool last,
                       const Epi &ep) {
  typedef typename V<B>::type vec;
  vec acc[OB][P];
  if (first) {
    for (int o = 0; o < OB; ++o)
      for (int p = 0; p < P; ++p) acc[o][p] = vec{};
  } else {
    for (int o = 0; o < OB; ++o)
      for (int p = 0; p < P; ++p) acc[o][p] = load<B>(out + o * ostride + (ow0 + p) * B);
  }
  const int64_t icn = s.icn;
  for (int64_t ib = ib0; ib < ib1; ++ib) {
    for (int64_t ky = 0; ky < s.kh; ++ky) {
      const int64_t iy = oh * s.sh + ky * s.dh - s.ph;
      if (iy < 0 || iy >= s.ih) continue;
      const float *xrow = x + ib * s.xs_blk + iy * s.xs_row;
      for (int64_t kx = 0; kx < s.kw; ++kx) {
        const float *wk = w + ((ib * s.kh + ky) * s.kw + kx) * icn * B;
        const int64_t ix0 = ow0 * s.sw + kx * s.dw - s.pw;
        bool ok[P];
        if (CHECK) {
          for (int p = 0; p < P; ++p) {
            const int64_t ix = ix0 + p * s.sw;
            ok[p] = ix >= 0 && ix < s.iw;
          }
        }
        const float *xp = xrow + ix0 * s.xs_pix;
        const int64_t step = s.sw * s.xs_pix;
        if constexpr (CHECK) {
          int nl = 0, nr = 0;  // pixels left of / right of the input at this tap
          for (int p = 0; p < P; ++p) {
            nl += !ok[p] && ix0 + p * s.sw < 0;
            nr += !ok[p] && ix0 + p * s.sw >= 0;
          }
          if (nl + nr >= P) continue;
          if (nl <= 1 && nr <= 1) {
            if (nl == 0 && nr == 0)
              dense_tap<B, OB, P, 0, 0>(acc, wk, wstride, xp, step, icn, s.xs_ch, s.wpf);
            else if (nl == 1 && nr == 0)
              dense_tap<B, OB, P, 1, 0>(acc, wk, wstride, xp, step, icn, s.xs_ch, s.wpf);
            else if (nl == 0)
              dense_tap<B, OB, P, 0, 1>(acc, wk, wstride, xp, step, icn, s.xs_ch, s.wpf);
            else if constexpr (P > 2)
              dense_tap<B, OB, P, 1, 1>(acc, wk, wstride, xp, step, icn, s.xs_ch, s.wpf);
            continue;
          }
        }
        if constexpr (!CHECK) {
          const int64_t xc = s.xs_ch, pf = s.wpf;
          switch (step) {
            case 2: dense_tap<B, OB, P, 0, 0, 2>(acc, wk, wstride, xp, step, icn, xc, pf); break;
            case 4: dense_tap<B, OB, P, 0, 0, 4>(acc, wk, wstride, xp, step, icn, xc, pf); break;
            case B: dense_tap<B, OB, P, 0, 0, B>(acc, wk, wstride, xp, step, icn, xc, pf); break;
            case 2 * B:
              dense_tap<B, OB, P, 0, 0, 2 * B>(acc, wk, wstride, xp, step, icn, xc, pf);
              break;
            default: dense_tap<B, OB, P, 0, 0>(acc, wk, wstride, xp, step, icn, xc, pf);
          }
          continue;
        }
        for (int64_t c = 0; c < icn; ++c) {
          vec wv[OB];
          for (int o = 0; o < OB; ++o) wv[o] = load<B>(wk + o * wstride + c * B);
          const float *xc = xp + c * s.xs_ch;
          for (int p = 0; p < P; ++p) {
            if (CHECK && !ok[p]) continue;
            const vec xv = splat_at<B>(xc + p * step);
            for (int o = 0; o < OB; ++o) acc[o][p] = fma<B>(wv[o], xv, acc[o][p]);
          }
        }
      }
    }
  }
#if !defined(__AVX512F__)
  // 16 vector registers (AVX2 and below): with the loop below GCC kept the accumulators on
  // the stack through the whole channel loop (a store after every FMA group: AVX2 3x3 layers
  // at half speed); the unrolled store keeps them in registers. (With AVX-512 it is the other
  // way round: the loop below is 1-8% faster there.)
  tile_store<B, OB, P>(acc, out + ow0 * B, ostride, last ? bias : nullptr,
                       res ? res + ow0 * B : nullptr, ep);
  return;
#endif
  for (int o = 0; o < OB; ++o) {
    const vec bv = last ? load<B>(bias + o * B) : vec{};
    for (int p = 0; p < P; ++p) {
      vec v = acc[o][p];
      if (last) {
        v += bv;
        if (res) v += load<B>(res + o * ostride + (ow0 + p) * B);
        v = activate<B>(v, ep);
      }
      store<B>(out + o * ostride + (ow0 + p) * B, v);
    }
  }
}

/* The OB x P tile of a 1x1 convolution without padding over an NCHWc input (the flat rows of
 * a stride-1 one, the rows of a strided one): no window leaves the input, so the loop is only
 * (input block, its B channels), without dense_tile's per-tap window arithmetic around it
 * (where GCC stored and reloaded the accumulators), and where the call covers every input
 * block the accumulators start from the bias. */
template <int B, int OB, int P>
inline void dense_tile_1x1(const Shape &s, const float *x, const float *w, int64_t wstride,
                           float *out, int64_t ostride, const float *bias, const float *res,
                           int64_t oh, int64_t ow0, int64_t ib0, int64_t ib1, bool first,
                           bool last, const Epi &ep) {
  typedef typename V<B>::type vec;
  vec acc[OB][P];
  if (first) {  // zeros: the bias is added by the store
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o)
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) acc[o][p] = vec{};
  } else {
#pragma GCC unroll 8
    for (int o = 0; o < OB; ++o)
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) acc[o][p] = load<B>(out + o * ostride + (ow0 + p) * B);
  }
  const int64_t step = s.sw * B;
  const float *xr = x + oh * s.sh * s.xs_row + ow0 * step;
  // the last input block with only s.icl channels in use (zero weights above) runs short
  const bool part = s.icl && ib1 == s.icb;
  for (int64_t ib = ib0; ib < ib1 - part; ++ib) {
    const float *xb = xr + ib * s.xs_blk;
    const float *wb = w + ib * B * B;
    for (int c = 0; c < B; ++c) {
      vec wv[OB];
      for (int o = 0; o < OB; ++o) wv[o] = load<B>(wb + o * wstride + c * B);
      for (int p = 0; p < P; ++p) {
        const vec xv = splat_at<B>(xb + p * step + c);
        for (int o = 0; o < OB; ++o) acc[o][p] = fma<B>(wv[o], xv, acc[o][p]);
      }
    }
  }
  if (part && ib1 > ib0) {
    const float *xb = xr + (ib1 - 1) * s.xs_blk;
    const float *wb = w + (ib1 - 1) * B * B;
    for (int64_t c = 0; c < s.icl; ++c) {
      vec wv[OB];
      for (int o = 0; o < OB; ++o) wv[o] = load<B>(wb + o * wstride + c * B);
      for (int p = 0; p < P; ++p) {
        const vec xv = splat_at<B>(xb + p * step + c);
        for (int o = 0; o < OB; ++o) acc[o][p] = fma<B>(wv[o], xv, acc[o][p]);
      }
    }
  }
  tile_store<B, OB, P>(acc, out + ow0 * B, ostride, last ? bias : nullptr,
                       res ? res + ow0 * B : nullptr, ep);
}

// whether dense_tile_1x1 computes this convolution's tiles: no window leaves the input (no
// padding before, and none after: an asymmetric pad folded into the convolution, passes/
// fold_pad.py's edge_pad, gives output rows / columns past the input's last, which the
// checked tiles compute)
inline bool pointwise_1x1(const Shape &s, int64_t block) {
  return s.kh == 1 && s.kw == 1 && s.ph == 0 && s.pw == 0 && s.icn == block &&
         s.xs_pix == block && s.xs_ch == 1 && (s.oh - 1) * s.sh < s.ih &&
         (s.ow - 1) * s.sw < s.iw;
}

// widest tile (pixels) for OB output blocks: OB * P accumulators in registers
template <int B, int OB> constexpr int tile_px() {
  return B == 16 ? (OB == 4 ? 6 : 14) : (OB == 4 ? 3 : OB == 2 ? 6 : 12);
}

template <int B, int OB, int P>
inline void dense_tail(const Shape &s, const float *x, const float *w, int64_t wstride,
                       float *out, int64_t ostride, const float *bias, const float *res,
                       int64_t oh, int64_t ow0, int64_t np, int64_t ib0, int64_t ib1,
                       bool first, bool last, const Epi &ep, bool check) {
  if constexpr (P > 0) {
    if (np == P) {
      if (!check && pointwise_1x1(s, B))
        dense_tile_1x1<B, OB, P>(s, x, w, wstride, out, ostride, bias, res, oh, ow0, ib0, ib1,
                                 first, last, ep);
      else if (check)
        dense_tile<B, OB, P, true>(s, x, w, wstride, out, ostride, bias, res, oh, ow0, ib0, ib1,
                                   first, last, ep);
      else
        dense_tile<B, OB, P, false>(s, x, w, wstride, out, ostride, bias, res, oh, ow0, ib0,
                                    ib1, first, last, ep);
      return;
    }
    dense_tail<B, OB, P - 1>(s, x, w, wstride, out, ostride, bias, res, oh, ow0, np, ib0, ib1,
                             first, last, ep, check);
  }
}

/* One output row segment [c0, c1) of OB blocks: full tiles, then one narrower tile. */
template <int B, int OB>
inline void dense_row(const Shape &s, const float *x, const float *w, int64_t wstride,
                      float *out, int64_t ostride, const float *bias, const float *res,
                      int64_t oh, int64_t c0, int64_t c1, int64_t ib0, int64_t ib1, bool first,
                      bool last, const Epi &ep) {
  constexpr int P = tile_px<B, OB>();
  // output columns whose whole window (every kx) lies inside the input width
  const int64_t span = (s.kw - 1) * s.dw;
  int64_t lo = s.pw > 0 ? (s.pw + s.sw - 1) / s.sw : 0;
  int64_t hi = s.iw - span + s.pw <= 0 ? 0 : (s.iw - span + s.pw - 1) / s.sw + 1;  // exclusive
  hi = std::min(hi, s.ow);
  int64_t o = c0;
  if constexpr (B == 16 && OB == 4) {
    // 4 x 7 tiles (28 accumulators; the broadcasts FMA operands) where they and 4 x 6 ones
    // cover the segment with no narrower tile: 7-pixel rows (7x7 maps), 28-pixel rows (a
    // 4 x 4 tail after 4 x 6 tiles: 7-12% slower), 56, 112
    int64_t n7 = (c1 - c0) / 7;
    while (n7 > 0 && (c1 - c0 - 7 * n7) % 6 != 0) --n7;
    for (; n7 > 0; --n7, o += 7)
      dense_tail<B, 4, 7>(s, x, w, wstride, out, ostride, bias, res, oh, o, 7, ib0, ib1, first,
                          last, ep, o < lo || o + 7 > hi);
  }
  for (; o < c1;) {
    const int64_t np = std::min<int64_t>(P, c1 - o);
    const bool check = o < lo || o + np > hi;
    dense_tail<B, OB, P>(s, x, w, wstride, out, ostride, bias, res, oh, o, np, ib0, ib1, first,
                         last, ep, check);
    o += np;
  }
}

// whether `units` equal pieces of work split over nt threads within ~12% of even
inline bool even_split(int64_t units, int nt) { return units % nt == 0 || units >= 8 * nt; }

inline int team(int64_t threads) {
  const int budget = kr::max_threads();
  return threads > 0 && threads < budget ? int(threads) : budget;
}

template <int B, int OB>
void dense_group(const Shape &s, const float *x, const float *w, const float *bias,
                 const float *res, float *out, int64_t n, int64_t ob0, int64_t r0, int64_t r1,
                 int64_t c0, int64_t c1, const Epi &ep) {
  const int64_t wstride = s.icb * s.kh * s.kw * s.icn * B;  // one output block's weights
  const int64_t ostride = s.os_blk ? s.os_blk : s.oh * s.ow * B;
  // input channel blocks per chunk: OB blocks' weights of one chunk within ~256 KiB (L2)
  const int64_t per_block = OB * s.kh * s.kw * s.icn * B * 4;
#ifndef KILN_CONV_CHUNK_BYTES
#define KILN_CONV_CHUNK_BYTES (256 << 10)
#endif
  const int64_t chunk = std::max<int64_t>(1, KILN_CONV_CHUNK_BYTES / per_block);
  const float *xn = x + n * s.xs_img;
  const float *wg = w + ob0 * wstride;
  float *og = out + (n * s.ocb + ob0) * ostride;
  const float *rg = res ? res + (n * s.ocb + ob0) * ostride : nullptr;
  const float *bg = bias + ob0 * B;
  for (int64_t ib = 0; ib < s.icb; ib += chunk) {
    const int64_t ie = std::min(s.icb, ib + chunk);
    for (int64_t oh = r0; oh < r1; ++oh)
      dense_row<B, OB>(s, xn, wg, wstride, og + oh * s.ow * B, ostride, bg,
                       rg ? rg + oh * s.ow * B : nullptr, oh, c0, c1, ib, ie, ib == 0,
                       ie == s.icb, ep);
  }
}

/* conv.cpp is compiled as parts in parallel where KILN_CONV_PART is defined (kiln/targets/cpu/
 * conv.py): part 0 the entry points, blocks and pooling; 1 dense_group<B, 2>; 2 dense_group<B, 4>
 * and <B, 1>; 3 dw_row<B> (the tiles under them are the file's bulk). A part instantiates its
 * own and declares the others' extern, so no part compiles another's tiles. */
#ifdef KILN_CONV_PART
#define KILN_CONV_DENSE_GROUP(B, OB)                                                         \
  void dense_group<B, OB>(const Shape &, const float *, const float *, const float *,         \
                          const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,\
                          int64_t, const Epi &)
#if KILN_CONV_PART == 1
#define KILN_CONV_PART1 template
#else
#define KILN_CONV_PART1 extern template
#endif
#if KILN_CONV_PART == 2
#define KILN_CONV_PART2 template
#else
#define KILN_CONV_PART2 extern template
#endif
#if KILN_CONV_PART == 3
#define KILN_CONV_PART3 template
#else
#define KILN_CONV_PART3 extern template
#endif
#ifdef KILN_CONV_B16
KILN_CONV_PART1 KILN_CONV_DENSE_GROUP(16, 2);
KILN_CONV_PART2 KILN_CONV_DENSE_GROUP(16, 4);
KILN_CONV_PART2 KILN_CONV_DENSE_GROUP(16, 1);
#endif
#ifdef KILN_CONV_B8
KILN_CONV_PART1 KILN_CONV_DENSE_GROUP(8, 2);
KILN_CONV_PART2 KILN_CONV_DENSE_GROUP(8, 4);
KILN_CONV_PART2 KILN_CONV_DENSE_GROUP(8, 1);
#endif
#endif

// the output-channel groups of a dense convolution: 4 blocks at a time, the remainder as a 2
// and / or a 1; rows of at most 14 pixels take groups of 2 (one tile of up to 14 pixels per
// row, no narrow tail), except 7- and 14-pixel rows with B = 16 (one or two 4 x 7 tiles: 28
// accumulators, 4 weight vectors per 7 broadcasts instead of 2 per 14; ResNet's 14x14 maps
// 4-5% faster)
template <int B> struct Groups {
  int64_t gw, n4, rem, ng;
  explicit Groups(const Shape &s) {
    gw = s.ow <= tile_px<B, 2>() && !(B == 16 && (s.ow == 7 || s.ow == 14)) ? 2 : 4;
    n4 = s.ocb / gw, rem = s.ocb % gw;
    ng = n4 + (rem >= 2) + (rem % 2);
  }
  // group gi: first block g0, gn blocks
  void at(int64_t gi, int64_t &g0, int64_t &gn) const {
    g0 = gw * gi, gn = gw;
    if (gi >= n4) {
      g0 = gw * n4 + (gi > n4 && rem >= 2 ? 2 : 0);
      gn = gi == n4 && rem >= 2 ? 2 : 1;
    }
  }
};

template <int B>
inline void dense_any(const Shape &s, const float *x, const float *w, const float *bias,
                      const float *res, float *out, int64_t n, int64_t g0, int64_t gn,
                      int64_t r0, int64_t r1, int64_t c0, int64_t c1, const Epi &ep) {
  switch (gn) {
    case 4: dense_group<B, 4>(s, x, w, bias, res, out, n, g0, r0, r1, c0, c1, ep); break;
    case 2: dense_group<B, 2>(s, x, w, bias, res, out, n, g0, r0, r1, c0, c1, ep); break;
    default: dense_group<B, 1>(s, x, w, bias, res, out, n, g0, r0, r1, c0, c1, ep); break;
  }
}

/* Spatial split: a member computes every output channel of a contiguous range [u0, u1) of
 * the (image, row) units, or of the (image, pixel-chunk) units of a flat 1x1 row (chunks of the
 * tile width); kr::parallel_for gives member t the t-th share (the others take what a
 * descheduled member has not started). A network's consecutive convolutions (and depthwise ones, split the same
 * way) give each thread the same share of the image, so what it reads is mostly what it wrote
 * one kernel earlier, in its own core's cache. Taken where the activations outweigh the
 * weights (every thread reads all the weights). */
template <int B>
inline int64_t spatial_units(const Shape &s) {
  const bool flat = s.oh == 1;
  const int64_t per = flat ? s.ow : s.oh;  // units per image
  const int64_t q = flat ? tile_px<B, 4>() : 1;  // split granularity (pixels or rows)
  return s.n * ((per + q - 1) / q);
}

template <int B>
void dense_spatial_range(const Shape &s, const float *x, const float *w, const float *bias,
                         const float *res, float *out, const Epi &ep, int64_t u0, int64_t u1) {
  const Groups<B> gs(s);
  const bool flat = s.oh == 1;
  const int64_t per = flat ? s.ow : s.oh;  // units per image
  const int64_t q = flat ? tile_px<B, 4>() : 1;  // split granularity (pixels or rows)
  const int64_t chunks = (per + q - 1) / q;
  for (int64_t u = u0; u < u1;) {
    const int64_t n = u / chunks, k0 = u % chunks;
    const int64_t k1 = std::min(chunks, k0 + (u1 - u));
    const int64_t a = k0 * q, b = std::min(per, k1 * q);
    for (int64_t gi = 0; gi < gs.ng; ++gi) {
      int64_t g0, gn;
      gs.at(gi, g0, gn);
      if (flat)
        dense_any<B>(s, x, w, bias, res, out, n, g0, gn, 0, 1, a, b, ep);
      else
        dense_any<B>(s, x, w, bias, res, out, n, g0, gn, a, b, 0, s.ow, ep);
    }
    u += k1 - k0;
  }
}

template <int B>
void dense(const Shape &s, const float *x, const float *w, const float *bias, const float *res,
           float *out, const Epi &ep, int64_t threads) {
  const Groups<B> gs(s);
  const int64_t ng = gs.ng;
  const int nt = team(threads);
  // vector FMAs: below ~4 us of one core's work, waking a second thread costs more than it saves
  const int64_t work = s.n * s.ocb * s.oh * s.ow * s.icb * s.icn * s.kh * s.kw;
  const bool par = nt > 1 && work >= 16384;
  const int64_t wbytes = s.ocb * s.icb * s.kh * s.kw * s.icn * B;
  const int64_t abytes = s.n * (s.icb * s.icn * s.ih * s.iw + s.ocb * B * s.oh * s.ow);
  const int64_t units = s.n * (s.oh == 1 ? s.ow / tile_px<B, 4>() : s.oh);
  if (par && abytes >= wbytes && units >= 2 * nt && even_split(units, nt)) {
    kr::parallel_for(spatial_units<B>(s), nt, [&](int64_t u0, int64_t u1) {
      dense_spatial_range<B>(s, x, w, bias, res, out, ep, u0, u1);
    });
    return;
  }
  // tasks: (batch, group, block of rows, column segment), at least ~4 per thread
  const int64_t base = s.n * ng, want = 4 * int64_t(nt);
  int64_t rblk = s.oh, cseg = 1;
  if (base < want) {
    if (s.oh == 1)  // a flat 1x1 row: split the pixels
      cseg = std::max<int64_t>(1, std::min<int64_t>((want + base - 1) / base, s.ow / 32));
    else
      rblk = std::max<int64_t>(1, s.oh * base / want);
  }
  const int64_t nr = (s.oh + rblk - 1) / rblk;
  const int64_t tasks = base * nr * cseg;
  const int64_t cw = (s.ow + cseg - 1) / cseg;
  // tasks handed out one at a time (OpenMP's schedule(dynamic, 1))
  kr::parallel_for_dynamic(tasks, tasks > 1 && par ? nt : 1, [&](int64_t t) {
    const int64_t cs = t % cseg, rest = t / cseg;
    const int64_t r = rest % nr, gi = (rest / nr) % ng, n = rest / nr / ng;
    const int64_t r0 = r * rblk, r1 = std::min(s.oh, r0 + rblk);
    const int64_t c0 = cs * cw, c1 = std::min(s.ow, c0 + cw);
    if (c0 >= c1) return;
    int64_t g0, gn;
    gs.at(gi, g0, gn);
    dense_any<B>(s, x, w, bias, res, out, n, g0, gn, r0, r1, c0, c1, ep);
  });
}

/* Depthwise: out[n, cb, oh, ow, :] = act(bias + sum over (ky, kx) of w[cb, ky, kx, :] *
 * x[n, cb, iy, ix, :] [+ res]), P pixels per tile. */
template <int B, int P, bool CHECK>
inline void dw_tile(const Shape &s, const float *xc, const float *wc, const float *bc,
                    const float *rrow, float *orow, int64_t oh, int64_t ow0, const Epi &ep) {
  typedef typename V<B>::type vec;
  vec acc[P];
  const vec bv = load<B>(bc);
  for (int p = 0; p < P; ++p) acc[p] = bv;
  for (int64_t ky = 0; ky < s.kh; ++ky) {
    const int64_t iy = oh * s.sh + ky * s.dh - s.ph;
    if (iy < 0 || iy >= s.ih) continue;
    const float *xrow = xc + (iy - s.y0) * s.iw * B;
    for (int64_t kx = 0; kx < s.kw; ++kx) {
      const vec wv = load<B>(wc + (ky * s.kw + kx) * B);
      const int64_t ix0 = ow0 * s.sw + kx * s.dw - s.pw;
      for (int p = 0; p < P; ++p) {
        const int64_t ix = ix0 + p * s.sw;
        if (CHECK && (ix < 0 || ix >= s.iw)) continue;
        acc[p] = fma<B>(wv, load<B>(xrow + ix * B), acc[p]);
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    vec v = acc[p];
    if (rrow) v += load<B>(rrow + (ow0 + p) * B);
    store<B>(orow + (ow0 + p) * B, activate<B>(v, ep));
  }
}

/* A depthwise tile for a static kernel width and stride (dilation 1). Stride 1: the input
 * vectors of one kernel row are loaded once and shared by the KW taps of the P pixels (CHECK:
 * those left or right of the input row are zeros, so an edge tile of a padded row runs the
 * same FMAs); strided (interior tiles only): each tap loads its input vector (an FMA's memory
 * operand). */
template <int B, int P, int KW, int SW, bool CHECK = false>
inline void dw_fast(const Shape &s, const float *xc, const float *wc, const float *bc,
                    const float *rrow, float *orow, int64_t oh, int64_t ow0, const Epi &ep) {
  typedef typename V<B>::type vec;
  constexpr int NX = SW * (P - 1) + KW;
  vec acc[P];
  const vec bv = load<B>(bc);
  for (int p = 0; p < P; ++p) acc[p] = bv;
  for (int64_t ky = 0; ky < s.kh; ++ky) {
    const int64_t iy = oh * s.sh + ky * s.dh - s.ph;
    if (iy < 0 || iy >= s.ih) continue;
    const int64_t ix0 = ow0 * SW - s.pw;
    const float *xrow = xc + (iy - s.y0) * s.iw * B;
    const float *xr = xrow + ix0 * B;
    static_assert(SW == 1 || !CHECK, "checked depthwise tiles are stride 1");
    if constexpr (SW == 1) {
      vec xv[NX];
      for (int j = 0; j < NX; ++j) {
        if (CHECK)
          xv[j] = ix0 + j >= 0 && ix0 + j < s.iw ? load<B>(xrow + (ix0 + j) * B) : vec{};
        else
          xv[j] = load<B>(xr + j * B);
      }
      for (int kx = 0; kx < KW; ++kx) {
        const vec wv = load<B>(wc + (ky * KW + kx) * B);
        for (int p = 0; p < P; ++p) acc[p] = fma<B>(wv, xv[p + kx], acc[p]);
      }
    } else {  // the 2P+1 vectors of a strided row would be copied to the stack (a memcpy call)
      for (int kx = 0; kx < KW; ++kx) {
        const vec wv = load<B>(wc + (ky * KW + kx) * B);
        for (int p = 0; p < P; ++p) acc[p] = fma<B>(wv, load<B>(xr + (p * SW + kx) * B), acc[p]);
      }
    }
  }
  dw_store<B, P>(acc, orow + ow0 * B, rrow ? rrow + ow0 * B : nullptr, ep);
}

template <int B, int P>
inline void dw_tail(const Shape &s, const float *xc, const float *wc, const float *bc,
                    const float *rrow, float *orow, int64_t oh, int64_t ow0, int64_t np,
                    const Epi &ep) {
  if constexpr (P > 0) {
    if (np == P) return dw_tile<B, P, true>(s, xc, wc, bc, rrow, orow, oh, ow0, ep);
    dw_tail<B, P - 1>(s, xc, wc, bc, rrow, orow, oh, ow0, np, ep);
  }
}

// np (<= P) pixels as one dw_fast tile: a row's last pixels
template <int B, int P, int KW, int SW, bool CHECK>
inline void dw_fast_tail(const Shape &s, const float *xc, const float *wc, const float *bc,
                         const float *rrow, float *orow, int64_t oh, int64_t ow0, int64_t np,
                         const Epi &ep) {
  if constexpr (P > 0) {
    if (np == P) return dw_fast<B, P, KW, SW, CHECK>(s, xc, wc, bc, rrow, orow, oh, ow0, ep);
    dw_fast_tail<B, P - 1, KW, SW, CHECK>(s, xc, wc, bc, rrow, orow, oh, ow0, np, ep);
  }
}

/* A whole stride-1 output row of kernel width KW (dilation 1) in tiles of P pixels: interior
 * tiles unchecked, the tiles whose windows cross the padding (lo, hi: dw_row's) and the
 * narrower last tile checked, so every pixel takes the register-resident row. */
template <int B, int P, int KW>
inline void dw_row_s1(const Shape &s, const float *xc, const float *wc, const float *bc,
                      const float *rrow, float *orow, int64_t oh, int64_t lo, int64_t hi,
                      const Epi &ep) {
  int64_t o = 0;
  for (; o + P <= s.ow; o += P) {
    if (o >= lo && o + P <= hi)
      dw_fast<B, P, KW, 1>(s, xc, wc, bc, rrow, orow, oh, o, ep);
    else
      dw_fast<B, P, KW, 1, true>(s, xc, wc, bc, rrow, orow, oh, o, ep);
  }
  if (o < s.ow)
    dw_fast_tail<B, P - 1, KW, 1, true>(s, xc, wc, bc, rrow, orow, oh, o, s.ow - o, ep);
}

template <int B>
void dw_row(const Shape &s, const float *x, const float *w, const float *bias, const float *res,
            float *out, const Epi &ep, int64_t n, int64_t cb, int64_t oh, int64_t lo,
            int64_t hi) {
  constexpr int P = B == 16 ? 8 : 4;
  const int64_t xblk = s.xs_blk ? s.xs_blk : s.ih * s.iw * B;
  const int64_t oblk = s.os_blk ? s.os_blk : s.oh * s.ow * B;
  const float *xc = x + (n * s.icb + cb) * xblk;
  const float *wc = w + cb * s.kh * s.kw * B;
  const float *bc = bias + cb * B;
  const int64_t ooff = (n * s.ocb + cb) * oblk + (oh - s.o0) * s.ow * B;
  float *orow = out + ooff;
  const float *rrow = res ? res + ooff : nullptr;
  if (s.dw == 1 && s.sw == 1 && s.kw == 3)
    return dw_row_s1<B, P, 3>(s, xc, wc, bc, rrow, orow, oh, lo, hi, ep);
  if (s.dw == 1 && s.sw == 1 && s.kw == 5)
    return dw_row_s1<B, P, 5>(s, xc, wc, bc, rrow, orow, oh, lo, hi, ep);
  if (s.dw == 1 && s.sw == 1 && s.kw == 7)  // ConvNeXt: 14 row vectors + 8 accumulators
    return dw_row_s1<B, P, 7>(s, xc, wc, bc, rrow, orow, oh, lo, hi, ep);
  int64_t o = 0;
  for (; o < s.ow && o < lo; ++o) dw_tile<B, 1, true>(s, xc, wc, bc, rrow, orow, oh, o, ep);
  // strided: interior tiles, the interior pixels short of a tile as one narrower tile
  if (s.dw == 1 && s.sw == 2 && s.kw == 3) {
    for (; o + P <= hi; o += P) dw_fast<B, P, 3, 2>(s, xc, wc, bc, rrow, orow, oh, o, ep);
    if (o < hi)
      dw_fast_tail<B, P - 1, 3, 2, false>(s, xc, wc, bc, rrow, orow, oh, o, hi - o, ep);
    o = std::max(o, hi);
  } else if (s.dw == 1 && s.sw == 2 && s.kw == 5) {
    for (; o + P <= hi; o += P) dw_fast<B, P, 5, 2>(s, xc, wc, bc, rrow, orow, oh, o, ep);
    if (o < hi)
      dw_fast_tail<B, P - 1, 5, 2, false>(s, xc, wc, bc, rrow, orow, oh, o, hi - o, ep);
    o = std::max(o, hi);
  }
  for (; o + P <= hi; o += P) dw_tile<B, P, false>(s, xc, wc, bc, rrow, orow, oh, o, ep);
  for (; o < s.ow;) {
    const int64_t np = std::min<int64_t>(P, s.ow - o);
    dw_tail<B, P>(s, xc, wc, bc, rrow, orow, oh, o, np, ep);
    o += np;
  }
}

#ifdef KILN_CONV_PART
#define KILN_CONV_DW_ROW(B)                                                                   \
  void dw_row<B>(const Shape &, const float *, const float *, const float *, const float *,   \
                 float *, const Epi &, int64_t, int64_t, int64_t, int64_t, int64_t)
#ifdef KILN_CONV_B16
KILN_CONV_PART3 KILN_CONV_DW_ROW(16);
#endif
#ifdef KILN_CONV_B8
KILN_CONV_PART3 KILN_CONV_DW_ROW(8);
#endif
#endif

/* Member t of nt: the t-th contiguous share of the (image, output row) units (kr::parallel_for:
 * the others take what a descheduled member has not started), every channel block (block by
 * block, its rows in order: the input rows a row shares with the next stay in L1). The share of the image dense_spatial_range gives the same thread. Where the rows do not
 * split evenly (e.g. 7 rows on 2 threads), the shares are of (image, block, row) instead. */
template <int B>
void depthwise(const Shape &s, const float *x, const float *w, const float *bias,
               const float *res, float *out, const Epi &ep, int64_t threads) {
  const int64_t span = (s.kw - 1) * s.dw;
  const int64_t lo = s.pw > 0 ? (s.pw + s.sw - 1) / s.sw : 0;
  int64_t hi = s.iw - span + s.pw <= 0 ? 0 : (s.iw - span + s.pw - 1) / s.sw + 1;
  hi = std::min(hi, s.ow);
  const int nt = team(threads);
  const bool by_rows = even_split(s.n * s.oh, nt);
  const int64_t units = s.n * s.oh * (by_rows ? 1 : s.ocb);
  const bool par = nt > 1 && units >= nt && s.n * s.oh * s.ocb * s.ow * s.kh * s.kw >= 16384;
  kr::parallel_for(units, par ? nt : 1, [&](int64_t u0, int64_t u1) {
    // rows [r0, r1) of image n, block cb
    auto rows = [&](int64_t n, int64_t cb, int64_t r0, int64_t r1) {
      for (int64_t oh = r0; oh < r1; ++oh)
        dw_row<B>(s, x, w, bias, res, out, ep, n, cb, oh, lo, hi);
    };
    if (by_rows) {
      for (int64_t u = u0; u < u1;) {
        const int64_t n = u / s.oh, r0 = u % s.oh, r1 = std::min(s.oh, r0 + (u1 - u));
        for (int64_t cb = 0; cb < s.ocb; ++cb) rows(n, cb, r0, r1);
        u += r1 - r0;
      }
    } else {
      for (int64_t u = u0; u < u1;) {  // runs of rows of one (image, block)
        const int64_t r0 = u % s.oh, r1 = std::min(s.oh, r0 + (u1 - u));
        rows(u / s.oh / s.ocb, (u / s.oh) % s.ocb, r0, r1);
        u += r1 - r0;
      }
    }
  });
}

template <int B>
int run(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow, int64_t sh,
        int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, bool dwise, int64_t act,
        double lo, double hi, int64_t threads, const View<float> &x, const View<float> &w,
        const View<float> &b, const float *res) {
  Shape s{};
  s.oh = oh, s.ow = ow, s.sh = sh, s.sw = sw, s.ph = ph, s.pw = pw, s.dh = dh, s.dw = dw;
  s.n = x.size(0);
  const Epi ep{int(act), float(lo), float(hi)};
  if (dwise) {  // x [N, Cb, H, W, B], w [Cb, KH, KW, B]
    s.icb = x.size(1), s.ih = x.size(2), s.iw = x.size(3), s.icn = B;
    s.ocb = w.size(0), s.kh = w.size(1), s.kw = w.size(2);
    if (s.ocb != s.icb) return e.fail("%s: depthwise convolution of %lld channel blocks with "
                                      "%lld weight blocks", where, (long long)s.icb,
                                      (long long)s.ocb);
    depthwise<B>(s, x.data, w.data, b.data, res, out, ep, threads);
    return 0;
  }
  s.ocb = w.size(0), s.kh = w.size(2), s.kw = w.size(3), s.icn = w.size(4);
  if (x.rank == 5) {  // NCHWc input
    s.icb = x.size(1), s.ih = x.size(2), s.iw = x.size(3);
    s.xs_pix = B, s.xs_ch = 1, s.xs_row = s.iw * B, s.xs_blk = s.ih * s.iw * B;
  } else {  // NCHW input (fewer input channels than one block): one "block" of icn channels
    s.icb = 1, s.ih = x.size(2), s.iw = x.size(3);
    s.xs_pix = 1, s.xs_ch = s.ih * s.iw, s.xs_row = s.iw, s.xs_blk = s.icn * s.ih * s.iw;
  }
  s.xs_img = s.icb * s.xs_blk;
  if (pointwise_1x1(s, B)) {
    s.icl = active_channels<B>(w.data, s.ocb, s.icb, 1);
    if (s.icl && !tail_finite<B>(x.data, s.n, s.icb, s.ih * s.iw, s.icl)) s.icl = 0;
  }
  // weights past 1 MiB (ResNet-18's 14x14 and 7x7 stages: 2.3 and 9.4 MB a convolution, read
  // from L3 / DRAM in the model): prefetched 40 lines ahead in each output block's stream;
  // 0.86-0.90 of the time of the 7x7 stage's convolutions at one thread on the Zen 5 box
  // (BENCHMARKS.md, s18cpu). Smaller weights stay in L2 between the row tiles: no prefetch.
  const int64_t wbytes = s.ocb * s.icb * s.kh * s.kw * s.icn * B * int64_t(sizeof(float));
  s.wpf = wbytes > (int64_t(1) << 20) ? 40 * 64 / int64_t(sizeof(float)) : 0;
  if (s.kh == 1 && s.kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0 && s.ih == oh &&
      s.iw == ow) {  // 1x1: the pixels as one flat row
    s.iw = s.ih * s.iw, s.ow = s.iw, s.ih = 1, s.oh = 1, s.xs_row = s.iw * s.xs_pix;
  }
  dense<B>(s, x.data, w.data, b.data, res, out, ep, threads);
  return 0;
}

inline int dispatch(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                    int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                    bool dwise, int64_t act, double lo, double hi, int64_t threads,
                    const View<float> &x, const View<float> &w, const View<float> &b,
                    const float *res) {
  const int64_t blk = w.size(w.rank - 1);
#ifdef KILN_CONV_B16
  if (blk == 16)
    return run<16>(e, where, out, oh, ow, sh, sw, ph, pw, dh, dw, dwise, act, lo, hi, threads,
                   x, w, b, res);
#endif
#ifdef KILN_CONV_B8
  if (blk == 8)
    return run<8>(e, where, out, oh, ow, sh, sw, ph, pw, dh, dw, dwise, act, lo, hi, threads, x,
                  w, b, res);
#endif
  return e.fail("%s: channel block of %lld floats (expected 8 or 16)", where, (long long)blk);
}

}  // namespace conv

#if !defined(KILN_CONV_PART) || KILN_CONV_PART == 0  // the entry points
int conv2d_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow, int64_t sh,
                 int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, bool depthwise,
                 int64_t act, double lo, double hi, int64_t threads, View<float> x,
                 View<float> w, View<float> b) {
  return conv::dispatch(e, where, out, oh, ow, sh, sw, ph, pw, dh, dw, depthwise, act, lo, hi,
                        threads, x, w, b, nullptr);
}

int conv2d_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow, int64_t sh,
                 int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, bool depthwise,
                 int64_t act, double lo, double hi, int64_t threads, View<float> x,
                 View<float> w, View<float> b, View<float> res) {
  return conv::dispatch(e, where, out, oh, ow, sh, sw, ph, pw, dh, dw, depthwise, act, lo, hi,
                        threads, x, w, b, res.data);
}

namespace conv {

// one inverted residual block (conv2d_block_nchwc): sizes, operands, the stages' epilogues
struct Block {
  int64_t n, icb, h, w, hcb, ocb, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t rows, in_rows;  // output rows per band; expanded rows a band's windows span at most
  int64_t icl;  // the expand's Shape::icl (active channels of x's last block; 0: all)
  // w1 == nullptr: no expand (MobileNetV2's first block, expand ratio 1: depthwise ->
  // project), the depthwise reads x itself (hcb == icb) and ebuf is not used
  const float *x, *w1, *b1, *w2, *b2, *w3, *b3, *res;
  float *out;
  Epi e1, e2, e3;
};

// output rows per band: the band's expanded rows and depthwise rows within ~384 KiB (L2,
// beside the project weights), at least one row
inline void band_rows(Block &k) {
#ifndef KILN_CONV_BAND_BYTES
#define KILN_CONV_BAND_BYTES (384 << 10)
#endif
  // bytes (B <= 16); without an expand the input rows are read in place, not buffered
  const int64_t erow = k.w1 ? k.hcb * k.w * 16 * 4 : 0, drow = k.hcb * k.ow * 16 * 4;
  auto in_rows = [&](int64_t r) { return std::min(k.h, (r - 1) * k.sh + (k.kh - 1) * k.dh + 1); };
  int64_t r = 1;
  while (r < k.oh && in_rows(r + 1) * erow + (r + 1) * drow <= KILN_CONV_BAND_BYTES) ++r;
  k.rows = r, k.in_rows = in_rows(r);
}

/* The project of a band: its depthwise rows dbuf [HCb][rows][ow][B] (block stride dblk), output
 * rows [r0, r1) of image n, as one flat 1x1 row, into out (+ res). */
template <int B>
inline void block_project(const Block &k, const float *dbuf, int64_t dblk, int64_t n,
                          int64_t r0, int64_t r1) {
  Shape sp{};
  sp.n = 1, sp.icb = k.hcb, sp.icn = B, sp.ih = 1, sp.iw = (r1 - r0) * k.ow;
  sp.ocb = k.ocb, sp.oh = 1, sp.ow = sp.iw, sp.kh = sp.kw = sp.sh = sp.sw = sp.dh = sp.dw = 1;
  sp.xs_pix = B, sp.xs_ch = 1, sp.xs_row = sp.iw * B, sp.xs_blk = dblk;
  sp.os_blk = k.oh * k.ow * B;
  const int64_t off = (n * k.ocb * k.oh + r0) * k.ow * B;
  const Groups<B> gs(sp);
  for (int64_t gi = 0; gi < gs.ng; ++gi) {
    int64_t g0, gn;
    gs.at(gi, g0, gn);
    dense_any<B>(sp, dbuf, k.w3, k.b3, k.res ? k.res + off : nullptr, k.out + off, 0, g0, gn, 0,
                 1, 0, sp.ow, k.e3);
  }
}

// the expanded rows [ylo, yhi) of image img that a member's ebuf holds (img -1: none)
struct Rows {
  int64_t img = -1, ylo = 0, yhi = 0;
};

/* The (image, output row) units [u0, u1), in bands of k.rows rows. ebuf [HCb][in_rows][W][B]
 * holds the expanded rows `have` says (the rows a band shares with the previous one of the same
 * member are moved to the front, not recomputed); dbuf [HCb][rows][ow][B] the band's depthwise
 * rows. */
template <int B>
void block_range(const Block &k, float *ebuf, float *dbuf, Rows &have, int64_t u0, int64_t u1) {
  const int64_t eblk = k.in_rows * k.w * B, dblk = k.rows * k.ow * B;
  // the depthwise stage's columns whose windows stay inside the width (kiln_conv.h's dw_row)
  const int64_t span = (k.kw - 1) * k.dw;
  const int64_t lo = k.pw > 0 ? (k.pw + k.sw - 1) / k.sw : 0;
  int64_t hi = k.w - span + k.pw <= 0 ? 0 : (k.w - span + k.pw - 1) / k.sw + 1;
  hi = std::min(hi, k.ow);
  int64_t &img = have.img, &ylo = have.ylo, &yhi = have.yhi;
  for (int64_t u = u0; u < u1;) {
    const int64_t n = u / k.oh, r0 = u % k.oh;
    const int64_t r1 = std::min({k.oh, r0 + k.rows, r0 + (u1 - u)});
    if (!k.w1) {  // no expand: the depthwise reads the input's rows in place
      Shape sd{};
      sd.n = 1, sd.icb = sd.ocb = k.hcb, sd.icn = B, sd.ih = k.h, sd.iw = k.w;
      sd.oh = k.oh, sd.ow = k.ow, sd.kh = k.kh, sd.kw = k.kw, sd.sh = k.sh, sd.sw = k.sw;
      sd.ph = k.ph, sd.pw = k.pw, sd.dh = k.dh, sd.dw = k.dw;
      sd.xs_blk = k.h * k.w * B, sd.os_blk = dblk, sd.o0 = r0;
      for (int64_t cb = 0; cb < k.hcb; ++cb)
        for (int64_t r = r0; r < r1; ++r)
          dw_row<B>(sd, k.x + n * k.icb * k.h * k.w * B, k.w2, k.b2, nullptr, dbuf, k.e2, 0, cb,
                    r, lo, hi);
      block_project<B>(k, dbuf, dblk, n, r0, r1);
      u += r1 - r0;
      continue;
    }
    const int64_t need_lo = std::max<int64_t>(0, r0 * k.sh - k.ph);
    const int64_t need_hi = std::max(need_lo, std::min(k.h, (r1 - 1) * k.sh - k.ph +
                                                                (k.kh - 1) * k.dh + 1));
    if (n != img || need_lo >= yhi || need_lo < ylo) {
      img = n, ylo = yhi = need_lo;
    } else if (need_lo > ylo) {  // keep the rows this band shares with the last
      for (int64_t hb = 0; hb < k.hcb; ++hb)
        std::memmove(ebuf + hb * eblk, ebuf + hb * eblk + (need_lo - ylo) * k.w * B,
                     (yhi - need_lo) * k.w * B * sizeof(float));
      ylo = need_lo;
    }
    if (need_hi > yhi) {  // expand: input rows [yhi, need_hi) as one flat 1x1 row
      Shape se{};
      se.n = 1, se.icb = k.icb, se.icn = B, se.ih = 1, se.iw = (need_hi - yhi) * k.w;
      se.ocb = k.hcb, se.oh = 1, se.ow = se.iw, se.kh = se.kw = se.sh = se.sw = se.dh = se.dw = 1;
      se.xs_pix = B, se.xs_ch = 1, se.xs_row = se.iw * B, se.xs_blk = k.h * k.w * B;
      se.os_blk = eblk, se.icl = k.icl;
      const float *xp = k.x + (n * k.icb * k.h + yhi) * k.w * B;
      float *ep = ebuf + (yhi - ylo) * k.w * B;
      const Groups<B> gs(se);
      for (int64_t gi = 0; gi < gs.ng; ++gi) {
        int64_t g0, gn;
        gs.at(gi, g0, gn);
        dense_any<B>(se, xp, k.w1, k.b1, nullptr, ep, 0, g0, gn, 0, 1, 0, se.ow, k.e1);
      }
      yhi = need_hi;
    }
    {  // depthwise: output rows [r0, r1) from the expanded rows [ylo, yhi)
      Shape sd{};
      sd.n = 1, sd.icb = sd.ocb = k.hcb, sd.icn = B, sd.ih = k.h, sd.iw = k.w;
      sd.oh = k.oh, sd.ow = k.ow, sd.kh = k.kh, sd.kw = k.kw, sd.sh = k.sh, sd.sw = k.sw;
      sd.ph = k.ph, sd.pw = k.pw, sd.dh = k.dh, sd.dw = k.dw;
      sd.xs_blk = eblk, sd.os_blk = dblk, sd.y0 = ylo, sd.o0 = r0;
      for (int64_t cb = 0; cb < k.hcb; ++cb)
        for (int64_t r = r0; r < r1; ++r)
          dw_row<B>(sd, ebuf, k.w2, k.b2, nullptr, dbuf, k.e2, 0, cb, r, lo, hi);
    }
    block_project<B>(k, dbuf, dblk, n, r0, r1);
    u += r1 - r0;
  }
}

/* The (image, channel block) units [u0, u1) of images of nb blocks as groups of at most gmax
 * (4 or 2) blocks of one image, the last ones of a run 2 and / or 1 (dense_any's widths):
 * fn(image, first block, blocks). */
template <class Fn>
inline void block_groups(int64_t nb, int64_t u0, int64_t u1, int64_t gmax, Fn &&fn) {
  for (int64_t u = u0; u < u1;) {
    const int64_t n = u / nb, c0 = u % nb, c1 = std::min(nb, c0 + (u1 - u));
    for (int64_t c = c0; c < c1;) {
      const int64_t left = c1 - c, gn = left >= gmax ? gmax : left >= 2 ? 2 : 1;
      fn(n, c, gn);
      c += gn;
    }
    u += c1 - c0;
  }
}

/* Where the rows do not split evenly over the team (small maps, e.g. 7 rows on 2 threads), two
 * regions: first the (image, hidden block) units [u0, u1), in groups of up to 4 blocks, each
 * group expanded whole into the member's ebuf [4][H][W][B] (the depthwise of a hidden block
 * reads that block only) and its depthwise stored into dall [N][HCb][oh][ow][B]; then the
 * (image, output block) units of the project. Shares of blocks, not of 4-block groups:
 * MobileNetV2's 7x7 blocks have 10 or 20 output blocks, whose groups (4, 4, 2 / 5 x 4) split
 * 4 : 6 and 8 : 12 blocks over 2 threads, where shares of blocks split 5 : 5 (4 + 1) and
 * 10 : 10 (4 + 4 + 2). */
template <int B>
void block_hidden(const Block &k, float *ebuf, float *dall, int64_t u0, int64_t u1) {
  const int64_t span = (k.kw - 1) * k.dw;
  const int64_t lo = k.pw > 0 ? (k.pw + k.sw - 1) / k.sw : 0;
  int64_t hi = k.w - span + k.pw <= 0 ? 0 : (k.w - span + k.pw - 1) / k.sw + 1;
  hi = std::min(hi, k.ow);
  const int64_t eblk = k.h * k.w * B, dimg = k.hcb * k.oh * k.ow * B;
  Shape se{};
  se.n = 1, se.icb = k.icb, se.icn = B, se.ih = 1, se.iw = k.h * k.w;
  se.ocb = k.hcb, se.oh = 1, se.ow = se.iw, se.kh = se.kw = se.sh = se.sw = se.dh = se.dw = 1;
  se.xs_pix = B, se.xs_ch = 1, se.xs_row = se.iw * B, se.xs_blk = eblk, se.os_blk = eblk;
  se.icl = k.icl;
  Shape sd{};
  sd.n = 1, sd.icb = sd.ocb = k.hcb, sd.icn = B, sd.ih = k.h, sd.iw = k.w;
  sd.oh = k.oh, sd.ow = k.ow, sd.kh = k.kh, sd.kw = k.kw, sd.sh = k.sh, sd.sw = k.sw;
  sd.ph = k.ph, sd.pw = k.pw, sd.dh = k.dh, sd.dw = k.dw, sd.xs_blk = eblk;
  block_groups(k.hcb, u0, u1, 4, [&](int64_t n, int64_t g0, int64_t gn) {
    // the group's hidden blocks g0.. land at ebuf (the weights and bias offset by g0); without
    // an expand the depthwise reads them in x
    const float *src = k.x + (n * k.icb + g0) * eblk;
    if (k.w1) {
      dense_any<B>(se, k.x + n * k.icb * eblk, k.w1 + g0 * k.icb * B * B, k.b1 + g0 * B,
                   nullptr, ebuf, 0, 0, gn, 0, 1, 0, se.ow, k.e1);
      src = ebuf;
    }
    for (int64_t j = 0; j < gn; ++j)
      for (int64_t r = 0; r < k.oh; ++r)
        dw_row<B>(sd, src, k.w2 + g0 * k.kh * k.kw * B, k.b2 + g0 * B, nullptr,
                  dall + n * dimg + g0 * k.oh * k.ow * B, k.e2, 0, j, r, lo, hi);
  });
}

template <int B>
void block_out(const Block &k, const float *dall, int64_t u0, int64_t u1) {
  const int64_t dimg = k.hcb * k.oh * k.ow * B;
  Shape sp{};
  sp.n = 1, sp.icb = k.hcb, sp.icn = B, sp.ih = 1, sp.iw = k.oh * k.ow;
  sp.ocb = k.ocb, sp.oh = 1, sp.ow = sp.iw, sp.kh = sp.kw = sp.sh = sp.sw = sp.dh = sp.dw = 1;
  sp.xs_pix = B, sp.xs_ch = 1, sp.xs_row = sp.iw * B, sp.xs_blk = k.oh * k.ow * B;
  const Groups<B> gp(sp);
  block_groups(k.ocb, u0, u1, gp.gw, [&](int64_t n, int64_t g0, int64_t gn) {
    const int64_t off = n * k.ocb * k.oh * k.ow * B;
    dense_any<B>(sp, dall + n * dimg, k.w3, k.b3, k.res ? k.res + off : nullptr, k.out + off, 0,
                 g0, gn, 0, 1, 0, sp.ow, k.e3);
  });
}

/* [0, n) over a team of nt (kr::parallel_for's schedule, with the member's id for per-member
 * buffers): member t owns the static share [n t / nt, n (t+1) / nt) and runs it front to back
 * in pieces of g, fn(t, lo, hi); done with its own, it takes pieces from the back of the
 * others'. Members are optional (the caller drains every share), so a member the OS has not
 * scheduled (a loaded machine) does not hold the region up: the others do its share. On an idle
 * machine every member runs its own share. Teams above 16: static shares, all members. */
template <class Fn>
inline void steal_for(int nt, int64_t n, int64_t g, Fn &&fn) {
  constexpr int kMaxShares = 16;
  if (nt <= 1 || nt > kMaxShares || n >= (int64_t(1) << 31)) {
    kr::parallel(nt, [&](int t, int m) {
      const int64_t lo = n * t / m, hi = n * (t + 1) / m;
      if (lo < hi) fn(t, lo, hi);
    });
    return;
  }
  kr::pool_detail::Share shares[kMaxShares];
  for (int t = 0; t < nt; ++t)
    shares[t].r.store((uint64_t(n * (t + 1) / nt) << 32) | uint64_t(n * t / nt),
                      std::memory_order_relaxed);
  kr::pool_detail::parallel(nt, [&](int t, int m) {
    int64_t lo, hi;
    if (m != nt)  // a smaller team than asked: the absent members' shares
      for (int v = 0; v < nt; ++v)
        if (v % m == t)
          while (shares[v].take(g, true, lo, hi)) fn(t, lo, hi);
    while (shares[t].take(g, true, lo, hi)) fn(t, lo, hi);
    for (int j = 1; j < nt; ++j) {
      kr::pool_detail::Share &v = shares[(t + j) % nt];
      while (v.take(g, false, lo, hi)) fn(t, lo, hi);
    }
  }, true);
}

template <int B>
int run_block(kr::Err &e, const char *where, Block &k, int64_t threads) {
  band_rows(k);
  const int nt0 = team(threads);
  const int64_t units = k.n * k.oh;
  // MACs of the block (expand, depthwise, project): below ~4 us of one core, one thread
  const int64_t work =
      k.n * ((k.w1 ? k.h * k.w * k.icb : 0) + k.oh * k.ow * (k.kh * k.kw + k.ocb)) * k.hcb * B;
  const int nt = nt0 > 1 && units >= nt0 && work >= 16384 * 16 ? nt0 : 1;
  if (nt > 1 && !even_split(units, nt)) {  // rows that do not split: by channel groups
    const int64_t per = 4 * k.h * k.w * B, dall = k.n * k.hcb * k.oh * k.ow * B;
    const size_t bytes = ((size_t(per * nt + dall) * sizeof(float)) + 63) / 64 * 64;
    float *buf = static_cast<float *>(std::aligned_alloc(64, bytes));
    if (!buf) return e.fail("%s: cannot allocate the %zu-byte block buffers", where, bytes);
    // two regions (a member may be absent from either): hidden blocks, then output blocks
    steal_for(nt, k.n * k.hcb, 4, [&](int t, int64_t lo, int64_t hi) {
      block_hidden<B>(k, buf + dall + per * t, buf, lo, hi);
    });
    Shape sp{};  // the project's flat row (its groups' width: block_out's)
    sp.n = 1, sp.icb = k.hcb, sp.icn = B, sp.ih = 1, sp.iw = sp.ow = k.oh * k.ow;
    sp.ocb = k.ocb, sp.oh = 1;
    const int64_t gw = Groups<B>(sp).gw;
    steal_for(nt, k.n * k.ocb, gw, [&](int, int64_t lo, int64_t hi) {
      block_out<B>(k, buf, lo, hi);
    });
    std::free(buf);
    return 0;
  }
  const int64_t erows = k.w1 ? k.hcb * k.in_rows * k.w * B : 0;  // no expand: no ebuf
  const int64_t per = erows + k.hcb * k.rows * k.ow * B;  // floats per thread
  const size_t bytes = ((size_t(per) * nt * sizeof(float)) + 63) / 64 * 64;
  float *buf = static_cast<float *>(std::aligned_alloc(64, bytes));
  if (!buf) return e.fail("%s: cannot allocate the %zu-byte band buffers", where, bytes);
  // member t owns the t-th contiguous share of the (image, row) units, a band at a time, and
  // then takes bands from the back of the others' (steal_for: on a loaded machine the others
  // do an unscheduled member's rows, recomputing the few expanded rows at the seams)
  Rows have[16];  // per member (teams above 16: static shares, one call per member)
  steal_for(nt, units, k.rows, [&](int t, int64_t lo, int64_t hi) {
    float *eb = buf + per * t;
    Rows once;
    block_range<B>(k, eb, eb + erows, nt > 16 ? once : have[t], lo, hi);
  });
  std::free(buf);
  return 0;
}

inline int block_dispatch(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                          int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                          int64_t dw, const Epi (&eps)[3], int64_t threads,
                          const View<float> &x, const View<float> *w1, const View<float> *b1,
                          const View<float> &w2, const View<float> &b2, const View<float> &w3,
                          const View<float> &b3, const float *res) {
  // w1, b1: the expand's (nullptr: a block without one, whose depthwise reads x)
  const int64_t blk = w2.size(w2.rank - 1);
  const bool chained = w1 ? w1->rank == 6 && w1->size(1) == x.size(1) &&
                                w1->size(0) == w2.size(0) && w1->size(2) * w1->size(3) == 1
                          : x.size(1) == w2.size(0);
  if (x.rank != 5 || w2.rank != 4 || w3.rank != 6 || x.size(4) != blk || !chained ||
      w3.size(1) != w2.size(0) || w3.size(2) * w3.size(3) != 1)
    return e.fail("%s: inverted residual block of x [rank %d], expand weight [rank %d], "
                  "depthwise weight [rank %d], project weight [rank %d] whose blocks do not "
                  "chain", where, x.rank, w1 ? w1->rank : 0, w2.rank, w3.rank);
  Block k{};
  k.n = x.size(0), k.icb = x.size(1), k.h = x.size(2), k.w = x.size(3);
  k.hcb = w2.size(0), k.kh = w2.size(1), k.kw = w2.size(2), k.ocb = w3.size(0);
  k.oh = oh, k.ow = ow, k.sh = sh, k.sw = sw, k.ph = ph, k.pw = pw, k.dh = dh, k.dw = dw;
  k.x = x.data, k.w1 = w1 ? w1->data : nullptr, k.b1 = b1 ? b1->data : nullptr;
  k.w2 = w2.data, k.b2 = b2.data, k.w3 = w3.data, k.b3 = b3.data, k.res = res, k.out = out;
  k.e1 = eps[0], k.e2 = eps[1], k.e3 = eps[2];
#ifdef KILN_CONV_B16
  if (blk == 16) {
    k.icl = k.w1 ? active_channels<16>(k.w1, k.hcb, k.icb, 1) : 0;
    if (k.icl && !tail_finite<16>(k.x, k.n, k.icb, k.h * k.w, k.icl)) k.icl = 0;
    return run_block<16>(e, where, k, threads);
  }
#endif
#ifdef KILN_CONV_B8
  if (blk == 8) {
    k.icl = k.w1 ? active_channels<8>(k.w1, k.hcb, k.icb, 1) : 0;
    if (k.icl && !tail_finite<8>(k.x, k.n, k.icb, k.h * k.w, k.icl)) k.icl = 0;
    return run_block<8>(e, where, k, threads);
  }
#endif
  return e.fail("%s: channel block of %lld floats (expected 8 or 16)", where, (long long)blk);
}

}  // namespace conv

int conv2d_block_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t act1, double lo1, double hi1, int64_t act2, double lo2,
                       double hi2, int64_t act3, double lo3, double hi3, int64_t threads,
                       View<float> x, View<float> w1, View<float> b1, View<float> w2,
                       View<float> b2, View<float> w3, View<float> b3) {
  const conv::Epi eps[3] = {{int(act1), float(lo1), float(hi1)},
                            {int(act2), float(lo2), float(hi2)},
                            {int(act3), float(lo3), float(hi3)}};
  return conv::block_dispatch(e, where, out, oh, ow, sh, sw, ph, pw, dh, dw, eps, threads, x,
                              &w1, &b1, w2, b2, w3, b3, nullptr);
}

int conv2d_block_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t act1, double lo1, double hi1, int64_t act2, double lo2,
                       double hi2, int64_t act3, double lo3, double hi3, int64_t threads,
                       View<float> x, View<float> w1, View<float> b1, View<float> w2,
                       View<float> b2, View<float> w3, View<float> b3, View<float> res) {
  const conv::Epi eps[3] = {{int(act1), float(lo1), float(hi1)},
                            {int(act2), float(lo2), float(hi2)},
                            {int(act3), float(lo3), float(hi3)}};
  return conv::block_dispatch(e, where, out, oh, ow, sh, sw, ph, pw, dh, dw, eps, threads, x,
                              &w1, &b1, w2, b2, w3, b3, res.data);
}

int conv2d_block_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t act1, double lo1, double hi1, int64_t act2, double lo2,
                       double hi2, int64_t act3, double lo3, double hi3, int64_t threads,
                       View<float> x, View<float> w2, View<float> b2, View<float> w3,
                       View<float> b3) {
  const conv::Epi eps[3] = {{int(act1), float(lo1), float(hi1)},
                            {int(act2), float(lo2), float(hi2)},
                            {int(act3), float(lo3), float(hi3)}};
  return conv::block_dispatch(e, where, out, oh, ow, sh, sw, ph, pw, dh, dw, eps, threads, x,
                              nullptr, nullptr, w2, b2, w3, b3, nullptr);
}

int conv2d_block_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                       int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
                       int64_t act1, double lo1, double hi1, int64_t act2, double lo2,
                       double hi2, int64_t act3, double lo3, double hi3, int64_t threads,
                       View<float> x, View<float> w2, View<float> b2, View<float> w3,
                       View<float> b3, View<float> res) {
  const conv::Epi eps[3] = {{int(act1), float(lo1), float(hi1)},
                            {int(act2), float(lo2), float(hi2)},
                            {int(act3), float(lo3), float(hi3)}};
  return conv::block_dispatch(e, where, out, oh, ow, sh, sw, ph, pw, dh, dw, eps, threads, x,
                              nullptr, nullptr, w2, b2, w3, b3, res.data);
}

namespace conv {

/* One output row of max pooling: B channels per vector, the window's rows and columns clipped
 * to the input; max(a, v) keeps a NaN of either side (v > a is false for a NaN, v != v is true
 * for one). The window rows inside the input are found once per row; the pixels whose window
 * columns lie inside the width go 4 at a time without tests (4 independent compare / select
 * chains: one pixel's chain of kh * kw dependent steps left ResNet's 3x3 pool 1.8x slower than
 * ONNX Runtime's), each pixel's taps in the same order as the checked loop of the edges. */
template <int B>
inline void pool_row(const float *xc, float *orow, int64_t ih, int64_t iw, int64_t ow,
                     int64_t oh_, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph,
                     int64_t pw, int64_t dh, int64_t dw) {
  typedef typename V<B>::type vec;
  const vec lowest = splat<B>(-__builtin_inff());
  auto one = [&](int64_t o) {  // any pixel: every tap tested
    vec acc = lowest;
    for (int64_t ky = 0; ky < kh; ++ky) {
      const int64_t iy = oh_ * sh + ky * dh - ph;
      if (iy < 0 || iy >= ih) continue;
      const float *xr = xc + iy * iw * B;
      for (int64_t kx = 0; kx < kw; ++kx) {
        const int64_t ix = o * sw + kx * dw - pw;
        if (ix < 0 || ix >= iw) continue;
        const vec v = load<B>(xr + ix * B);
        acc = (v > acc) | (v != v) ? v : acc;
      }
    }
    store<B>(orow + o * B, acc);
  };
  int64_t ky0 = 0, ky1 = kh;  // the window rows inside the input
  while (ky0 < kh && oh_ * sh + ky0 * dh - ph < 0) ++ky0;
  while (ky1 > ky0 && oh_ * sh + (ky1 - 1) * dh - ph >= ih) --ky1;
  const int64_t span = (kw - 1) * dw;  // columns whose window lies inside the width: [lo, hi)
  const int64_t lo = std::min(ow, pw > 0 ? (pw + sw - 1) / sw : int64_t(0));
  const int64_t hi = std::min(ow, iw - span + pw <= 0 ? 0 : (iw - span + pw - 1) / sw + 1);
  int64_t o = 0;
  for (; o < lo; ++o) one(o);
  constexpr int P = 4;
  for (; o + P <= hi; o += P) {
    vec acc[P];
    for (int p = 0; p < P; ++p) acc[p] = lowest;
    for (int64_t ky = ky0; ky < ky1; ++ky) {
      const float *xr = xc + ((oh_ * sh + ky * dh - ph) * iw + o * sw - pw) * B;
      for (int64_t kx = 0; kx < kw; ++kx)
        for (int p = 0; p < P; ++p) {
          const vec v = load<B>(xr + (p * sw + kx * dw) * B);
          acc[p] = (v > acc[p]) | (v != v) ? v : acc[p];
        }
    }
    for (int p = 0; p < P; ++p) store<B>(orow + (o + p) * B, acc[p]);
  }
  for (; o < ow; ++o) one(o);
}

template <int B>
int max_pool(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow, int64_t kh,
             int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw,
             int64_t threads, const View<float> &x) {
  const int64_t n = x.size(0), cb = x.size(1), ih = x.size(2), iw = x.size(3);
  (void)e, (void)where;
  // the same (image, row) shares as the convolutions around it (kiln_conv.h's spatial split)
  const int64_t units = n * oh;
  const int nt = team(threads);
  kr::parallel_for(units, nt > 1 && units >= nt && units * cb * ow * kh * kw >= 16384 ? nt : 1,
                   [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t i = u / oh, r = u % oh;
      for (int64_t c = 0; c < cb; ++c)
        pool_row<B>(x.data + (i * cb + c) * ih * iw * B, out + ((i * cb + c) * oh + r) * ow * B,
                    ih, iw, ow, r, kh, kw, sh, sw, ph, pw, dh, dw);
    }
  });
  return 0;
}

}  // namespace conv

int max_pool2d_nchwc(kr::Err &e, const char *where, float *out, int64_t oh, int64_t ow,
                     int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                     int64_t dh, int64_t dw, int64_t threads, View<float> x) {
  const int64_t blk = x.size(x.rank - 1);
#ifdef KILN_CONV_B16
  if (blk == 16)
    return conv::max_pool<16>(e, where, out, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, threads, x);
#endif
#ifdef KILN_CONV_B8
  if (blk == 8)
    return conv::max_pool<8>(e, where, out, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, threads, x);
#endif
  return e.fail("%s: channel block of %lld floats (expected 8 or 16)", where, (long long)blk);
}

#endif  // the entry points
}  // namespace kl
#endif  // KILN_CONV_IMPL
#endif  // KILN_CONV_H
