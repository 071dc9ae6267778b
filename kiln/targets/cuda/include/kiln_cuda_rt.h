/* kiln_cuda_rt.h - support code compiled into every generated CUDA model.so (namespace kc).
 *
 * Input: the CUDA driver (libcuda.so.1) and cuBLAS (libcublas.so.{13,12,11}, or $KILN_CUBLAS),
 * both opened with dlopen when a model instance is created, never linked: a package builds and
 * links on a machine without CUDA (only cuda.h is needed, for types). Output: function tables
 * with error strings, input checks for device tensors, device outputs as DLManagedTensor
 * (kDLCUDA), the device arena, kernel launches, the cuBLAS GEMM wrapper and the cuBLASLt one
 * (8-bit float / int8 GEMMs, and float GEMMs whose algorithm max_autotune picked; libcublasLt
 * opened the same way).
 *
 * Invariants: every function returns 0 on success or non-zero with a message in Err; nothing
 * throws. Outputs come from a memory pool per device (output_pool) and are freed stream-ordered
 * on the stream that produced them (keep that stream alive while the outputs live); they stay
 * valid after the instance is destroyed.
 * Row-major GEMMs call column-major cuBLAS as C^T = B^T A^T, so no operand is copied. */
#ifndef KILN_CUDA_RT_H
#define KILN_CUDA_RT_H
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>

#include <cuda.h>

#include "kiln_model_rt.h"

namespace kc {
using kr::Err;

#define KC_FN(name) decltype(&::name) name = nullptr
struct Driver {
  const char *error = nullptr;
  KC_FN(cuInit); KC_FN(cuDeviceGet); KC_FN(cuDeviceGetCount); KC_FN(cuDeviceGetAttribute);
  KC_FN(cuDevicePrimaryCtxRetain); KC_FN(cuDevicePrimaryCtxRelease); KC_FN(cuCtxPushCurrent);
  KC_FN(cuCtxPopCurrent); KC_FN(cuModuleLoadData); KC_FN(cuModuleGetFunction);
  KC_FN(cuModuleUnload); KC_FN(cuFuncSetAttribute); KC_FN(cuLaunchKernel); KC_FN(cuMemAlloc);
  KC_FN(cuMemFree); KC_FN(cuMemcpyHtoD); KC_FN(cuMemcpyDtoHAsync); KC_FN(cuMemsetD8Async);
  KC_FN(cuMemsetD32Async); KC_FN(cuStreamSynchronize); KC_FN(cuGetErrorString);
  KC_FN(cuMemPoolCreate); KC_FN(cuMemPoolDestroy); KC_FN(cuMemPoolSetAttribute);
  KC_FN(cuMemAllocFromPoolAsync); KC_FN(cuMemFreeAsync); KC_FN(cuMemcpyDtoDAsync);
  KC_FN(cuStreamCreate); KC_FN(cuStreamDestroy); KC_FN(cuStreamBeginCapture);
  KC_FN(cuStreamEndCapture); KC_FN(cuGraphInstantiate); KC_FN(cuGraphLaunch);
  KC_FN(cuGraphDestroy); KC_FN(cuGraphExecDestroy); KC_FN(cuStreamIsCapturing);
  KC_FN(cuMemAllocHost); KC_FN(cuMemFreeHost); KC_FN(cuCtxSynchronize);
#if CUDA_VERSION >= 12000
  /* optional (null on drivers without it): launches with programmatic stream serialisation */
  KC_FN(cuLaunchKernelEx);
#endif
  int version = 0;  /* cuDriverGetVersion: 12030 = CUDA 12.3 */
};
#undef KC_FN

template <class F> inline bool sym(void *h, const char *name, F *out) {
  void *p = ::dlsym(h, name);
  std::memcpy(out, &p, sizeof p);
  return p != nullptr;
}

/* The driver table, loaded once per process (thread-safe static initialisation). */
inline const Driver &driver() {
  static const Driver d = [] {
    Driver t;
    void *h = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) { t.error = "cannot load libcuda.so.1 (no NVIDIA driver on this machine?)"; return t; }
#define KC_SYM(field, name) if (!sym(h, name, &t.field)) { t.error = "libcuda.so.1 lacks " name \
                                                           " (driver too old)"; return t; }
    KC_SYM(cuInit, "cuInit") KC_SYM(cuDeviceGet, "cuDeviceGet")
    KC_SYM(cuDeviceGetCount, "cuDeviceGetCount") KC_SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute")
    KC_SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
    KC_SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2")
    KC_SYM(cuCtxPushCurrent, "cuCtxPushCurrent_v2") KC_SYM(cuCtxPopCurrent, "cuCtxPopCurrent_v2")
    KC_SYM(cuModuleLoadData, "cuModuleLoadData") KC_SYM(cuModuleGetFunction, "cuModuleGetFunction")
    KC_SYM(cuModuleUnload, "cuModuleUnload") KC_SYM(cuFuncSetAttribute, "cuFuncSetAttribute")
    KC_SYM(cuLaunchKernel, "cuLaunchKernel") KC_SYM(cuMemAlloc, "cuMemAlloc_v2")
    KC_SYM(cuMemFree, "cuMemFree_v2") KC_SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2")
    KC_SYM(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2") KC_SYM(cuMemsetD8Async, "cuMemsetD8Async")
    KC_SYM(cuMemsetD32Async, "cuMemsetD32Async")
    KC_SYM(cuMemAllocHost, "cuMemAllocHost_v2") KC_SYM(cuMemFreeHost, "cuMemFreeHost")
    KC_SYM(cuCtxSynchronize, "cuCtxSynchronize")
    KC_SYM(cuStreamSynchronize, "cuStreamSynchronize")
    KC_SYM(cuGetErrorString, "cuGetErrorString") KC_SYM(cuMemPoolCreate, "cuMemPoolCreate")
    KC_SYM(cuMemPoolDestroy, "cuMemPoolDestroy")
    KC_SYM(cuMemPoolSetAttribute, "cuMemPoolSetAttribute")
    KC_SYM(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync")
    KC_SYM(cuMemFreeAsync, "cuMemFreeAsync")
    KC_SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2")
    KC_SYM(cuStreamCreate, "cuStreamCreate") KC_SYM(cuStreamDestroy, "cuStreamDestroy_v2")
    KC_SYM(cuStreamBeginCapture, "cuStreamBeginCapture_v2")
    KC_SYM(cuStreamEndCapture, "cuStreamEndCapture")
    KC_SYM(cuGraphInstantiate, "cuGraphInstantiateWithFlags")
    KC_SYM(cuGraphLaunch, "cuGraphLaunch") KC_SYM(cuGraphDestroy, "cuGraphDestroy")
    KC_SYM(cuGraphExecDestroy, "cuGraphExecDestroy")
    KC_SYM(cuStreamIsCapturing, "cuStreamIsCapturing")
#undef KC_SYM
#if CUDA_VERSION >= 12000
    sym(h, "cuLaunchKernelEx", &t.cuLaunchKernelEx);
#endif
    decltype(&::cuDriverGetVersion) version = nullptr;
    if (sym(h, "cuDriverGetVersion", &version)) version(&t.version);
    return t;
  }();
  return d;
}

/* Fails with "<what>: <driver message>" unless r is CUDA_SUCCESS. */
inline int check(Err &e, CUresult r, const char *what) {
  if (r == CUDA_SUCCESS) return 0;
  const char *s = nullptr;
  if (driver().cuGetErrorString) driver().cuGetErrorString(r, &s);
  return e.fail("%s: CUDA error %d (%s)", what, static_cast<int>(r), s ? s : "unknown");
}

/* cuBLAS, declared here (no cublas headers needed): handles are opaque, enums are ints. */
typedef void *cublasHandle_t;
struct Blas {
  const char *error = nullptr;
  int (*create)(cublasHandle_t *) = nullptr;
  int (*destroy)(cublasHandle_t) = nullptr;
  int (*set_stream)(cublasHandle_t, CUstream) = nullptr;
  int (*set_workspace)(cublasHandle_t, void *, size_t) = nullptr;
  int (*sgemm)(cublasHandle_t, int, int, int, int, int, const float *, const float *, int,
               long long, const float *, int, long long, const float *, float *, int, long long,
               int) = nullptr;
  int (*dgemm)(cublasHandle_t, int, int, int, int, int, const double *, const double *, int,
               long long, const double *, int, long long, const double *, double *, int,
               long long, int) = nullptr;
  /* cublasGemmStridedBatchedEx: mixed types (16-bit operands, float accumulation) */
  int (*gemm_ex)(cublasHandle_t, int, int, int, int, int, const void *, const void *, int, int,
                 long long, const void *, int, int, long long, const void *, void *, int, int,
                 long long, int, int, int) = nullptr;
};

/* 16-bit float storage types (host code never computes with them) and their cudaDataType. */
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };
template <class T> struct CudaType;
template <> struct CudaType<f16> { static constexpr int value = 2; };    /* CUDA_R_16F */
template <> struct CudaType<bf16> { static constexpr int value = 14; };  /* CUDA_R_16BF */
constexpr int kComputeF32 = 68;  /* CUBLAS_COMPUTE_32F: accumulate in float */
constexpr int kGemmDefault = -1; /* CUBLAS_GEMM_DEFAULT */

inline const Blas &blas() {
  static const Blas b = [] {
    Blas t;
    const char *names[] = {std::getenv("KILN_CUBLAS"), "libcublas.so.13", "libcublas.so.12",
                           "libcublas.so.11", "libcublas.so"};
    void *h = nullptr;
    for (const char *n : names)
      if (n && *n && (h = ::dlopen(n, RTLD_NOW | RTLD_LOCAL))) break;
    if (!h) {
      t.error = "cannot load cuBLAS (tried $KILN_CUBLAS, libcublas.so.13/.12/.11): put its "
                "directory on LD_LIBRARY_PATH, set KILN_CUBLAS, or import torch first";
      return t;
    }
    if (!sym(h, "cublasCreate_v2", &t.create) || !sym(h, "cublasDestroy_v2", &t.destroy) ||
        !sym(h, "cublasSetStream_v2", &t.set_stream) ||
        !sym(h, "cublasSetWorkspace_v2", &t.set_workspace) ||
        !sym(h, "cublasSgemmStridedBatched", &t.sgemm) ||
        !sym(h, "cublasDgemmStridedBatched", &t.dgemm) ||
        !sym(h, "cublasGemmStridedBatchedEx", &t.gemm_ex))
      t.error = "the cuBLAS library found lacks a needed function";
    return t;
  }();
  return b;
}

/* Makes ctx current for this scope and restores the previous one. */
struct CtxGuard {
  bool pushed = false;
  explicit CtxGuard(CUcontext ctx) {
    pushed = ctx && driver().cuCtxPushCurrent(ctx) == CUDA_SUCCESS;
  }
  ~CtxGuard() {
    CUcontext old;
    if (pushed) driver().cuCtxPopCurrent(&old);
  }
};

/* Checks shared by every input: present, on this instance's CUDA device, dtype, rank. */
inline int check_tensor(Err &e, const DLTensor *t, int idx, const char *name, uint8_t code,
                        uint8_t bits, int32_t ndim, int device_id) {
  if (!t) return e.fail("input %d (%s): is NULL", idx, name);
  if (t->device.device_type != kDLCUDA)
    return e.fail("input %d (%s): expected a tensor on device cuda:%d, got one on %s (this "
                  "model was loaded for cuda:%d)", idx, name, device_id,
                  kr::device_name(t->device.device_type), device_id);
  if (t->device.device_id != device_id)
    return e.fail("input %d (%s): expected a tensor on device cuda:%d, got one on cuda:%d", idx,
                  name, device_id, static_cast<int>(t->device.device_id));
  DLTensor host = *t;
  host.device.device_type = kDLCPU;  // the remaining checks are the CPU ones
  return kr::check_tensor(e, &host, idx, name, code, bits, ndim);
}

/* Kernels assume 16-byte aligned pointers (vector loads). */
inline int check_data(Err &e, const DLTensor *t, int idx, const char *name) {
  if (kr::numel(t) == 0) return 0;
  if (!t->data) return e.fail("input %d (%s): data is NULL", idx, name);
  uintptr_t p = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  if (p % 16 != 0)
    return e.fail("input %d (%s): data pointer is not 16-byte aligned (a view with an offset?); "
                  "pass a fresh tensor (.clone())", idx, name);
  return 0;
}

inline CUdeviceptr dptr(const DLTensor *t) {
  return reinterpret_cast<CUdeviceptr>(t->data) + t->byte_offset;
}

struct OutputBox {
  DLManagedTensor managed;
  int64_t shape[8];
  CUcontext ctx;
  CUstream stream;
};

inline void free_output(DLManagedTensor *m) {
  if (!m) return;
  OutputBox *box = static_cast<OutputBox *>(m->manager_ctx);
  if (m->dl_tensor.data) {
    CtxGuard g(box->ctx);
    driver().cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(m->dl_tensor.data), box->stream);
  }
  delete box;
}

/* The output pool of `device_id` for this library: created on first use and never destroyed
 * (freed outputs stay reserved for the next run, like a caching allocator). Destroying a
 * per-instance pool after CUDA graphs had written into its allocations crashed the driver
 * later (H100, driver 580), so the pool outlives every instance. */
inline int output_pool(Err &e, int device_id, CUmemoryPool *out) {
  static std::mutex mu;
  static CUmemoryPool pools[64] = {};
  if (device_id < 0 || device_id >= 64) return e.fail("device cuda:%d: too many devices", device_id);
  std::lock_guard<std::mutex> lock(mu);
  if (!pools[device_id]) {
    CUmemPoolProps props;
    std::memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = device_id;
    CUmemoryPool p = nullptr;
    cuuint64_t keep = ~cuuint64_t(0);  /* keep freed output memory for the next run */
    if (check(e, driver().cuMemPoolCreate(&p, &props), "creating the output pool")) return 1;
    if (check(e, driver().cuMemPoolSetAttribute(p, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep),
              "output pool")) {
      driver().cuMemPoolDestroy(p);
      return 1;
    }
    pools[device_id] = p;
  }
  *out = pools[device_id];
  return 0;
}

/* A fresh contiguous device tensor from `pool`, ordered on `stream`; the caller owns it. */
inline DLManagedTensor *new_output(Err &e, CUmemoryPool pool, CUcontext ctx, CUstream stream,
                                   int device_id, uint8_t code, uint8_t bits, int32_t ndim,
                                   const int64_t *shape) {
  OutputBox *box = new (std::nothrow) OutputBox();
  if (!box || ndim > 8) { delete box; e.fail("out of memory allocating an output"); return nullptr; }
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) { box->shape[d] = shape[d]; n *= shape[d]; }
  size_t bytes = static_cast<size_t>(n) * (bits / 8);
  CUdeviceptr p = 0;
  if (check(e, driver().cuMemAllocFromPoolAsync(&p, bytes ? bytes : 16, pool, stream),
            "allocating an output")) { delete box; return nullptr; }
  DLTensor &t = box->managed.dl_tensor;
  t.data = reinterpret_cast<void *>(p);
  t.device = DLDevice{kDLCUDA, device_id};
  t.ndim = ndim;
  t.dtype = DLDataType{code, bits, 1};
  t.shape = box->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  box->ctx = ctx;
  box->stream = stream;
  box->managed.manager_ctx = box;
  box->managed.deleter = free_output;
  return &box->managed;
}

/* A run that cannot be captured (it reads values on the host mid-run: `why`) fails clearly
 * when the caller's stream is capturing a CUDA graph, instead of a driver error mid-run. */
inline int refuse_capture(Err &e, CUstream stream, const char *why) {
  CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
  if (driver().cuStreamIsCapturing(stream, &cs) != CUDA_SUCCESS ||
      cs == CU_STREAM_CAPTURE_STATUS_NONE)
    return 0;
  return e.fail("this package cannot run while its stream is capturing a CUDA graph (%s); "
                "call it outside the capture", why);
}

/* Buffers sized by a data-dependent size without an upper bound (`x.item()` with no
 * torch._check(x <= N), repeat_interleave's length): allocated on the device during a run once
 * the size is known, outside the arena, stream-ordered from the output pool
 * (cuMemAllocFromPoolAsync: no device-wide synchronisation, memory the pool keeps is reused by
 * the next run) and freed stream-ordered at their last use or when the run returns (any path).
 * The CPU twin is kr::HeapBuffers. Programs with such sizes never replay as CUDA graphs (the
 * host reads the size mid-run), so every allocation is a plain stream-ordered one. */
struct DeviceHeap {
  CUmemoryPool pool;
  CUstream stream;  /* the run's stream: frees at the end of the run are ordered on it */
  CUdeviceptr held[64] = {};
  int n = 0;
  DeviceHeap(CUmemoryPool p, CUstream s) : pool(p), stream(s) {}
  DeviceHeap(const DeviceHeap &) = delete;
  DeviceHeap &operator=(const DeviceHeap &) = delete;
  CUdeviceptr alloc(Err &e, const char *name, int64_t bytes, CUstream s) {
    size_t rounded = (static_cast<size_t>(bytes > 0 ? bytes : 0) + 255) / 256 * 256;
    int slot = -1;
    for (int i = 0; i < n && slot < 0; ++i)
      if (!held[i]) slot = i;
    if (slot < 0 && n == 64) {
      e.fail("more than 64 run-time device buffers live at once (%s)", name);
      return 0;
    }
    CUdeviceptr p = 0;
    CUresult r = driver().cuMemAllocFromPoolAsync(&p, rounded ? rounded : 256, pool, s);
    if (r != CUDA_SUCCESS) {
      const char *msg = nullptr;
      if (driver().cuGetErrorString) driver().cuGetErrorString(r, &msg);
      e.fail("allocating %s (%lld bytes, sized at run time): CUDA error %d (%s)", name,
             (long long)bytes, static_cast<int>(r), msg ? msg : "unknown");
      return 0;
    }
    if (slot < 0) slot = n++;
    held[slot] = p;
    return p;
  }
  void release(CUdeviceptr p, CUstream s) {
    for (int i = 0; i < n; ++i)
      if (held[i] == p && p) { driver().cuMemFreeAsync(p, s); held[i] = 0; return; }
  }
  ~DeviceHeap() {
    for (int i = 0; i < n; ++i)
      if (held[i]) driver().cuMemFreeAsync(held[i], stream);
  }
};

/* The device arena: one allocation, grown (never shrunk) when a larger plan needs it. */
struct Arena {
  CUdeviceptr base = 0;
  size_t cap = 0;
  uint64_t epoch = 0;  /* bumped when base moves: CUDA graphs captured before are stale */
  int reserve(Err &e, size_t bytes) {
    if (bytes <= cap) return 0;
    size_t rounded = (bytes + 255) / 256 * 256;
    ++epoch;
    if (base) driver().cuMemFree(base);  // synchronises: kernels still using it have finished
    base = 0;
    cap = 0;
    if (check(e, driver().cuMemAlloc(&base, rounded), "allocating the device arena")) return 1;
    cap = rounded;
    return 0;
  }
};

/* Programmatic dependent launch can be used on this device: compute capability >= 9.0 and a
 * driver (>= 12.3) that has cuLaunchKernelEx and keeps the dependency in captured graphs. */
inline bool pdl_supported(int cc) {
#if CUDA_VERSION >= 12000
  return cc >= 90 && driver().cuLaunchKernelEx != nullptr && driver().version >= 12030;
#else
  (void)cc;
  return false;
#endif
}

/* Launches a Triton kernel over `rows` rows, XBLOCK rows per program; programs beyond 2^31-1
 * continue in grid y (the kernel computes pid = y * gridDim.x + x). Zero rows: no launch.
 * pdl: with programmatic stream serialisation (the kernel may start while the previous one
 * finishes; kiln's kernels then wait for it, griddepcontrol.wait, before reading or writing
 * any buffer: targets/cuda/kernel.py `with_pdl`); only where pdl_supported. */
inline int launch(Err &e, const char *name, CUfunction f, int64_t rows, int64_t xblock,
                  unsigned warps, unsigned shared, CUstream s, void **args, bool pdl = false) {
  if (rows <= 0) return 0;
  const int64_t n = (rows + xblock - 1) / xblock;
  const int64_t gx = n < 2147483647 ? n : 2147483647;
  const int64_t gy = (n + gx - 1) / gx;
  if (gy > 65535) return e.fail("%s: grid of %lld programs is too large", name, (long long)n);
#if CUDA_VERSION >= 12000
  if (pdl) {
    CUlaunchAttribute attr[1];
    std::memset(attr, 0, sizeof attr);
    attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr[0].value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig c;
    std::memset(&c, 0, sizeof c);
    c.gridDimX = static_cast<unsigned>(gx);
    c.gridDimY = static_cast<unsigned>(gy);
    c.gridDimZ = 1;
    c.blockDimX = 32 * warps;
    c.blockDimY = c.blockDimZ = 1;
    c.sharedMemBytes = shared;
    c.hStream = s;
    c.attrs = attr;
    c.numAttrs = 1;
    return check(e, driver().cuLaunchKernelEx(&c, f, args, nullptr), name);
  }
#else
  (void)pdl;
#endif
  CUresult r = driver().cuLaunchKernel(f, static_cast<unsigned>(gx), static_cast<unsigned>(gy),
                                       1, 32 * warps, 1, 1, shared, s, args, nullptr);
  return check(e, r, name);
}

/* A user Triton kernel on a (gx, gy, gz) grid of programs (CUDA's limits: x < 2^31,
 * y and z <= 65535); an empty grid launches nothing. */
inline int launch_grid(Err &e, const char *name, CUfunction f, int64_t gx, int64_t gy,
                       int64_t gz, unsigned warps, unsigned shared, CUstream s, void **args) {
  if (gx <= 0 || gy <= 0 || gz <= 0) return 0;
  if (gx > 2147483647 || gy > 65535 || gz > 65535)
    return e.fail("%s: grid (%lld, %lld, %lld) exceeds CUDA's limits", name, (long long)gx,
                  (long long)gy, (long long)gz);
  CUresult r = driver().cuLaunchKernel(f, static_cast<unsigned>(gx), static_cast<unsigned>(gy),
                                       static_cast<unsigned>(gz), 32 * warps, 1, 1, shared, s,
                                       args, nullptr);
  return check(e, r, name);
}

/* Two batch dims (nb0, nb1; operand batch strides as0/as1, bs0/bs1) as `loops` strided-batched
 * calls of `count` matrices each (batch strides sa, sb): one call when nb1 == 1, when nb0 == 1
 * or when dim 0 steps over whole dim-1 batches; else one call per index of dim 0. */
inline void batch_calls(int64_t nb0, int64_t nb1, int64_t as0, int64_t as1, int64_t bs0,
                        int64_t bs1, int64_t *count, int64_t *sa, int64_t *sb, int64_t *loops) {
  *count = nb1; *sa = as1; *sb = bs1; *loops = nb0;
  if (nb1 == 1) { *count = nb0; *sa = as0; *sb = bs0; *loops = 1; }
  else if (nb0 == 1 || (as0 == as1 * nb1 && bs0 == bs1 * nb1)) { *count = nb0 * nb1; *loops = 1; }
}

/* C[b0][b1] (M x N, contiguous) = A[b0][b1] (M x K) * B[b0][b1] (K x N); offsets, strides in
 * elements. */
template <class T>
inline int gemm(Err &e, cublasHandle_t h, CUstream s, const char *name, int64_t nb0, int64_t nb1,
                int64_t M, int64_t N, int64_t K, CUdeviceptr A, int64_t as0, int64_t as1,
                int64_t ar, int64_t ac, CUdeviceptr B, int64_t bs0, int64_t bs1, int64_t br,
                int64_t bc, CUdeviceptr C) {
  const int64_t nb = nb0 * nb1;
  if (nb == 0 || M == 0 || N == 0) return 0;
  if (K == 0)
    return check(e, driver().cuMemsetD8Async(C, 0, static_cast<size_t>(nb * M * N) * sizeof(T),
                                             s), name);
  bool ta, tb;
  int64_t lda, ldb;
  if (!kr::blas_layout(M, K, ar, ac, &ta, &lda) ||
      !kr::blas_layout(K, N, br, bc, &tb, &ldb))
    return e.fail("%s: operand layout not supported by cuBLAS", name);
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX)
    return e.fail("%s: matrix too large for 32-bit cuBLAS", name);
  int64_t count, sa, sb, loops;
  batch_calls(nb0, nb1, as0, as1, bs0, bs1, &count, &sa, &sb, &loops);
  for (int64_t l = 0; l < loops; ++l) {
    const T *a = reinterpret_cast<const T *>(A) + l * as0;
    const T *b = reinterpret_cast<const T *>(B) + l * bs0;
    T *c = reinterpret_cast<T *>(C) + l * nb1 * M * N;
    int st;
    if constexpr (sizeof(T) == 2) {  /* f16/bf16 operands and result, float accumulation */
      const float one = 1, zero = 0;
      const int dt = CudaType<T>::value;
      st = blas().gemm_ex(h, tb ? 1 : 0, ta ? 1 : 0, (int)N, (int)M, (int)K, &one, b, dt,
                          (int)ldb, sb, a, dt, (int)lda, sa, &zero, c, dt, (int)N, M * N,
                          (int)count, kComputeF32, kGemmDefault);
    } else if constexpr (sizeof(T) == 4) {
      const T one = 1, zero = 0;
      st = blas().sgemm(h, tb ? 1 : 0, ta ? 1 : 0, (int)N, (int)M, (int)K, &one, b, (int)ldb, sb,
                        a, (int)lda, sa, &zero, c, (int)N, M * N, (int)count);
    } else {
      const T one = 1, zero = 0;
      st = blas().dgemm(h, tb ? 1 : 0, ta ? 1 : 0, (int)N, (int)M, (int)K, &one, b, (int)ldb, sb,
                        a, (int)lda, sa, &zero, c, (int)N, M * N, (int)count);
    }
    if (st != 0) return e.fail("%s: cuBLAS error %d", name, st);
  }
  return 0;
}

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  /* cuBLAS's own default on Hopper */

/* cuBLASLt, for 8-bit float and int8 GEMMs (cuBLAS's GEMMs take neither with scales), opened
 * like cuBLAS (libcublasLt.so.{13,12,11}, or $KILN_CUBLASLT). Declared here, no headers:
 * descriptors are opaque pointers, enums the ints of cublasLt.h / library_types.h. */
typedef void *cublasLtHandle_t;
struct LtHeuristic {  /* cublasLtMatmulHeuristicResult_t */
  uint64_t algo[8];
  size_t workspace_bytes;
  int state;
  float waves;
  int reserved[4];
};
struct BlasLt {
  const char *error = nullptr;
  int (*create)(cublasLtHandle_t *) = nullptr;
  int (*destroy)(cublasLtHandle_t) = nullptr;
  int (*desc_create)(void **, int, int) = nullptr;
  int (*desc_destroy)(void *) = nullptr;
  int (*desc_set)(void *, int, const void *, size_t) = nullptr;
  int (*layout_create)(void **, int, uint64_t, uint64_t, int64_t) = nullptr;
  int (*layout_destroy)(void *) = nullptr;
  int (*layout_set)(void *, int, const void *, size_t) = nullptr;
  int (*pref_create)(void **) = nullptr;
  int (*pref_destroy)(void *) = nullptr;
  int (*pref_set)(void *, int, const void *, size_t) = nullptr;
  int (*heuristic)(cublasLtHandle_t, void *, void *, void *, void *, void *, void *, int,
                   LtHeuristic *, int *) = nullptr;
  int (*matmul)(cublasLtHandle_t, void *, const void *, const void *, void *, const void *,
                void *, const void *, const void *, void *, void *, void *, const void *, void *,
                size_t, CUstream) = nullptr;
};
/* The algorithm cuBLASLt's heuristic chose for one GEMM of an instance at the sizes (m, n, k)
 * and operand alignments: asked once per such key, not per run (the query costs tens of
 * microseconds on the host). */
struct LtPlan {
  int64_t m = -1, n = -1, k = -1;
  uint32_t align[3] = {};
  LtHeuristic heur{};
};
/* The alignment of a device address in bytes, up to the 256 cuBLASLt's heuristic assumes. */
inline uint32_t address_alignment(CUdeviceptr p) {
  uint32_t a = 256;
  while (a > 1 && p % a) a >>= 1;
  return a;
}
/* cudaDataType_t values */
constexpr int kR32F = 0, kR16F = 2, kR8I = 3, kR32I = 10, kR16BF = 14, kR8F_E4M3 = 28,
              kR8F_E5M2 = 29;
/* cublasLtMatmulDescAttributes_t, cublasLtEpilogue_t, cublasComputeType_t, preference */
constexpr int kLtTransA = 3, kLtTransB = 4, kLtEpilogue = 7, kLtBiasPointer = 8,
              kLtAScale = 17, kLtBScale = 18, kLtBiasType = 26, kLtEpilogueBias = 4,
              kComputeI32 = 72, kLtPrefWorkspace = 1, kLtPrefAlignA = 5, kLtPrefAlignB = 6,
              kLtPrefAlignC = 7, kLtPrefAlignD = 8;
/* cublasLtMatrixLayoutAttribute_t: batch count (int32) and batch stride (int64, elements) */
constexpr int kLtLayoutBatchCount = 5, kLtLayoutBatchStride = 6;

inline const BlasLt &blaslt() {
  static const BlasLt b = [] {
    BlasLt t;
    const char *names[] = {std::getenv("KILN_CUBLASLT"), "libcublasLt.so.13",
                           "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so"};
    void *h = nullptr;
    for (const char *n : names)
      if (n && *n && (h = ::dlopen(n, RTLD_NOW | RTLD_LOCAL))) break;
    if (!h) {
      t.error = "cannot load cuBLASLt (tried $KILN_CUBLASLT, libcublasLt.so.13/.12/.11): put "
                "its directory on LD_LIBRARY_PATH, set KILN_CUBLASLT, or import torch first";
      return t;
    }
    if (!sym(h, "cublasLtCreate", &t.create) || !sym(h, "cublasLtDestroy", &t.destroy) ||
        !sym(h, "cublasLtMatmulDescCreate", &t.desc_create) ||
        !sym(h, "cublasLtMatmulDescDestroy", &t.desc_destroy) ||
        !sym(h, "cublasLtMatmulDescSetAttribute", &t.desc_set) ||
        !sym(h, "cublasLtMatrixLayoutCreate", &t.layout_create) ||
        !sym(h, "cublasLtMatrixLayoutDestroy", &t.layout_destroy) ||
        !sym(h, "cublasLtMatrixLayoutSetAttribute", &t.layout_set) ||
        !sym(h, "cublasLtMatmulPreferenceCreate", &t.pref_create) ||
        !sym(h, "cublasLtMatmulPreferenceDestroy", &t.pref_destroy) ||
        !sym(h, "cublasLtMatmulPreferenceSetAttribute", &t.pref_set) ||
        !sym(h, "cublasLtMatmulAlgoGetHeuristic", &t.heuristic) ||
        !sym(h, "cublasLtMatmul", &t.matmul))
      t.error = "the cuBLASLt library found lacks a needed function";
    return t;
  }();
  return b;
}

/* C (M x N, row-major, contiguous, type c_type) = A (M x K, row-major, leading dimension lda)
 * * B (K x N, column-major, leading dimension ldb), times the float32 scalars at scale_a and
 * scale_b (0: none), plus bias[N] (0: none; type bias_type), through cuBLASLt. 8-bit float
 * operands accumulate in float32, int8 operands into int32 (c_type kR32I, no scales, no bias).
 * Column-major cuBLASLt computes C^T (N x M) = B^T A^T: its A is our B read transposed and its
 * B our A, the "TN" layout it requires for these types (lowering/lowp.py guarantees it). */
inline int lt_gemm(Err &e, cublasLtHandle_t h, CUstream s, const char *name, int64_t M,
                   int64_t N, int64_t K, CUdeviceptr A, int a_type, int64_t lda, CUdeviceptr B,
                   int b_type, int64_t ldb, CUdeviceptr C, int c_type, CUdeviceptr scale_a,
                   CUdeviceptr scale_b, CUdeviceptr bias, int bias_type, CUdeviceptr ws,
                   size_t ws_bytes, LtPlan *plan) {
  if (M == 0 || N == 0) return 0;
  if (K == 0) return e.fail("%s: a low-precision GEMM needs K > 0", name);
  const BlasLt &lt = blaslt();
  const bool ints = a_type == kR8I;
  void *desc = nullptr, *la = nullptr, *lb = nullptr, *lc = nullptr, *pref = nullptr;
  int st = lt.desc_create(&desc, ints ? kComputeI32 : kComputeF32, ints ? kR32I : kR32F);
  const char *what = "cublasLtMatmulDescCreate";
  const int trans = 1, keep = 0;
  const uint64_t ws64 = ws_bytes;
  auto set = [&](int attr, const void *v, size_t n, const char *w) {
    if (st == 0) { st = lt.desc_set(desc, attr, v, n); what = w; }
  };
  set(kLtTransA, &trans, sizeof trans, "setting TRANSA");
  set(kLtTransB, &keep, sizeof keep, "setting TRANSB");
  if (scale_a) set(kLtBScale, &scale_a, sizeof scale_a, "setting the scale of A");
  if (scale_b) set(kLtAScale, &scale_b, sizeof scale_b, "setting the scale of B");
  if (bias) {
    const int epi = kLtEpilogueBias;
    set(kLtEpilogue, &epi, sizeof epi, "setting the bias epilogue");
    set(kLtBiasPointer, &bias, sizeof bias, "setting the bias pointer");
    set(kLtBiasType, &bias_type, sizeof bias_type, "setting the bias type");
  }
  if (st == 0) { st = lt.layout_create(&la, b_type, K, N, ldb); what = "layout of B"; }
  if (st == 0) { st = lt.layout_create(&lb, a_type, K, M, lda); what = "layout of A"; }
  if (st == 0) { st = lt.layout_create(&lc, c_type, N, M, N); what = "layout of C"; }
  if (st == 0) { st = lt.pref_create(&pref); what = "cublasLtMatmulPreferenceCreate"; }
  if (st == 0) {
    st = lt.pref_set(pref, kLtPrefWorkspace, &ws64, sizeof ws64);
    what = "setting the workspace size";
  }
  /* the heuristic assumes 256-byte aligned matrices unless told (its A is our B) */
  const uint32_t align[3] = {address_alignment(B), address_alignment(A), address_alignment(C)};
  const int pref_attr[4] = {kLtPrefAlignA, kLtPrefAlignB, kLtPrefAlignC, kLtPrefAlignD};
  for (int i = 0; i < 4 && st == 0; ++i) {
    st = lt.pref_set(pref, pref_attr[i], &align[i < 3 ? i : 2], sizeof(uint32_t));
    what = "setting the operand alignments";
  }
  LtHeuristic heur{};
  int found = 0;
  if (st == 0 && plan->m == M && plan->n == N && plan->k == K &&
      std::memcmp(plan->align, align, sizeof align) == 0) {
    heur = plan->heur;
  } else if (st == 0) {
    st = lt.heuristic(h, desc, la, lb, lc, lc, pref, 1, &heur, &found);
    what = "cublasLtMatmulAlgoGetHeuristic";
    if (st == 0 && found == 0) st = -1;
    if (st == 0) {
      plan->m = M; plan->n = N; plan->k = K; plan->heur = heur;
      std::memcpy(plan->align, align, sizeof align);
    }
  }
  if (st == 0) {
    const float onef = 1, zerof = 0;
    const int32_t onei = 1, zeroi = 0;
    const void *alpha = ints ? static_cast<const void *>(&onei) : &onef;
    const void *beta = ints ? static_cast<const void *>(&zeroi) : &zerof;
    st = lt.matmul(h, desc, alpha, reinterpret_cast<const void *>(B), la,
                   reinterpret_cast<const void *>(A), lb, beta, reinterpret_cast<void *>(C), lc,
                   reinterpret_cast<void *>(C), lc, heur.algo, reinterpret_cast<void *>(ws),
                   ws_bytes, s);
    what = "cublasLtMatmul";
  }
  if (pref) lt.pref_destroy(pref);
  if (lc) lt.layout_destroy(lc);
  if (lb) lt.layout_destroy(lb);
  if (la) lt.layout_destroy(la);
  if (desc) lt.desc_destroy(desc);
  if (st == -1)
    return e.fail("%s: cuBLASLt has no algorithm for this GEMM (M=%lld N=%lld K=%lld)", name,
                  (long long)M, (long long)N, (long long)K);
  if (st != 0) return e.fail("%s: %s failed (cuBLAS status %d)", name, what, st);
  return 0;
}

/* cuBLASLt for float16 / bfloat16 / float32 GEMMs with an algorithm picked at compile time
 * (a "blas" choice with config {"algo": i}: the i-th result of cublasLtMatmulAlgoGetHeuristic,
 * which max_autotune profiled against cuBLAS's own choice). float32 computes in float32 (no
 * TF32, as eager by default); 16-bit operands accumulate in float32.
 *
 * LtGemmPlan: the descriptors, layouts and chosen algorithm of one GEMM of an instance for one
 * key (sizes, leading dimensions, batch, layouts, operand alignments): made on the first run
 * with that key and reused until the key changes (dynamic sizes re-plan when they change, as
 * LtPlan does); the heuristic is asked for kLtAlgos results (up to 64 when `algo` is larger)
 * and result `algo` is used, result 0 when it returned fewer; with no result at all the GEMM
 * runs on cuBLAS (kc::gemm) instead, as it does when cublasLtMatmul refuses the algorithm
 * (NOT_SUPPORTED), so a choice never makes a run fail. */
constexpr int kLtAlgos = 8;
constexpr int kLtNotSupported = 15;  /* CUBLAS_STATUS_NOT_SUPPORTED */

struct LtGemmPlan {
  int64_t key[15] = {-1};  /* what the plan was made for (lt_blas_gemm): sizes .. dtype */
  void *desc = nullptr, *la = nullptr, *lb = nullptr, *lc = nullptr;
  LtHeuristic heur{};
  int found = 0;  /* usable algorithms the heuristic returned (0: cuBLAS runs the GEMM) */
  int used = 0;   /* the index of the algorithm run */
  LtGemmPlan() = default;
  LtGemmPlan(const LtGemmPlan &) = delete;
  LtGemmPlan &operator=(const LtGemmPlan &) = delete;
  void release() {
    if (lc) blaslt().layout_destroy(lc);
    if (lb) blaslt().layout_destroy(lb);
    if (la) blaslt().layout_destroy(la);
    if (desc) blaslt().desc_destroy(desc);
    desc = la = lb = lc = nullptr;
    key[0] = -1;
  }
  ~LtGemmPlan() { release(); }
};

/* Makes `plan` for C^T (N x M, column-major, contiguous) = op(B^T) op(A^T), `count` matrices
 * per call: cuBLASLt's A is our B (transposed when tb), its B our A (when ta). Returns a
 * cuBLAS status (0: the plan holds descriptors and `found` algorithms), `*what` the step. */
inline int lt_make_plan(cublasLtHandle_t h, int dtype, int algo, int64_t M, int64_t N,
                        int64_t K, int64_t count, bool ta, int64_t lda, int64_t sa, bool tb,
                        int64_t ldb, int64_t sb, const uint32_t align[3], size_t ws_bytes,
                        LtGemmPlan *plan, const char **what) {
  const BlasLt &lt = blaslt();
  plan->release();
  plan->found = plan->used = 0;
  int st = lt.desc_create(&plan->desc, kComputeF32, kR32F);
  *what = "cublasLtMatmulDescCreate";
  const int opa = tb ? 1 : 0, opb = ta ? 1 : 0;
  if (st == 0) { st = lt.desc_set(plan->desc, kLtTransA, &opa, sizeof opa); *what = "TRANSA"; }
  if (st == 0) { st = lt.desc_set(plan->desc, kLtTransB, &opb, sizeof opb); *what = "TRANSB"; }
  /* stored matrices (column-major): our B is N x K (K x N when transposed), A likewise */
  if (st == 0) {
    st = lt.layout_create(&plan->la, dtype, tb ? K : N, tb ? N : K, ldb);
    *what = "layout of B";
  }
  if (st == 0) {
    st = lt.layout_create(&plan->lb, dtype, ta ? M : K, ta ? K : M, lda);
    *what = "layout of A";
  }
  if (st == 0) { st = lt.layout_create(&plan->lc, dtype, N, M, N); *what = "layout of C"; }
  if (count > 1) {
    const int32_t c32 = static_cast<int32_t>(count);
    const int64_t sc = M * N;
    void *lay[3] = {plan->la, plan->lb, plan->lc};
    const int64_t stride[3] = {sb, sa, sc};
    for (int i = 0; i < 3 && st == 0; ++i) {
      st = lt.layout_set(lay[i], kLtLayoutBatchCount, &c32, sizeof c32);
      if (st == 0) st = lt.layout_set(lay[i], kLtLayoutBatchStride, &stride[i], sizeof(int64_t));
      *what = "batch layout";
    }
  }
  void *pref = nullptr;
  if (st == 0) { st = lt.pref_create(&pref); *what = "cublasLtMatmulPreferenceCreate"; }
  const uint64_t ws64 = ws_bytes;
  if (st == 0) {
    st = lt.pref_set(pref, kLtPrefWorkspace, &ws64, sizeof ws64);
    *what = "setting the workspace size";
  }
  const int pref_attr[4] = {kLtPrefAlignA, kLtPrefAlignB, kLtPrefAlignC, kLtPrefAlignD};
  for (int i = 0; i < 4 && st == 0; ++i) {
    st = lt.pref_set(pref, pref_attr[i], &align[i < 3 ? i : 2], sizeof(uint32_t));
    *what = "setting the operand alignments";
  }
  constexpr int kMaxResults = 64;
  const int want = algo + 1 < kLtAlgos ? kLtAlgos : algo + 1 > kMaxResults ? kMaxResults
                                                                          : algo + 1;
  LtHeuristic res[kMaxResults];
  int got = 0;
  if (st == 0) {
    st = lt.heuristic(h, plan->desc, plan->la, plan->lb, plan->lc, plan->lc, pref, want, res,
                      &got);
    *what = "cublasLtMatmulAlgoGetHeuristic";
    if (st != 0) { st = 0; got = 0; }  /* no algorithm: cuBLAS computes it */
  }
  if (pref) lt.pref_destroy(pref);
  if (st != 0) return st;
  int usable[kMaxResults], n = 0;  /* results that can run, in the heuristic's order */
  for (int i = 0; i < got; ++i)
    if (res[i].state == 0) usable[n++] = i;
  plan->found = n;
  plan->used = algo < n ? algo : 0;  /* fewer results than `algo + 1`: result 0 */
  if (n > 0) plan->heur = res[usable[plan->used]];
  return 0;
}

/* The GEMM of kc::gemm (same operands and layouts) through cuBLASLt with heuristic result
 * `algo` (see LtGemmPlan). `bh` (cuBLAS, bound to `s`) runs it when cuBLASLt has none. */
template <class T>
inline int lt_blas_gemm(Err &e, cublasLtHandle_t h, cublasHandle_t bh, CUstream s,
                        const char *name, int algo, int64_t nb0, int64_t nb1, int64_t M,
                        int64_t N, int64_t K, CUdeviceptr A, int64_t as0, int64_t as1,
                        int64_t ar, int64_t ac, CUdeviceptr B, int64_t bs0, int64_t bs1,
                        int64_t br, int64_t bc, CUdeviceptr C, CUdeviceptr ws, size_t ws_bytes,
                        LtGemmPlan *plan) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "cuBLASLt GEMMs take f16, bf16, float");
  const int64_t nb = nb0 * nb1;
  if (nb == 0 || M == 0 || N == 0) return 0;
  if (K == 0)
    return check(e, driver().cuMemsetD8Async(C, 0, static_cast<size_t>(nb * M * N) * sizeof(T),
                                             s), name);
  if (algo < 0) algo = 0;
  bool ta, tb;
  int64_t lda, ldb;
  if (!kr::blas_layout(M, K, ar, ac, &ta, &lda) ||
      !kr::blas_layout(K, N, br, bc, &tb, &ldb))
    return e.fail("%s: operand layout not supported by cuBLASLt", name);
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX)
    return e.fail("%s: matrix too large for 32-bit cuBLASLt", name);
  int64_t count, sa, sb, loops;
  batch_calls(nb0, nb1, as0, as1, bs0, bs1, &count, &sa, &sb, &loops);
  int dtype = kR32F;
  if constexpr (sizeof(T) == 2) dtype = CudaType<T>::value;
  const int64_t sz = sizeof(T);
  /* what the heuristic may assume of every matrix: base addresses and batch steps */
  auto steps = [&](int64_t inner, int64_t outer) {
    return static_cast<uint64_t>(((count > 1 ? inner : 0) | (loops > 1 ? outer : 0)) * sz);
  };
  const uint64_t step_a = steps(sa, as0), step_b = steps(sb, bs0), step_c = steps(M * N, M * N);
  const uint32_t align[3] = {address_alignment(B | step_b), address_alignment(A | step_a),
                             address_alignment(C | step_c)};
  const int64_t key[15] = {M, N, K, count, lda, ldb, sa, sb, ta, tb, algo, align[0], align[1],
                           align[2], dtype};
  if (std::memcmp(plan->key, key, sizeof key) != 0) {
    const char *what = "";
    const BlasLt &lt = blaslt();
    if (lt.error) return e.fail("%s: %s", name, lt.error);
    int st = lt_make_plan(h, dtype, algo, M, N, K, count, ta, lda, sa, tb, ldb, sb, align,
                          ws_bytes, plan, &what);
    if (st != 0) {
      plan->release();
      return e.fail("%s: %s failed (cuBLAS status %d)", name, what, st);
    }
    std::memcpy(plan->key, key, sizeof key);
  }
  if (plan->found == 0)
    return gemm<T>(e, bh, s, name, nb0, nb1, M, N, K, A, as0, as1, ar, ac, B, bs0, bs1, br, bc,
                   C);
  const float one = 1, zero = 0;
  for (int64_t l = 0; l < loops; ++l) {
    const void *a = reinterpret_cast<const T *>(A) + l * as0;
    const void *b = reinterpret_cast<const T *>(B) + l * bs0;
    void *c = reinterpret_cast<T *>(C) + l * nb1 * M * N;
    int st = blaslt().matmul(h, plan->desc, &one, b, plan->la, a, plan->lb, &zero, c,
                             plan->lc, c, plan->lc, plan->heur.algo,
                             reinterpret_cast<void *>(ws), ws_bytes, s);
    if (st == kLtNotSupported) {  /* refused at run time: cuBLAS computes it from now on */
      plan->found = 0;
      return gemm<T>(e, bh, s, name, nb0, nb1, M, N, K, A, as0, as1, ar, ac, B, bs0, bs1, br,
                     bc, C);
    }
    if (st != 0)
      return e.fail("%s: cublasLtMatmul failed (cuBLAS status %d, algorithm %d of %d)", name,
                    st, plan->used, plan->found);
  }
  return 0;
}

/* cuBLAS on `s`, with the instance's own workspace (cublasSetStream resets the workspace to
 * cuBLAS's default pool, whose lazy allocation a CUDA graph capture must not see). */
inline int blas_bind(Err &e, cublasHandle_t h, CUstream s, CUdeviceptr ws, size_t ws_bytes) {
  if (!h) return 0;
  if (blas().set_stream(h, s) != 0) return e.fail("cublasSetStream failed");
  if (ws && blas().set_workspace(h, reinterpret_cast<void *>(ws), ws_bytes) != 0)
    return e.fail("cublasSetWorkspace failed");
  return 0;
}

inline size_t nbytes(const DLTensor *t) {
  return static_cast<size_t>(kr::numel(t)) * ((t->dtype.bits * t->dtype.lanes + 7) / 8);
}

/* CUDA graphs of a whole run, one per size tuple (`key`: the values of the size symbols).
 *
 * Design: the first run of a size tuple runs directly on the caller's stream (a warm-up: cuBLAS
 * and the driver load what they load lazily). The second is captured, without executing, on the
 * instance's private capture stream, reading its inputs from and writing its outputs to static
 * device buffers owned by the graph entry; from then on every run with these sizes copies the
 * inputs into those buffers, launches the graph on the caller's stream and copies the outputs
 * into the fresh output tensors: three kinds of stream-ordered operation instead of one launch
 * per kernel and GEMM, correct whatever pointers the caller passes (nothing is captured by the
 * caller's pointer). The copies cost time where launches cost none, so a run whose inputs and
 * outputs exceed kGraphBytesPerLaunch per launch saved runs directly instead (a large
 * memory-bound model: launch overhead is negligible there, and the copies would double its
 * traffic). A graph captured before the arena moved (a larger plan grew it) is stale and is
 * captured again. A failed capture leaves that size tuple running directly. At most kMaxGraphs
 * size tuples are kept; the oldest is replaced first. */
constexpr size_t kGraphBytesPerLaunch = size_t(4) << 20;  /* ~3 us of launch vs ~3 us of copy */

struct GraphEntry {
  int64_t key[16];
  CUgraphExec exec = nullptr;
  CUdeviceptr io = 0;
  uint64_t epoch = 0;
  bool captured = false;  /* false: seen once (ran directly), capture on the next run */
  bool direct = false;    /* capture failed: run these sizes directly */
};

struct Graphs {
  static constexpr int kMaxGraphs = 8;
  GraphEntry entry[kMaxGraphs];
  int used = 0, next = 0;
  CUstream capture_stream = nullptr;

  void drop(GraphEntry &g) {
    if (g.exec) driver().cuGraphExecDestroy(g.exec);
    if (g.io) driver().cuMemFree(g.io);
    g = GraphEntry();
  }
  void release() {
    for (int i = 0; i < used; ++i) drop(entry[i]);
    used = next = 0;
    if (capture_stream) driver().cuStreamDestroy(capture_stream);
    capture_stream = nullptr;
  }
  GraphEntry *find(const int64_t *key, int nkey) {
    for (int i = 0; i < used; ++i)
      if (std::memcmp(entry[i].key, key, sizeof(int64_t) * nkey) == 0) return &entry[i];
    return nullptr;
  }
  GraphEntry *add(const int64_t *key, int nkey) {
    GraphEntry *g;
    if (used < kMaxGraphs) {
      g = &entry[used++];
    } else {  /* replace the oldest */
      g = &entry[next];
      next = (next + 1) % kMaxGraphs;
    }
    drop(*g);
    std::memcpy(g->key, key, sizeof(int64_t) * nkey);
    return g;
  }
};

/* The index status of a model whose kernels look data up by index (embedding, gather, ...): a
 * kernel that meets an index out of range stores 1 into the device word `status`, which stays
 * set until reported. Each run ends by copying it into pinned host memory (`host`) on its
 * stream, without waiting. `wait` (the run waits for its own copy: the C API's stream-less
 * run, or Options(cuda_sync_checks=True)) reports this run's lookups; otherwise the host copy
 * is read at the start of the next run, and a set flag is reported then as an earlier run's,
 * as CUDA reports its own asynchronous errors, while the runs stay free of host waits.
 * Reporting waits for all work in flight on the context, so that no later copy sets the host
 * word again, then clears both words: the model stays usable. */
inline int index_status(Err &e, CUdeviceptr status, volatile int32_t *host, CUstream stream,
                        bool wait, const char *ops) {
  const Driver &d = driver();
  if (wait && check(e, d.cuStreamSynchronize(stream), "run")) return 1;
  if (!*host) return 0;
  if (check(e, d.cuCtxSynchronize(), "run") ||
      check(e, d.cuMemsetD32Async(status, 0, 1, stream), "clearing the index status") ||
      check(e, d.cuStreamSynchronize(stream), "clearing the index status")) return 1;
  *host = 0;
  if (wait) return e.fail("index out of range in %s", ops);
  return e.fail("index out of range in %s, in an earlier run of this model (CUDA runs are "
                "asynchronous: a run reports a bad index of the one before it; that run's "
                "outputs are not valid; Options(cuda_sync_checks=True) makes every run check "
                "its own)", ops);
}

inline size_t io_round(size_t n) { return (n + 255) / 256 * 256; }

/* Runs `body(stream, input pointers, output pointers)` through the graph of this size tuple
 * (see Graphs). `body` returns 0 or fails with a message in e. */
template <class Body>
inline int run_graph(Err &e, Graphs &gs, const int64_t *key, int nkey, uint64_t epoch,
                     int launches, int n_in, const CUdeviceptr *in, const size_t *in_bytes,
                     int n_out, const CUdeviceptr *out, const size_t *out_bytes,
                     CUstream stream, Body &&body) {
  const Driver &d = driver();
  size_t io = 0;
  for (int i = 0; i < n_in; ++i) io += in_bytes[i];
  for (int i = 0; i < n_out; ++i) io += out_bytes[i];
  const int saved = launches - n_in - n_out - 1;
  if (nkey > 16 || n_in > 64 || n_out > 64 || saved <= 0 ||
      io > kGraphBytesPerLaunch * static_cast<size_t>(saved))
    return body(stream, in, out);
  GraphEntry *g = gs.find(key, nkey);
  if (!g) {  /* first run of these sizes: directly */
    g = gs.add(key, nkey);
    return body(stream, in, out);
  }
  if (g->direct) return body(stream, in, out);
  CUdeviceptr sin[64], sout[64];
  if (!g->captured || g->epoch != epoch) {
    if (g->exec) d.cuGraphExecDestroy(g->exec);
    if (g->io) d.cuMemFree(g->io);
    g->exec = nullptr;
    g->io = 0;
    g->captured = false;
    size_t total = 0;
    for (int i = 0; i < n_in; ++i) total += io_round(in_bytes[i]);
    for (int i = 0; i < n_out; ++i) total += io_round(out_bytes[i]);
    if (!gs.capture_stream &&
        check(e, d.cuStreamCreate(&gs.capture_stream, CU_STREAM_NON_BLOCKING), "capture stream"))
      return 1;
    if (check(e, d.cuMemAlloc(&g->io, total ? total : 256), "allocating graph inputs/outputs"))
      return 1;
    size_t off = 0;
    for (int i = 0; i < n_in; ++i) { sin[i] = g->io + off; off += io_round(in_bytes[i]); }
    for (int i = 0; i < n_out; ++i) { sout[i] = g->io + off; off += io_round(out_bytes[i]); }
    if (check(e, d.cuStreamBeginCapture(gs.capture_stream, CU_STREAM_CAPTURE_MODE_RELAXED),
              "beginning CUDA graph capture")) return 1;
    int rc = body(gs.capture_stream, sin, sout);
    CUgraph graph = nullptr;
    CUresult r = d.cuStreamEndCapture(gs.capture_stream, &graph);
    if (rc == 0 && r == CUDA_SUCCESS && graph) r = d.cuGraphInstantiate(&g->exec, graph, 0);
    if (graph) d.cuGraphDestroy(graph);
    if (rc || r != CUDA_SUCCESS || !graph) {  /* not capturable: run directly from now on */
      g->exec = nullptr;
      g->direct = true;
      return body(stream, in, out);
    }
    g->captured = true;
    g->epoch = epoch;
  } else {
    size_t off = 0;
    for (int i = 0; i < n_in; ++i) { sin[i] = g->io + off; off += io_round(in_bytes[i]); }
    for (int i = 0; i < n_out; ++i) { sout[i] = g->io + off; off += io_round(out_bytes[i]); }
  }
  for (int i = 0; i < n_in; ++i)
    if (in_bytes[i] && check(e, d.cuMemcpyDtoDAsync(sin[i], in[i], in_bytes[i], stream),
                             "copying an input into the CUDA graph")) return 1;
  if (check(e, d.cuGraphLaunch(g->exec, stream), "launching the CUDA graph")) return 1;
  for (int i = 0; i < n_out; ++i)
    if (out_bytes[i] && check(e, d.cuMemcpyDtoDAsync(out[i], sout[i], out_bytes[i], stream),
                              "copying an output out of the CUDA graph")) return 1;
  return 0;
}

}  // namespace kc
#endif
