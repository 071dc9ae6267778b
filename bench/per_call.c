/* per_call.c - per-call time of kiln_model_run from C (bench/per_call.py builds and runs it).
 *
 * Usage: per_call <package.kiln> <threads> <rounds> <calls> <shape> [<shape> ...]
 *   threads: kiln_model_set_num_threads (0: automatic), as the Python runner's num_threads;
 *   each <shape> is one float32 input's dims joined by 'x' ("4", "3x2"; "" for a scalar).
 * Prints one line per round: the mean microseconds per kiln_model_run (outputs freed through
 * their deleters inside the timed loop, as any caller must), after 200 warm-up calls.
 * Exit status: 0, 1 on a kiln error (kiln_last_error() on stderr), 2 on usage errors.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kiln.h"

#define MAX_IN 16
#define MAX_DIM 8

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static int run_once(kiln_model *m, const DLTensor *const *in, int64_t n_in,
                    DLManagedTensor **out, int64_t n_out) {
  if (kiln_model_run(m, in, n_in, out, n_out) != 0) {
    fprintf(stderr, "per_call: %s\n", kiln_last_error());
    return 1;
  }
  for (int64_t i = 0; i < n_out; ++i)
    if (out[i] && out[i]->deleter) out[i]->deleter(out[i]);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 5 || argc - 5 > MAX_IN) {
    fprintf(stderr, "usage: per_call <package.kiln> <threads> <rounds> <calls> <shape>...\n");
    return 2;
  }
  const int threads = atoi(argv[2]), rounds = atoi(argv[3]), calls = atoi(argv[4]);
  const int64_t n_in = argc - 5;
  static DLTensor t[MAX_IN];
  static int64_t shape[MAX_IN][MAX_DIM], strides[MAX_IN][MAX_DIM];
  const DLTensor *in[MAX_IN];
  for (int64_t i = 0; i < n_in; ++i) {
    int ndim = 0;
    int64_t numel = 1;
    for (char *s = argv[5 + i]; *s && ndim < MAX_DIM; ++ndim) {
      shape[i][ndim] = strtoll(s, &s, 10);
      numel *= shape[i][ndim];
      if (*s == 'x') ++s;
    }
    for (int d = ndim - 1, st = 1; d >= 0; st *= (int)shape[i][d], --d) strides[i][d] = st;
    float *data = malloc(sizeof(float) * (size_t)(numel > 0 ? numel : 1));
    for (int64_t k = 0; k < numel; ++k) data[k] = (float)(k % 7) * 0.25f;
    t[i].data = data;
    t[i].device.device_type = kDLCPU;
    t[i].ndim = ndim;
    t[i].dtype.code = kDLFloat;
    t[i].dtype.bits = 32;
    t[i].dtype.lanes = 1;
    t[i].shape = shape[i];
    t[i].strides = strides[i];
    in[i] = &t[i];
  }
  kiln_model *m = NULL;
  if (kiln_model_load(argv[1], "cpu", &m) != 0) {
    fprintf(stderr, "per_call: %s\n", kiln_last_error());
    return 1;
  }
  if (kiln_model_set_num_threads(m, threads) != 0) {
    fprintf(stderr, "per_call: %s\n", kiln_last_error());
    return 1;
  }
  const int64_t n_out = kiln_model_num_outputs(m);
  DLManagedTensor *out[MAX_IN];
  if (n_out > MAX_IN) return 2;
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 200; ++k)
      if (run_once(m, in, n_in, out, n_out)) return 1;
    const double t0 = now_us();
    for (int k = 0; k < calls; ++k)
      if (run_once(m, in, n_in, out, n_out)) return 1;
    printf("%.4f\n", (now_us() - t0) / calls);
    fflush(stdout);
  }
  kiln_model_free(m);
  return 0;
}
