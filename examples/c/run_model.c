/* run_model.c - run a kiln package from C on tensors stored in KLT1 files.
 *
 * Usage: run_model [-v] [-o PREFIX] [-t THREADS] <package.kiln> [input0.bin input1.bin ...]
 *
 * Each input file is a KLT1 tensor (see README.md). For each output i the program prints
 *     output[i] <dtype> [d0,d1,...]
 * followed, without -o, by one value per line (%.9g for float32/16/bf16, %.17g for float64,
 * integers in decimal, complex as "re im"); with -o PREFIX it instead writes PREFIX<i>.bin in the
 * KLT1 format. -t sets the model's OpenMP thread budget (kiln_model_set_num_threads; 0 is
 * automatic, the default). -v prints the -march level of the code loaded on stderr
 * (kiln_model_cpu_level: a portable package's pick for this CPU). Exit status: 0 on success, 1 when kiln reports an error (kiln_last_error() is
 * printed on stderr), 2 on usage or file errors.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

typedef struct {
  DLTensor t;
  int64_t *shape;
  int64_t *strides;
  void *data;
} Input;

static const char *dtype_name(DLDataType d) {
  switch (d.code) {
    case kDLFloat: return d.bits == 64 ? "float64" : d.bits == 32 ? "float32" : "float16";
    case kDLBfloat: return "bfloat16";
    case kDLInt: return d.bits == 64 ? "int64" : d.bits == 32 ? "int32" : d.bits == 16 ? "int16"
                                                                                     : "int8";
    case kDLUInt: return d.bits == 64 ? "uint64" : d.bits == 32 ? "uint32"
                                     : d.bits == 16 ? "uint16" : "uint8";
    case kDLBool: return "bool";
    case kDLComplex: return d.bits == 128 ? "complex128" : "complex64";
    default: return "unknown";
  }
}

static int read_all(const char *path, unsigned char **buf, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return -1;
  size_t cap = 1 << 16, n = 0;
  unsigned char *b = malloc(cap);
  size_t got;
  while (b && (got = fread(b + n, 1, cap - n, f)) > 0) {
    n += got;
    if (n == cap) {
      unsigned char *nb = realloc(b, cap *= 2);
      if (!nb) free(b);
      b = nb;
    }
  }
  fclose(f);
  if (!b) return -1;
  *buf = b;
  *len = n;
  return 0;
}

/* Parses a KLT1 file into in (data copied into its own buffer). Returns 0 or -1. */
static int load_input(const char *path, Input *in) {
  unsigned char *b = NULL;
  size_t len = 0;
  memset(in, 0, sizeof *in);
  if (read_all(path, &b, &len) != 0) {
    fprintf(stderr, "run_model: cannot read '%s'\n", path);
    return -1;
  }
  uint32_t ndim = 0;
  if (len < 12 || memcmp(b, "KLT1", 4) != 0) goto bad;
  memcpy(&ndim, b + 8, 4);
  if (ndim > 64 || len < 12 + 8 * (size_t)ndim) goto bad;
  in->t.dtype.code = b[4];
  in->t.dtype.bits = b[5];
  memcpy(&in->t.dtype.lanes, b + 6, 2);
  if (in->t.dtype.bits % 8 != 0 || in->t.dtype.bits == 0 || in->t.dtype.lanes != 1) goto bad;
  in->shape = calloc(ndim + 1, sizeof(int64_t));
  in->strides = calloc(ndim + 1, sizeof(int64_t));
  if (!in->shape || !in->strides) goto bad;
  memcpy(in->shape, b + 12, 8 * (size_t)ndim);
  uint64_t numel = 1;
  for (int i = (int)ndim - 1; i >= 0; --i) {
    if (in->shape[i] < 0) goto bad;
    in->strides[i] = (int64_t)numel;
    numel *= (uint64_t)in->shape[i];
  }
  size_t nbytes = (size_t)numel * in->t.dtype.bits / 8;
  if (len - 12 - 8 * (size_t)ndim != nbytes) goto bad;
  in->data = malloc(nbytes ? nbytes : 1);
  if (!in->data) goto bad;
  memcpy(in->data, b + 12 + 8 * (size_t)ndim, nbytes);
  free(b);
  in->t.data = in->data;
  in->t.device.device_type = kDLCPU;
  in->t.device.device_id = 0;
  in->t.ndim = (int32_t)ndim;
  in->t.shape = in->shape;
  in->t.strides = in->strides;
  in->t.byte_offset = 0;
  return 0;
bad:
  fprintf(stderr, "run_model: '%s' is not a valid KLT1 tensor file\n", path);
  free(b);
  return -1;
}

static double half_to_double(uint16_t h) {
  int exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  double sign = (h & 0x8000) ? -1.0 : 1.0, v;
  if (exp == 0) v = mant / 1024.0 / 16384.0;  /* subnormal: mant * 2^-24 */
  else if (exp == 31) v = mant ? 0.0 / 0.0 : 1.0 / 0.0;
  else {
    v = (1.0 + mant / 1024.0);
    for (int e = exp - 15; e > 0; --e) v *= 2.0;
    for (int e = exp - 15; e < 0; ++e) v /= 2.0;
  }
  return sign * v;
}

static void print_value(FILE *f, DLDataType d, const unsigned char *p) {
  float fl;
  double db;
  uint32_t u32;
  switch (d.code) {
    case kDLFloat:
      if (d.bits == 64) { memcpy(&db, p, 8); fprintf(f, "%.17g\n", db); }
      else if (d.bits == 32) { memcpy(&fl, p, 4); fprintf(f, "%.9g\n", fl); }
      else { uint16_t h; memcpy(&h, p, 2); fprintf(f, "%.9g\n", half_to_double(h)); }
      return;
    case kDLBfloat: {
      uint16_t h;
      memcpy(&h, p, 2);
      u32 = (uint32_t)h << 16;
      memcpy(&fl, &u32, 4);
      fprintf(f, "%.9g\n", fl);
      return;
    }
    case kDLComplex:
      if (d.bits == 128) { double c[2]; memcpy(c, p, 16); fprintf(f, "%.17g %.17g\n", c[0], c[1]); }
      else { float c[2]; memcpy(c, p, 8); fprintf(f, "%.9g %.9g\n", c[0], c[1]); }
      return;
    case kDLBool: fprintf(f, "%d\n", p[0] ? 1 : 0); return;
    case kDLUInt: {
      uint64_t v = 0;
      memcpy(&v, p, d.bits / 8); /* little-endian host */
      fprintf(f, "%llu\n", (unsigned long long)v);
      return;
    }
    default: {
      int64_t v = 0;
      memcpy(&v, p, d.bits / 8);
      int sh = 64 - d.bits; /* sign-extend */
      if (sh > 0) v = (int64_t)((uint64_t)v << sh) >> sh;
      fprintf(f, "%lld\n", (long long)v);
    }
  }
}

/* Prints or writes one output, walking its (possibly strided) elements in row-major order. */
static int emit(const DLTensor *t, int index, const char *prefix) {
  size_t es = t->dtype.bits / 8;
  uint64_t numel = 1;
  int32_t nd = t->ndim;
  printf("output[%d] %s [", index, dtype_name(t->dtype));
  for (int i = 0; i < nd; ++i) {
    printf(i ? ",%lld" : "%lld", (long long)t->shape[i]);
    numel *= (uint64_t)t->shape[i];
  }
  printf("]\n");
  if (t->device.device_type != kDLCPU) {
    fprintf(stderr, "run_model: output %d is not on the CPU\n", index);
    return -1;
  }
  FILE *f = NULL;
  if (prefix) {
    char path[4096];
    snprintf(path, sizeof path, "%s%d.bin", prefix, index);
    f = fopen(path, "wb");
    if (!f) { fprintf(stderr, "run_model: cannot write '%s'\n", path); return -1; }
    uint32_t ndim = (uint32_t)nd;
    fwrite("KLT1", 1, 4, f);
    fwrite(&t->dtype, 1, 4, f);
    fwrite(&ndim, 4, 1, f);
    fwrite(t->shape, 8, (size_t)nd, f);
  }
  int64_t idx[64] = {0};
  const unsigned char *base = (const unsigned char *)t->data + t->byte_offset;
  for (uint64_t k = 0; k < numel; ++k) {
    int64_t off = 0, stride = 1;
    for (int i = nd - 1; i >= 0; --i) {
      off += idx[i] * (t->strides ? t->strides[i] : stride);
      stride *= t->shape[i];
    }
    const unsigned char *p = base + off * (int64_t)es;
    if (f) fwrite(p, 1, es, f);
    else print_value(stdout, t->dtype, p);
    for (int i = nd - 1; i >= 0 && ++idx[i] == t->shape[i]; --i) idx[i] = 0;
  }
  if (f && fclose(f) != 0) return -1;
  return 0;
}

int main(int argc, char **argv) {
  const char *prefix = NULL, *threads = NULL;
  int a = 1, verbose = 0;
  while (a + 1 < argc && (strcmp(argv[a], "-o") == 0 || strcmp(argv[a], "-t") == 0 ||
                          strcmp(argv[a], "-v") == 0)) {
    if (argv[a][1] == 'v') { verbose = 1; a += 1; continue; }
    if (argv[a][1] == 'o') prefix = argv[a + 1];
    else threads = argv[a + 1];
    a += 2;
  }
  char *end = NULL;
  long n_threads = threads ? strtol(threads, &end, 10) : 0;
  if (a >= argc || (threads && (end == threads || *end != '\0' || n_threads < INT32_MIN ||
                                n_threads > INT32_MAX))) {
    fprintf(stderr, "usage: %s [-v] [-o PREFIX] [-t THREADS] <package.kiln> [input.bin ...]\n",
            argv[0]);
    return 2;
  }
  if (kiln_abi_version() != KILN_ABI_VERSION) {
    fprintf(stderr, "run_model: libkiln ABI %d, expected %d\n", kiln_abi_version(),
            KILN_ABI_VERSION);
    return 1;
  }
  kiln_model *m = NULL;
  if (kiln_model_load(argv[a], "cpu", &m) != 0) {
    fprintf(stderr, "run_model: %s\n", kiln_last_error());
    return 1;
  }
  if (verbose && kiln_abi_minor() >= 4) {
    fprintf(stderr, "run_model: cpu level '%s'\n", kiln_model_cpu_level(m));
  }
  if (threads && (kiln_abi_minor() < 1 || kiln_model_set_num_threads(m, (int)n_threads) != 0)) {
    fprintf(stderr, "run_model: %s\n", kiln_abi_minor() < 1 ? "libkiln has no thread budget"
                                                            : kiln_last_error());
    kiln_model_free(m);
    return 1;
  }
  int n_in = argc - a - 1, rc = 0;
  Input *ins = calloc((size_t)n_in + 1, sizeof(Input));
  const DLTensor **ptrs = calloc((size_t)n_in + 1, sizeof(DLTensor *));
  int64_t n_out = kiln_model_num_outputs(m);
  DLManagedTensor **outs = calloc((size_t)n_out + 1, sizeof(DLManagedTensor *));
  if (!ins || !ptrs || !outs) { fprintf(stderr, "run_model: out of memory\n"); return 2; }
  for (int i = 0; i < n_in && rc == 0; ++i) {
    if (load_input(argv[a + 1 + i], &ins[i]) != 0) rc = 2;
    ptrs[i] = &ins[i].t;
  }
  if (rc == 0 && kiln_model_run(m, ptrs, n_in, outs, n_out) != 0) {
    fprintf(stderr, "run_model: %s\n", kiln_last_error());
    rc = 1;
  }
  for (int64_t i = 0; rc == 0 && i < n_out; ++i) {
    if (emit(&outs[i]->dl_tensor, (int)i, prefix) != 0) rc = 2;
  }
  for (int64_t i = 0; i < n_out; ++i) {
    if (outs[i]) outs[i]->deleter(outs[i]);
  }
  for (int i = 0; i < n_in; ++i) {
    free(ins[i].shape);
    free(ins[i].strides);
    free(ins[i].data);
  }
  free(ins);
  free(ptrs);
  free(outs);
  kiln_model_free(m);
  return rc;
}
