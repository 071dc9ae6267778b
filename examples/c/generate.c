/* generate.c - generate tokens from C with a kiln package of two entry points, "prefill" and
 * "decode" (e.g. kiln.models.hf_decoder.export_decoder of a Hugging Face decoder), sharing the
 * weights and the KV cache of one loaded model.
 *
 * Usage: generate [-n MAX_NEW] [-T TEMPERATURE] [-k TOP_K] [-p TOP_P] [-s SEED] [-e STOP]
 *                 [-t THREADS] [-d DEVICE] <package.kiln> <id,id,...> [<id,id,...> ...]
 *
 * The loop: prefill runs the whole prompt (input_ids int64 [1, T], cache_position int64 [T] =
 * 0..T-1) and fills the cache; every decode step runs one token (input_ids [1, 1],
 * cache_position [1] = its position). Each next token is chosen by kiln_sample from the last
 * row of the logits: greedy without -T (or -T 0), else temperature / top-k / top-p sampling
 * with a generator seeded by -s (the same seed gives the same tokens, here and in
 * `kiln generate`, which calls the same function). Prints
 *     tokens: t1,t2,...
 *     prefill: <T> tokens in <ms> ms; decode: <n> tokens, <ms> ms/token, <x> tokens/s
 * -e STOP ends the generation at token STOP (printed as the last token; with -d cuda the device
 * loop runs its MAX_NEW steps and the tokens are cut after the first STOP).
 *
 * A batched package (kiln.models.batched_decoder.export_batched: prefill(input_ids int64 [B, T],
 * lengths int64 [B]), decode(input_ids int64 [B, 1], positions int64 [B]), both -> logits
 * [B, vocab]; told apart by its input names and shapes, kiln_model_entry_input_name / _shape,
 * libkiln minor 7) takes up to B prompts, one positional id list each, of any lengths: the
 * loop of kiln.runtime.generate_batch. One prefill of the prompts padded with 0 to the longest
 * (rows past the prompts run the one-token dummy prompt 0), then decode steps of the whole
 * batch, each sequence at its own position (its length, then one more per step). Sequence b
 * samples from row b of the logits with its own generator, seeded with SEED + b; one that
 * generates STOP ends there while the others go on; the loop ends when every prompt's
 * sequence has ended or has MAX_NEW tokens. Prints
 *     tokens[b]: t1,t2,...        (one line per prompt, in order)
 *     batch <B> (<n> prompts); prefill: <ms> ms; decode: <steps> steps, <ms> ms/step, <x> tokens/s
 * The same options give the same tokens as `kiln generate PKG --prompt-ids ... --prompt-ids
 * ...` and generate_batch. Usage errors (exit status 2): more prompts than B, an empty or
 * malformed prompt, a prompt that with MAX_NEW tokens does not fit the cache (longest + MAX_NEW
 * - 1 > its length), several prompts for a batch-1 package; batched packages run on the CPU
 * only here (-d cuda: use `kiln generate`).
 *
 * Exit status: 0 on success, 1 when kiln reports an error (kiln_last_error() on stderr), 2 on
 * usage errors.
 *
 * -d cuda[:N] runs a CUDA package on GPU N. Its inputs live in device memory (allocated here
 * through the CUDA driver, opened with dlopen: nothing to link), and a package with a "sample"
 * entry point (hf_decoder.export_decoder(..., sampler=device_sampler.export_sampler)) samples
 * on the device: its outputs, the next input_ids [1, 1] and cache_position [1], are the next
 * decode's inputs, so no step waits for the host; the tokens are copied back at the end. The
 * sampler is a counter-based one of its own (kiln/models/device_sampler.py): greedy gives the
 * host's tokens, a seed gives the same tokens on every run (not the host sampler's).
 */
#define _POSIX_C_SOURCE 199309L
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kiln.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int usage(void) {
  fprintf(stderr, "usage: generate [-n MAX_NEW] [-T TEMPERATURE] [-k TOP_K] [-p TOP_P] "
                  "[-s SEED] [-e STOP] [-t THREADS] [-d DEVICE] <package.kiln> <id,id,...> "
                  "[<id,id,...> ...]\n"
                  "  (several id lists: one prompt each, for a batched package)\n");
  return 2;
}

/* "1,2,3" -> ids (malloc'd), *n; -1 on a malformed list. */
static int parse_ids(const char *text, int64_t **ids, int64_t *n) {
  size_t cap = 1;
  for (const char *c = text; *c; ++c) cap += *c == ',';
  *ids = malloc(cap * sizeof(int64_t));
  *n = 0;
  if (!*ids) return -1;
  const char *c = text;
  while (*c) {
    char *end = NULL;
    long long v = strtoll(c, &end, 10);
    if (end == c || (*end && *end != ',')) return -1;
    (*ids)[(*n)++] = v;
    c = *end ? end + 1 : end;
  }
  return *n > 0 ? 0 : -1;
}

/* A host int64 tensor over data (contiguous). */
static DLTensor int64_tensor(int64_t *data, int32_t ndim, int64_t *shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.dtype.code = kDLInt;
  t.dtype.bits = 64;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

/* Runs entry `name` on (input_ids, cache_position), then samples the next token. */
static int step(kiln_model *m, const char *name, int64_t *ids, int64_t *pos, int64_t n,
                float temperature, int64_t top_k, float top_p, uint64_t *rng, int64_t *token) {
  int64_t ids_shape[2] = {1, n}, pos_shape[1] = {n};
  DLTensor a = int64_tensor(ids, 2, ids_shape), b = int64_tensor(pos, 1, pos_shape);
  const DLTensor *in[2] = {&a, &b};
  DLManagedTensor *out[1] = {NULL};
  if (kiln_model_run_entry(m, name, in, 2, out, 1) != 0) return -1;
  int rc = kiln_sample(&out[0]->dl_tensor, temperature, top_k, top_p, rng, token);
  out[0]->deleter(out[0]);
  return rc;
}

/* Whether entry point `entry` of m has an input `name` at index i (libkiln minor 7). */
static int input_named(kiln_model *m, const char *entry, int64_t i, const char *name) {
  const char *got = kiln_model_entry_input_name(m, entry, i);
  return got && strcmp(got, name) == 0;
}

/* A batched package (kiln.models.batched_decoder; kiln.runtime.generation.is_batched and
 * batched_shape): prefill takes (input_ids, lengths). Returns 1 with *batch (decode's
 * input_ids [B, 1]) and *max_len (a KV cache [B, kv_heads, max_len, head_dim]), 0 for another
 * package (or a libkiln before minor 7), -1 (message on stderr) for a batched one whose shapes
 * are not those. */
static int batched_shape(kiln_model *m, int64_t *batch, int64_t *max_len) {
  if (kiln_abi_minor() < 7 || kiln_model_entry_num_inputs(m, "prefill") != 2 ||
      !input_named(m, "prefill", 0, "input_ids") || !input_named(m, "prefill", 1, "lengths"))
    return 0;
  int64_t shape[4] = {0, 0, 0, 0};
  if (kiln_model_entry_num_inputs(m, "decode") != 2 ||
      kiln_model_entry_input_shape(m, "decode", 0, shape, 4) != 2 || shape[0] < 1 ||
      shape[1] != 1) {
    fprintf(stderr, "generate: the package's prefill takes (input_ids, lengths), but its decode "
                    "entry point does not take input_ids [B, 1] and positions [B] "
                    "(kiln.models.batched_decoder)\n");
    return -1;
  }
  *batch = shape[0];
  int64_t n_state = kiln_model_num_state(m);
  for (int64_t k = 0; k < n_state; ++k) {
    int64_t cache[4];
    if (kiln_model_state_shape(m, k, cache, 4) == 4 && cache[0] == *batch && cache[2] > 0) {
      *max_len = cache[2];
      return 1;
    }
  }
  fprintf(stderr, "generate: the package has no KV-cache state of shape [%lld, kv_heads, "
                  "max_len, head_dim]\n", (long long)*batch);
  return -1;
}

/* Row b of logits [B, V] as a [V] tensor (a view: kiln_sample reads the last row). */
static DLTensor logits_row(const DLTensor *l, int64_t b) {
  DLTensor r = *l;
  int64_t stride0 = l->strides ? l->strides[0] : l->shape[1];
  r.ndim = 1;
  r.shape = l->shape + 1;
  r.strides = l->strides ? l->strides + 1 : NULL;
  r.byte_offset = l->byte_offset +
                  (uint64_t)(b * stride0) * (uint64_t)((l->dtype.bits * l->dtype.lanes + 7) / 8);
  return r;
}

/* Runs entry `name` on (ids [batch, width], vec [batch]) and samples token b of each row b
 * that is not done[b] into tokens[b * max_new + n[b]++] with generator rng[b]. */
static int batched_step(kiln_model *m, const char *name, int64_t *ids, int64_t width,
                        int64_t *vec, int64_t batch, float temperature, int64_t top_k,
                        float top_p, uint64_t *rng, const int *done, int64_t *tokens,
                        long max_new, long *n) {
  int64_t ids_shape[2] = {batch, width}, vec_shape[1] = {batch};
  DLTensor a = int64_tensor(ids, 2, ids_shape), v = int64_tensor(vec, 1, vec_shape);
  const DLTensor *in[2] = {&a, &v};
  DLManagedTensor *out[1] = {NULL};
  if (kiln_model_run_entry(m, name, in, 2, out, 1) != 0) return -1;
  const DLTensor *l = &out[0]->dl_tensor;
  int rc = 0;
  if (l->ndim != 2 || l->shape[0] != batch) {
    fprintf(stderr, "generate: %s returned logits of rank %d, expected [%lld, vocab]\n", name,
            (int)l->ndim, (long long)batch);
    rc = -2;
  }
  for (int64_t b = 0; rc == 0 && b < batch; ++b) {
    if (done[b]) continue;
    DLTensor row = logits_row(l, b);
    rc = kiln_sample(&row, temperature, top_k, top_p, &rng[b], &tokens[b * max_new + n[b]]);
    n[b] += rc == 0;
  }
  out[0]->deleter(out[0]);
  return rc;
}

/* kiln.runtime.generate_batch's loop over the n_prompts prompts (at most batch) of a batched
 * package; prints the tokens and the timing line. 0, 1 (a kiln error) or 2 (usage). */
static int generate_batched(kiln_model *m, int64_t batch, int64_t max_len, int64_t **prompts,
                            const int64_t *lens_in, int64_t n_prompts, long max_new,
                            float temperature, int64_t top_k, float top_p, uint64_t seed,
                            int has_stop, int64_t stop) {
  if (n_prompts > batch) {
    fprintf(stderr, "generate: %lld prompts for a package of batch %lld; give at most %lld "
                    "(or compile a larger batch)\n", (long long)n_prompts, (long long)batch,
            (long long)batch);
    return 2;
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < n_prompts; ++b) longest = lens_in[b] > longest ? lens_in[b] : longest;
  if (longest + max_new - 1 > max_len) {
    fprintf(stderr, "generate: a prompt of %lld tokens and %ld new tokens need %lld cache "
                    "positions; the package's cache holds %lld\n", (long long)longest, max_new,
            (long long)(longest + max_new - 1), (long long)max_len);
    return 2;
  }
  int status = 1;
  int64_t *ids = calloc((size_t)(batch * longest), sizeof(int64_t));
  int64_t *vec = calloc((size_t)batch, sizeof(int64_t));
  int64_t *tokens = calloc((size_t)batch * (size_t)max_new, sizeof(int64_t));
  uint64_t *rng = calloc((size_t)batch, sizeof(uint64_t));
  long *n = calloc((size_t)batch, sizeof(long));
  int *done = calloc((size_t)batch, sizeof(int));
  if (!ids || !vec || !tokens || !rng || !n || !done) {
    fprintf(stderr, "generate: out of memory\n");
    goto out;
  }
  /* rows past the prompts: the one-token dummy prompt 0 (ids already 0) */
  for (int64_t b = 0; b < batch; ++b) {
    vec[b] = b < n_prompts ? lens_in[b] : 1;
    if (b < n_prompts) memcpy(&ids[b * longest], prompts[b], (size_t)lens_in[b] * 8);
    rng[b] = seed + (uint64_t)b; /* generate_batch: Sampler(..., seed + b) */
  }
  if (kiln_model_reset_state(m) != 0) goto fail;
  double t0 = now_s();
  int rc = batched_step(m, "prefill", ids, longest, vec, batch, temperature, top_k, top_p,
                        rng, done, tokens, max_new, n);
  if (rc) goto step_fail;
  double t1 = now_s();
  for (int64_t b = 0; b < batch; ++b) done[b] = has_stop && tokens[b * max_new] == stop;
  long steps = 0;
  for (;;) {
    int all_done = 1;
    for (int64_t b = 0; b < n_prompts; ++b) all_done &= done[b];
    if (steps >= max_new - 1 || all_done) break;
    /* vec holds each row's next position: its length, then one more per step */
    for (int64_t b = 0; b < batch; ++b) ids[b] = tokens[b * max_new + n[b] - 1];
    rc = batched_step(m, "decode", ids, 1, vec, batch, temperature, top_k, top_p, rng, done,
                      tokens, max_new, n);
    if (rc) goto step_fail;
    for (int64_t b = 0; b < batch; ++b) {
      vec[b] += 1;
      if (!done[b]) done[b] = has_stop && tokens[b * max_new + n[b] - 1] == stop;
    }
    ++steps;
  }
  double t2 = now_s();
  long decoded = 0;
  for (int64_t b = 0; b < n_prompts; ++b) {
    printf("tokens[%lld]: ", (long long)b);
    for (long k = 0; k < n[b]; ++k)
      printf("%s%lld", k ? "," : "", (long long)tokens[b * max_new + k]);
    printf("\n");
    decoded += n[b] - 1;
  }
  printf("batch %lld (%lld prompts); prefill: %.2f ms; decode: %ld steps, %.2f ms/step, "
         "%.1f tokens/s\n", (long long)batch, (long long)n_prompts, (t1 - t0) * 1e3, steps,
         steps ? (t2 - t1) * 1e3 / steps : 0.0, t2 > t1 ? decoded / (t2 - t1) : 0.0);
  status = 0;
  goto out;
step_fail:
  if (rc == -2) goto out; /* message printed */
fail:
  fprintf(stderr, "generate: %s\n", kiln_last_error());
out:
  free(ids);
  free(vec);
  free(tokens);
  free(rng);
  free(n);
  free(done);
  return status;
}

/* The few CUDA driver functions the device loop needs (libcuda.so.1, opened at run time). */
typedef unsigned long long CUdeviceptr_;
struct Cuda {
  int (*init)(unsigned);
  int (*device_get)(int *, int);
  int (*retain)(void **, int);
  int (*set_current)(void *);
  int (*alloc)(CUdeviceptr_ *, size_t);
  int (*free)(CUdeviceptr_);
  int (*htod)(CUdeviceptr_, const void *, size_t);
  int (*dtoh)(void *, CUdeviceptr_, size_t);
  int (*sync)(void);
};

static int cuda_open(struct Cuda *c, int device) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  const char *names[] = {"cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
                         "cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
                         "cuCtxSynchronize"};
  void **fn = (void **)c;
  if (!h) return -1;
  for (size_t k = 0; k < sizeof names / sizeof names[0]; ++k)
    if (!(fn[k] = dlsym(h, names[k]))) return -1;
  int dev = 0;
  void *ctx = NULL;
  if (c->init(0) || c->device_get(&dev, device) || c->retain(&ctx, dev) ||
      c->set_current(ctx))
    return -1;
  return 0;
}

/* A device int64 / float32 tensor over data (contiguous). */
static DLTensor device_tensor(CUdeviceptr_ data, int device, uint8_t code, int32_t ndim,
                              int64_t *shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = (void *)(uintptr_t)data;
  t.device.device_type = kDLCUDA;
  t.device.device_id = device;
  t.ndim = ndim;
  t.dtype.code = code;
  t.dtype.bits = code == kDLInt ? 64 : 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

static void drop(DLManagedTensor **t) {
  if (*t && (*t)->deleter) (*t)->deleter(*t);
  *t = NULL;
}

/* The whole loop on GPU `device` with the package's "sample" entry point; tokens[0..*n). */
static int generate_cuda(kiln_model *m, int device, const int64_t *prompt, int64_t n_prompt,
                         long max_new, float temperature, int64_t top_k, float top_p,
                         uint64_t seed, int64_t *tokens, long *n, double *t_prefill,
                         double *t_decode) {
  struct Cuda c;
  if (cuda_open(&c, device) != 0) {
    fprintf(stderr, "generate: cannot open the CUDA driver (libcuda.so.1) for cuda:%d\n",
            device);
    return -1;
  }
  if (kiln_model_entry_num_inputs(m, "sample") != 4) {
    fprintf(stderr, "generate: the package has no \"sample\" entry point taking (logits, "
                    "cache_position, fparams, iparams): export it with hf_decoder.export_decoder"
                    "(..., sampler=device_sampler.export_sampler)\n");
    return -1;
  }
  int rc = -1;
  CUdeviceptr_ d_ids = 0, d_pos = 0, d_fp = 0, d_ip = 0;
  DLManagedTensor **ids = calloc((size_t)max_new, sizeof *ids);
  DLManagedTensor *logits = NULL, *pos = NULL;
  int64_t *host_pos = malloc((size_t)n_prompt * sizeof(int64_t));
  float fp[2] = {temperature, top_p};
  int64_t ip[2] = {top_k, (int64_t)seed};
  int64_t s_ids[2] = {1, n_prompt}, s_pos[1] = {n_prompt}, s_two[1] = {2};
  if (!ids || !host_pos) goto out;
  for (int64_t k = 0; k < n_prompt; ++k) host_pos[k] = k;
  if (c.alloc(&d_ids, (size_t)n_prompt * 8) || c.alloc(&d_pos, (size_t)n_prompt * 8) ||
      c.alloc(&d_fp, sizeof fp) || c.alloc(&d_ip, sizeof ip) ||
      c.htod(d_ids, prompt, (size_t)n_prompt * 8) ||
      c.htod(d_pos, host_pos, (size_t)n_prompt * 8) || c.htod(d_fp, fp, sizeof fp) ||
      c.htod(d_ip, ip, sizeof ip)) {
    fprintf(stderr, "generate: CUDA allocation or copy failed\n");
    goto out;
  }
  DLTensor a = device_tensor(d_ids, device, kDLInt, 2, s_ids);
  DLTensor b = device_tensor(d_pos, device, kDLInt, 1, s_pos);
  DLTensor f = device_tensor(d_fp, device, kDLFloat, 1, s_two);
  DLTensor g = device_tensor(d_ip, device, kDLInt, 1, s_two);
  double t0 = now_s();
  const DLTensor *pre_in[2] = {&a, &b};
  if (kiln_model_run_entry(m, "prefill", pre_in, 2, &logits, 1) != 0) goto fail;
  const DLTensor *s_in[4] = {&logits->dl_tensor, &b, &f, &g};
  DLManagedTensor *s_out[2] = {NULL, NULL};
  if (kiln_model_run_entry(m, "sample", s_in, 4, s_out, 2) != 0) goto fail;
  drop(&logits);
  ids[0] = s_out[0];
  pos = s_out[1];
  if (c.sync()) goto cuda_fail;
  double t1 = now_s();
  long k = 1;
  for (; k < max_new; ++k) {
    const DLTensor *d_in[2] = {&ids[k - 1]->dl_tensor, &pos->dl_tensor};
    if (kiln_model_run_entry(m, "decode", d_in, 2, &logits, 1) != 0) goto fail;
    const DLTensor *in[4] = {&logits->dl_tensor, &pos->dl_tensor, &f, &g};
    if (kiln_model_run_entry(m, "sample", in, 4, s_out, 2) != 0) goto fail;
    drop(&logits);
    drop(&pos);
    ids[k] = s_out[0];
    pos = s_out[1];
  }
  if (c.sync()) goto cuda_fail;
  *t_prefill = t1 - t0;
  *t_decode = now_s() - t1;
  for (long j = 0; j < k; ++j)
    if (c.dtoh(&tokens[j], (CUdeviceptr_)(uintptr_t)ids[j]->dl_tensor.data, 8)) goto cuda_fail;
  *n = k;
  rc = 0;
  goto out;
cuda_fail:
  fprintf(stderr, "generate: a CUDA synchronise or copy failed\n");
  goto out;
fail:
  fprintf(stderr, "generate: %s\n", kiln_last_error());
out:
  drop(&logits);
  drop(&pos);
  for (long j = 0; ids && j < max_new; ++j) drop(&ids[j]);
  free(ids);
  free(host_pos);
  if (d_ids) c.free(d_ids);
  if (d_pos) c.free(d_pos);
  if (d_fp) c.free(d_fp);
  if (d_ip) c.free(d_ip);
  return rc;
}

int main(int argc, char **argv) {
  long max_new = 32, threads = 0;
  float temperature = 0.0f, top_p = 1.0f;
  long long top_k = 0;
  unsigned long long seed = 0;
  const char *device = "cpu";
  long long stop = 0;
  int has_stop = 0, i = 1;
  for (; i < argc && argv[i][0] == '-' && argv[i][1] && !argv[i][2]; i += 2) {
    if (i + 1 >= argc) return usage();
    const char *v = argv[i + 1];
    switch (argv[i][1]) {
      case 'n': max_new = strtol(v, NULL, 10); break;
      case 'T': temperature = strtof(v, NULL); break;
      case 'k': top_k = strtoll(v, NULL, 10); break;
      case 'p': top_p = strtof(v, NULL); break;
      case 's': seed = strtoull(v, NULL, 10); break;
      case 't': threads = strtol(v, NULL, 10); break;
      case 'd': device = v; break;
      case 'e': stop = strtoll(v, NULL, 10); has_stop = 1; break;
      default: return usage();
    }
  }
  if (argc - i < 2 || max_new < 1) return usage();
  int64_t n_prompts = argc - i - 1;
  int64_t **prompts = calloc((size_t)n_prompts, sizeof *prompts);
  int64_t *lens = calloc((size_t)n_prompts, sizeof *lens);
  kiln_model *m = NULL;
  int64_t *tokens = NULL, *pos = NULL;
  int status = 2;
  if (!prompts || !lens) {
    status = 1;
    goto done;
  }
  for (int64_t b = 0; b < n_prompts; ++b) {
    if (parse_ids(argv[i + 1 + b], &prompts[b], &lens[b]) != 0) {
      fprintf(stderr, "generate: bad prompt ids '%s' (expected e.g. 1,2,3; a prompt has at "
                      "least one id)\n", argv[i + 1 + b]);
      goto done;
    }
  }
  status = 1;
  int64_t *prompt = prompts[0], n_prompt = lens[0];
  if (kiln_abi_version() != KILN_ABI_VERSION || kiln_abi_minor() < 5) {
    fprintf(stderr, "generate: libkiln ABI %d.%d, need %d.5 or later\n", kiln_abi_version(),
            kiln_abi_minor(), KILN_ABI_VERSION);
    goto done;
  }
  tokens = malloc((size_t)max_new * sizeof(int64_t));
  pos = malloc((size_t)n_prompt * sizeof(int64_t));
  if (!tokens || !pos) goto done;
  if (kiln_model_load(argv[i], device, &m) != 0) goto fail;
  if (threads > 0 && kiln_model_set_num_threads(m, (int)threads) != 0) goto fail;
  int64_t batch = 1, max_len = 0;
  int batched = batched_shape(m, &batch, &max_len);
  if (batched < 0) goto done;
  if (batched && strcmp(device, "cpu") != 0) {
    fprintf(stderr, "generate: batched packages run on the CPU here; on %s use `kiln generate "
                    "PKG --device %s --prompt-ids ... --prompt-ids ...`\n", device, device);
    status = 2;
    goto done;
  }
  if (batched) {
    status = generate_batched(m, batch, max_len, prompts, lens, n_prompts, max_new,
                              temperature, top_k, top_p, seed, has_stop, stop);
    goto done;
  }
  if (n_prompts > 1) {
    fprintf(stderr, "generate: %lld prompts, but this package decodes one sequence; compile a "
                    "batched package (kiln.models.batched_decoder.export_batched) for several\n",
            (long long)n_prompts);
    status = 2;
    goto done;
  }
  if (kiln_model_reset_state(m) != 0) goto fail; /* a fresh KV cache */
  long n = 1;
  double t0 = 0, t1 = 0, t2 = 0;
  if (strncmp(device, "cuda", 4) == 0) {
    int dev = device[4] == ':' ? atoi(device + 5) : 0;
    double tp = 0, td = 0;
    if (generate_cuda(m, dev, prompt, n_prompt, max_new, temperature, top_k, top_p, seed,
                      tokens, &n, &tp, &td) != 0)
      goto done;
    t1 = tp;
    t2 = tp + td;
    for (long k = 0; has_stop && k < n; ++k) /* the tokens up to the first STOP */
      if (tokens[k] == stop) n = k + 1;
    goto print;
  }
  uint64_t rng = seed;
  for (int64_t k = 0; k < n_prompt; ++k) pos[k] = k;
  t0 = now_s();
  if (step(m, "prefill", prompt, pos, n_prompt, temperature, top_k, top_p, &rng, &tokens[0]))
    goto fail;
  t1 = now_s();
  for (; n < max_new && !(has_stop && tokens[n - 1] == stop); ++n) {
    int64_t id = tokens[n - 1], p = n_prompt + n - 1;
    if (step(m, "decode", &id, &p, 1, temperature, top_k, top_p, &rng, &tokens[n])) goto fail;
  }
  t2 = now_s();
print:
  printf("tokens: ");
  for (long k = 0; k < n; ++k) printf("%s%lld", k ? "," : "", (long long)tokens[k]);
  printf("\nprefill: %lld tokens in %.2f ms; decode: %ld tokens, %.2f ms/token, %.1f tokens/s\n",
         (long long)n_prompt, (t1 - t0) * 1e3, n - 1, n > 1 ? (t2 - t1) * 1e3 / (n - 1) : 0.0,
         n > 1 && t2 > t1 ? (n - 1) / (t2 - t1) : 0.0);
  status = 0;
  goto done;
fail:
  fprintf(stderr, "generate: %s\n", kiln_last_error());
done:
  kiln_model_free(m);
  free(tokens);
  free(pos);
  for (int64_t b = 0; prompts && b < n_prompts; ++b) free(prompts[b]);
  free(prompts);
  free(lens);
  return status;
}
