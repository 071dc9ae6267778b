// sample.cpp - kiln_sample (kiln.h): the next token from a row of logits, greedy or by
// temperature / top-k / top-p sampling with a seeded generator. The one implementation that
// `kiln generate` (through the Python runner) and examples/c/generate.c both call.
//
// The row: the last one of the logits tensor (shape [..., V], any strides, host memory,
// float32 / float64 / float16 / bfloat16). Greedy (temperature <= 0): the first index of the
// largest value. Sampling: p_i = softmax(logits / temperature) in double; top_k > 0 keeps the
// k most likely tokens (ties by lower index), 0 < top_p < 1 then keeps the shortest prefix
// of the rest, most likely first, whose mass reaches top_p; the kept probabilities are
// renormalised and one token is drawn with u = the next double of the generator in [0, 1).
// The generator is splitmix64 over the caller's 64-bit state (seed it with any value): the
// same seed gives the same tokens on every machine.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "../include/kiln.h"
#include "error.h"

namespace {

uint64_t splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400u));
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3FFu) << 13);
    }
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The last row of `t` as doubles.
std::vector<double> last_row(const DLTensor *t) {
  if (t->device.device_type != kDLCPU) {
    kiln::fail("kiln_sample: logits must be in host memory (device type %d): copy them to the "
               "CPU first", static_cast<int>(t->device.device_type));
  }
  if (t->ndim < 1 || !t->shape) kiln::fail("kiln_sample: logits need at least one dimension");
  const int64_t v = t->shape[t->ndim - 1];
  if (v < 1) kiln::fail("kiln_sample: the logits' last dimension is empty");
  for (int d = 0; d < t->ndim; ++d) {
    if (t->shape[d] < 1) kiln::fail("kiln_sample: logits have an empty dimension %d", d);
  }
  const DLDataType dt = t->dtype;
  int64_t item;
  if (dt.lanes == 1 && dt.code == kDLFloat && (dt.bits == 32 || dt.bits == 64 || dt.bits == 16)) {
    item = dt.bits / 8;
  } else if (dt.lanes == 1 && dt.code == kDLBfloat && dt.bits == 16) {
    item = 2;
  } else {
    kiln::fail("kiln_sample: logits must be float32, float64, float16 or bfloat16 (DLPack "
               "code %d, %d bits)", static_cast<int>(dt.code), static_cast<int>(dt.bits));
  }
  int64_t off = 0, step = 1;  // in elements
  if (t->strides) {
    for (int d = 0; d + 1 < t->ndim; ++d) off += (t->shape[d] - 1) * t->strides[d];
    step = t->strides[t->ndim - 1];
  } else {
    int64_t rows = 1;
    for (int d = 0; d + 1 < t->ndim; ++d) rows *= t->shape[d];
    off = (rows - 1) * v;
  }
  if (!t->data) kiln::fail("kiln_sample: logits have no data");
  const char *base = static_cast<const char *>(t->data) + t->byte_offset;
  std::vector<double> out(static_cast<size_t>(v));
  for (int64_t i = 0; i < v; ++i) {
    const char *p = base + (off + i * step) * item;
    if (dt.code == kDLBfloat) {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      out[i] = f;
    } else if (dt.bits == 16) {
      uint16_t h;
      std::memcpy(&h, p, 2);
      out[i] = half_to_float(h);
    } else if (dt.bits == 32) {
      float f;
      std::memcpy(&f, p, 4);
      out[i] = f;
    } else {
      std::memcpy(&out[i], p, 8);
    }
  }
  return out;
}

int64_t sample_row(const std::vector<double> &x, double temperature, int64_t top_k,
                   double top_p, uint64_t *rng) {
  const int64_t v = static_cast<int64_t>(x.size());
  int64_t best = 0;
  for (int64_t i = 1; i < v; ++i) {
    if (x[i] > x[best] || (std::isnan(x[i]) && !std::isnan(x[best]))) best = i;
  }
  if (std::isnan(x[best])) kiln::fail("kiln_sample: the logits are NaN");
  if (temperature <= 0) return best;
  std::vector<int64_t> order(static_cast<size_t>(v));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  int64_t keep = top_k > 0 ? std::min(top_k, v) : v;
  std::vector<double> p(static_cast<size_t>(keep));
  double total = 0;
  for (int64_t j = 0; j < keep; ++j) {
    p[j] = std::exp((x[order[j]] - x[best]) / temperature);
    total += p[j];
  }
  if (top_p > 0 && top_p < 1) {
    double mass = 0;
    int64_t n = 0;
    while (n < keep) {
      mass += p[n++] / total;
      if (mass >= top_p) break;
    }
    keep = std::max<int64_t>(n, 1);
    total = 0;
    for (int64_t j = 0; j < keep; ++j) total += p[j];
  }
  const double u = static_cast<double>(splitmix64(rng) >> 11) * 0x1.0p-53 * total;
  double acc = 0;
  for (int64_t j = 0; j < keep; ++j) {
    acc += p[j];
    if (u < acc) return order[j];
  }
  return order[keep - 1];
}

}  // namespace

extern "C" KILN_API int kiln_sample(const DLTensor *logits, float temperature, int64_t top_k,
                                    float top_p, uint64_t *rng_state, int64_t *token) {
  try {
    if (!logits) kiln::fail("kiln_sample: logits is NULL");
    if (!token) kiln::fail("kiln_sample: token is NULL");
    if (std::isnan(temperature)) kiln::fail("kiln_sample: temperature is NaN");
    if (top_k < 0) kiln::fail("kiln_sample: top_k must be >= 0 (0: all), got %lld",
                              static_cast<long long>(top_k));
    if (!(top_p >= 0 && top_p <= 1)) {
      kiln::fail("kiln_sample: top_p must be in [0, 1] (0 or 1: all), got %g",
                 static_cast<double>(top_p));
    }
    if (temperature > 0 && !rng_state) kiln::fail("kiln_sample: rng_state is NULL");
    *token = sample_row(last_row(logits), temperature, top_k, top_p, rng_state);
    return 0;
  } catch (const std::exception &e) {
    kiln::set_last_error(e.what());
  } catch (...) {
    kiln::set_last_error("kiln_sample: unknown internal error");
  }
  return 1;
}
