/* kiln_comm_mpi.h - collectives of CPU packages through MPI (namespace kc), compiled into a
 * generated model.so only when its program has collectives (lowering/collectives.py).
 *
 * MPI is not linked: libmpi is opened with dlopen the first time an instance is given a
 * communicator ($KILN_MPI_LIB, else libmpi.so.40, else libmpi.so), so packages without
 * collectives, and the processes that never attach one, need no MPI at all. The binding is
 * Open MPI's ABI (Debian's libopenmpi: handles are pointers to the library's predefined
 * objects, looked up by their symbol names, ompi_mpi_comm_world, ompi_mpi_float, ...).
 *
 * MPI is initialised (MPI_THREAD_MULTIPLE asked) unless the process already did it (mpi4py,
 * the caller's own MPI_Init); then it is finalised at exit only when kiln initialised it.
 * Processes are started by `mpirun -n N`. An instance's communicator is
 * MPI_Comm_split(MPI_COMM_WORLD, color = a hash of comm_id (0 without one), key = rank): the
 * ranks that pass the same comm_id form one communicator, ordered by the rank each passes,
 * which must be their rank in it. Every collective is a blocking call on that communicator
 * (the functional collective returns a fresh buffer, the input is only read). */
#ifndef KILN_COMM_MPI_H
#define KILN_COMM_MPI_H
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kiln_model_rt.h"

namespace kc {

// Open MPI's handle types are pointers; MPI_Status is passed as MPI_STATUS_IGNORE (NULL)
using Handle = void *;

struct Mpi {
  void *lib = nullptr;
  char error[512] = {0};
  int (*Initialized)(int *) = nullptr;
  int (*Finalized)(int *) = nullptr;
  int (*Init_thread)(int *, char ***, int, int *) = nullptr;
  int (*Finalize)(void) = nullptr;
  int (*Comm_split)(Handle, int, int, Handle *) = nullptr;
  int (*Comm_free)(Handle *) = nullptr;
  int (*Comm_rank)(Handle, int *) = nullptr;
  int (*Comm_size)(Handle, int *) = nullptr;
  int (*Allreduce)(const void *, void *, int, Handle, Handle, Handle) = nullptr;
  int (*Allgather)(const void *, int, Handle, void *, int, Handle, Handle) = nullptr;
  int (*Reduce_scatter_block)(const void *, void *, int, Handle, Handle, Handle) = nullptr;
  int (*Alltoall)(const void *, int, Handle, void *, int, Handle, Handle) = nullptr;
  int (*Error_string)(int, char *, int *) = nullptr;
  Handle world = nullptr;
  Handle ops[5] = {};  // REDUCE_OPS order: sum, avg (a sum, then divided), max, min, product
  bool initialised_here = false;
};

inline void finalize_at_exit();

// The process's MPI binding, loaded once; NULL with the reason in *why on failure.
inline Mpi *mpi(const char **why) {
  static Mpi m;
  static std::once_flag once;
  std::call_once(once, [] {
    const char *env = std::getenv("KILN_MPI_LIB");
    const char *names[] = {env && *env ? env : "libmpi.so.40", "libmpi.so.40", "libmpi.so"};
    for (const char *n : names) {
      // RTLD_GLOBAL: Open MPI's plugins resolve symbols of libmpi itself
      if ((m.lib = ::dlopen(n, RTLD_NOW | RTLD_GLOBAL))) break;
    }
    if (!m.lib) {
      const char *d = ::dlerror();
      std::snprintf(m.error, sizeof m.error, "cannot open the MPI library (libmpi.so.40; set "
                    "KILN_MPI_LIB, or install Open MPI: apt-get install libopenmpi-dev): %s",
                    d ? d : "not found");
      return;
    }
    bool ok = true;
    auto sym = [&](const char *name) {
      void *p = ::dlsym(m.lib, name);
      if (!p && ok) {
        ok = false;
        std::snprintf(m.error, sizeof m.error, "the MPI library lacks %s (kiln binds Open MPI's "
                      "ABI)", name);
      }
      return p;
    };
#define KC_BIND(f) m.f = reinterpret_cast<decltype(m.f)>(sym("MPI_" #f))
    KC_BIND(Initialized); KC_BIND(Finalized); KC_BIND(Init_thread); KC_BIND(Finalize);
    KC_BIND(Comm_split); KC_BIND(Comm_free); KC_BIND(Comm_rank); KC_BIND(Comm_size);
    KC_BIND(Allreduce); KC_BIND(Allgather); KC_BIND(Reduce_scatter_block); KC_BIND(Alltoall);
    KC_BIND(Error_string);
#undef KC_BIND
    m.world = sym("ompi_mpi_comm_world");
    const char *ops[5] = {"ompi_mpi_op_sum", "ompi_mpi_op_sum", "ompi_mpi_op_max",
                          "ompi_mpi_op_min", "ompi_mpi_op_prod"};
    for (int i = 0; i < 5; ++i) m.ops[i] = sym(ops[i]);
    if (!ok) return;
    int done = 0;
    m.Initialized(&done);
    if (!done) {
      int provided = 0;
      if (m.Init_thread(nullptr, nullptr, 3 /* MPI_THREAD_MULTIPLE */, &provided) != 0) {
        std::snprintf(m.error, sizeof m.error, "MPI_Init_thread failed");
        return;
      }
      m.initialised_here = true;
      std::atexit(finalize_at_exit);
    }
  });
  if (m.error[0]) {
    *why = m.error;
    return nullptr;
  }
  return &m;
}

inline void finalize_at_exit() {
  const char *why = nullptr;
  Mpi *m = mpi(&why);
  int done = 1;
  if (m && m->initialised_here && m->Finalized(&done) == 0 && !done) m->Finalize();
}

inline bool finalized(Mpi *m) {
  int done = 1;
  return !m || m->Finalized(&done) != 0 || done;
}

template <class T> const char *mpi_type();
template <> inline const char *mpi_type<float>() { return "ompi_mpi_float"; }
template <> inline const char *mpi_type<double>() { return "ompi_mpi_double"; }
template <> inline const char *mpi_type<int64_t>() { return "ompi_mpi_int64_t"; }
template <> inline const char *mpi_type<int32_t>() { return "ompi_mpi_int32_t"; }
template <> inline const char *mpi_type<int16_t>() { return "ompi_mpi_int16_t"; }
template <> inline const char *mpi_type<int8_t>() { return "ompi_mpi_int8_t"; }
template <> inline const char *mpi_type<uint8_t>() { return "ompi_mpi_uint8_t"; }
template <> inline const char *mpi_type<bool>() { return "ompi_mpi_c_bool"; }

// One instance's communicator (moved, never copied, between instances of one model).
struct Comm {
  Mpi *m = nullptr;
  Handle comm = nullptr;
  int rank = -1;
  int size = 0;
  Comm() = default;
  Comm(const Comm &) = delete;
  Comm &operator=(const Comm &) = delete;
  ~Comm() { release(); }
  void release() {
    if (comm && !finalized(m)) m->Comm_free(&comm);
    comm = nullptr;
  }
  void take(Comm &other) {
    release();
    m = other.m, comm = other.comm, rank = other.rank, size = other.size;
    other.comm = nullptr;
  }
};

inline uint32_t color_of(const void *id, size_t len) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (size_t i = 0; i < len; ++i) h = (h ^ static_cast<const unsigned char *>(id)[i]) * 16777619u;
  return len ? h & 0x3fffffffu : 0u;
}

// A communicator for (rank, world_size) among the ranks passing the same comm_id; `expect`:
// the group size the program was exported for (0: any).
inline int attach(kr::Err &e, Comm &c, int rank, int world_size, int expect, const void *id,
                  size_t len) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return e.fail("rank %d and world_size %d: expected 0 <= rank < world_size", rank,
                  world_size);
  }
  if (expect > 0 && world_size != expect) {
    return e.fail("the program was exported for a process group of %d ranks, got world_size "
                  "%d (shapes depend on it: export again for %d ranks)", expect, world_size,
                  world_size);
  }
  const char *why = nullptr;
  Mpi *m = mpi(&why);
  if (!m) return e.fail("%s", why);
  Handle comm = nullptr;
  if (m->Comm_split(m->world, static_cast<int>(color_of(id, len)), rank, &comm) != 0 || !comm) {
    return e.fail("MPI_Comm_split failed");
  }
  int r = -1, n = 0;
  m->Comm_rank(comm, &r);
  m->Comm_size(comm, &n);
  if (n != world_size || r != rank) {
    m->Comm_free(&comm);
    return e.fail("the MPI processes passing this comm_id are %d (this one is rank %d of them), "
                  "but rank=%d world_size=%d were given (start the processes with mpirun -n %d, "
                  "each passing its own rank)", n, r, rank, world_size, world_size);
  }
  c.release();
  c.m = m, c.comm = comm, c.rank = rank, c.size = world_size;
  return 0;
}

template <class T>
inline int ready(kr::Err &e, Comm &c, const char *what, int group_size, int64_t count,
                 Handle *type) {
  if (!c.comm) {
    return e.fail("%s: this package runs collectives and its instance has no communicator (load "
                  "it with rank=, world_size= (and comm_id=); C: kiln_model_set_comm)", what);
  }
  if (group_size > 0 && c.size != group_size) {
    return e.fail("%s: exported for %d ranks, the communicator has %d", what, group_size, c.size);
  }
  if (count > 0x7fffffff) return e.fail("%s: %lld elements, more than MPI's int count", what,
                                        static_cast<long long>(count));
  *type = ::dlsym(c.m->lib, mpi_type<T>());
  if (!*type) return e.fail("%s: no MPI datatype %s", what, mpi_type<T>());
  return 0;
}

inline int check(kr::Err &e, Comm &c, int rc, const char *call, const char *what) {
  if (rc == 0) return 0;
  char msg[256] = {0};
  int n = 0;
  c.m->Error_string(rc, msg, &n);
  return e.fail("%s: %s failed: %s", what, call, msg);
}

template <class T> void divide(T *out, int64_t n, int by) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(out[i] / by);
}

// out[n] = reduce over ranks of in[n]
template <class T>
int all_reduce(kr::Err &e, Comm &c, const char *what, int group_size, int reduce, T *out,
               const T *in, int64_t n) {
  Handle type = nullptr;
  if (ready<T>(e, c, what, group_size, n, &type)) return 1;
  if (reduce < 0 || reduce > 4) return e.fail("%s: reduce op %d", what, reduce);
  if (check(e, c, c.m->Allreduce(in, out, static_cast<int>(n), type, c.m->ops[reduce], c.comm),
            "MPI_Allreduce", what)) return 1;
  if (reduce == 1) divide(out, n, c.size);
  return 0;
}

// out[size * n] = the ranks' in[n], in rank order
template <class T>
int all_gather(kr::Err &e, Comm &c, const char *what, int group_size, int, T *out, const T *in,
               int64_t n) {
  Handle type = nullptr;
  if (ready<T>(e, c, what, group_size, n * (group_size > 0 ? group_size : 1), &type)) return 1;
  return check(e, c, c.m->Allgather(in, static_cast<int>(n), type, out, static_cast<int>(n),
                                    type, c.comm), "MPI_Allgather", what);
}

// out[n / size] = block `rank` of the reduction over ranks of in[n]
template <class T>
int reduce_scatter(kr::Err &e, Comm &c, const char *what, int group_size, int reduce, T *out,
                   const T *in, int64_t n) {
  Handle type = nullptr;
  if (ready<T>(e, c, what, group_size, n, &type)) return 1;
  if (reduce < 0 || reduce > 4) return e.fail("%s: reduce op %d", what, reduce);
  const int64_t block = n / c.size;
  if (check(e, c, c.m->Reduce_scatter_block(in, out, static_cast<int>(block), type,
                                            c.m->ops[reduce], c.comm),
            "MPI_Reduce_scatter_block", what)) return 1;
  if (reduce == 1) divide(out, block, c.size);
  return 0;
}

// block j of out[n] = block `rank` of rank j's in[n] (n / size elements a block)
template <class T>
int all_to_all(kr::Err &e, Comm &c, const char *what, int group_size, int, T *out, const T *in,
               int64_t n) {
  Handle type = nullptr;
  if (ready<T>(e, c, what, group_size, n, &type)) return 1;
  const int block = static_cast<int>(n / c.size);
  return check(e, c, c.m->Alltoall(in, block, type, out, block, type, c.comm), "MPI_Alltoall",
               what);
}

}  // namespace kc
#endif
