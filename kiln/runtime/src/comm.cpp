// comm.cpp - kiln_model_set_comm's part: find the model library's collectives table and
// call it. The communicator itself (MPI or NCCL, both opened with dlopen) lives in the model
// library (kiln_comm_mpi.h, kiln_comm_nccl.h), one per instance.
#include "comm.h"

#include <dlfcn.h>

#include "error.h"

namespace kiln {

const kiln_model_comm *comm_table(const kiln_model_abi *abi) {
  if (!abi) return nullptr;
  // the table is static data of the model library: find that library, already loaded
  Dl_info info{};
  if (!::dladdr(static_cast<const void *>(abi), &info) || !info.dli_fname) return nullptr;
  void *lib = ::dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
  if (!lib) return nullptr;
  void *sym = ::dlsym(lib, KILN_MODEL_COMM_SYMBOL);
  ::dlclose(lib);  // drops the reference RTLD_NOLOAD took; the loader keeps its own
  if (!sym) return nullptr;
  const kiln_model_comm *t = reinterpret_cast<kiln_model_comm_fn>(sym)();
  return t && t->version >= 1 && t->attach && t->move ? t : nullptr;
}

void comm_attach(const kiln_model_abi *abi, void *instance, int rank, int world_size,
                 const void *comm_id, size_t comm_id_len) {
  const kiln_model_comm *t = comm_table(abi);
  if (!t) {
    fail("kiln_model_set_comm: this package's program runs no collectives (export it with "
         "torch.distributed._functional_collectives to run it on several ranks)");
  }
  if (comm_id_len && !comm_id) fail("kiln_model_set_comm: comm_id is NULL, comm_id_len %zu",
                                    comm_id_len);
  char err[1024] = {0};
  if (t->attach(instance, rank, world_size, comm_id, comm_id_len, err, sizeof err) != 0) {
    err[sizeof err - 1] = '\0';
    fail("kiln_model_set_comm (%s, rank %d of %d): %s", t->backend ? t->backend : "?", rank,
         world_size, err[0] ? err : "(no message)");
  }
}

void comm_move(const kiln_model_abi *abi, void *from, void *to) {
  const kiln_model_comm *t = comm_table(abi);
  if (t) t->move(from, to);
}

}  // namespace kiln
