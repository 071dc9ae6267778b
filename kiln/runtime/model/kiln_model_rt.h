/* kiln_model_rt.h - support code compiled into every generated model.so (namespace kr):
 * error reporting, input validation against the export's promises, output allocation as
 * DLManagedTensor, the arena, and the BLAS GEMM wrapper. */
#ifndef KILN_MODEL_RT_H
#define KILN_MODEL_RT_H
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "dlpack.h"

#ifndef KILN_COMPLEX_TYPES  // also in kiln_kernels.h: complex elements, stored and moved only
#define KILN_COMPLEX_TYPES
struct kr_complex32 { unsigned short re, im; };  // two float16 bit patterns (torch.chalf)
struct kr_complex64 { float re, im; };
struct kr_complex128 { double re, im; };
#endif
#include "kiln_model_abi.h"
#include "kiln_kernels.h"
#include "kiln_gemm.h"

#ifdef KILN_WITH_BLAS
extern "C" {
#include <cblas.h>
}
#endif
#include "kiln_pool.h"  // kiln's own thread pool (no OpenMP runtime)

namespace kr {

// The clock of the per-step profiling hooks (kiln_model_prof in kiln_model_abi.h), in ns.
inline uint64_t prof_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
}

struct Err {
  char *buf;
  size_t len;
  int fail(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
    if (buf && len) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(buf, len, fmt, ap);
      va_end(ap);
    }
    return 1;
  }
};

inline const char *dtype_name(DLDataType t) {
  if (t.lanes != 1) return "vector";
  switch (t.code) {
    case kDLFloat: return t.bits == 32 ? "float32" : t.bits == 64 ? "float64" :
                          t.bits == 16 ? "float16" : "float?";
    case kDLInt: return t.bits == 64 ? "int64" : t.bits == 32 ? "int32" : t.bits == 16 ? "int16"
                        : t.bits == 8 ? "int8" : "int?";
    case kDLUInt: return t.bits == 8 ? "uint8" : "uint?";
    case kDLBool: return "bool";
    case kDLBfloat: return "bfloat16";
    case kDLFloat8_e4m3fn: return t.bits == 8 ? "float8_e4m3fn" : "float8?";
    case kDLFloat8_e5m2: return t.bits == 8 ? "float8_e5m2" : "float8?";
    case kDLFloat8_e4m3fnuz: return t.bits == 8 ? "float8_e4m3fnuz" : "float8?";
    case kDLFloat8_e5m2fnuz: return t.bits == 8 ? "float8_e5m2fnuz" : "float8?";
    case kDLComplex: return t.bits == 64 ? "complex64" : t.bits == 128 ? "complex128" : "complex?";
    default: return "unknown";
  }
}

inline const char *device_name(int type) {
  switch (type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    default: return "other";
  }
}

/* Checks shared by every input: present, dtype, device, rank, data pointer. */
inline int check_tensor(Err &e, const DLTensor *t, int idx, const char *name, uint8_t code,
                        uint8_t bits, int32_t ndim) {
  if (!t) return e.fail("input %d (%s): is NULL", idx, name);
  if (t->device.device_type != kDLCPU)
    return e.fail("input %d (%s): expected device cpu, got %s", idx, name,
                  device_name(t->device.device_type));
  if (t->dtype.code != code || t->dtype.bits != bits || t->dtype.lanes != 1) {
    DLDataType want{code, bits, 1};
    return e.fail("input %d (%s): expected dtype %s, got %s", idx, name, dtype_name(want),
                  dtype_name(t->dtype));
  }
  if (t->ndim != ndim)
    return e.fail("input %d (%s): expected %d dimensions, got %d", idx, name, ndim, t->ndim);
  if (ndim > 0 && !t->shape) return e.fail("input %d (%s): shape is NULL", idx, name);
  int64_t bytes = bits / 8 ? bits / 8 : 1;
  for (int d = 0; d < ndim; ++d) {
    if (t->shape[d] < 0)
      return e.fail("input %d (%s): size of dim %d is negative (%lld)", idx, name, d,
                    (long long)t->shape[d]);
    // every later computation (numel, strides, byte sizes) is then free of overflow
    if (__builtin_mul_overflow(bytes, t->shape[d], &bytes))
      return e.fail("input %d (%s): shape overflows: the size in bytes of dims 0..%d exceeds "
                    "2^63 (dim %d is %lld)", idx, name, d, d, (long long)t->shape[d]);
  }
  return 0;
}

inline int64_t numel(const DLTensor *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->shape[d];
  return n;
}

/* Row-major contiguity (size-1 dims may have any stride; NULL strides mean compact). */
inline int check_contiguous(Err &e, const DLTensor *t, int idx, const char *name) {
  if (!t->strides || numel(t) == 0) return 0;  // zero-size: no element, any strides
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; --d) {
    if (t->shape[d] != 1 && t->strides[d] != expect)
      return e.fail("input %d (%s): expected contiguous strides, got stride %lld for dim %d "
                    "(expected %lld); call .contiguous() first", idx, name,
                    (long long)t->strides[d], d, (long long)expect);
    expect *= t->shape[d];
  }
  return 0;
}

inline int check_data(Err &e, const DLTensor *t, int idx, const char *name, size_t align) {
  if (numel(t) > 0 && !t->data) return e.fail("input %d (%s): data is NULL", idx, name);
  uintptr_t p = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  if (numel(t) > 0 && p % align != 0)
    return e.fail("input %d (%s): data pointer is not aligned to %zu bytes", idx, name, align);
  return 0;
}

template <class T> inline const T *data_of(const DLTensor *t) {
  return reinterpret_cast<const T *>(static_cast<const char *>(t->data) + t->byte_offset);
}

struct OutputBox {
  DLManagedTensor managed;
  int64_t shape[8];
  size_t bytes;  // allocated (rounded) size of the data block
};

/* Freed output blocks of at least 64 KiB, kept for the next output of the same size: a fresh
 * large allocation comes from new pages, and faulting them in cost more than the kernels that
 * fill them (16 MiB: ~4,000 page faults per run). Bounded (16 blocks, 1 GiB); shared by the
 * instances of one model library; never destroyed, so a tensor freed during process exit
 * still finds it. */
struct OutputPool {
  std::mutex mu;
  std::vector<std::pair<size_t, void *>> blocks;
  size_t held = 0;
  void *take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i].first == bytes) {
        void *p = blocks[i].second;
        blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
        held -= bytes;
        return p;
      }
    }
    return nullptr;
  }
  void give(size_t bytes, void *p) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (bytes >= (size_t(1) << 16) && blocks.size() < 16 && held + bytes <= (size_t(1) << 30)) {
        blocks.emplace_back(bytes, p);
        held += bytes;
        return;
      }
    }
    std::free(p);
  }
};

inline OutputPool &output_pool() {
  static OutputPool *pool = new OutputPool();  // intentionally never freed (see above)
  return *pool;
}

inline void free_output(DLManagedTensor *m) {
  if (!m) return;
  OutputBox *box = static_cast<OutputBox *>(m->manager_ctx);
  output_pool().give(box->bytes, m->dl_tensor.data);
  delete box;
}

/* A fresh contiguous CPU tensor the caller owns (64-byte aligned; never NULL data). */
inline DLManagedTensor *new_output(Err &e, uint8_t code, uint8_t bits, int32_t ndim,
                                   const int64_t *shape) {
  OutputBox *box = new (std::nothrow) OutputBox();
  if (!box || ndim > 8) { delete box; e.fail("out of memory allocating an output"); return nullptr; }
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) { box->shape[d] = shape[d]; n *= shape[d]; }
  size_t bytes = static_cast<size_t>(n) * (bits / 8);
  size_t rounded = bytes ? (bytes + 63) / 64 * 64 : 64;
  void *data = output_pool().take(rounded);
  if (!data) data = std::aligned_alloc(64, rounded);
  box->bytes = rounded;
  if (!data) { delete box; e.fail("out of memory allocating %zu bytes for an output", bytes); return nullptr; }
  DLTensor &t = box->managed.dl_tensor;
  t.data = data;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = DLDataType{code, bits, 1};
  t.shape = box->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  box->managed.manager_ctx = box;
  box->managed.deleter = free_output;
  return &box->managed;
}

/* Options(check_finite=True): the first non-finite value a step wrote fails the run. */
template <class T>
inline int check_finite(Err &e, const T *p, int64_t n, const char *buf, const char *source) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(static_cast<double>(p[i]))) {
      return e.fail("check_finite: %s[%lld] is %g (buffer %s, from %s)", buf, (long long)i,
                    static_cast<double>(p[i]), buf, source);
    }
  }
  return 0;
}

/* Arena: one 64-byte aligned block per instance, grown when a larger plan needs it. */
struct Arena {
  char *base = nullptr;
  size_t cap = 0;
  bool reserve(size_t bytes) {
    if (bytes <= cap) return true;
    size_t rounded = (bytes + 63) / 64 * 64;
    char *p = static_cast<char *>(std::aligned_alloc(64, rounded));
    if (!p) return false;
    std::free(base);
    base = p;
    cap = rounded;
    return true;
  }
  ~Arena() { std::free(base); }
};

/* Buffers sized by a data-dependent size without an upper bound (`x.item()` with no
 * torch._check(x <= N), repeat_interleave's length): allocated during a run once the size is
 * known, outside the arena, and freed at their last use or when the run returns (any path). */
struct HeapBuffers {
  void *held[64] = {};
  int n = 0;
  void *alloc(Err &e, const char *name, int64_t bytes) {
    size_t rounded = (static_cast<size_t>(bytes > 0 ? bytes : 0) + 63) / 64 * 64;
    void *p = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!p) { e.fail("out of memory allocating %s (%lld bytes)", name, (long long)bytes); return nullptr; }
    for (int i = 0; i < n; ++i)
      if (!held[i]) { held[i] = p; return p; }
    if (n == 64) { std::free(p); e.fail("more than 64 run-time buffers live at once (%s)", name); return nullptr; }
    held[n++] = p;
    return p;
  }
  void release(void *p) {
    for (int i = 0; i < n; ++i)
      if (held[i] == p) { std::free(p); held[i] = nullptr; return; }
  }
  ~HeapBuffers() { for (int i = 0; i < n; ++i) std::free(held[i]); }
};

/* One row-major GEMM operand layout (transpose flag, leading dimension) for BLAS and cuBLAS:
 * false when it is not expressible. */
inline bool blas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, bool *trans,
                        int64_t *ld) {
  if ((cs == 1 || cols == 1) && (rs >= cols || rows == 1)) {
    *trans = false;
    *ld = rows == 1 ? (cols > 0 ? cols : 1) : rs;
    if (*ld < cols) *ld = cols;
    return true;
  }
  if ((rs == 1 || rows == 1) && (cs >= rows || cols == 1)) {
    *trans = true;
    *ld = cols == 1 ? (rows > 0 ? rows : 1) : cs;
    if (*ld < rows) *ld = rows;
    return true;
  }
  return false;
}

#ifdef KILN_WITH_BLAS
/* One single-threaded BLAS call on a block (row-major C with leading dimension ldc). */
template <class T>
inline void gemm_block(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T *a,
                       int64_t lda, const T *b, int64_t ldb, T *c, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = T(0);
    return;
  }
  if constexpr (sizeof(T) == 4)
    scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                      (int)M, (int)N, (int)K, 1.0f, a, (int)lda, b, (int)ldb, 0.0f, c, (int)ldc);
  else
    scipy_cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                      (int)M, (int)N, (int)K, 1.0, a, (int)lda, b, (int)ldb, 0.0, c, (int)ldc);
}

/* BLAS runs single-threaded inside kiln's thread pool (kiln_pool.h): a second thread pool
 * (OpenBLAS's own) competing for the same cores made GEMMs several times slower. Called once per model. */
inline void blas_single_threaded() { scipy_openblas_set_num_threads(1); }
#endif

/* C[b][m][n] = A[b][m][k] * B[b][k][n] over up to two batch dims, C contiguous. Work is split
 * over OpenMP threads by batch when there are enough batches, else by rows of C, else by
 * columns; `block(M', N', K, a, ar, ac, b, br, bc, c, ldc)` computes one single-threaded part.
 * `epi(r0, r1, c0, c1)` (a fused epilogue, kiln/gemm/fuse_cpu.py) then rewrites that part in
 * place while it is in cache: rows [r0, r1) of C seen as [nb * M][N], columns [c0, c1). */
template <class T, class Block, class Epi = NoEpilogue>
inline void gemm_split(int64_t nb0, int64_t nb1, int64_t M, int64_t N, int64_t K, const T *A,
                       int64_t as0, int64_t as1, int64_t ar, int64_t ac, const T *B, int64_t bs0,
                       int64_t bs1, int64_t br, int64_t bc, T *C, Block block, Epi epi = {}) {
  const int64_t nb = nb0 * nb1;
  int threads = 1;
  if (static_cast<double>(nb) * M * N * K >= 262144.0) threads = max_threads();
  // element (m, k) of A sits at m*ar + k*ac in either layout, so sub-blocks are pointer offsets
  const bool by_rows = M >= N;
  const int64_t parts_mn = nb < threads ? std::max<int64_t>(1, std::min<int64_t>(
                                              threads, by_rows ? M : N)) : 1;
  // (batch, part) pairs flattened, static schedule over the team
  parallel_for(nb * parts_mn, threads, [&](int64_t f0, int64_t f1) {
  for (int64_t f = f0; f < f1; ++f) {
    {
      const int64_t bi = f / parts_mn, p = f % parts_mn;
      const int64_t b0 = bi / nb1, b1 = bi % nb1;
      const T *a = A + b0 * as0 + b1 * as1;
      const T *bb = B + b0 * bs0 + b1 * bs1;
      T *c = C + bi * M * N;
      const int64_t len = by_rows ? M : N;
      const int64_t lo = len * p / parts_mn, hi = len * (p + 1) / parts_mn;
      if (by_rows) {
        block(hi - lo, N, K, a + lo * ar, ar, ac, bb, br, bc, c + lo * N, N);
        epi(bi * M + lo, bi * M + hi, int64_t(0), N);
      } else {
        block(M, hi - lo, K, a, ar, ac, bb + lo * bc, br, bc, c + lo, N);
        epi(bi * M, bi * M + M, lo, hi);
      }
    }
  }
  });
}

/* The "cpp" backend: kiln's register-blocked GEMM (kiln_gemm.h) with the tile the autotuner
 * chose; takes any operand strides. */
template <class T, int MR, int NV, int KC, int NC, class Epi = NoEpilogue>
inline int gemm_cpp(int64_t nb0, int64_t nb1, int64_t M, int64_t N, int64_t K, const T *A,
                    int64_t as0, int64_t as1, int64_t ar, int64_t ac, const T *B, int64_t bs0,
                    int64_t bs1, int64_t br, int64_t bc, T *C, Epi epi = {}) {
  gemm_split<T>(nb0, nb1, M, N, K, A, as0, as1, ar, ac, B, bs0, bs1, br, bc, C,
                ukr_gemm_block<T, MR, NV, KC, NC>, epi);
  return 0;
}

/* The "cpp" backend with a prepacked constant B (kiln_gemm.h, `packed_block`): `Bp` holds
 * the panels of the one B every batch element shares. Work is split over kiln's pool by panels
 * of N (each thread streams its share of B once), or by rows of C when N has too few panels to
 * go round and M has enough row blocks. Each part is further cut into row groups (tasks of
 * parallel_for, which runs a member's own tasks in order and lets a member that finished take
 * the tasks left at the back of another's share): when the OS deschedules one member (a
 * loaded machine), the others finish its rows instead of waiting for it. Cutting rows costs
 * nothing where one K block covers K (the row loop is the same); with several K blocks a
 * group re-reads its panels' B, so rows are cut only while that share of B fits in L2
 * (512 KiB), else a part stays whole (the schedule before). A part of 4 row tiles or more
 * runs in BLIS order (`packed_block_cols`, the next panel's K block prefetched), others row
 * tile outer (`packed_block`). Order forces one (tests, bench/gemm_packed_ab.cpp): 1 row tile
 * outer, 2 BLIS order without the prefetch, 3 BLIS order. */
template <class T, int NR, int MR, int KC, int Order = 0, class Epi = NoEpilogue>
inline int gemm_cpp_packed(int64_t nb0, int64_t nb1, int64_t M, int64_t N, int64_t K,
                           const T *A, int64_t as0, int64_t as1, int64_t ar, int64_t ac,
                           const T *Bp, T *C, Epi epi = {}) {
  const int64_t nb = nb0 * nb1, P = (N + NR - 1) / NR;
  int threads = 1;
  if (static_cast<double>(nb) * M * N * K >= 262144.0) threads = max_threads();
  const int64_t blocks = (M + MR - 1) / MR;
  const bool by_rows = P < 2 * threads && M >= 2 * MR * threads;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, by_rows ? blocks : P));
  // row groups per (part, batch element): up to 8 for the split by panels, so that a share
  // of parallel_for (one part) has pieces to take; by rows, the row blocks themselves
  const int64_t share_b = (P + parts - 1) / parts * NR * K * int64_t(sizeof(T));
  const bool cut = threads > 1 && (K <= KC || share_b <= (int64_t(512) << 10));
  const int64_t groups = by_rows ? blocks : (cut ? std::min<int64_t>(blocks, 8) : 1);
  const int64_t row_parts = by_rows ? 1 : parts;  // parts along N
  const int64_t tasks = row_parts * nb * groups;
  // one K block for the whole GEMM, chosen from all its rows: each row's sums then run in the
  // same order whichever thread, row group or loop order computes it (results independent of
  // the thread count; tests/targets/cpu/test_pool.py, tests/gemm/test_gemm_packed_cols.py).
  // At most MR rows: the whole K at once. (Chosen from a row group's rows instead, a GEMM of
  // more rows cut into groups of MR at 2 threads summed K in one block there and in KC blocks
  // at 1 thread: mlp's 64x256x1024 differed by 3e-7 between the two.)
  const int64_t kcg = M <= MR ? K : Order == 1 ? KC : packed_cols_kc<T, NR, MR, KC>(M);
  parallel_for(tasks, int(std::min<int64_t>(threads, tasks)), [&](int64_t t0, int64_t t1) {
    static thread_local std::vector<T> apack;
    apack.resize(static_cast<size_t>(packed_apack_size<MR, KC>(M, K)));
    for (int64_t t = t0; t < t1;) {
      // the run of tasks [t, e) of one (part, batch element): contiguous row groups
      const int64_t part = t / (nb * groups), bi = (t / groups) % nb, g0 = t % groups;
      const int64_t e = std::min(t1, t - g0 + groups);
      const int64_t lo = std::min(M, blocks * g0 / groups * MR),
                    hi = std::min(M, blocks * (g0 + e - t) / groups * MR);
      t = e;
      if (lo >= hi) continue;
      const T *a = A + (bi / nb1) * as0 + (bi % nb1) * as1;
      T *c = C + bi * M * N;
      const int64_t r0 = bi * M + lo;
      const int64_t p0 = by_rows ? 0 : P * part / parts, p1 = by_rows ? P : P * (part + 1) / parts;
      // not inlined: the fused epilogue's body (e.g. an exact GELU) compiled once per GEMM,
      // not once per loop order calling it
      auto rows_epi = [&](int64_t i0, int64_t i1, int64_t j0, int64_t j1)
                          __attribute__((noinline)) { epi(r0 + i0, r0 + i1, j0, j1); };
      // BLIS order with the next panel prefetched (Order 0) from 4 row tiles up: at 2 threads
      // on the device's Xeon 0.75-0.93 of packed_block's time at M = 64 / 128 with the weight
      // read from L3 or memory (as in a model), 0.84-1.04 with one weight cached from the
      // call before (BENCHMARKS.md, s13gemm; without the prefetch 0.94 at 64x1024x1024 cached
      // but 0.91-1.05 from L3 / memory); below
      // that (a GEMV, M = 16 with its 4-row tail, the row groups cut for 2 threads)
      // packed_block, which reads B once per row tile and its tail 3 panels at once
      const bool cols = Order >= 2 || (Order == 0 && hi - lo >= 4 * MR);
      if (cols)
        packed_block_cols<T, NR, MR, KC>(hi - lo, N, K, a + lo * ar, ar, ac, Bp, p0, p1,
                                         c + lo * N, N, apack.data(), rows_epi, Order != 2, kcg);
      else
        packed_block<T, NR, MR, KC>(hi - lo, N, K, a + lo * ar, ar, ac, Bp, p0, p1, c + lo * N,
                                    N, apack.data(), rows_epi, kcg);
    }
  });
  return 0;
}

#ifdef KILN_WITH_BLAS
/* The "blas" backend: OpenBLAS on each part (operands must be BLAS-expressible). */
template <class T>
inline int gemm(Err &e, const char *name, int64_t nb0, int64_t nb1, int64_t M, int64_t N,
                int64_t K, const T *A, int64_t as0, int64_t as1, int64_t ar, int64_t ac,
                const T *B, int64_t bs0, int64_t bs1, int64_t br, int64_t bc, T *C) {
  bool ta, tb;
  int64_t lda, ldb;
  if (!blas_layout(M, K, ar, ac, &ta, &lda) || !blas_layout(K, N, br, bc, &tb, &ldb))
    return e.fail("%s: operand layout not supported by BLAS", name);
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX)
    return e.fail("%s: matrix too large for 32-bit BLAS", name);
  gemm_split<T>(nb0, nb1, M, N, K, A, as0, as1, ar, ac, B, bs0, bs1, br, bc, C,
                [=](int64_t m, int64_t n, int64_t k, const T *a, int64_t, int64_t, const T *b,
                    int64_t, int64_t, T *c, int64_t ldc) {
                  gemm_block<T>(ta, tb, m, n, k, a, lda, b, ldb, c, ldc);
                });
  return 0;
}
#endif

}  // namespace kr
#endif
