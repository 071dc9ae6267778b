/* kiln_model_abi.h - the internal contract between the kiln runtime (libkiln) and one generated
 * model library (lib/model.so inside a package).
 *
 * Every generated model.so exports exactly one symbol, `kiln_model_abi_v1`, returning a pointer to
 * a static table. libkiln (the public C API in kiln.h) opens the package, maps the weights and
 * drives the model only through this table. Users never include this header.
 *
 * Ownership rules:
 *  - weights: create() receives n_weights read-only pointers (into the memory-mapped safetensors
 *    blob), in the order of weight_names; they stay valid until destroy().
 *  - run(): inputs are borrowed; the model validates every one (count, dtype, device, rank, sizes,
 *    Dim ranges, strides) and reports the first violation through err. libkiln passes CPU
 *    inputs compact: one with other strides is copied into a compact buffer first (copy_in.h). On success it fills
 *    outputs[0..n_outputs) with freshly allocated DLManagedTensors the caller owns (the deleter
 *    frees them; it lives in model.so, which libkiln therefore never unloads).
 *  - One instance is not re-entrant: libkiln serialises run() calls per instance.
 */
#ifndef KILN_MODEL_ABI_H
#define KILN_MODEL_ABI_H
#include <stddef.h>
#include <stdint.h>
#include "dlpack.h"

#define KILN_MODEL_ABI_VERSION 1u

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_model_abi {
  uint32_t abi_version;              /* KILN_MODEL_ABI_VERSION */
  int64_t n_inputs;                  /* flat user inputs */
  int64_t n_outputs;                 /* flat user outputs */
  int64_t n_weights;
  const char *const *weight_names;   /* safetensors keys, n_weights entries */
  const int64_t *weight_nbytes;      /* expected byte size of each weight */
  const char *const *weight_dtypes;  /* safetensors dtype strings ("F32", "I64", ...) */
  /* Returns an instance or NULL (message in err). */
  void *(*create)(const void *const *weights, char *err, size_t errlen);
  /* Returns 0 on success, non-zero with a message in err. */
  int (*run)(void *instance, const DLTensor *const *inputs, int64_t n_inputs,
             DLManagedTensor **outputs, int64_t n_outputs, char *err, size_t errlen);
  void (*destroy)(void *instance);
  /* Added for device models; read by libkiln only when the package manifest names a device
   * other than "cpu" (older CPU-only tables end at destroy). device_type: kDLCPU or kDLCUDA.
   * run_on_stream: like run, with every kernel ordered on `stream` (a CUstream; NULL is the
   * legacy default stream); outputs are device tensors ready when the stream reaches them.
   * create_on_device: like create, on CUDA device `device_id`; `weights` are host pointers,
   * copied to the device before it returns. Both are NULL in CPU models. */
  int32_t device_type;
  int (*run_on_stream)(void *instance, const DLTensor *const *inputs, int64_t n_inputs,
                       DLManagedTensor **outputs, int64_t n_outputs, void *stream, char *err,
                       size_t errlen);
  void *(*create_on_device)(int32_t device_id, const void *const *weights, char *err,
                            size_t errlen);
  /* Added for state (read by libkiln only when the manifest has "state_abi": 1; older tables
   * end at create_on_device). k indexes the weights; a state weight is one the program updates
   * (a KV cache, a counter), of which each instance owns a writable copy (device memory on
   * CUDA), initialised from `weights` at create.
   *  - state_buffer: the address of state weight k; NULL when weight k is not state.
   *  - share_state: the instance uses `buffer` (state_buffer of another instance of the same
   *    package, same bytes) for state k from now on, instead of its own copy; the buffer stays
   *    its owner's, which libkiln destroys last. Called before the first run (libkiln: the
   *    entry points of one package share their state buffers by name).
   *  - read_state / write_state: copy weight_nbytes[k] bytes of state k to / from host memory,
   *    synchronously (libkiln: reset, and copying a cache between handles). */
  void *(*state_buffer)(void *instance, int64_t k);
  int (*share_state)(void *instance, int64_t k, void *buffer, char *err, size_t errlen);
  int (*read_state)(void *instance, int64_t k, void *host, char *err, size_t errlen);
  int (*write_state)(void *instance, int64_t k, const void *host, char *err, size_t errlen);
  /* Added for one upload of the weights per loaded package on a device (read by libkiln only
   * for device models whose manifest has "state_abi" >= 2; older tables end at write_state,
   * CPU tables leave them NULL). create_on_device then accepts NULL in `weights`: weight k is
   * neither allocated nor uploaded, and the caller gives the instance another instance's
   * device copy with share_weight before the first run (libkiln: the entry points of one
   * package share every weight stored under one key, each uploaded by the first entry that
   * has it, which libkiln destroys last).
   *  - weight_buffer: the device address of weight k (NULL when not uploaded or k is out of
   *    range).
   *  - share_weight: the instance reads weight k from `buffer` (weight_buffer of another
   *    instance, same bytes) from now on; the buffer stays its owner's. */
  void *(*weight_buffer)(void *instance, int64_t k);
  int (*share_weight)(void *instance, int64_t k, void *buffer, char *err, size_t errlen);
} kiln_model_abi;

typedef const kiln_model_abi *(*kiln_model_abi_fn)(void);
#define KILN_MODEL_ABI_SYMBOL "kiln_model_abi_v1"

/* Models whose program runs collectives (torch's functional collectives) also export
 * `kiln_model_comm_v1`, returning this table; libkiln looks it up with dlsym
 * (kiln_model_set_comm). attach gives an instance its communicator: this process is `rank` of
 * `world_size` ranks joined by `comm_id` (NCCL: a 128-byte ncclUniqueId; MPI: any bytes, the
 * ranks passing the same bytes form the communicator; may be empty). It is collective: every
 * rank calls it. move hands the communicator of instance `from` over to `to` (a fresh instance
 * made by kiln_model_update_weights), leaving `from` without one. */
typedef struct kiln_model_comm {
  uint32_t version;          /* 1 */
  int32_t world_size;        /* the process group's size at export; 0: any */
  const char *backend;       /* "mpi" (CPU) or "nccl" (CUDA) */
  int (*attach)(void *instance, int32_t rank, int32_t world_size, const void *comm_id,
                size_t comm_id_len, char *err, size_t errlen);
  void (*move)(void *from, void *to);
} kiln_model_comm;

typedef const kiln_model_comm *(*kiln_model_comm_fn)(void);
#define KILN_MODEL_COMM_SYMBOL "kiln_model_comm_v1"

/* Models printed with per-step profiling hooks (CPU packages) also export
 * `kiln_model_prof_v1`, returning this table; libkiln looks it up with dlsym (kiln.h,
 * kiln_model_set_profiling). Step i of a run is one call of the program: a fused kernel, a
 * GEMM, a library routine or an ATen fallback call, named as the manifest's "kernels" name it,
 * with its kind and its graph's source ops (comma-separated). attach(instance, ns) makes the
 * instance's later runs add each step's wall time, in nanoseconds, to ns[i] (n_steps slots,
 * owned by the caller; a step run several times in one run, e.g. inside a loop, adds each
 * time); attach(instance, NULL) stops it. Detached (the default), a run pays one predictable
 * branch per step and reads no clock. */
typedef struct kiln_model_prof {
  uint32_t version;                  /* 1 */
  int64_t n_steps;
  const char *const *step_names;
  const char *const *step_kinds;
  const char *const *step_sources;
  void (*attach)(void *instance, uint64_t *ns);
} kiln_model_prof;

typedef const kiln_model_prof *(*kiln_model_prof_fn)(void);
#define KILN_MODEL_PROF_SYMBOL "kiln_model_prof_v1"

#ifdef __cplusplus
}
#endif
#endif
