// comm.h - the communicator of a model whose program runs collectives (kiln_model_set_comm):
// found through the model library's `kiln_model_comm_v1` table (kiln_model_abi.h).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kiln_model_abi.h"

namespace kiln {

// The collectives table of the library holding `abi`, or NULL when its program has none.
const kiln_model_comm *comm_table(const kiln_model_abi *abi);

// Gives `instance` its communicator (throws kiln::Error naming the cause on failure).
void comm_attach(const kiln_model_abi *abi, void *instance, int rank, int world_size,
                 const void *comm_id, size_t comm_id_len);

// Hands the communicator of `from` over to `to` (no-op for models without collectives).
void comm_move(const kiln_model_abi *abi, void *from, void *to);

}  // namespace kiln
