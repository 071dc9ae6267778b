/* kiln_kernels.h - scalar helpers used by generated kernels (namespace kr).
 *
 * float versions of exp/tanh/sigmoid/erf are written with plain arithmetic, bit operations and
 * selects (no branch, no library call, no floor: SSE2 has none) so that the compiler can
 * vectorise loops that call them at every -march level (std::exp does not vectorise without
 * -ffast-math, which kiln does not use: it would break NaN and infinity semantics).
 * Accuracy against float64 (every 61st float32 bit pattern; tests/targets/cpu/test_vector_math.py
 * sweeps every 4099th): exp 1.0 ulp, sigmoid 2.3 ulp, tanh 1.85 ulp, subnormal results kept;
 * erf within 3.6e-7 absolute (every float). */
#ifndef KILN_KERNELS_H
#define KILN_KERNELS_H
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include "kiln_pool.h"  // kr::parallel_for, kr::team_cap: kiln's own thread pool

// Complex elements: a pair of reals with torch's layout. Kernels compute on the parts
// (`x.re`, `x.im`: lowering/complex.py), so no complex arithmetic is needed here.
#ifndef KILN_COMPLEX_TYPES
#define KILN_COMPLEX_TYPES
struct kr_complex32 { unsigned short re, im; };  // two float16 bit patterns (torch.chalf)
struct kr_complex64 { float re, im; };
struct kr_complex128 { double re, im; };
#endif

#define KILN_KERNEL __attribute__((visibility("default")))
#define KILN_UNLIKELY(x) __builtin_expect(!!(x), 0)

namespace kr {

template <class T> inline T lowest() {
  return std::numeric_limits<T>::has_infinity ? -std::numeric_limits<T>::infinity()
                                              : std::numeric_limits<T>::lowest();
}
template <class T> inline T highest() {
  return std::numeric_limits<T>::has_infinity ? std::numeric_limits<T>::infinity()
                                              : std::numeric_limits<T>::max();
}
inline void flag(int32_t *status) { __atomic_store_n(status, 1, __ATOMIC_RELAXED); }

/* the maximum / minimum of index values, taken by value: std::max's references to temporaries
 * make GCC privatise them as arrays in `omp simd` loops, where it then gives up vectorising
 * (an index clamped by a pad or a slice: kiln/ir/sym.py's to_c with kernel=True) */
constexpr int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
constexpr int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

inline float bits_to_float(int32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

/* 16-bit float storage types. Kernels never compute in them (passes/widen_half.py): a value
 * converts to float on load and rounds to nearest-even on store, like eager on the CPU.
 * float16 conversions are the branch-free IEEE ones (subnormals, inf, NaN kept). */
inline uint32_t float_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
inline float float_of_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

inline float f16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = float_of_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = float_of_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return float_of_bits(sign | (two_w < (1u << 27) ? float_bits(denormalized)
                                                   : float_bits(normalized)));
}
inline uint16_t float_to_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = float_of_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = float_bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
inline float bf16_to_float(uint16_t h) { return float_of_bits(static_cast<uint32_t>(h) << 16); }
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t nan = (u >> 16) | 0x0040u;  // quiet NaN, sign kept
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // nearest-even
  return static_cast<uint16_t>(f != f ? nan : rounded);  // a select: loops stay vectorisable
}

struct half {
  uint16_t bits;
  half() = default;
  template <class T> explicit half(T v) : bits(float_to_f16(static_cast<float>(v))) {}
  operator float() const { return f16_to_float(bits); }
};
struct bfloat16 {
  uint16_t bits;
  bfloat16() = default;
  template <class T> explicit bfloat16(T v) : bits(float_to_bf16(static_cast<float>(v))) {}
  operator float() const { return bf16_to_float(bits); }
};
static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2, "16-bit storage types");

/* 8-bit float storage types, torch's float8_e4m3fn (4 exponent bits, bias 7, no infinities,
 * S.1111.111 is NaN) and float8_e5m2 (5 exponent bits, bias 15, IEEE-like). Conversions match
 * eager bit for bit: to float exactly; from float rounding to nearest-even, subnormals kept;
 * e4m3fn saturates finite overflow and infinities to +-448 (torch >= 2.12; Sat = false: they
 * become NaN, as in earlier torch versions), e5m2 overflows to +-inf; NaN stays
 * NaN (S.1111111; to float with eager's payload). Template arguments: exponent bits E, mantissa bits M. */
template <int E, int M> inline float f8_to_float(uint8_t v) {
  constexpr int bias = (1 << (E - 1)) - 1;
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t e = (v >> M) & ((1u << E) - 1), m = v & ((1u << M) - 1);
  const bool ieee = E == 5;  // e5m2 reserves the top exponent; e4m3fn only S.1111.111
  if ((ieee && e == (1u << E) - 1) || (!ieee && e == (1u << E) - 1 && m == (1u << M) - 1))
    return float_of_bits(sign | 0x7F800000u |  // inf, or a quiet NaN with eager's payload
                         (ieee && m == 0 ? 0u : (m << (23 - M)) | 0x400000u));
  if (e == 0)  // subnormal: m * 2^(1 - bias - M), exact in float
    return float_of_bits(sign | float_bits(static_cast<float>(m) *
                                           float_of_bits((127u + 1 - bias - M) << 23)));
  return float_of_bits(sign | ((e + 127 - bias) << 23) | (m << (23 - M)));
}
template <int E, int M, bool Sat = true> inline uint8_t float_to_f8(float f) {
  constexpr int bias = (1 << (E - 1)) - 1;
  const uint32_t w = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((w >> 24) & 0x80u);
  const uint32_t a = w & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7F;  // NaN
  // first magnitude that rounds past the largest finite value: 464 (e4m3fn), 61440 (e5m2)
  constexpr uint32_t over = E == 4 ? 0x43E80000u : 0x47700000u;
  if (a >= over)  // e4m3fn saturates (or, from past 464, is NaN), e5m2 is inf
    return sign | (E == 4 ? (Sat || a == over ? 0x7E : 0x7F) : 0x7C);
  if (a < static_cast<uint32_t>(127 + 1 - bias) << 23) {
    // subnormal range: m = round(|f| * 2^(bias - 1 + M)) (the scaling is exact; adding and
    // subtracting 2^23 rounds to nearest-even); m == 2^M is the smallest normal's encoding
    const float t = float_of_bits(a) * float_of_bits((127u + bias - 1 + M) << 23);
    const float big = 8388608.0f;
    return sign | static_cast<uint8_t>(static_cast<uint32_t>((t + big) - big));
  }
  constexpr int shift = 23 - M;
  const uint32_t r = a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1u);  // nearest-even
  return sign | static_cast<uint8_t>((r >> shift) - (static_cast<uint32_t>(127 - bias) << M));
}

struct float8_e4m3fn {
  uint8_t bits;
  float8_e4m3fn() = default;
  template <class T> explicit float8_e4m3fn(T v) : bits(float_to_f8<4, 3>(static_cast<float>(v))) {}
  operator float() const { return f8_to_float<4, 3>(bits); }
  /* the conversion of torch < 2.12: overflow past 464 and infinities become NaN */
  template <class T> static float8_e4m3fn overflow_nan(T v) {
    float8_e4m3fn r;
    r.bits = float_to_f8<4, 3, false>(static_cast<float>(v));
    return r;
  }
};
struct float8_e5m2 {
  uint8_t bits;
  float8_e5m2() = default;
  template <class T> explicit float8_e5m2(T v) : bits(float_to_f8<5, 2>(static_cast<float>(v))) {}
  operator float() const { return f8_to_float<5, 2>(bits); }
};
static_assert(sizeof(float8_e4m3fn) == 1 && sizeof(float8_e5m2) == 1, "8-bit storage types");

/* The "fnuz" variants (finite, no negative zero), torch's float8_e4m3fnuz (bias 8) and
 * float8_e5m2fnuz (bias 16): every pattern but 0x80 is finite, 0x80 (negative zero's place) is
 * the one NaN, read as eager reads it (float bits 0x7F800001). From float: nearest-even,
 * subnormals kept; NaN, +-inf and magnitudes from the halfway point past the largest finite
 * value (248 for e4m3fnuz, 61440 for e5m2fnuz) become NaN (eager does not saturate them); a
 * value that rounds to zero is +0, whatever its sign. */
template <int E, int M> inline float f8fnuz_to_float(uint8_t v) {
  constexpr int bias = 1 << (E - 1);
  if (v == 0x80u) return float_of_bits(0x7F800001u);
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t e = (v >> M) & ((1u << E) - 1), m = v & ((1u << M) - 1);
  if (e == 0)  // subnormal (or +0): m * 2^(1 - bias - M), exact in float
    return float_of_bits(sign | float_bits(static_cast<float>(m) *
                                           float_of_bits((127u + 1 - bias - M) << 23)));
  return float_of_bits(sign | ((e + 127 - bias) << 23) | (m << (23 - M)));
}
template <int E, int M> inline uint8_t float_to_f8fnuz(float f) {
  constexpr int bias = 1 << (E - 1);
  const uint32_t w = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((w >> 24) & 0x80u);
  const uint32_t a = w & 0x7FFFFFFFu;
  // halfway past the largest finite value (2 - 2^-M) * 2^(2^E - 1 - bias): 248, 61440
  constexpr uint32_t over = (static_cast<uint32_t>(127 + (1 << E) - 1 - bias) << 23) |
                            (((1u << (M + 1)) - 1) << (22 - M));
  if (a >= over) return 0x80;  // overflow, +-inf and NaN
  uint8_t r;
  if (a < static_cast<uint32_t>(127 + 1 - bias) << 23) {
    // subnormal range: round(|f| * 2^(bias - 1 + M)) to nearest-even (exact scaling; adding
    // and subtracting 2^23 rounds); 2^M is the smallest normal's encoding
    const float t = float_of_bits(a) * float_of_bits((127u + bias - 1 + M) << 23);
    const float big = 8388608.0f;
    r = static_cast<uint8_t>(static_cast<uint32_t>((t + big) - big));
  } else {
    constexpr int shift = 23 - M;
    const uint32_t n = a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1u);  // nearest-even
    r = static_cast<uint8_t>((n >> shift) - (static_cast<uint32_t>(127 - bias) << M));
  }
  return r == 0 ? 0 : static_cast<uint8_t>(sign | r);  // no negative zero
}
struct float8_e4m3fnuz {
  uint8_t bits;
  float8_e4m3fnuz() = default;
  template <class T>
  explicit float8_e4m3fnuz(T v) : bits(float_to_f8fnuz<4, 3>(static_cast<float>(v))) {}
  operator float() const { return f8fnuz_to_float<4, 3>(bits); }
};
struct float8_e5m2fnuz {
  uint8_t bits;
  float8_e5m2fnuz() = default;
  template <class T>
  explicit float8_e5m2fnuz(T v) : bits(float_to_f8fnuz<5, 2>(static_cast<float>(v))) {}
  operator float() const { return f8fnuz_to_float<5, 2>(bits); }
};
static_assert(sizeof(float8_e4m3fnuz) == 1 && sizeof(float8_e5m2fnuz) == 1, "8-bit storage types");

/* Storage-type conversions for generated loops (kiln/targets/cpu/kernel.py): the struct lives
 * only inside these functions, never as a temporary of the loop body. Under `#pragma omp simd`
 * GCC turns every addressable local of the body (a struct whose constructor or conversion is
 * called on it) into a per-lane array, and a struct copied through one keeps the whole loop
 * scalar; a load printed as `static_cast<float>(buf[i])` and a store as
 * `buf[i].bits = kr::to_bits<S>(x)` vectorise. */
template <class S, class T> inline auto to_bits(T x) { return S(x).bits; }
template <class S, class T> inline float round_as(T x) { return static_cast<float>(S(x)); }
// A part of a complex32 element (its float16 bits) as a value
inline half half_of_bits(uint16_t b) { half h; h.bits = b; return h; }

namespace math_detail {
/* Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, for |x| <= 104: k rounded to nearest by
 * adding 1.5 * 2^23 (no floor: SSE2 has no vector floor, so a floor call would keep the loop
 * scalar on x86-64 builds); k's integer read from the sum's bits, no float -> int conversion.
 * kiln compiles with -std=c++17 (no FMA contraction) and without -ffast-math, so the sum and
 * difference are not reassociated away. */
inline float reduce_ln2(float x, int32_t &k) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  const float s = x * 1.44269504088896341f + magic;
  k = static_cast<int32_t>(float_bits(s) - float_bits(magic));
  const float kf = s - magic;
  return x - kf * 0.693359375f + kf * 2.12194440e-4f;
}
/* (exp(r) - 1 - r) / r^2 on |r| <= ln2/2 (the classic single-precision expf polynomial). */
inline float exp_poly(float r) {
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  return p * r + 5.0000001201e-1f;
}
/* 2^k as a float, k in [-126, 127]. */
inline float pow2i(int32_t k) { return float_of_bits(static_cast<uint32_t>(k + 127) << 23); }
/* exp(x) for x in [-104, 89] (callers clamp): y = exp(r) scaled by 2^k in two halves, each
 * a normal float for k in [-150, 128], so results that underflow to subnormals round once
 * (not flushed) and results past FLT_MAX become inf. */
inline float exp_clamped(float x) {
  int32_t k;
  const float r = reduce_ln2(x, k);
  const float y = exp_poly(r) * r * r + r + 1.0f;
  const int32_t k1 = k >> 1;
  return y * pow2i(k1) * pow2i(k - k1);
}
/* |x| and x's sign bit (bit operations: -0.0 and NaN keep theirs). */
inline float fabs_bits(float x) { return float_of_bits(float_bits(x) & 0x7FFFFFFFu); }
inline float with_sign_of(float mag, float x) {
  return float_of_bits((float_bits(mag) & 0x7FFFFFFFu) | (float_bits(x) & 0x80000000u));
}
}  // namespace math_detail

/* Branch-free (selects and bit operations only, no library calls) so loops over them vectorise
 * at every -march level, SSE2 included; tests/targets/cpu/test_vector_math.py sweeps their
 * error against float64 over every float exponent, subnormals, infinities and NaN. */
inline float exp(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float out = math_detail::exp_clamped(xc);
  return x != x ? x : out;
}
template <class T> inline T exp(T x) { return std::exp(x); }

template <class T> inline T log(T x) { return std::log(x); }
template <class T> inline T rsqrt(T x) { return T(1) / std::sqrt(x); }

/* sigmoid(x) = num / (1 + e) with e = exp(-|x|) in (0, 1] (never overflows): num = 1 for
 * x >= 0, e for x < 0 (no 1 - small cancellation; subnormal results for x < -87.3 kept). One
 * division. */
inline float sigmoid(float x) {
  const float ax = math_detail::fabs_bits(x);
  const float e = math_detail::exp_clamped(ax > 104.0f ? -104.0f : -ax);
  const float num = x < 0.0f ? e : 1.0f;
  const float out = num / (1.0f + e);
  return x != x ? x : out;
}
template <class T> inline T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }

/* tanh(|x|) from e = exp(-2|x|) = 1 + u, u = expm1(-2|x|), computed without cancellation: with
 * -2|x| = k ln2 + r, u = 2^k expm1(r) + (2^k - 1), expm1(r) = r + r^2 P(r). |x| < 0.55: -u / (2 + u) (no separate Taylor branch: u = -2|x| exactly for
 * tiny x); above: 1 - 2e / (1 + e) (the quotient small, its rounding a fraction of an ulp of
 * the result). One division either way (the two are selected operand-wise). |x| is clamped
 * at 9.5, past which tanh rounds to 1; the sign is copied from x (-0.0 -> -0.0). */
inline float tanh(float x) {
  const float ax = math_detail::fabs_bits(x);
  const float y = -2.0f * (ax > 9.5f ? 9.5f : ax);
  int32_t k;
  const float r = math_detail::reduce_ln2(y, k);
  const float em = math_detail::exp_poly(r) * r * r + r;
  const float s = math_detail::pow2i(k);
  const float se = s * em;  // exact (a power of two times em)
  // -u = (1 - s) - se, 2e = 2 (s + se), 2 + u = 1 + e = (1 + s) + se: each one rounding
  // (1 - s and 1 + s are exact for k >= -23)
  const bool small = ax < 0.55f;
  const float q = (small ? (1.0f - s) - se : 2.0f * (s + se)) / ((1.0f + s) + se);
  const float t = small ? q : 1.0f - q;
  return x != x ? x : math_detail::with_sign_of(t, x);
}
template <class T> inline T tanh(T x) { return std::tanh(x); }

inline float erf(float x) {
  // erf(x) = x * P(x^2) / Q(x^2) on |x| <= 3.925 (past it erf rounds to +-1 in float): one
  // division and two short Horner chains, branch-free (selects only), so loops that call it
  // vectorise without the exp of the classic erfc-based forms. P (degree 6) and Q (degree 5)
  // were fitted by kiln (linearised rational least squares with Lawson reweighting, float64,
  // then P refitted for Q rounded to float); written from scratch, in the style of the rational
  // erf of vector math libraries. Max |error| vs float64 erf over every float: 3.6e-7.
  // -0.0 -> -0.0, +-inf -> +-1, NaN -> NaN.
  const float ax = x < 0 ? -x : x;
  const float a = ax > 3.925f ? 3.925f : ax;
  const float z = a * a;
  float p = -1.336415778e-08f;
  p = p * z + 4.722861377e-06f;
  p = p * z + 3.805547021e-04f;
  p = p * z + 3.832967952e-03f;
  p = p * z + 5.428268760e-02f;
  p = p * z + 1.847023815e-01f;
  p = p * z + 1.128379226e+00f;
  float q = 6.346590817e-05f;
  q = q * z + 1.305393176e-03f;
  q = q * z + 1.543277223e-02f;
  q = q * z + 1.137797982e-01f;
  q = q * z + 4.970217347e-01f;
  q = q * z + 1.0f;
  float r = a * p / q;
  r = ax >= 3.925f ? 1.0f : r;
  return x < 0 ? -r : r;
}
template <class T> inline T erf(T x) { return std::erf(x); }

template <class T> inline T relu(T x) { return x < T(0) ? T(0) : x; }
template <class T> inline T abs(T x) {  // floats: the sign bit cleared (abs(-0.0) = +0.0, as eager)
  if constexpr (std::is_floating_point_v<T>) return std::fabs(x);
  else return x < T(0) ? -x : x;
}
template <class T> inline T sign(T x) { return T((T(0) < x) - (x < T(0))); }
template <class T> inline bool isinf(T x) {
  if constexpr (std::is_floating_point_v<T>) return std::isinf(x); else return false;
}
template <class T> inline T maximum(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) { if (a != a) return a; if (b != b) return b; }
  return a > b ? a : b;
}
template <class T> inline T minimum(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) { if (a != a) return a; if (b != b) return b; }
  return a < b ? a : b;
}
/* Integer division by zero is undefined in C++; kiln returns 0 instead of trapping. */
template <class T> inline T div(T a, T b) {
  if constexpr (std::is_integral_v<T>) { return b == 0 ? T(0) : T(a / b); } else return a / b;
}
template <class T> inline T truncdiv(T a, T b) {
  if constexpr (std::is_integral_v<T>) return div(a, b); else return std::trunc(a / b);
}
template <class T> inline T floordiv(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    if (b == 0) return T(0);
    T q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? T(q - 1) : q;
  } else {  // torch's semantics: from fmod, so 1.0 // 0.1 == 9 (floor(1.0 / 0.1) is 10)
    if (b == 0) return a / b;
    const T mod = std::fmod(a, b);
    T q = (a - mod) / b;
    if (mod != 0 && ((b < 0) != (mod < 0))) q -= T(1);
    if (q == 0) return std::copysign(T(0), a / b);
    const T fq = std::floor(q);
    return q - fq > T(0.5) ? fq + T(1) : fq;
  }
}
template <class T> inline T remainder(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    if (b == 0) return T(0);
    T r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? T(r + b) : r;
  } else {
    T r = std::fmod(a, b);
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
  }
}
template <class T> inline T fmod(T a, T b) {
  if constexpr (std::is_integral_v<T>) return b == 0 ? T(0) : T(a % b); else return std::fmod(a, b);
}
template <class T> inline T pow(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    T r = 1;
    for (T i = 0; i < b; ++i) r *= a;
    return b < 0 ? T(0) : r;
  } else {
    return std::pow(a, b);
  }
}

template <class T> inline bool signbit(T x) {
  if constexpr (std::is_floating_point_v<T>) return std::signbit(x); else return x < T(0);
}
/* Modified Bessel function I0, in double: the power series sum ((x/2)^k / k!)^2 up to
 * |x| = 30, above it the asymptotic series e^x / sqrt(2 pi x) * sum ((2k-1)!!)^2 / (k! (8x)^k),
 * with e^x in T (overflowing where torch's does).
 * (std::cyl_bessel_i throws for negative or large arguments.) */
template <class T> inline T i0(T v) {
  const double x = std::fabs(double(v));
  if (x != x) return T(x);
  double sum = 1, term = 1;
  if (x <= 30.0) {
    const double q = x * x / 4;
    for (int k = 1; k < 200 && term > sum * 1e-17; ++k) {
      term *= q / (double(k) * k);
      sum += term;
    }
    return T(sum);
  }
  const double inv = 1 / (8 * x);
  for (int k = 1; k < 40 && term > sum * 1e-17; ++k) {
    term *= (2.0 * k - 1) * (2.0 * k - 1) * inv / k;
    sum += term;
  }
  // e^x in T, as torch computes it: float results are inf from x = 88.72 on, double from 709.78
  const T ex = std::exp(T(x));
  return T(double(ex) * (sum / std::sqrt(2 * 3.14159265358979323846 * x)));
}
/* Shifts as torch defines them: a count outside [0, bits) shifts every bit out (a right shift
 * of a negative value leaves -1); a left shift is done on the unsigned type (no UB). */
template <class T> inline T shift_left(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    if (b < T(0) || b >= T(sizeof(T) * 8)) return T(0);
    return T(U(a) << b);
  } else {
    return a * std::exp2(b);
  }
}
template <class T> inline T shift_right(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    if (b < T(0) || b >= T(sizeof(T) * 8)) return std::is_signed_v<T> && a < T(0) ? T(-1) : T(0);
    return T(a >> b);
  } else {
    return a / std::exp2(b);
  }
}
/* Philox4x32-10 (Salmon et al., SC'11): key (seed lo, seed hi), counter (index lo, index hi,
 * stream, run); returns output word `lane` (0..3) as an int64 in [0, 2^32). */
inline int64_t philox(int64_t seed, int64_t run, int64_t stream, int64_t index, int64_t lane) {
  uint32_t k0 = uint32_t(uint64_t(seed)), k1 = uint32_t(uint64_t(seed) >> 32);
  uint32_t c0 = uint32_t(uint64_t(index)), c1 = uint32_t(uint64_t(index) >> 32);
  uint32_t c2 = uint32_t(uint64_t(stream)), c3 = uint32_t(uint64_t(run));
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = uint32_t(p1);
    c3 = uint32_t(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return int64_t(lane == 0 ? c0 : lane == 1 ? c1 : lane == 2 ? c2 : c3);
}

}  // namespace kr
#endif
