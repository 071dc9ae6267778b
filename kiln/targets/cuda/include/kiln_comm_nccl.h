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
 * Every collective (ncclAllReduce, ncclAllGather, ncclReduceScatter; all_to_all as grouped
 * ncclSend / ncclRecv) runs on the communicator's own stream: an event recorded on the run's
 * (compute) stream where the collective is issued - its operand is ready there - is waited on
 * by the communication stream, the collective is enqueued there and a second event recorded
 * after it; `wait` (a collective_wait line, placed as late as the data allows by
 * targets/collectives.py) makes the compute stream wait for that event. The kernels between a
 * collective and its wait run concurrently with it. Forked and joined by events, the two
 * streams are captured together when a run replays as a CUDA graph. Two events per collective
 * of the program, made with the stream (at the context's highest priority) when the
 * communicator is attached. KILN_NCCL_SERIAL=1
 * (read at attach) enqueues the collectives on the compute stream instead (no overlap: the
 * serial baseline). Device pointers are CUdeviceptr (bytes). */
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

// The driver's event functions (not in kc::Driver), from the same libcuda.so.1.
struct Events {
  const char *error = nullptr;
  CUresult (*Create)(CUevent *, unsigned) = nullptr;
  CUresult (*Destroy)(CUevent) = nullptr;
  CUresult (*Record)(CUevent, CUstream) = nullptr;
  CUresult (*StreamWait)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*PriorityRange)(int *, int *) = nullptr;  // optional: the stream's priority
  CUresult (*CreateWithPriority)(CUstream *, unsigned, int) = nullptr;
};

inline const Events &events() {
  static const Events t = [] {
    Events v;
    void *h = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h || !kc::sym(h, "cuEventCreate", &v.Create) ||
        !kc::sym(h, "cuEventDestroy_v2", &v.Destroy) || !kc::sym(h, "cuEventRecord", &v.Record) ||
        !kc::sym(h, "cuStreamWaitEvent", &v.StreamWait))
      v.error = "libcuda.so.1 lacks the event functions (cuEventCreate, cuEventRecord, "
                "cuStreamWaitEvent)";
    if (h && !(kc::sym(h, "cuCtxGetStreamPriorityRange", &v.PriorityRange) &&
               kc::sym(h, "cuStreamCreateWithPriority", &v.CreateWithPriority)))
      v.PriorityRange = nullptr, v.CreateWithPriority = nullptr;
    return v;
  }();
  return t;
}

constexpr int kMaxCollectives = 4096;

// One instance's communicator (moved, never copied, between instances of one model): the
// NCCL communicator, its stream and two events per collective (`ready`: the operand is ready
// on the compute stream; `done`: the collective finished on the communication stream).
struct Comm {
  const Nccl *n = nullptr;
  ncclComm_t comm = nullptr;
  CUcontext ctx = nullptr;
  int rank = -1;
  int size = 0;
  CUstream stream = nullptr;  // null: serial (collectives on the compute stream)
  int n_events = 0;
  CUevent ready[kMaxCollectives] = {};
  CUevent done[kMaxCollectives] = {};
  Comm() = default;
  Comm(const Comm &) = delete;
  Comm &operator=(const Comm &) = delete;
  ~Comm() { release(); }
  void release() {
    if (comm || stream) {
      kc::CtxGuard g(ctx);
      if (comm) n->CommDestroy(comm);
      for (int i = 0; i < n_events; ++i) {
        if (ready[i]) events().Destroy(ready[i]);
        if (done[i]) events().Destroy(done[i]);
        ready[i] = done[i] = nullptr;
      }
      if (stream) kc::driver().cuStreamDestroy(stream);
    }
    comm = nullptr, stream = nullptr, n_events = 0;
  }
  void take(Comm &o) {
    release();
    n = o.n, comm = o.comm, ctx = o.ctx, rank = o.rank, size = o.size, stream = o.stream;
    n_events = o.n_events;
    for (int i = 0; i < n_events; ++i) ready[i] = o.ready[i], done[i] = o.done[i];
    o.comm = nullptr, o.stream = nullptr, o.n_events = 0;
  }
};

inline int check(Err &e, const Nccl *n, int rc, const char *call, const char *what) {
  if (rc == 0) return 0;
  return e.fail("%s: %s failed: %s (ncclResult %d)", what, call, n->GetErrorString(rc), rc);
}

// The communication stream and `n` event pairs (unless KILN_NCCL_SERIAL is set and not 0).
inline int make_stream(Err &e, Comm &c, int n) {
  const char *serial = std::getenv("KILN_NCCL_SERIAL");
  if (serial && *serial && std::strcmp(serial, "0") != 0) return 0;
  if (n > kMaxCollectives)
    return e.fail("%d collectives in one program: at most %d", n, kMaxCollectives);
  const Events &ev = events();
  if (ev.error) return e.fail("%s", ev.error);
  // the highest priority the context offers: NCCL's blocks are scheduled ahead of the
  // compute kernels' waiting blocks, so the collective is not starved by the overlapped work
  int least = 0, greatest = 0;
  const bool prio = ev.PriorityRange && ev.CreateWithPriority &&
                    ev.PriorityRange(&least, &greatest) == CUDA_SUCCESS;
  if (kc::check(e, prio ? ev.CreateWithPriority(&c.stream, CU_STREAM_NON_BLOCKING, greatest)
                        : kc::driver().cuStreamCreate(&c.stream, CU_STREAM_NON_BLOCKING),
                "creating the communication stream")) return 1;
  for (int i = 0; i < n; ++i) {
    if (kc::check(e, ev.Create(&c.ready[i], CU_EVENT_DISABLE_TIMING), "creating an event") ||
        kc::check(e, ev.Create(&c.done[i], CU_EVENT_DISABLE_TIMING), "creating an event")) {
      c.n_events = i + 1;
      return 1;
    }
  }
  c.n_events = n;
  return 0;
}

// A communicator for (rank, world_size) from the ncclUniqueId `id` (128 bytes); `expect`:
// the group size the program was exported for (0: any); `n`: the program's collectives. The
// instance's context is current.
inline int attach(Err &e, Comm &c, CUcontext ctx, int rank, int world_size, int expect,
                  const void *id, size_t len, int n) {
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
  const Nccl *nc = nccl(&why);
  if (!nc) return e.fail("%s", why);
  ncclUniqueId uid;
  std::memcpy(&uid, id, sizeof uid);
  ncclComm_t comm = nullptr;
  if (check(e, nc, nc->CommInitRank(&comm, world_size, uid, rank), "ncclCommInitRank",
            "creating the communicator")) return 1;
  c.release();
  c.n = nc, c.comm = comm, c.ctx = ctx, c.rank = rank, c.size = world_size;
  if (make_stream(e, c, n)) {
    c.release();
    return 1;
  }
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

// Where collective `index` is enqueued: the communication stream, after it waited for the
// compute stream's work so far (the operand's producer); the compute stream when serial.
inline int fork(Err &e, Comm &c, const char *what, int index, CUstream stream, CUstream *on) {
  *on = stream;
  if (!c.stream) return 0;
  if (index < 0 || index >= c.n_events)
    return e.fail("%s: collective %d, the communicator has events for %d", what, index,
                  c.n_events);
  if (kc::check(e, events().Record(c.ready[index], stream), what) ||
      kc::check(e, events().StreamWait(c.stream, c.ready[index], 0), what)) return 1;
  *on = c.stream;
  return 0;
}

// After collective `index` was enqueued on the communication stream: its completion event.
inline int joined(Err &e, Comm &c, const char *what, int index, int rc) {
  if (rc || !c.stream) return rc;
  return kc::check(e, events().Record(c.done[index], c.stream), what);
}

// The compute stream waits for collective `index` (a collective_wait line).
inline int wait(Err &e, Comm &c, int index, CUstream stream) {
  if (!c.stream) return 0;
  if (index < 0 || index >= c.n_events)
    return e.fail("wait for collective %d: the communicator has events for %d", index,
                  c.n_events);
  return kc::check(e, events().StreamWait(stream, c.done[index], 0),
                   "waiting for a collective");
}

inline const void *ptr(CUdeviceptr p) { return reinterpret_cast<const void *>(p); }
inline void *mptr(CUdeviceptr p) { return reinterpret_cast<void *>(p); }

// `T`: an unsigned integer type of the element's size; `dt`: the element's ncclDataType_t
template <class T>
int all_reduce(Err &e, Comm &c, const char *what, int group_size, int reduce, CUdeviceptr out,
               CUdeviceptr in, int64_t n, int dt, CUstream stream, int index) {
  if (ready(e, c, what, group_size)) return 1;
  if (reduce < 0 || reduce > 4) return e.fail("%s: reduce op %d", what, reduce);
  CUstream on;
  if (fork(e, c, what, index, stream, &on)) return 1;
  return joined(e, c, what, index,
                check(e, c.n, c.n->AllReduce(ptr(in), mptr(out), static_cast<size_t>(n), dt,
                                             kOps[reduce], c.comm, on), "ncclAllReduce", what));
}

template <class T>
int all_gather(Err &e, Comm &c, const char *what, int group_size, int, CUdeviceptr out,
               CUdeviceptr in, int64_t n, int dt, CUstream stream, int index) {
  if (ready(e, c, what, group_size)) return 1;
  CUstream on;
  if (fork(e, c, what, index, stream, &on)) return 1;
  return joined(e, c, what, index,
                check(e, c.n, c.n->AllGather(ptr(in), mptr(out), static_cast<size_t>(n), dt,
                                             c.comm, on), "ncclAllGather", what));
}

template <class T>
int reduce_scatter(Err &e, Comm &c, const char *what, int group_size, int reduce,
                   CUdeviceptr out, CUdeviceptr in, int64_t n, int dt, CUstream stream,
                   int index) {
  if (ready(e, c, what, group_size)) return 1;
  if (reduce < 0 || reduce > 4) return e.fail("%s: reduce op %d", what, reduce);
  CUstream on;
  if (fork(e, c, what, index, stream, &on)) return 1;
  return joined(e, c, what, index,
                check(e, c.n, c.n->ReduceScatter(ptr(in), mptr(out),
                                                 static_cast<size_t>(n / c.size), dt,
                                                 kOps[reduce], c.comm, on),
                      "ncclReduceScatter", what));
}

template <class T>
int all_to_all(Err &e, Comm &c, const char *what, int group_size, int, CUdeviceptr out,
               CUdeviceptr in, int64_t n, int dt, CUstream stream, int index) {
  if (ready(e, c, what, group_size)) return 1;
  if (fork(e, c, what, index, stream, &stream)) return 1;
  const size_t block = static_cast<size_t>(n / c.size);
  const size_t bytes = block * sizeof(T);
  if (check(e, c.n, c.n->GroupStart(), "ncclGroupStart", what)) return 1;
  int rc = 0;
  for (int p = 0; p < c.size && rc == 0; ++p) {
    rc = c.n->Send(ptr(in + p * bytes), block, dt, p, c.comm, stream);
    if (rc == 0) rc = c.n->Recv(mptr(out + p * bytes), block, dt, p, c.comm, stream);
  }
  const int end = c.n->GroupEnd();
  return joined(e, c, what, index, check(e, c.n, rc ? rc : end, "ncclSend/ncclRecv", what));
}

}  // namespace kcn
#endif
