/* kiln_lib.h - runtime routines behind Loop IR `Extern` nodes (namespace kl): operations a
 * fused loop nest cannot express well (sorting, scans, scatters, embedding bags).
 *
 * Calling convention (the wrapper prints every call the same way):
 *   kl::<routine>(err, where, outputs..., attributes..., operands...)
 * Outputs are contiguous buffers; operands are strided views `kl::View` (pointer, rank and an
 * array of sizes then strides, in elements), so transposed or sliced inputs are read in place.
 * `where` names the graph nodes for error messages. A routine returns 0, or 1 after writing an
 * error into `err` (an index out of range): it never reads or writes out of bounds.
 *
 * Row routines (sort, topk, scans) work along the operand's last dim; lowering permutes the
 * operand so that the dim it works on comes last. Rows are independent and run in parallel.
 * The numpy twins of these routines are in kiln/ir/interp.py (`ROUTINES`). */
#ifndef KILN_LIB_H
#define KILN_LIB_H
#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kiln_model_rt.h"

namespace kl {

template <class T> struct View {
  const T *data;
  int rank;
  const int64_t *dims;  // sizes[rank] then strides[rank]
  int64_t size(int d) const { return dims[d]; }
  int64_t stride(int d) const { return dims[rank + d]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= dims[d];
    return n;
  }
  // element offset of the `flat`-th element in row-major order over the first `r` dims
  int64_t offset(int64_t flat, int r) const {
    int64_t off = 0;
    for (int d = r - 1; d >= 0; --d) {
      off += (flat % dims[d]) * dims[rank + d];
      flat /= dims[d];
    }
    return off;
  }
  T at(int64_t flat) const { return data[offset(flat, rank)]; }
};

template <class T> inline View<T> view(const T *data, int rank, const int64_t *dims) {
  return View<T>{data, rank, dims};
}

template <class T> inline bool is_nan(T x) { return x != x; }

// a sorts before b in ascending order; NaN is larger than every number (as torch)
template <class T> inline bool less(T a, T b) { return (!is_nan(a) && is_nan(b)) || a < b; }

// accumulation type: double for floats (as torch's CPU scans), the type itself otherwise
template <class T>
using acc_t = typename std::conditional<std::is_floating_point<T>::value, double, T>::type;

// rows of a row routine: all dims of `x` but the last; n: the last dim's size
template <class T> inline int64_t rows_of(const View<T> &x) {
  int64_t r = 1;
  for (int d = 0; d + 1 < x.rank; ++d) r *= x.size(d);
  return r;
}
template <class T> inline int64_t row_len(const View<T> &x) {
  return x.rank ? x.size(x.rank - 1) : 1;
}
template <class T> inline int64_t row_stride(const View<T> &x) {
  return x.rank ? x.stride(x.rank - 1) : 0;
}

/* sort: values and int64 indices of each row, ascending or descending, NaN sorting as the
 * largest value. `stable`: equal values keep their order (std::stable_sort on the indices);
 * otherwise std::sort on (value, index) pairs comparing values only, which leaves ties in the
 * same order as torch's CPU sort does. */
template <class T>
int sort(kr::Err &, const char *, T *vals, int64_t *idx, bool descending, bool stable,
         View<T> x) {
  const int64_t rows = rows_of(x), n = row_len(x), s = row_stride(x);
  // rows in static bands over the team; each member sorts with its own scratch
  kr::parallel_for(rows, rows > 1 && rows * n > 4096 ? kr::max_threads() : 1,
                   [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<T, int64_t>> pairs(stable ? 0 : static_cast<size_t>(n));
    for (int64_t r = r0; r < r1; ++r) {
      const T *row = x.data + x.offset(r, x.rank - 1);
      int64_t *ix = idx + r * n;
      if (stable) {
        for (int64_t j = 0; j < n; ++j) ix[j] = j;
        if (descending)
          std::stable_sort(ix, ix + n, [&](int64_t a, int64_t b) { return less(row[b * s], row[a * s]); });
        else
          std::stable_sort(ix, ix + n, [&](int64_t a, int64_t b) { return less(row[a * s], row[b * s]); });
        for (int64_t j = 0; j < n; ++j) vals[r * n + j] = row[ix[j] * s];
        continue;
      }
      for (int64_t j = 0; j < n; ++j) pairs[j] = {row[j * s], j};
      using P = std::pair<T, int64_t>;
      if (descending)
        std::sort(pairs.begin(), pairs.end(), [](const P &a, const P &b) { return less(b.first, a.first); });
      else
        std::sort(pairs.begin(), pairs.end(), [](const P &a, const P &b) { return less(a.first, b.first); });
      for (int64_t j = 0; j < n; ++j) {
        vals[r * n + j] = pairs[j].first;
        ix[j] = pairs[j].second;
      }
    }
  });
  return 0;
}

/* topk: the k largest (or smallest) of each row, NaN as the largest value (sorted, or with
 * `sorted` false in the order the selection leaves them, as torch). Selection
 * on (value, index) pairs comparing values only: a partial sort when k is small against the row
 * (k * 64 <= n), else nth_element and a sort of the part before the k-th; this leaves ties in
 * the order torch's CPU topk gives them. */
template <class T>
int topk(kr::Err &, const char *, T *vals, int64_t *idx, int64_t k, bool largest, bool sorted,
         View<T> x) {
  const int64_t rows = rows_of(x), n = row_len(x), s = row_stride(x);
  using P = std::pair<T, int64_t>;
  auto first = [largest](const P &a, const P &b) {
    return largest ? less(b.first, a.first) : less(a.first, b.first);
  };
  kr::parallel_for(rows, rows > 1 && rows * n > 4096 ? kr::max_threads() : 1,
                   [&](int64_t r0, int64_t r1) {
    std::vector<P> q(static_cast<size_t>(n));
    for (int64_t r = r0; r < r1; ++r) {
      const T *row = x.data + x.offset(r, x.rank - 1);
      for (int64_t j = 0; j < n; ++j) q[j] = {row[j * s], j};
      if (k > 0 && k * 64 <= n) {
        std::partial_sort(q.begin(), q.begin() + k, q.end(), first);
      } else if (k > 0) {
        std::nth_element(q.begin(), q.begin() + k - 1, q.end(), first);
        if (sorted) std::sort(q.begin(), q.begin() + k - 1, first);
      }
      for (int64_t j = 0; j < k; ++j) {
        vals[r * k + j] = q[j].first;
        idx[r * k + j] = q[j].second;
      }
    }
  });
  return 0;
}

// kScanProdOwn: a product accumulated in the element's own type (complex only: eager's
// complex prod reduction, a left-to-right loop in scalar_t; cumprod accumulates in acc_type)
enum ScanKind : int64_t { kScanSum = 0, kScanProd = 1, kScanLogSumExp = 2, kScanProdOwn = 3 };

template <class A> inline A log_add_exp(A a, A b) {
  if (is_nan(a) || is_nan(b)) return a + b;
  const A lo = std::min(a, b), hi = std::max(a, b);
  if (lo == hi && !std::isfinite(lo)) return lo;  // both -inf or both +inf
  return hi + std::log1p(std::exp(lo - hi));
}

/* scan: inclusive cumulative sum, product or log-sum-exp along each row (in `acc_t<Out>`). */
template <class Out, class In>
int scan(kr::Err &, const char *, Out *out, int64_t kind, View<In> x) {
  using A = acc_t<Out>;
  const int64_t rows = rows_of(x), n = row_len(x), s = row_stride(x);
  kr::parallel_for(rows, rows > 1 && rows * n > 4096 ? kr::max_threads() : 1, [&](int64_t r0_, int64_t r1_) {
  for (int64_t r = r0_; r < r1_; ++r) {
    const In *row = x.data + x.offset(r, x.rank - 1);
    A acc = kind == kScanProd ? A(1) : kind == kScanSum ? A(0) : A(-INFINITY);
    for (int64_t j = 0; j < n; ++j) {
      const A v = static_cast<A>(static_cast<Out>(row[j * s]));
      if (kind == kScanSum) acc = acc + v;
      else if (kind == kScanProd) acc = acc * v;
      else acc = log_add_exp(acc, v);
      out[r * n + j] = static_cast<Out>(acc);
    }
  }
  });
  return 0;
}

/* cummax / cummin: running extreme and its index along each row. A later equal value takes
 * over the index; once a NaN is seen the value stays NaN and each later NaN takes over the
 * index (eager's CPU and CUDA kernels: the index of the most recent NaN). */
template <class T>
int scan_extreme(kr::Err &, const char *, T *vals, int64_t *idx, bool is_max, View<T> x) {
  const int64_t rows = rows_of(x), n = row_len(x), s = row_stride(x);
  kr::parallel_for(rows, rows > 1 && rows * n > 4096 ? kr::max_threads() : 1, [&](int64_t r0_, int64_t r1_) {
  for (int64_t r = r0_; r < r1_; ++r) {
    const T *row = x.data + x.offset(r, x.rank - 1);
    T best = n ? row[0] : T();
    int64_t at = 0;
    for (int64_t j = 0; j < n; ++j) {
      const T v = row[j * s];
      if (is_nan(v) || (!is_nan(best) && (is_max ? v >= best : v <= best))) {
        best = v;
        at = j;
      }
      vals[r * n + j] = best;
      idx[r * n + j] = at;
    }
  }
  });
  return 0;
}

enum PutMode : int64_t { kSet = 0, kAdd = 1, kMul = 2, kMean = 3, kMax = 4, kMin = 5 };

// 16-bit float storage types (a put of a half KV cache): combined in float, stored rounded
template <class T> constexpr bool is_half_storage =
    std::is_same_v<T, kr::half> || std::is_same_v<T, kr::bfloat16>;

template <class T> inline T put_identity(int64_t mode) {
  if constexpr (is_half_storage<T>) {
    return T(put_identity<float>(mode));
  } else {
    switch (mode) {
      case kMul: return T(1);
      case kMax: return kr::lowest<T>();
      case kMin: return kr::highest<T>();
      default: return T(0);
    }
  }
}

template <class T> inline T put_combine(int64_t mode, T old, T v) {
  if constexpr (is_half_storage<T>) {
    return mode == kSet ? v : T(put_combine<float>(mode, float(old), float(v)));
  } else {
    switch (mode) {
      case kAdd: case kMean: return static_cast<T>(old + v);
      case kMul: return static_cast<T>(old * v);
      case kMax: return is_nan(v) || is_nan(old) ? static_cast<T>(old + v) : std::max(old, v);
      case kMin: return is_nan(v) || is_nan(old) ? static_cast<T>(old + v) : std::min(old, v);
      default: return v;
    }
  }
}

// complex puts (the frontend sends products here; sets and sums go part by part): a product is
// eager's c10::complex operator*= as GCC contracts it (re = fma(a, c, -bd), im = fma(a, d, bc);
// see scan_complex), applied in update order, so infinities give eager's NaN pattern
template <class C> inline C cput_combine(int64_t mode, C old, C v) {
  switch (mode) {
    case kAdd: case kMean: return C{old.re + v.re, old.im + v.im};
    case kMul: return C{std::fma(old.re, v.re, -(old.im * v.im)),
                        std::fma(old.re, v.im, old.im * v.re)};
    default: return v;
  }
}
inline kr_complex64 put_combine(int64_t mode, kr_complex64 old, kr_complex64 v) {
  return cput_combine(mode, old, v);
}
inline kr_complex128 put_combine(int64_t mode, kr_complex128 old, kr_complex128 v) {
  return cput_combine(mode, old, v);
}
template <> inline kr_complex64 put_identity<kr_complex64>(int64_t mode) {
  return {mode == kMul ? 1.0f : 0.0f, 0.0f};
}
template <> inline kr_complex128 put_identity<kr_complex128>(int64_t mode) {
  return {mode == kMul ? 1.0 : 0.0, 0.0};
}

/* put: out = self, then for every element `it` of the iteration space (the shape of `values`),
 * in row-major order, out[dest(it)] = combine(out[dest(it)], values[it]). Coordinate d of
 * dest is it[dims[d]] when dims[d] >= 0, else the value of index operand -dims[d]-1 at `it`
 * (wrapped when negative if `wrap`, else an error; out of range is always an error). One
 * routine covers scatter, scatter_add, scatter_reduce, index_put and (through decomposition)
 * index_add / index_copy / index_fill. Updates run in order: with duplicate destinations the
 * last write wins (kSet), sums add in order. `counts` (kMean only) counts the contributions. */
template <class T, class... Idx>
int put_counted(kr::Err &e, const char *where, T *out, int64_t *counts, int64_t mode,
                bool include_self, bool wrap, std::initializer_list<int64_t> dims_il,
                View<T> self, View<T> values, Idx... index) {
  const View<int64_t> ix[] = {index..., View<int64_t>{nullptr, 0, nullptr}};
  const std::vector<int64_t> dims(dims_il);
  const int R = self.rank, K = values.rank;
  const int64_t total = self.numel(), iters = values.numel();
  // out == self, contiguous: a state buffer updated in place (memory/inplace.py
  // state_updates), whose elements are already in place: no copy of the whole tensor
  bool same = out == self.data && !counts;
  int64_t st = 1;
  for (int d = R - 1; same && d >= 0; --d) {
    same = self.size(d) == 1 || self.stride(d) == st;
    st *= self.size(d);
  }
  kr::parallel_for((same ? 0 : total), total > 65536 && !same ? kr::max_threads() : 1, [&](int64_t p0_, int64_t p1_) {
  for (int64_t p = p0_; p < p1_; ++p) {
    out[p] = self.at(p);
    if (counts) counts[p] = include_self ? 1 : 0;
  }
  });
  // An update-space dim that is also a destination coordinate (`par`) splits the updates into
  // ranges of it that write disjoint places: threads take one range each and walk the update
  // space in row-major order within it (updates of one place keep their order, memory is
  // walked as in the sequential order). Without such a dim, updates run sequentially.
  int par = -1;
  for (int d = 0; d < R && par < 0; ++d) par = dims[d] >= 0 ? dims[d] : -1;
  const int64_t slices = par >= 0 ? values.size(par) : 1;
  const int64_t per_slice = slices ? iters / slices : 0;
  int failed = 0;
  // destination of update `it`; -1 (after reporting) for an index out of range
  auto dest = [&](const std::vector<int64_t> &it) -> int64_t {
    int64_t off = 0;
    for (int d = 0; d < R; ++d) {
      int64_t c;
      if (dims[d] >= 0) {
        c = it[dims[d]];
      } else {
        const View<int64_t> &v = ix[-dims[d] - 1];
        int64_t o = 0;
        for (int k = 0; k < K; ++k) o += it[k] * v.stride(k);
        c = v.data[o];
        const int64_t n = self.size(d);
        if (wrap && c < 0 && c >= -n) c += n;
        if (c < 0 || c >= n) {
          kr::Lock lock(kr::team_critical());  // first error only
          if (!failed) {
            failed = 1;
            e.fail("index out of range in %s: index %lld is out of bounds for dim %d of size "
                   "%lld", where, (long long)v.data[o], d, (long long)n);
          }
          return -1;
        }
      }
      off = off * self.size(d) + c;
    }
    return off;
  };
  // apply (or, first, without include_self, reset) the updates with it[par] in [lo, hi)
  auto range = [&](int64_t lo, int64_t hi, bool apply) {
    if (lo >= hi) return;
    std::vector<int64_t> it(static_cast<size_t>(K > 0 ? K : 1), 0);
    if (par >= 0) it[par] = lo;
    const int64_t n = par >= 0 ? per_slice * (hi - lo) : iters;
    for (int64_t f = 0; f < n; ++f) {
      int64_t voff = 0;
      for (int k = 0; k < K; ++k) voff += it[k] * values.stride(k);
      const int64_t p = dest(it);
      if (p < 0) return;
      if (apply) {
        out[p] = put_combine(mode, out[p], values.data[voff]);
        if (counts) counts[p] += 1;
      } else {
        out[p] = put_identity<T>(mode);
      }
      for (int k = K - 1; k >= 0; --k) {  // next update in row-major order
        if (++it[k] < (k == par ? hi : values.size(k))) break;
        it[k] = k == par ? lo : 0;
      }
    }
  };
  for (int pass = include_self ? 1 : 0; pass < 2 && !failed; ++pass) {
    if (par >= 0 && slices > 1 && iters > 65536) {
      kr::parallel(kr::max_threads(), [&](int t, int nt) {
        range(slices * t / nt, slices * (t + 1) / nt, pass == 1);
      });
    } else {
      range(0, slices, pass == 1);
    }
  }
  if (failed) return 1;
  if (mode == kMean) {
    for (int64_t p = 0; p < total; ++p) {
      if (counts[p] == 0) continue;
      if constexpr (std::is_floating_point<T>::value) {
        out[p] = static_cast<T>(out[p] / static_cast<T>(counts[p]));
      } else if constexpr (!std::is_same_v<T, kr_complex64> &&
                           !std::is_same_v<T, kr_complex128>) {  // (complex: no mean here)
        const int64_t q = static_cast<int64_t>(out[p]), c = counts[p];
        out[p] = static_cast<T>(q / c - ((q % c != 0) && ((q < 0) != (c < 0))));  // floor
      }
    }
  }
  return 0;
}

template <class T, class... Idx>
int put(kr::Err &e, const char *where, T *out, int64_t mode, bool include_self, bool wrap,
        std::initializer_list<int64_t> dims, View<T> self, View<T> values, Idx... index) {
  return put_counted(e, where, out, static_cast<int64_t *>(nullptr), mode, include_self, wrap,
                     dims, self, values, index...);
}

template <class T, class... Idx>
int put_mean(kr::Err &e, const char *where, T *out, int64_t *counts, int64_t mode,
             bool include_self, bool wrap, std::initializer_list<int64_t> dims, View<T> self,
             View<T> values, Idx... index) {
  return put_counted(e, where, out, counts, mode, include_self, wrap, dims, self, values,
                     index...);
}

/* scan of complex values: logcumsumexp and products (the frontend writes complex cumsum on
 * the parts). Products: eager's cumprod loop (c10::complex<double> acc *= x, the textbook
 * product with eager's fused multiply-adds, from 1 + 0i, each result rounded to the output's
 * parts), so that infinities and
 * NaNs come out as eager's sequential loop gives them (a pairwise tree gives other NaN
 * patterns: (0.5+0.5i)(2-i)(inf+0i) is inf+inf i left to right, inf+NaN i from the right);
 * kScanProdOwn: the same in the element's own precision (eager's prod reduction loop).
 * logcumsumexp: eager's CPU loop exactly: in std::complex<double> (acc_type of complex64 and
 * complex128), acc = log_add_exp(x_j, acc) from -inf + 0i, each result rounded to the
 * output's parts. log_add_exp is ATen's _log_add_exp_helper (LogAddExp.h): the operand with
 * the smaller real part is `min` (ties: the running value), NaN anywhere gives NaN + NaN i,
 * two equal infinite real parts -inf: min, +inf: log(exp(min) + exp(max)), else
 * log1p(exp(min - max)) + max with c10's CPU complex log1p (numpy's) and division (Smith's,
 * numpy's); products and sums written out as c10's (textbook). */
using cd = std::complex<double>;
inline bool cnan(cd z) { return std::isnan(z.real()) || std::isnan(z.imag()); }
inline cd cmul(cd x, cd y) {
  return {x.real() * y.real() - x.imag() * y.imag(), x.real() * y.imag() + x.imag() * y.real()};
}
inline cd cdiv(cd x, cd y) {
  const double a = x.real(), b = x.imag(), c = y.real(), d = y.imag();
  if (std::abs(c) >= std::abs(d)) {
    if (c == 0 && d == 0) return {a / std::abs(c), b / std::abs(d)};
    const double rat = d / c, scl = 1.0 / (c + d * rat);
    return {(a + b * rat) * scl, (b - a * rat) * scl};
  }
  const double rat = c / d, scl = 1.0 / (d + c * rat);
  return {(a * rat + b) * scl, (b * rat - a) * scl};
}
inline cd clog1p(cd z) {
  const cd u = {z.real() + 1.0, z.imag()};
  if (u.real() == 1.0 && u.imag() == 0.0) return z;
  const cd lu = std::log(u), um1 = {u.real() - 1.0, u.imag()};
  if (um1 == z) return lu;
  return cmul(lu, cdiv(z, um1));
}
inline cd log_add_exp(cd x, cd y) {
  cd mn = y, mx = x;
  if (cnan(y)) mx = y;
  else if (cnan(x)) mn = x;
  else if (x.real() < y.real()) mn = x, mx = y;
  if (cnan(mn)) return {NAN, NAN};
  if (!std::isfinite(mn.real()) && mn.real() == mx.real()) {
    if (mn.real() < 0) return mn;
    const cd a = std::exp(mn), b = std::exp(mx);
    return std::log(cd{a.real() + b.real(), a.imag() + b.imag()});
  }
  const cd l = clog1p(std::exp(cd{mn.real() - mx.real(), mn.imag() - mx.imag()}));
  return {l.real() + mx.real(), l.imag() + mx.imag()};
}
template <class C>
int scan_complex(kr::Err &e, const char *where, C *out, int64_t kind, View<C> x) {
  using P = decltype(C::re);
  const int64_t rows = rows_of(x), n = row_len(x), s = row_stride(x);
  if (kind == kScanProd || kind == kScanProdOwn) {
    kr::parallel_for(rows, rows > 1 && rows * n > 4096 ? kr::max_threads() : 1, [&](int64_t r0_, int64_t r1_) {
    for (int64_t r = r0_; r < r1_; ++r) {
      const C *row = x.data + x.offset(r, x.rank - 1);
      double ar = 1.0, ai = 0.0;  // kScanProd: c10::complex<double> acc
      P pr = 1, pi = 0;           // kScanProdOwn: the element's own type
      for (int64_t j = 0; j < n; ++j) {
        const C v = row[j * s];
        // eager's c10::complex operator*= as GCC contracts it in torch's CPU kernels
        // (-ffp-contract=fast, FMA): re = fma(a, c, -(b d)), im = fma(a, d, b c); with a
        // cancelling sum the residue decides whether a later inf gives inf or NaN
        if (kind == kScanProd) {
          const double c = v.re, d = v.im, a = ar, b = ai;
          ar = std::fma(a, c, -(b * d));
          ai = std::fma(a, d, b * c);
          out[r * n + j] = C{static_cast<P>(ar), static_cast<P>(ai)};
        } else {
          const P a = pr, b = pi;
          pr = std::fma(a, v.re, -(b * v.im));
          pi = std::fma(a, v.im, b * v.re);
          out[r * n + j] = C{pr, pi};
        }
      }
    }
    });
    return 0;
  }
  if (kind != kScanLogSumExp) return e.fail("%s: complex scan of kind %lld", where, (long long)kind);
  kr::parallel_for(rows, rows > 1 && rows * n > 4096 ? kr::max_threads() : 1, [&](int64_t r0_, int64_t r1_) {
  for (int64_t r = r0_; r < r1_; ++r) {
    const C *row = x.data + x.offset(r, x.rank - 1);
    cd acc = {-INFINITY, 0.0};
    for (int64_t j = 0; j < n; ++j) {
      acc = log_add_exp(cd{double(row[j * s].re), double(row[j * s].im)}, acc);
      out[r * n + j] = C{static_cast<decltype(C::re)>(acc.real()),
                         static_cast<decltype(C::im)>(acc.imag())};
    }
  }
  });
  return 0;
}
inline int scan(kr::Err &e, const char *where, kr_complex64 *out, int64_t kind, View<kr_complex64> x) {
  return scan_complex(e, where, out, kind, x);
}
inline int scan(kr::Err &e, const char *where, kr_complex128 *out, int64_t kind, View<kr_complex128> x) {
  return scan_complex(e, where, out, kind, x);
}

/* nonzero: the coordinates of x's true elements in row-major order, one row of x.rank int64s
 * each. `count` holds the number of true elements, counted by the program before the call:
 * its value bound the output's data-dependent row count (a read_size), so a mismatch is an
 * error, never a write past the output. */
inline int nonzero(kr::Err &e, const char *where, int64_t *out, View<bool> x,
                   View<int64_t> count) {
  const int R = x.rank;
  const int64_t total = x.numel(), want = count.data[0];
  std::vector<int64_t> c(static_cast<size_t>(R > 0 ? R : 1), 0);
  int64_t k = 0;
  for (int64_t p = 0; p < total; ++p) {
    if (x.at(p)) {
      if (k < want)
        for (int d = 0; d < R; ++d) out[k * R + d] = c[d];
      ++k;
    }
    for (int d = R - 1; d >= 0; --d) {  // the next coordinate in row-major order
      if (++c[d] < x.size(d)) break;
      c[d] = 0;
    }
  }
  if (k != want)
    return e.fail("%s: nonzero found %lld elements where the count said %lld", where,
                  (long long)k, (long long)want);
  return 0;
}

/* masked_scatter: out = self; the positions where `mask` (broadcast to self's shape) is true
 * take the elements of `source` one after another, in row-major order. */
template <class T>
int masked_scatter(kr::Err &e, const char *where, T *out, View<T> self, View<bool> mask,
                   View<T> source) {
  const int64_t total = self.numel(), avail = source.numel();
  int64_t k = 0;
  for (int64_t p = 0; p < total; ++p) {
    if (mask.at(p)) {
      if (k >= avail) {
        return e.fail("%s: the mask selects more elements than source has (%lld)", where,
                      (long long)avail);
      }
      out[p] = source.at(k++);
    } else {
      out[p] = self.at(p);
    }
  }
  return 0;
}

enum BagMode : int64_t { kBagSum = 0, kBagMean = 1, kBagMax = 2 };

/* embedding_bag: bag b sums / averages / takes the max of weight rows indices[offsets[b] ..
 * offsets[b+1]) (the last bag ends at the end of `indices` unless include_last_offset),
 * skipping padding_idx (-1: none); empty bags give zeros. max takes a bag's first row, then
 * each greater one (eager's CPU and CUDA kernels: a NaN counts only where it comes first).
 * Bags run in parallel. */
template <class T, class I>
int embedding_bag_weighted(kr::Err &e, const char *where, T *out, int64_t mode,
                           bool include_last_offset, int64_t padding_idx, View<T> weight,
                           View<I> indices, View<I> offsets, const View<T> *psw) {
  const int64_t n = indices.numel(), nw = weight.size(0), D = weight.size(1);
  const int64_t bags = offsets.numel() - (include_last_offset ? 1 : 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = static_cast<int64_t>(indices.at(i));
    if (id < 0 || id >= nw)
      return e.fail("index out of range in %s: index %lld is out of bounds for dim 0 of size "
                    "%lld", where, (long long)id, (long long)nw);
  }
  for (int64_t b = 0; b < offsets.numel(); ++b) {
    const int64_t o = static_cast<int64_t>(offsets.at(b));
    if (o < 0 || o > n || (b > 0 && o < static_cast<int64_t>(offsets.at(b - 1))))
      return e.fail("%s: offsets[%lld] = %lld is not in [offsets[%lld], %lld]", where,
                    (long long)b, (long long)o, (long long)(b > 0 ? b - 1 : 0), (long long)n);
  }
  kr::parallel_for(bags, bags * D > 4096 ? kr::max_threads() : 1, [&](int64_t b0_, int64_t b1_) {
  for (int64_t b = b0_; b < b1_; ++b) {
    const int64_t lo = static_cast<int64_t>(offsets.at(b));
    const int64_t hi = b + 1 < offsets.numel() ? static_cast<int64_t>(offsets.at(b + 1)) : n;
    T *o = out + b * D;
    int64_t used = 0;
    for (int64_t c = 0; c < D; ++c) o[c] = mode == kBagMax ? kr::lowest<T>() : T(0);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t id = static_cast<int64_t>(indices.at(i));
      if (id == padding_idx) continue;
      ++used;
      const T scale = psw ? psw->at(i) : T(1);
      for (int64_t c = 0; c < D; ++c) {
        const T w = weight.data[id * weight.stride(0) + c * weight.stride(1)];
        if (mode == kBagMax) o[c] = used == 1 || w > o[c] ? w : o[c];  // (eager's NaNs)
        else o[c] += psw ? w * scale : w;
      }
    }
    if (used == 0)
      for (int64_t c = 0; c < D; ++c) o[c] = T(0);
    else if (mode == kBagMean)
      for (int64_t c = 0; c < D; ++c) o[c] /= static_cast<T>(used);
  }
  });
  return 0;
}

template <class T, class I>
int embedding_bag(kr::Err &e, const char *where, T *out, int64_t mode, bool include_last_offset,
                  int64_t padding_idx, View<T> weight, View<I> indices, View<I> offsets) {
  return embedding_bag_weighted(e, where, out, mode, include_last_offset, padding_idx, weight,
                                indices, offsets, static_cast<const View<T> *>(nullptr));
}

template <class T, class I>
int embedding_bag(kr::Err &e, const char *where, T *out, int64_t mode, bool include_last_offset,
                  int64_t padding_idx, View<T> weight, View<I> indices, View<I> offsets,
                  View<T> per_sample_weights) {
  return embedding_bag_weighted(e, where, out, mode, include_last_offset, padding_idx, weight,
                                indices, offsets, &per_sample_weights);
}

}  // namespace kl

#include "kiln_conv.h"  // the direct convolution (declarations; conv.cpp compiles the code)
#include "kiln_qgemm.h"  // quantised / bf16 weight GEMMs (declarations; qgemm.cpp compiles them)
#include "kiln_attention.h"  // fused attention (declarations; attention.cpp compiles them)

#endif
