/* kiln_kernels.h - scalar helpers used by generated kernels (namespace kr).
 *
 * float versions of exp/tanh/sigmoid/erf are written with plain arithmetic and selects so that
 * the compiler can vectorise loops that call them (std::exp does not vectorise without
 * -ffast-math, which kiln does not use: it would break NaN and infinity semantics).
 * Accuracy: exp within 2 ulp over the float range; erf within 1.5e-7 absolute. */
#ifndef KILN_KERNELS_H
#define KILN_KERNELS_H
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
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
/* Team size of a kernel compiled with Options.num_threads = n: n, lowered to this run's
 * thread budget (omp_get_max_threads(), which libkiln sets per run) when that is smaller. */
inline int team_cap(int n) {
#ifdef _OPENMP
  const int budget = omp_get_max_threads();
  return budget < n ? budget : n;
#else
  return n;
#endif
}
inline void flag(int32_t *status) { __atomic_store_n(status, 1, __ATOMIC_RELAXED); }

inline float bits_to_float(int32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

inline float exp(float x) {
  const float xc = x < -87.5f ? -87.5f : (x > 88.5f ? 88.5f : x);
  const float k = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = bits_to_float((static_cast<int32_t>(k) + 127) << 23);
  float out = y * scale;
  out = x < -87.3f ? 0.0f : out;
  out = x > 88.7f ? std::numeric_limits<float>::infinity() : out;
  return x != x ? x : out;
}
template <class T> inline T exp(T x) { return std::exp(x); }

template <class T> inline T log(T x) { return std::log(x); }
template <class T> inline T rsqrt(T x) { return T(1) / std::sqrt(x); }

inline float sigmoid(float x) { return 1.0f / (1.0f + kr::exp(-x)); }
template <class T> inline T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }

inline float tanh(float x) {
  const float ax = x < 0 ? -x : x;
  const float e = kr::exp(-2.0f * ax);
  const float big = (1.0f - e) / (1.0f + e);
  const float x2 = x * x;  // small |x|: odd Taylor polynomial avoids cancellation
  const float small = x * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f +
                                                             x2 * -0.0539682540f)));
  const float out = x < 0 ? -big : big;
  return ax < 0.0625f ? small : out;
}
template <class T> inline T tanh(T x) { return std::tanh(x); }

inline float erf(float x) {
  const float ax = x < 0 ? -x : x;
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f +
                     t * (-1.453152027f + t * 1.061405429f))));
  const float y = 1.0f - poly * kr::exp(-ax * ax);
  // near zero use the Taylor series for a small relative error
  const float x2 = x * x;
  const float taylor = 1.1283791671f * x * (1.0f - x2 * (0.333333333f - x2 * 0.1f));
  const float out = x < 0 ? -y : y;
  return ax < 0.05f ? taylor : out;
}
template <class T> inline T erf(T x) { return std::erf(x); }

template <class T> inline T relu(T x) { return x < T(0) ? T(0) : x; }
template <class T> inline T abs(T x) { return x < T(0) ? -x : x; }
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

}  // namespace kr
#endif
