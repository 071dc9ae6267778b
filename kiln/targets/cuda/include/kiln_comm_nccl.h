/* kiln_comm_nccl.h - collectives of CUDA packages through NCCL (namespace kcn), compiled into
 * a generated model.so only when its program has collectives (lowering/collectives.py).
 *
 * NCCL is not linked: libnccl.so.2 is opened with dlopen when an instance is given its
 * communicator ($KILN_NCCL_LIB, else libnccl.so.2: the Python loader preloads the NVIDIA NCCL
 * wheel's copy, which torch depends on). One communicator per instance, made by
 * ncclCommInitRank from the ncclUniqueId (128 bytes) the caller passes as comm_id, with the
 * instance's CUDA context current. NVLink SHARP (NVLS, multicast) is off: NCCL_NVLS_ENABLE=0
 * is set before the first communicator unless the environment sets it.
 *
 * Every collective is enqueued on the run's stream (ncclAllReduce, ncclAllGather,
 * ncclReduceScatter; all_to_all as grouped ncclSend / ncclRecv), so a run that replays as a
 * CUDA graph captures them with its kernels. Device pointers are CUdeviceptr (bytes). */
#ifndef KILN_COMM_NCCL_H
#define KILN_COMM_NCCL_H
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kiln_cuda_rt.h"

namespace kcn {
using kr::Err;

typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
// ncclDataType_t / ncclRedOp_t values (nccl.h, stable since NCCL 2.10)
enum : int { kInt8 = 0, kUint8 = 1, kInt32 = 2, kInt64 = 4, kFloat16 = 6, kFloat32 = 7,
             kFloat64 = 8, kBfloat16 = 9 };
// kiln's REDUCE_OPS order (sum, avg, max, min, product) -> ncclRedOp_t
constexpr int kOps[5] = {0 /* ncclSum */, 4 /* ncclAvg */, 2 /* ncclMax */, 3 /* ncclMin */,
                         1 /* ncclProd */};

struct Nccl {
  void *lib = nullptr;
  char error[512] = {0};
  int (*GetVersion)(int *) = nullptr;
  int (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int) = nullptr;
  int (*CommDestroy)(ncclComm_t) = nullptr;
  int (*AllReduce)(const void *, void *, size_t, int, int, ncclComm_t, CUstream) = nullptr;
  int (*AllGather)(const void *, void *, size_t, int, ncclComm_t, CUstream) = nullptr;
  int (*ReduceScatter)(const void *, void *, size_t, int, int, ncclComm_t, CUstream) = nullptr;
  int (*Send)(const void *, size_t, int, int, ncclComm_t, CUstream) = nullptr;
  int (*Recv)(void *, size_t, int, int, ncclComm_t, CUstream) = nullptr;
  int (*GroupStart)(void) = nullptr;
  int (*GroupEnd)(void) = nullptr;
  const char *(*GetErrorString)(int) = nullptr;
};

// The process's NCCL binding, loaded once; NULL with the reason in *why on failure.
inline const Nccl *nccl(const char **why) {
  static Nccl t;
  static std::once_flag once;
  std::call_once(once, [] {
    const char *env = std::getenv("KILN_NCCL_LIB");
    t.lib = ::dlopen(env && *env ? env : "libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!t.lib) {
      const char *d = ::dlerror();
      std::snprintf(t.error, sizeof t.error, "cannot open NCCL (libnccl.so.2; set KILN_NCCL_LIB "
                    "or install the nvidia-nccl-cu12/cu13 wheel): %s", d ? d : "not found");
      return;
    }
    bool ok = true;
    auto bind = [&](const char *name, auto *out) {
      void *p = ::dlsym(t.lib, name);
      std::memcpy(out, &p, sizeof p);
      if (!p && ok) {
        ok = false;
        std::snprintf(t.error, sizeof t.error, "libnccl.so.2 lacks %s (NCCL >= 2.10 needed)",
                      name);
      }
    };
    bind("ncclGetVersion", &t.GetVersion); bind("ncclCommInitRank", &t.CommInitRank);
    bind("ncclCommDestroy", &t.CommDestroy); bind("ncclAllReduce", &t.AllReduce);
    bind("ncclAllGather", &t.AllGather); bind("ncclReduceScatter", &t.ReduceScatter);
    bind("ncclSend", &t.Send); bind("ncclRecv", &t.Recv); bind("ncclGroupStart", &t.GroupStart);
    bind("ncclGroupEnd", &t.GroupEnd); bind("ncclGetErrorString", &t.GetErrorString);
  });
  if (t.error[0]) {
    *why = t.error;
    return nullptr;
  }
  return &t;
}

// One instance's communicator (moved, never copied, between instances of one model).
struct Comm {
  const Nccl *n = nullptr;
  ncclComm_t comm = nullptr;
  CUcontext ctx = nullptr;
  int rank = -1;
  int size = 0;
  Comm() = default;
  Comm(const Comm &) = delete;
  Comm &operator=(const Comm &) = delete;
  ~Comm() { release(); }
  void release() {
    if (comm) {
      kc::CtxGuard g(ctx);
      n->CommDestroy(comm);
    }
    comm = nullptr;
  }
  void take(Comm &o) {
    release();
    n = o.n, comm = o.comm, ctx = o.ctx, rank = o.rank, size = o.size;
    o.comm = nullptr;
  }
};

inline int check(Err &e, const Nccl *n, int rc, const char *call, const char *what) {
  if (rc == 0) return 0;
  return e.fail("%s: %s failed: %s (ncclResult %d)", what, call, n->GetErrorString(rc), rc);
}

// A communicator for (rank, world_size) from the ncclUniqueId `id` (128 bytes); `expect`:
// the group size the program was exported for (0: any). The instance's context is current.
inline int attach(Err &e, Comm &c, CUcontext ctx, int rank, int world_size, int expect,
                  const void *id, size_t len) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return e.fail("rank %d and world_size %d: expected 0 <= rank < world_size", rank,
                  world_size);
  }
  if (expect > 0 && world_size != expect) {
    return e.fail("the program was exported for a process group of %d ranks, got world_size "
                  "%d (shapes depend on it: export again for %d ranks)", expect, world_size,
                  world_size);
  }
  if (len != sizeof(ncclUniqueId) || !id) {
    return e.fail("comm_id must be a %zu-byte ncclUniqueId (kiln.runtime.nccl_unique_id() on "
                  "one rank, shared with the others), got %zu bytes", sizeof(ncclUniqueId), len);
  }
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast off unless the caller chose
  const char *why = nullptr;
  const Nccl *n = nccl(&why);
  if (!n) return e.fail("%s", why);
  ncclUniqueId uid;
  std::memcpy(&uid, id, sizeof uid);
  ncclComm_t comm = nullptr;
  if (check(e, n, n->CommInitRank(&comm, world_size, uid, rank), "ncclCommInitRank",
            "creating the communicator")) return 1;
  c.release();
  c.n = n, c.comm = comm, c.ctx = ctx, c.rank = rank, c.size = world_size;
  return 0;
}

inline int ready(Err &e, Comm &c, const char *what, int group_size) {
  if (!c.comm) {
    return e.fail("%s: this package runs collectives and its instance has no communicator (load "
                  "it with rank=, world_size=, comm_id=; C: kiln_model_set_comm)", what);
  }
  if (group_size > 0 && c.size != group_size) {
    return e.fail("%s: exported for %d ranks, the communicator has %d", what, group_size,
                  c.size);
  }
  return 0;
}

inline const void *ptr(CUdeviceptr p) { return reinterpret_cast<const void *>(p); }
inline void *mptr(CUdeviceptr p) { return reinterpret_cast<void *>(p); }

// `T`: an unsigned integer type of the element's size; `dt`: the element's ncclDataType_t
template <class T>
int all_reduce(Err &e, Comm &c, const char *what, int group_size, int reduce, CUdeviceptr out,
               CUdeviceptr in, int64_t n, int dt, CUstream stream) {
  if (ready(e, c, what, group_size)) return 1;
  if (reduce < 0 || reduce > 4) return e.fail("%s: reduce op %d", what, reduce);
  return check(e, c.n, c.n->AllReduce(ptr(in), mptr(out), static_cast<size_t>(n), dt,
                                      kOps[reduce], c.comm, stream), "ncclAllReduce", what);
}

template <class T>
int all_gather(Err &e, Comm &c, const char *what, int group_size, int, CUdeviceptr out,
               CUdeviceptr in, int64_t n, int dt, CUstream stream) {
  if (ready(e, c, what, group_size)) return 1;
  return check(e, c.n, c.n->AllGather(ptr(in), mptr(out), static_cast<size_t>(n), dt, c.comm,
                                      stream), "ncclAllGather", what);
}

template <class T>
int reduce_scatter(Err &e, Comm &c, const char *what, int group_size, int reduce,
                   CUdeviceptr out, CUdeviceptr in, int64_t n, int dt, CUstream stream) {
  if (ready(e, c, what, group_size)) return 1;
  if (reduce < 0 || reduce > 4) return e.fail("%s: reduce op %d", what, reduce);
  return check(e, c.n, c.n->ReduceScatter(ptr(in), mptr(out), static_cast<size_t>(n / c.size),
                                          dt, kOps[reduce], c.comm, stream),
               "ncclReduceScatter", what);
}

template <class T>
int all_to_all(Err &e, Comm &c, const char *what, int group_size, int, CUdeviceptr out,
               CUdeviceptr in, int64_t n, int dt, CUstream stream) {
  if (ready(e, c, what, group_size)) return 1;
  const size_t block = static_cast<size_t>(n / c.size);
  const size_t bytes = block * sizeof(T);
  if (check(e, c.n, c.n->GroupStart(), "ncclGroupStart", what)) return 1;
  int rc = 0;
  for (int p = 0; p < c.size && rc == 0; ++p) {
    rc = c.n->Send(ptr(in + p * bytes), block, dt, p, c.comm, stream);
    if (rc == 0) rc = c.n->Recv(mptr(out + p * bytes), block, dt, p, c.comm, stream);
  }
  const int end = c.n->GroupEnd();
  return check(e, c.n, rc ? rc : end, "ncclSend/ncclRecv", what);
}

}  // namespace kcn
#endif
