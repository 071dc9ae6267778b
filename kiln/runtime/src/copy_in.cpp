// copy_in.cpp - see copy_in.h.
#include "copy_in.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace kiln {
namespace {

constexpr int kMaxRank = 64;

// Element size in bytes of a dtype the model could accept, else 0.
int64_t element_bytes(DLDataType d) {
  if (d.lanes != 1 || d.bits == 0 || d.bits % 8 != 0) return 0;
  return d.bits / 8;
}

// The byte distance (lowest, highest) of any element from element 0 fits in int64, and so do
// the byte sizes: the copy's address arithmetic cannot overflow.
bool extents_fit(const DLTensor *t, int64_t es) {
  int64_t lo = 0, hi = 0, bytes = es;
  for (int d = 0; d < t->ndim; ++d) {
    const int64_t n = t->shape[d];
    if (n < 0 || __builtin_mul_overflow(bytes, n, &bytes)) return false;
    if (n == 0) return false;  // nothing to copy
    int64_t span;
    if (__builtin_mul_overflow(n - 1, t->strides[d], &span) ||
        __builtin_mul_overflow(span, es, &span))
      return false;
    if (span < 0 ? __builtin_add_overflow(lo, span, &lo) : __builtin_add_overflow(hi, span, &hi))
      return false;
  }
  return true;
}

template <size_t B>
void copy_row(char *dst, const char *src, int64_t n, int64_t step) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * B, src + i * step, B);
}

}  // namespace

bool needs_copy_in(const DLTensor *t) {
  if (!t || t->device.device_type != kDLCPU || t->ndim <= 0 || t->ndim > kMaxRank ||
      !t->shape || !t->strides || !t->data)
    return false;
  const int64_t es = element_bytes(t->dtype);
  if (!es || !extents_fit(t, es)) return false;
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; --d) {
    if (t->shape[d] != 1 && t->strides[d] != expect) return true;
    expect *= t->shape[d];
  }
  return false;
}

static void copy_row_any(char *out, const char *src, int64_t n, int64_t step, int64_t es) {
  switch (es) {
    case 1: copy_row<1>(out, src, n, step); break;
    case 2: copy_row<2>(out, src, n, step); break;
    case 4: copy_row<4>(out, src, n, step); break;
    case 8: copy_row<8>(out, src, n, step); break;
    case 16: copy_row<16>(out, src, n, step); break;
    default:
      for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * es, src + i * step, es);
  }
}

void copy_compact(const DLTensor *t, void *dst) {
  const int64_t es = element_bytes(t->dtype);
  const int nd = t->ndim;
  const char *base = static_cast<const char *>(t->data) + t->byte_offset;
  char *out = static_cast<char *>(dst);
  const int64_t inner = t->shape[nd - 1], step = t->strides[nd - 1] * es;
  // a transposed last pair (rows contiguous in the source, not its last dim): copied in
  // kTile x kTile tiles, so that neither reads nor writes walk a whole column per element
  constexpr int64_t kTile = 16;  // 8..64 measured: 16 and 8 best (power-of-two strides alias cache sets)
  const bool tiled = nd >= 2 && t->strides[nd - 1] != 1 && t->strides[nd - 2] == 1 &&
                     inner >= kTile && t->shape[nd - 2] >= kTile;
  const int outer_dims = tiled ? nd - 2 : nd - 1;
  int64_t outer = 1;
  for (int d = 0; d < outer_dims; ++d) outer *= t->shape[d];
  int64_t idx[kMaxRank] = {0};  // odometer over the outer dims
  const char *src = base;
  for (int64_t o = 0; o < outer; ++o) {
    if (tiled) {
      const int64_t rows = t->shape[nd - 2], rstep = t->strides[nd - 2] * es;
      for (int64_t i0 = 0; i0 < rows; i0 += kTile)
        for (int64_t j0 = 0; j0 < inner; j0 += kTile)
          for (int64_t i = i0; i < i0 + kTile && i < rows; ++i) {
            const int64_t n = j0 + kTile < inner ? kTile : inner - j0;
            copy_row_any(out + (i * inner + j0) * es, src + i * rstep + j0 * step, n, step, es);
          }
      out += rows * inner * es;
    } else {
      copy_row_any(out, src, inner, step, es);
      out += inner * es;
    }
    for (int d = outer_dims - 1; d >= 0; --d) {  // next outer index; src follows by strides
      src += t->strides[d] * es;
      if (++idx[d] < t->shape[d]) break;
      src -= t->shape[d] * t->strides[d] * es;
      idx[d] = 0;
    }
  }
}

CopyIn::~CopyIn() {
  for (Block &b : blocks_) std::free(b.data);
}

const DLTensor *const *CopyIn::bind(const DLTensor *const *inputs, int64_t n) {
  int64_t first = -1;
  for (int64_t i = 0; i < n && first < 0; ++i) {
    if (needs_copy_in(inputs[i])) first = i;
  }
  if (first < 0) return inputs;
  if (static_cast<int64_t>(blocks_.size()) < n) blocks_.resize(static_cast<size_t>(n));
  copies_.resize(static_cast<size_t>(n));
  bound_.assign(inputs, inputs + n);
  for (int64_t i = first; i < n; ++i) {
    const DLTensor *t = inputs[i];
    if (!needs_copy_in(t)) continue;
    size_t bytes = static_cast<size_t>(element_bytes(t->dtype));
    for (int d = 0; d < t->ndim; ++d) bytes *= static_cast<size_t>(t->shape[d]);
    Block &b = blocks_[static_cast<size_t>(i)];
    if (b.bytes < bytes) {
      const size_t rounded = (bytes + 63) / 64 * 64;
      void *p = std::aligned_alloc(64, rounded);
      if (!p) throw std::bad_alloc();
      std::free(b.data);
      b.data = p;
      b.bytes = rounded;
    }
    copy_compact(t, b.data);
    DLTensor &c = copies_[static_cast<size_t>(i)];
    c = *t;
    c.data = b.data;
    c.strides = nullptr;  // compact row-major
    c.byte_offset = 0;
    bound_[static_cast<size_t>(i)] = &c;
  }
  return bound_.data();
}

}  // namespace kiln
