/* generate.c - generate tokens from C with a kiln package of two entry points, "prefill" and
 * "decode" (e.g. kiln.models.hf_decoder.export_decoder of a Hugging Face decoder), sharing the
 * weights and the KV cache of one loaded model.
 *
 * Usage: generate [-n MAX_NEW] [-T TEMPERATURE] [-k TOP_K] [-p TOP_P] [-s SEED] [-t THREADS]
 *                 <package.kiln> <id,id,...>
 *
 * The loop: prefill runs the whole prompt (input_ids int64 [1, T], cache_position int64 [T] =
 * 0..T-1) and fills the cache; every decode step runs one token (input_ids [1, 1],
 * cache_position [1] = its position). Each next token is chosen by kiln_sample from the last
 * row of the logits: greedy without -T (or -T 0), else temperature / top-k / top-p sampling
 * with a generator seeded by -s (the same seed gives the same tokens, here and in
 * `kiln generate`, which calls the same function). Prints
 *     tokens: t1,t2,...
 *     prefill: <T> tokens in <ms> ms; decode: <n> tokens, <ms> ms/token, <x> tokens/s
 * Exit status: 0 on success, 1 when kiln reports an error (kiln_last_error() on stderr), 2 on
 * usage errors.
 */
#define _POSIX_C_SOURCE 199309L
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
                  "[-s SEED] [-t THREADS] <package.kiln> <id,id,...>\n");
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

int main(int argc, char **argv) {
  long max_new = 32, threads = 0;
  float temperature = 0.0f, top_p = 1.0f;
  long long top_k = 0;
  unsigned long long seed = 0;
  int i = 1;
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
      default: return usage();
    }
  }
  if (argc - i != 2 || max_new < 1) return usage();
  int64_t *prompt = NULL, n_prompt = 0;
  if (parse_ids(argv[i + 1], &prompt, &n_prompt) != 0) {
    fprintf(stderr, "generate: bad prompt ids '%s' (expected e.g. 1,2,3)\n", argv[i + 1]);
    free(prompt);
    return 2;
  }
  if (kiln_abi_version() != KILN_ABI_VERSION || kiln_abi_minor() < 5) {
    fprintf(stderr, "generate: libkiln ABI %d.%d, need %d.5 or later\n", kiln_abi_version(),
            kiln_abi_minor(), KILN_ABI_VERSION);
    free(prompt);
    return 1;
  }
  kiln_model *m = NULL;
  int64_t *tokens = malloc((size_t)max_new * sizeof(int64_t));
  int64_t *pos = malloc((size_t)n_prompt * sizeof(int64_t));
  int status = 1;
  if (!tokens || !pos) goto done;
  if (kiln_model_load(argv[i], "cpu", &m) != 0) goto fail;
  if (threads > 0 && kiln_model_set_num_threads(m, (int)threads) != 0) goto fail;
  if (kiln_model_reset_state(m) != 0) goto fail; /* a fresh KV cache */
  uint64_t rng = seed;
  for (int64_t k = 0; k < n_prompt; ++k) pos[k] = k;
  double t0 = now_s();
  if (step(m, "prefill", prompt, pos, n_prompt, temperature, top_k, top_p, &rng, &tokens[0]))
    goto fail;
  double t1 = now_s();
  long n = 1;
  for (; n < max_new; ++n) {
    int64_t id = tokens[n - 1], p = n_prompt + n - 1;
    if (step(m, "decode", &id, &p, 1, temperature, top_k, top_p, &rng, &tokens[n])) goto fail;
  }
  double t2 = now_s();
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
  free(prompt);
  return status;
}
