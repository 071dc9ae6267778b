/* kiln.h - the public, stable C ABI of the kiln runtime (libkiln).
 *
 * A compiled model is one package file ("model.kiln"). libkiln opens it, verifies it, maps its
 * weights and runs the model on DLPack tensors:
 *
 *     kiln_model *m = NULL;
 *     if (kiln_model_load("model.kiln", "cpu", &m) != 0) {
 *       fprintf(stderr, "%s\n", kiln_last_error());
 *       return 1;
 *     }
 *     const DLTensor *in[1] = {&x};
 *     DLManagedTensor *out[1] = {NULL};
 *     if (kiln_model_run(m, in, 1, out, 1) != 0) { ...kiln_last_error()... }
 *     ... use out[0]->dl_tensor ...
 *     out[0]->deleter(out[0]);
 *     kiln_model_free(m);
 *
 * Conventions:
 *  - Every function returning int returns 0 on success and non-zero on failure; a failure sets
 *    the calling thread's error message (kiln_last_error). No function aborts or crashes on a
 *    NULL argument: it fails with a message instead.
 *  - Inputs are borrowed for the duration of the call and never modified.
 *  - Outputs are owned by the caller and must be released with their own deleter, exactly once.
 *    They stay valid after kiln_model_free.
 *  - A kiln_model may be shared between threads: runs on one model are serialised internally;
 *    runs on different models proceed in parallel.
 *  - The ABI is versioned by KILN_ABI_VERSION; functions are only ever added, never changed.
 *    KILN_ABI_MINOR counts the additions (kiln_abi_minor() >= N: the functions of minor N exist).
 *  - Threads (CPU models): a run's kernels use the model instance's own thread pool (no
 *    OpenMP runtime), with a team of max(1, T / active runs), T = OMP_NUM_THREADS when set,
 *    else the CPUs the process may run on, so that several handles used from several threads
 *    share the cores instead of oversubscribing them. kiln_model_set_num_threads gives one
 *    handle a fixed budget instead. (Packages compiled before the pool use their OpenMP: T is
 *    then the calling thread's omp_get_max_threads(), restored when the run returns.)
 */
#ifndef KILN_H
#define KILN_H

#include <stddef.h>
#include <stdint.h>
#include "dlpack.h"

#define KILN_ABI_VERSION 1
/* 1: kiln_abi_minor, kiln_model_set_num_threads, kiln_model_num_threads
 * 2: kiln_cpu_supports
 * 3: kiln_model_set_comm
 * 4: kiln_model_cpu_level
 * 5: entry points (kiln_model_num_entries, kiln_model_entry_name, kiln_model_entry_num_inputs,
 *    kiln_model_entry_num_outputs, kiln_model_run_entry, kiln_model_run_entry_on_stream),
 *    state (kiln_model_reset_state, kiln_model_num_state, kiln_model_state_name,
 *    kiln_model_state_nbytes, kiln_model_read_state, kiln_model_write_state,
 *    kiln_model_copy_state) and kiln_sample
 * 6: per-step profiling (kiln_model_set_profiling, kiln_model_profile_num_steps,
 *    kiln_model_profile_runs, kiln_model_profile_step, kiln_model_profile_write)
 * 7: input and state records (kiln_model_entry_input_name, kiln_model_entry_input_shape,
 *    kiln_model_state_shape) */
#define KILN_ABI_MINOR 7

#if defined(_WIN32)
#define KILN_API
#else
#define KILN_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* An opened, ready-to-run model. Opaque. */
typedef struct kiln_model kiln_model;

/* Returns the ABI version libkiln implements (KILN_ABI_VERSION of the header it was built with).
 * Callers should check it equals the KILN_ABI_VERSION they were compiled against. */
KILN_API int kiln_abi_version(void);

/* Returns KILN_ABI_MINOR of the header libkiln was built with (minor 1 and later). A caller
 * that uses a function added in minor N checks kiln_abi_minor() >= N (a libkiln older than
 * minor 1 does not export this function: look it up with dlsym when that matters). */
KILN_API int kiln_abi_minor(void);

/* Opens the package at package_path for the given device and stores the model in *out.
 * device: "cpu", "cuda" (device 0) or "cuda:N"; it must match the device the package was
 * compiled for (manifest "device"), else loading fails naming both. A CUDA model copies its
 * weights to device N here and runs its kernels there; libcuda.so.1 and cuBLAS are opened at
 * this point (never linked).
 * The package is memory-mapped read-only, its zip structure and the CRC32 of every entry used
 * (manifest.json, lib/model.so, weights.safetensors) are verified, lib/model.so is extracted to
 * the cache directory ($KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln) and loaded,
 * and every weight the model declares is checked (present, dtype, byte size, bounds).
 * On failure *out is set to NULL (when out is not NULL) and non-zero is returned. */
KILN_API int kiln_model_load(const char *package_path, const char *device, kiln_model **out);

/* Number of flat tensor inputs / outputs of the model; -1 when m is NULL. */
KILN_API int64_t kiln_model_num_inputs(const kiln_model *m);
KILN_API int64_t kiln_model_num_outputs(const kiln_model *m);

/* Runs the model. inputs: n_inputs borrowed tensor pointers (none may be NULL); outputs: an array
 * of n_outputs slots that receives newly allocated tensors owned by the caller. Either array may
 * be NULL only when its count is 0. The counts must equal kiln_model_num_inputs/num_outputs
 * (else e.g. "kiln_model_run: expected 2 inputs, got 3"). Each input is validated by the model
 * (dtype, device, rank, sizes); CPU inputs may have any strides (zero and negative included:
 * one that is not compact row-major is copied into a compact buffer of the handle before the
 * run), CUDA inputs must be compact. The first violation is reported as an error message
 * starting with "input <i> (<name>): ". On failure nothing needs freeing: the output slots are
 * untouched (argument errors) or NULL. Thread-safe: concurrent calls on one model are
 * serialised. */
KILN_API int kiln_model_run(kiln_model *m, const DLTensor *const *inputs, int64_t n_inputs,
                            DLManagedTensor **outputs, int64_t n_outputs);

/* Like kiln_model_run, for a CUDA model: every kernel and copy is ordered on cuda_stream (a
 * CUstream / cudaStream_t; NULL is the legacy default stream, which kiln_model_run uses). Inputs
 * must be kDLCUDA tensors on the model's device, ready on that stream; outputs are kDLCUDA
 * tensors, valid once the stream reaches the end of this run; their deleters free them
 * stream-ordered on cuda_stream, which must therefore outlive them. Returns without waiting
 * for the GPU, except for models that index through data (embedding, gather), which check the
 * indices at the end of the run and so synchronise the stream. For a CPU model cuda_stream must
 * be NULL (then this is kiln_model_run). */
KILN_API int kiln_model_run_on_stream(kiln_model *m, const DLTensor *const *inputs,
                                      int64_t n_inputs, DLManagedTensor **outputs,
                                      int64_t n_outputs, void *cuda_stream);

/* The message of the last failure on the calling thread ("" if none). The pointer stays valid
 * until the next failing kiln call on this thread. Successful calls do not clear it. */
/* Replaces every weight with the tensors of a safetensors file, without recompiling. The file
 * must hold every weight the model uses (by its name in the manifest's "weights" list) with the
 * same dtype and byte size; it is memory-mapped and stays mapped while the model uses it.
 * Atomic with respect to kiln_model_run on the same handle: a run in flight completes on the
 * old weights, later runs see only the new ones. On failure the old weights stay in place.
 * Returns 0 on success, non-zero with kiln_last_error() set. */
KILN_API int kiln_model_update_weights(kiln_model *m, const char *safetensors_path);

KILN_API const char *kiln_last_error(void);

/* Thread budget of one handle (minor 1). num_threads > 0: every later run on m uses that many
 * threads (the model's pool caps a team at 256), whatever else runs in the process; 0 (the
 * default): automatic, i.e. max(1, T / CPU runs in flight in the process), T as above.
 * Fails on a NULL model or num_threads outside [0, 4096]. May be called at any time, also
 * while other threads run m: runs that already started keep their team size. No effect on a
 * CUDA model. */
KILN_API int kiln_model_set_num_threads(kiln_model *m, int num_threads);

/* The budget set by kiln_model_set_num_threads (0: automatic); -1 when m is NULL. */
KILN_API int kiln_model_num_threads(const kiln_model *m);

/* Whether this CPU (and the OS, for AVX / AVX-512 / AMX register state) supports the
 * instruction-set extension `feature` (minor 2), named as a package's manifest lists them in
 * requires.cpu_features ("avx2", "fma", "avx512f", "avx512bf16", "amx-tile", ...): 1 yes,
 * 0 no, -1 when the name is unknown to this libkiln or NULL. kiln_model_load checks every
 * feature a package lists before it maps the package's code, and fails naming the missing
 * ones, instead of the process dying with an illegal instruction. */
KILN_API int kiln_cpu_supports(const char *feature);

/* Gives a model whose program runs collectives (torch.distributed's functional collectives:
 * all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single) its
 * communicator (minor 3): this process is `rank` of `world_size` ranks, which must be the
 * process group's size at export. Collective: every rank calls it, each with its own rank and
 * the same comm_id. Runs fail until it succeeded.
 *  - CUDA packages (NCCL): comm_id is a 128-byte ncclUniqueId made by one rank with
 *    ncclGetUniqueId (Python: kiln.runtime.nccl_unique_id()) and passed to all of them;
 *    libnccl.so.2 is opened here ($KILN_NCCL_LIB, else the one on the loader's path); NVLink
 *    SHARP (NVLS) is turned off unless NCCL_NVLS_ENABLE is set. Collectives are enqueued on
 *    the run's stream.
 *  - CPU packages (MPI): the processes are started by mpirun; libmpi (Open MPI) is opened here
 *    ($KILN_MPI_LIB, else libmpi.so.40) and initialised unless the process did it. The ranks
 *    passing the same comm_id bytes (any length, may be NULL with length 0) form one
 *    communicator of MPI_COMM_WORLD, ordered by `rank`.
 * kiln_model_update_weights keeps the communicator. Fails on a model without collectives. */
KILN_API int kiln_model_set_comm(kiln_model *m, int rank, int world_size, const void *comm_id,
                                 size_t comm_id_len);

/* The -march level of the code kiln_model_load mapped (minor 4): for a portable package
 * (kiln.Options(march="portable"), manifest requires.cpu_levels) the first of its levels whose
 * features this CPU has, e.g. "x86-64-v4"; else the package's one build (build.march:
 * "native", "x86-64-v3", "" when compiled without -march). Valid until kiln_model_free; NULL
 * when m is NULL. */
KILN_API const char *kiln_model_cpu_level(const kiln_model *m);

/* Entry points (minor 5). A package compiled from several programs (kiln.compile({"prefill":
 * ..., "decode": ...})) has one entry point per program; they share the package's weights and
 * the model's state buffers (the buffers the programs update, e.g. a KV cache: one copy per
 * kiln_model, read and written by every entry point). A package of one program has one entry
 * point, "forward". kiln_model_run, kiln_model_num_inputs and kiln_model_num_outputs are those
 * of the first entry point. */
KILN_API int64_t kiln_model_num_entries(const kiln_model *m);  /* -1 when m is NULL */
/* The name of entry point i in [0, kiln_model_num_entries); valid until kiln_model_free; NULL
 * (with kiln_last_error set) when m is NULL or i out of range. */
KILN_API const char *kiln_model_entry_name(const kiln_model *m, int64_t i);
/* Flat inputs / outputs of the named entry point; -1 (kiln_last_error names the entry points
 * the package has) when there is no such entry. */
KILN_API int64_t kiln_model_entry_num_inputs(const kiln_model *m, const char *entry);
KILN_API int64_t kiln_model_entry_num_outputs(const kiln_model *m, const char *entry);
/* kiln_model_run / kiln_model_run_on_stream of the named entry point; an unknown name fails
 * with "kiln_model_run_entry: package '<path>' has no entry point '<name>' (its entry points:
 * prefill, decode)". Runs of all entry points of one model are serialised. */
KILN_API int kiln_model_run_entry(kiln_model *m, const char *entry, const DLTensor *const *inputs,
                                  int64_t n_inputs, DLManagedTensor **outputs,
                                  int64_t n_outputs);
KILN_API int kiln_model_run_entry_on_stream(kiln_model *m, const char *entry,
                                            const DLTensor *const *inputs, int64_t n_inputs,
                                            DLManagedTensor **outputs, int64_t n_outputs,
                                            void *cuda_stream);

/* State (minor 5): the buffers the model's programs update (registered buffers written in
 * place: a KV cache, a counter, batch-norm running statistics), one copy per kiln_model.
 * kiln_model_reset_state sets every one back to its value in the package (or in the weights
 * given to kiln_model_update_weights, which also resets them). The others need a package
 * written by a kiln with state functions (manifest "state_abi"), else they fail saying so:
 * kiln_model_num_state counts the buffers (0 for such an older package; -1 when m is NULL),
 * kiln_model_state_name is the name of buffer i (its key in the package's weights, e.g.
 * "b_key_cache_0"), kiln_model_state_nbytes its size (-1 on error); read / write copy all of
 * its bytes to / from host memory (nbytes must equal its size; synchronous; for a CUDA model
 * ordered on the legacy default stream, so a caller whose runs use another stream
 * synchronises that stream first; the same holds for reset). kiln_model_copy_state copies every state buffer of src into dst (two handles of
 * the same package: e.g. to fork a conversation's KV cache). None of them may overlap a run
 * on the same model from another thread: they wait for it. */
KILN_API int kiln_model_reset_state(kiln_model *m);
KILN_API int64_t kiln_model_num_state(const kiln_model *m);
KILN_API const char *kiln_model_state_name(const kiln_model *m, int64_t i);
KILN_API int64_t kiln_model_state_nbytes(const kiln_model *m, int64_t i);
KILN_API int kiln_model_read_state(kiln_model *m, int64_t i, void *host, size_t nbytes);
KILN_API int kiln_model_write_state(kiln_model *m, int64_t i, const void *host, size_t nbytes);
KILN_API int kiln_model_copy_state(kiln_model *dst, kiln_model *src);

/* The next token from logits (minor 5): the last row of `logits` (shape [..., V], host
 * memory, any strides; float32, float64, float16 or bfloat16) -> *token in [0, V).
 * temperature <= 0: greedy, the first index of the largest logit (rng_state unused, may be
 * NULL). Otherwise p = softmax(logits / temperature); top_k > 0 keeps the k most likely
 * tokens (0: all); then 0 < top_p < 1 keeps the fewest most likely tokens whose probability
 * mass reaches top_p (0 or 1: all); one token is drawn from the kept ones, renormalised, with
 * the next number of the generator whose 64-bit state is *rng_state (splitmix64; set it to a
 * seed once, then pass it to every call: the same seed gives the same tokens anywhere).
 * Returns 0, or non-zero with kiln_last_error() set (bad arguments, NaN logits). */
KILN_API int kiln_sample(const DLTensor *logits, float temperature, int64_t top_k, float top_p,
                         uint64_t *rng_state, int64_t *token);

/* Input and state records (minor 7), as the package's manifest records them: e.g. to tell a
 * batched decoder (prefill(input_ids [B, T], lengths [B])) from a batch-1 one
 * (prefill(input_ids [1, T], cache_position [T])), and its batch and cache length, before
 * running it (examples/c/generate.c).
 *  - kiln_model_entry_input_name: the name of flat input i of the named entry point ("" when
 *    the record has none); valid until kiln_model_free; NULL (kiln_last_error set) for an
 *    unknown entry, i out of range, or a package written before inputs were recorded.
 *  - kiln_model_entry_input_shape / kiln_model_state_shape: the rank of input i of the entry
 *    / of state buffer i (kiln_model_state_name), its sizes written to shape[0 .. min(rank,
 *    capacity)) with -1 for a dynamic size (one given at run time, e.g. a prompt length);
 *    -1 on error (as above; shape may be NULL only when capacity is 0). */
KILN_API const char *kiln_model_entry_input_name(const kiln_model *m, const char *entry,
                                                 int64_t i);
KILN_API int64_t kiln_model_entry_input_shape(const kiln_model *m, const char *entry, int64_t i,
                                              int64_t *shape, int64_t capacity);
KILN_API int64_t kiln_model_state_shape(const kiln_model *m, int64_t i, int64_t *shape,
                                        int64_t capacity);

/* Per-step profiling of CPU models (minor 6). Every CPU package's compiled wrapper times each
 * of its steps (a fused kernel, a GEMM, a library routine, an ATen fallback call) when
 * profiling is on for its model: two clock reads around the step, in the C++ itself. Off (the
 * default) a run pays one predictable branch per step and reads no clock.
 *  - kiln_model_set_profiling(m, 1) turns it on for every later run of every entry point of m
 *    (and clears the counters when it was off); 0 turns it off (the counters stay readable).
 *    Fails for a CUDA model (its kernels are timed on the device: `kiln profile`).
 *  - The environment variable KILN_PROFILE, set (not "0") when kiln_model_load runs, turns it
 *    on at load, and kiln_model_free writes the summary (kiln_model_profile_write): to stderr
 *    for KILN_PROFILE=1, else appended to the file KILN_PROFILE names.
 *  - kiln_model_profile_num_steps: the steps of the entry point (NULL: the default one), in
 *    program order; 0 for a package without the hooks (CUDA, or compiled before them); -1 on
 *    error. kiln_model_profile_runs: the profiled runs that succeeded since profiling was
 *    turned on.
 *  - kiln_model_profile_step: step i's name (the manifest's "kernels" name), kind ("cpp",
 *    "blas_gemm", "cpp_gemm", "lib.<routine>", "aten.<op>"), source ops (the graph nodes it
 *    computes, comma-separated), its seconds in the last profiled run and summed over the
 *    profiled runs (a step run several times in one run, e.g. in a loop, counts each time).
 *    Any output pointer may be NULL. Strings stay valid until kiln_model_free.
 *  - kiln_model_profile_write: every entry point's summary as text (a '#' header, then one
 *    tab-separated row per step, slowest first: name, kind, total ms, mean us per run, share
 *    of the steps' total, source ops), to stderr when path is NULL or "-", else appended to
 *    the file at path.
 * These wait for a run in flight on m. */
KILN_API int kiln_model_set_profiling(kiln_model *m, int on);
KILN_API int64_t kiln_model_profile_num_steps(kiln_model *m, const char *entry);
KILN_API int64_t kiln_model_profile_runs(kiln_model *m, const char *entry);
KILN_API int kiln_model_profile_step(kiln_model *m, const char *entry, int64_t i,
                                     const char **name, const char **kind,
                                     const char **source_ops, double *last_seconds,
                                     double *total_seconds);
KILN_API int kiln_model_profile_write(kiln_model *m, const char *path);

/* Releases a model (its weights mapping and instance). NULL is allowed and does nothing.
 * Outputs produced earlier stay valid. Must not be called while a run on m is in progress. */
KILN_API void kiln_model_free(kiln_model *m);

#ifdef __cplusplus
}
#endif
#endif /* KILN_H */
