/* kiln_dnnl.h - oneDNN (libdnnl.so.3) as a second backend of the CPU direct convolution
 * (`Conv`) and of the CPU GEMMs with a constant B (`Matmul`, below: kiln/targets/cpu/dnnl_gemm.py).
 *
 * A convolution the autotuner gave to oneDNN (kiln/targets/cpu/dnnl.py) reads and writes the
 * same buffers as kiln_conv.h's conv2d_nchwc: activations in NCHWc ([N, C/B, H, W, B], channels
 * zero-padded to B; oneDNN's nChw16c / nChw8c, so no layout change around the call), the stem's
 * plain NCHW input, weights as kiln packed them at compile time (dense OIhw{B}i{B}o, stem
 * Ohwi{B}o, depthwise Goihw{B}g), bias [OCp]. Channels are given to oneDNN padded (the padding
 * weights are zeros), so no padded-dims semantics are involved.
 *
 * `kl::dnnl::Conv` is one convolution of one loaded instance: `init` (from the model's create(),
 * i.e. at package load) builds the primitive with the weights' layout left to oneDNN
 * (format_tag any) and reorders kiln's packed weights into it once; `run` executes it. The
 * epilogue is oneDNN's: bias in the primitive, residual as a binary-add post-op, relu / clamp /
 * silu as eltwise post-ops (out = act(W * x + bias [+ residual]), as kiln_conv.h's).
 *
 * The library is opened with dlopen at the first init (no link-time dependency: a package that
 * cannot find it fails to load with an error naming it, never at symbol binding): its soname
 * first (kiln's Python loader preloads it from the installed wheel), then the path recorded at
 * compile time (KILN_DNNL_PATH). Threads: a run of budget N (kr::max_threads, capped by the
 * call's `threads` as kiln_conv.h's team()) gives oneDNN N threads: omp_set_num_threads(N) for
 * an OpenMP build (the caller is the team's thread 0; kiln's pool is parked meanwhile), nothing
 * to do for a sequential one. Other runtimes (TBB, SYCL: PyPI's `onednn`) cannot be bounded
 * through oneDNN's C API, so init refuses them with an error naming the wheels that can.
 *
 * The C API declarations below are the few this file calls, with the values of oneDNN v3's
 * dnnl_types.h (stable across v3.x: oneDNN keeps ABI compatibility within a major version). */
#ifndef KILN_DNNL_H
#define KILN_DNNL_H
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kiln_lib.h"

#ifndef KILN_DNNL_PATH
#define KILN_DNNL_PATH ""
#endif

namespace kl {
namespace dnnl {

typedef struct opaque *handle;  // every oneDNN object is an opaque pointer
typedef int64_t dims[12];
struct ExecArg { int arg; handle memory; };
struct Version { int major, minor, patch; const char *hash; unsigned cpu_runtime, gpu_runtime; };

enum : int {
  kSuccess = 0, kF32 = 3, kTagAny = 1, kTag_a = 2,
  kTag_aBcd16b = 78, kTag_aBcd8b = 102,        // nChw16c / nChw8c
  kTag_ABcd16b16a = 79, kTag_ABcd8b8a = 107,   // OIhw16i16o / OIhw8i8o
  kTag_Acdb16a = 211, kTag_Acdb8a = 216,       // Ohwi16o / Ohwi8o
  kTag_Abcde16a = 114, kTag_Abcde8a = 138,     // Goihw16g / Goihw8g
  kForwardInference = 96, kConvDirect = 1,
  kEltRelu = 32, kEltSwish = 44, kEltClip = 46, kBinaryAdd = 131056,
  kCpu = 1, kStreamDefault = 1, kScratchpadUser = 1,
  kQueryImplInfo = 8, kQueryWeightsMd = 131, kQueryScratchpadMd = 136,
  kArgSrc = 1, kArgSrc1 = 2, kArgDst = 17, kArgWeights = 33, kArgBias = 41, kArgScratchpad = 80,
  kArgFrom = 1, kArgTo = 17, kArgPostOp0 = 32768,  // DNNL_ARG_ATTR_MULTIPLE_POST_OP(0)
  kRuntimeSeq = 1, kRuntimeOmp = 2,
};

/* The entry points, dlsym'd from the library. */
struct Api {
  void *lib = nullptr;
  const Version *(*version)();
  int (*engine_create)(handle *, int, size_t);
  int (*engine_destroy)(handle);
  int (*stream_create)(handle *, handle, unsigned);
  int (*stream_destroy)(handle);
  int (*stream_wait)(handle);
  int (*md_tag)(handle *, int, const int64_t *, int, int);
  int (*md_strides)(handle *, int, const int64_t *, int, const int64_t *);
  int (*md_destroy)(handle);
  size_t (*md_size)(handle);
  int (*md_equal)(handle, handle);
  int (*memory_create)(handle *, handle, handle, void *);
  int (*memory_set)(handle, void *);
  int (*memory_destroy)(handle);
  int (*attr_create)(handle *);
  int (*attr_destroy)(handle);
  int (*attr_post_ops)(handle, handle);
  int (*attr_scratchpad)(handle, int);
  int (*po_create)(handle *);
  int (*po_destroy)(handle);
  int (*po_eltwise)(handle, int, float, float);
  int (*po_binary)(handle, int, handle);
  int (*conv_pd)(handle *, handle, int, int, handle, handle, handle, handle, const int64_t *,
                 const int64_t *, const int64_t *, const int64_t *, handle);
  int (*matmul_pd)(handle *, handle, handle, handle, handle, handle, handle);
  int (*reorder_pd)(handle *, handle, handle, handle, handle, handle);
  handle (*pd_md)(handle, int, int);
  int (*pd_query)(handle, int, int, void *);
  int (*pd_destroy)(handle);
  int (*prim_create)(handle *, handle);
  int (*prim_execute)(handle, handle, int, const ExecArg *);
  int (*prim_destroy)(handle);
  void (*omp_set_num_threads)(int) = nullptr;
  int (*omp_get_max_threads)() = nullptr;
  char error[512] = "";
};

template <class F> inline bool bind(void *lib, const char *name, F &f) {
  void *p = ::dlsym(lib, name);
  std::memcpy(&f, &p, sizeof f);
  return p != nullptr;
}

inline const Api &api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    void *lib = ::dlopen("libdnnl.so.3", RTLD_NOW | RTLD_GLOBAL);
    if (!lib && KILN_DNNL_PATH[0]) lib = ::dlopen(KILN_DNNL_PATH, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      const char *d = ::dlerror();
      std::snprintf(a.error, sizeof a.error,
                    "this package's convolutions or GEMMs use oneDNN (libdnnl.so.3), which "
                    "cannot be opened (%s): pip install onednn-cpu-gomp, or compile without oneDNN "
                    "(Options.cpu_conv_backends, cpu_gemm_backends)", d ? d : "not found");
      return;
    }
    bool ok = bind(lib, "dnnl_version", a.version) &&
              bind(lib, "dnnl_engine_create", a.engine_create) &&
              bind(lib, "dnnl_engine_destroy", a.engine_destroy) &&
              bind(lib, "dnnl_stream_create", a.stream_create) &&
              bind(lib, "dnnl_stream_destroy", a.stream_destroy) &&
              bind(lib, "dnnl_stream_wait", a.stream_wait) &&
              bind(lib, "dnnl_memory_desc_create_with_tag", a.md_tag) &&
              bind(lib, "dnnl_memory_desc_create_with_strides", a.md_strides) &&
              bind(lib, "dnnl_memory_desc_destroy", a.md_destroy) &&
              bind(lib, "dnnl_memory_desc_get_size", a.md_size) &&
              bind(lib, "dnnl_memory_desc_equal", a.md_equal) &&
              bind(lib, "dnnl_memory_create", a.memory_create) &&
              bind(lib, "dnnl_memory_set_data_handle", a.memory_set) &&
              bind(lib, "dnnl_memory_destroy", a.memory_destroy) &&
              bind(lib, "dnnl_primitive_attr_create", a.attr_create) &&
              bind(lib, "dnnl_primitive_attr_destroy", a.attr_destroy) &&
              bind(lib, "dnnl_primitive_attr_set_post_ops", a.attr_post_ops) &&
              bind(lib, "dnnl_primitive_attr_set_scratchpad_mode", a.attr_scratchpad) &&
              bind(lib, "dnnl_post_ops_create", a.po_create) &&
              bind(lib, "dnnl_post_ops_destroy", a.po_destroy) &&
              bind(lib, "dnnl_post_ops_append_eltwise", a.po_eltwise) &&
              bind(lib, "dnnl_post_ops_append_binary", a.po_binary) &&
              bind(lib, "dnnl_convolution_forward_primitive_desc_create", a.conv_pd) &&
              bind(lib, "dnnl_matmul_primitive_desc_create", a.matmul_pd) &&
              bind(lib, "dnnl_reorder_primitive_desc_create", a.reorder_pd) &&
              bind(lib, "dnnl_primitive_desc_query_md", a.pd_md) &&
              bind(lib, "dnnl_primitive_desc_query", a.pd_query) &&
              bind(lib, "dnnl_primitive_desc_destroy", a.pd_destroy) &&
              bind(lib, "dnnl_primitive_create", a.prim_create) &&
              bind(lib, "dnnl_primitive_execute", a.prim_execute) &&
              bind(lib, "dnnl_primitive_destroy", a.prim_destroy);
    if (!ok) {
      std::snprintf(a.error, sizeof a.error, "libdnnl.so.3 lacks a oneDNN v3 entry point (%s)",
                    ::dlerror());
      return;
    }
    const Version *v = a.version();
    if (v->major != 3) {
      std::snprintf(a.error, sizeof a.error, "libdnnl.so.3 is oneDNN %d.%d; kiln needs v3",
                    v->major, v->minor);
      return;
    }
    if (v->cpu_runtime == kRuntimeOmp) {
      bind(lib, "omp_set_num_threads", a.omp_set_num_threads);
      bind(lib, "omp_get_max_threads", a.omp_get_max_threads);
      if (!a.omp_set_num_threads || !a.omp_get_max_threads) {
        std::snprintf(a.error, sizeof a.error, "oneDNN %d.%d is an OpenMP build but "
                      "omp_set_num_threads is not found", v->major, v->minor);
        return;
      }
    } else if (v->cpu_runtime != kRuntimeSeq) {
      std::snprintf(a.error, sizeof a.error,
                    "oneDNN %d.%d's CPU runtime (0x%x: TBB or SYCL, as PyPI's onednn wheel) "
                    "cannot be held to kiln's thread budget: use an OpenMP build "
                    "(pip install onednn-cpu-gomp) or compile without oneDNN", v->major,
                    v->minor, v->cpu_runtime);
      return;
    }
    a.lib = lib;
  });
  return a;
}

/* OpenMP's thread count of the calling thread set to `n` for a scope (the caller's own setting
 * restored after), in an OpenMP build of oneDNN. */
class Threads {
 public:
  Threads(const Api &a, int n) : a_(a) {
    if (!a_.omp_set_num_threads) return;
    saved_ = a_.omp_get_max_threads();
    a_.omp_set_num_threads(n);
  }
  ~Threads() {
    if (a_.omp_set_num_threads) a_.omp_set_num_threads(saved_);
  }

 private:
  const Api &a_;
  int saved_ = 0;
};

/* One convolution (see the file comment). Geometry as kiln_conv.h's: n images, icp (padded;
 * for a plain NCHW stem input: the real count) input and ocp (padded) output channels. */
struct Conv {
  handle engine = nullptr, stream = nullptr, prim = nullptr;
  handle m_src = nullptr, m_wei = nullptr, m_bias = nullptr, m_dst = nullptr, m_res = nullptr,
         m_scratch = nullptr;
  void *wei_owned = nullptr, *scratch = nullptr;  // reordered weights; scratchpad
  int64_t threads = 0;
  char impl[64] = "";  // oneDNN's implementation name (dnnl_query_impl_info_str)

  Conv() = default;
  Conv(const Conv &) = delete;
  Conv &operator=(const Conv &) = delete;
  ~Conv() {
    const Api &a = api();
    if (!a.lib) return;
    for (handle m : {m_src, m_wei, m_bias, m_dst, m_res, m_scratch})
      if (m) a.memory_destroy(m);
    if (prim) a.prim_destroy(prim);
    if (stream) a.stream_destroy(stream);
    if (engine) a.engine_destroy(engine);
    std::free(wei_owned);
    std::free(scratch);
  }

  static int check(kr::Err &e, const char *where, const char *what, int st) {
    return st == kSuccess ? 0 : e.fail("%s: oneDNN %s failed (status %d)", where, what, st);
  }

  int init(kr::Err &e, const char *where, int64_t n, int64_t icp, int64_t ih, int64_t iw,
           int64_t ocp, int64_t oh, int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
           int64_t ph, int64_t pw, int64_t dh, int64_t dw, bool depthwise, bool plain_src,
           int64_t block, int64_t act, double lo, double hi, bool residual, int64_t nthreads,
           const float *w, const float *bias) {
    const Api &a = api();
    if (!a.lib) return e.fail("%s: %s", where, a.error);
    Threads serial(a, 1);  // the weight reorder at load: on the caller alone
    threads = nthreads;
    const bool b16 = block == 16;
    int st = a.engine_create(&engine, kCpu, 0);
    if (check(e, where, "engine creation", st)) return 1;
    if (check(e, where, "stream creation", a.stream_create(&stream, engine, kStreamDefault)))
      return 1;
    const int blocked = b16 ? kTag_aBcd16b : kTag_aBcd8b;
    dims sd = {n, icp, ih, iw}, dd = {n, ocp, oh, ow}, bd = {ocp}, one = {1};
    handle src_md = nullptr, dst_md = nullptr, bias_md = nullptr, wu_md = nullptr,
           wa_md = nullptr, attr = nullptr, po = nullptr, pd = nullptr;
    int wtag;
    dims wd;
    int wnd;
    if (depthwise) {
      wnd = 5, wd[0] = ocp, wd[1] = 1, wd[2] = 1, wd[3] = kh, wd[4] = kw;
      wtag = b16 ? kTag_Abcde16a : kTag_Abcde8a;
    } else {
      wnd = 4, wd[0] = ocp, wd[1] = icp, wd[2] = kh, wd[3] = kw;
      wtag = plain_src ? (b16 ? kTag_Acdb16a : kTag_Acdb8a)
                       : (b16 ? kTag_ABcd16b16a : kTag_ABcd8b8a);
    }
    dims ss = {icp * ih * iw, ih * iw, iw, 1};
    bool ok = (plain_src ? a.md_strides(&src_md, 4, sd, kF32, ss)
                         : a.md_tag(&src_md, 4, sd, kF32, blocked)) == kSuccess &&
              a.md_tag(&dst_md, 4, dd, kF32, blocked) == kSuccess &&
              a.md_strides(&bias_md, 1, bd, kF32, one) == kSuccess &&
              a.md_tag(&wu_md, wnd, wd, kF32, wtag) == kSuccess &&
              a.md_tag(&wa_md, wnd, wd, kF32, kTagAny) == kSuccess &&
              a.attr_create(&attr) == kSuccess && a.po_create(&po) == kSuccess;
    if (ok && residual) ok = a.po_binary(po, kBinaryAdd, dst_md) == kSuccess;
    if (ok && act == 1) ok = a.po_eltwise(po, kEltRelu, 0.f, 0.f) == kSuccess;
    if (ok && act == 2) ok = a.po_eltwise(po, kEltClip, float(lo), float(hi)) == kSuccess;
    if (ok && act == 3) ok = a.po_eltwise(po, kEltSwish, 1.f, 0.f) == kSuccess;
    if (ok) ok = a.attr_post_ops(attr, po) == kSuccess &&
                 a.attr_scratchpad(attr, kScratchpadUser) == kSuccess;
    dims strides = {sh, sw}, dil = {dh - 1, dw - 1}, pl = {ph, pw};
    // padding on the right: what makes the output oh x ow (kiln's shapes are torch's)
    dims pr = {std::max<int64_t>(0, (oh - 1) * sh + (kh - 1) * dh + 1 - ih - ph),
               std::max<int64_t>(0, (ow - 1) * sw + (kw - 1) * dw + 1 - iw - pw)};
    if (ok) st = a.conv_pd(&pd, engine, kForwardInference, kConvDirect, src_md, wa_md, bias_md,
                           dst_md, strides, dil, pl, pr, attr);
    int rc = 0;
    if (!ok) rc = e.fail("%s: oneDNN memory descriptors or attributes failed", where);
    else if (st != kSuccess)
      rc = e.fail("%s: oneDNN has no convolution for this shape (status %d)", where, st);
    if (!rc) rc = finish(e, where, a, pd, wu_md, dst_md, src_md, bias_md, residual, w, bias);
    if (pd) a.pd_destroy(pd);
    for (handle m : {src_md, dst_md, bias_md, wu_md, wa_md})
      if (m) a.md_destroy(m);
    if (po) a.po_destroy(po);
    if (attr) a.attr_destroy(attr);
    return rc;
  }

  // the primitive, its memories and the weights in the primitive's layout (reordered once)
  int finish(kr::Err &e, const char *where, const Api &a, handle pd, handle wu_md, handle dst_md,
             handle src_md, handle bias_md, bool residual, const float *w, const float *bias) {
    const char *info = nullptr;
    if (a.pd_query(pd, kQueryImplInfo, 0, &info) == kSuccess && info)
      std::snprintf(impl, sizeof impl, "%s", info);
    handle wmd = a.pd_md(pd, kQueryWeightsMd, 0);
    handle smd = a.pd_md(pd, kQueryScratchpadMd, 0);
    if (check(e, where, "primitive creation", a.prim_create(&prim, pd))) return 1;
    if (check(e, where, "memory", a.memory_create(&m_src, src_md, engine, nullptr)) ||
        check(e, where, "memory", a.memory_create(&m_dst, dst_md, engine, nullptr)) ||
        check(e, where, "memory", a.memory_create(&m_bias, bias_md, engine,
                                                  const_cast<float *>(bias))) ||
        (residual && check(e, where, "memory", a.memory_create(&m_res, dst_md, engine, nullptr))))
      return 1;
    const size_t sbytes = smd ? a.md_size(smd) : 0;
    if (sbytes) {
      scratch = std::aligned_alloc(64, (sbytes + 63) / 64 * 64);
      if (!scratch) return e.fail("%s: out of memory (oneDNN scratchpad)", where);
      if (check(e, where, "memory", a.memory_create(&m_scratch, smd, engine, scratch))) return 1;
    }
    if (a.md_equal(wmd, wu_md)) {  // oneDNN takes kiln's packed layout as it is
      return check(e, where, "memory", a.memory_create(&m_wei, wmd, engine,
                                                       const_cast<float *>(w)));
    }
    const size_t wbytes = a.md_size(wmd);
    wei_owned = std::aligned_alloc(64, (wbytes + 63) / 64 * 64);
    if (!wei_owned) return e.fail("%s: out of memory (oneDNN weights)", where);
    handle from = nullptr, rpd = nullptr, rprim = nullptr;
    int rc = check(e, where, "memory", a.memory_create(&from, wu_md, engine,
                                                       const_cast<float *>(w))) ||
             check(e, where, "memory", a.memory_create(&m_wei, wmd, engine, wei_owned)) ||
             check(e, where, "weight reorder", a.reorder_pd(&rpd, wu_md, engine, wmd, engine,
                                                            nullptr)) ||
             check(e, where, "weight reorder", a.prim_create(&rprim, rpd));
    if (!rc) {
      const ExecArg args[] = {{kArgFrom, from}, {kArgTo, m_wei}};
      rc = check(e, where, "weight reorder", a.prim_execute(rprim, stream, 2, args)) ||
           check(e, where, "weight reorder", a.stream_wait(stream));
    }
    if (rprim) a.prim_destroy(rprim);
    if (rpd) a.pd_destroy(rpd);
    if (from) a.memory_destroy(from);
    return rc;
  }

  int run(kr::Err &e, const char *where, float *out, const float *x, const float *res) {
    const Api &a = api();
    const int budget = kr::max_threads();
    const int nt = threads > 0 && threads < budget ? int(threads) : budget;
    Threads team(a, nt);
    a.memory_set(m_src, const_cast<float *>(x));
    a.memory_set(m_dst, out);
    ExecArg args[6] = {{kArgSrc, m_src}, {kArgWeights, m_wei}, {kArgBias, m_bias},
                       {kArgDst, m_dst}};
    int na = 4;
    if (m_scratch) args[na++] = {kArgScratchpad, m_scratch};
    if (m_res) {
      a.memory_set(m_res, const_cast<float *>(res));
      args[na++] = {kArgPostOp0 | kArgSrc1, m_res};
    }
    if (check(e, where, "execution", a.prim_execute(prim, stream, na, args))) return 1;
    return check(e, where, "execution", a.stream_wait(stream));
  }
};

/* Post-op kinds of a Matmul's epilogue (kiln/targets/cpu/dnnl_gemm.py writes them): eltwise
 * ops on the value (alpha, beta as oneDNN's), then binary ops with a second operand, either one
 * row of N broadcast over the M rows ("row") or a whole [M, N] one ("full"). */
enum : int {
  kPoRelu = 1, kPoGeluErf = 2, kPoGeluTanh = 3, kPoSwish = 4, kPoLogistic = 5, kPoTanh = 6,
  kPoLinear = 7, kPoClip = 8,
  kPoAddRow = 16, kPoAddFull = 17, kPoMulRow = 18, kPoMulFull = 19, kPoSubRow = 20,
  kPoSubFull = 21,
};
enum : int {
  kEltTanh = 33, kEltLinear = 38, kEltLogistic = 41, kEltGeluTanh = 43, kEltGeluErf = 49,
  kBinaryMul = 131057, kBinarySub = 131061,
};

/* One GEMM with a constant B, C[M, N] = epilogue(A[M, K] @ B[K, N]), on oneDNN's matmul, of one
 * loaded instance. A is read with strides (ar, ac), B (a package weight, not packed by kiln) with
 * (br, bc); C is contiguous. `init` (from create(): at load) builds the primitive with B's layout
 * left to oneDNN (format_tag any) and reorders the weight into it once; `bias`: the first
 * epilogue op is a row add, given to the primitive as its bias; `kinds` / `alpha` / `beta`: the
 * other ops, in order (the kPo* codes). `run` executes it: `ins` holds the binary ops' second
 * operands in op order. */
struct Matmul {
  static constexpr int kMaxIns = 8;
  handle engine = nullptr, stream = nullptr, prim = nullptr;
  handle m_src = nullptr, m_wei = nullptr, m_bias = nullptr, m_dst = nullptr, m_scratch = nullptr;
  handle m_in[kMaxIns] = {};
  int in_arg[kMaxIns] = {};
  int n_in = 0;
  void *wei_owned = nullptr, *scratch = nullptr;
  char impl[64] = "";

  Matmul() = default;
  Matmul(const Matmul &) = delete;
  Matmul &operator=(const Matmul &) = delete;
  ~Matmul() {
    const Api &a = api();
    if (!a.lib) return;
    for (handle m : {m_src, m_wei, m_bias, m_dst, m_scratch})
      if (m) a.memory_destroy(m);
    for (int i = 0; i < n_in; ++i)
      if (m_in[i]) a.memory_destroy(m_in[i]);
    if (prim) a.prim_destroy(prim);
    if (stream) a.stream_destroy(stream);
    if (engine) a.engine_destroy(engine);
    std::free(wei_owned);
    std::free(scratch);
  }

  int init(kr::Err &e, const char *where, int64_t M, int64_t N, int64_t K, int64_t ar,
           int64_t ac, int64_t br, int64_t bc, bool bias, int nops, const int *kinds,
           const float *alpha, const float *beta, const float *w) {
    const Api &a = api();
    if (!a.lib) return e.fail("%s: %s", where, a.error);
    if (!a.matmul_pd) return e.fail("%s: libdnnl.so.3 has no matmul", where);
    Threads serial(a, 1);  // the weight reorder at load: on the caller alone
    if (Conv::check(e, where, "engine creation", a.engine_create(&engine, kCpu, 0)) ||
        Conv::check(e, where, "stream creation", a.stream_create(&stream, engine,
                                                                 kStreamDefault)))
      return 1;
    dims sd = {M, K}, ss = {ar, ac}, wd = {K, N}, ws = {br, bc}, dd = {M, N}, ds = {N, 1},
         rd = {1, N};
    handle src_md = nullptr, wu_md = nullptr, wa_md = nullptr, dst_md = nullptr,
           row_md = nullptr, attr = nullptr, po = nullptr, pd = nullptr;
    bool ok = a.md_strides(&src_md, 2, sd, kF32, ss) == kSuccess &&
              a.md_strides(&wu_md, 2, wd, kF32, ws) == kSuccess &&
              a.md_tag(&wa_md, 2, wd, kF32, kTagAny) == kSuccess &&
              a.md_strides(&dst_md, 2, dd, kF32, ds) == kSuccess &&
              a.md_strides(&row_md, 2, rd, kF32, ds) == kSuccess &&
              a.attr_create(&attr) == kSuccess && a.po_create(&po) == kSuccess;
    for (int i = 0; ok && i < nops; ++i) {
      const int k = kinds[i];
      static const int elt[] = {0, kEltRelu, kEltGeluErf, kEltGeluTanh, kEltSwish,
                                kEltLogistic, kEltTanh, kEltLinear, kEltClip};
      if (k >= kPoRelu && k <= kPoClip) {
        ok = a.po_eltwise(po, elt[k], alpha[i], beta[i]) == kSuccess;
      } else if (k >= kPoAddRow && k <= kPoSubFull) {
        if (n_in == kMaxIns) return e.fail("%s: more than %d binary post-ops", where, kMaxIns);
        const int alg = k <= kPoAddFull ? kBinaryAdd : k <= kPoMulFull ? kBinaryMul : kBinarySub;
        handle md = (k - kPoAddRow) % 2 ? dst_md : row_md;
        ok = a.po_binary(po, alg, md) == kSuccess &&
             a.memory_create(&m_in[n_in], md, engine, nullptr) == kSuccess;
        in_arg[n_in++] = kArgPostOp0 * (i + 1) | kArgSrc1;
      } else {
        ok = false;
      }
    }
    if (ok) ok = a.attr_post_ops(attr, po) == kSuccess &&
                 a.attr_scratchpad(attr, kScratchpadUser) == kSuccess;
    int st = kSuccess;
    if (ok) st = a.matmul_pd(&pd, engine, src_md, wa_md, bias ? row_md : nullptr, dst_md, attr);
    int rc = 0;
    if (!ok) rc = e.fail("%s: oneDNN memory descriptors or attributes failed", where);
    else if (st != kSuccess)
      rc = e.fail("%s: oneDNN has no matmul for this GEMM (status %d)", where, st);
    if (!rc) rc = finish(e, where, a, pd, src_md, wu_md, dst_md, bias ? row_md : nullptr, w);
    if (pd) a.pd_destroy(pd);
    for (handle m : {src_md, wu_md, wa_md, dst_md, row_md})
      if (m) a.md_destroy(m);
    if (po) a.po_destroy(po);
    if (attr) a.attr_destroy(attr);
    return rc;
  }

  int finish(kr::Err &e, const char *where, const Api &a, handle pd, handle src_md,
             handle wu_md, handle dst_md, handle bias_md, const float *w) {
    const char *info = nullptr;
    if (a.pd_query(pd, kQueryImplInfo, 0, &info) == kSuccess && info)
      std::snprintf(impl, sizeof impl, "%s", info);
    handle wmd = a.pd_md(pd, kQueryWeightsMd, 0);
    handle smd = a.pd_md(pd, kQueryScratchpadMd, 0);
    if (Conv::check(e, where, "primitive creation", a.prim_create(&prim, pd)) ||
        Conv::check(e, where, "memory", a.memory_create(&m_src, src_md, engine, nullptr)) ||
        Conv::check(e, where, "memory", a.memory_create(&m_dst, dst_md, engine, nullptr)) ||
        (bias_md &&
         Conv::check(e, where, "memory", a.memory_create(&m_bias, bias_md, engine, nullptr))))
      return 1;
    const size_t sbytes = smd ? a.md_size(smd) : 0;
    if (sbytes) {
      scratch = std::aligned_alloc(64, (sbytes + 63) / 64 * 64);
      if (!scratch) return e.fail("%s: out of memory (oneDNN scratchpad)", where);
      if (Conv::check(e, where, "memory", a.memory_create(&m_scratch, smd, engine, scratch)))
        return 1;
    }
    if (a.md_equal(wmd, wu_md))  // oneDNN reads the weight as the package stores it
      return Conv::check(e, where, "memory", a.memory_create(&m_wei, wmd, engine,
                                                             const_cast<float *>(w)));
    const size_t wbytes = a.md_size(wmd);
    wei_owned = std::aligned_alloc(64, (wbytes + 63) / 64 * 64);
    if (!wei_owned) return e.fail("%s: out of memory (oneDNN weights)", where);
    handle from = nullptr, rpd = nullptr, rprim = nullptr;
    int rc = Conv::check(e, where, "memory", a.memory_create(&from, wu_md, engine,
                                                             const_cast<float *>(w))) ||
             Conv::check(e, where, "memory", a.memory_create(&m_wei, wmd, engine, wei_owned)) ||
             Conv::check(e, where, "weight reorder", a.reorder_pd(&rpd, wu_md, engine, wmd,
                                                                  engine, nullptr)) ||
             Conv::check(e, where, "weight reorder", a.prim_create(&rprim, rpd));
    if (!rc) {
      const ExecArg args[] = {{kArgFrom, from}, {kArgTo, m_wei}};
      rc = Conv::check(e, where, "weight reorder", a.prim_execute(rprim, stream, 2, args)) ||
           Conv::check(e, where, "weight reorder", a.stream_wait(stream));
    }
    if (rprim) a.prim_destroy(rprim);
    if (rpd) a.pd_destroy(rpd);
    if (from) a.memory_destroy(from);
    return rc;
  }

  /* Threads: the run's budget (kr::max_threads), as a convolution's. */
  int run(kr::Err &e, const char *where, float *out, const float *x, const float *bias,
          const float *const *ins) {
    const Api &a = api();
    Threads team(a, kr::max_threads());
    a.memory_set(m_src, const_cast<float *>(x));
    a.memory_set(m_dst, out);
    ExecArg args[5 + kMaxIns] = {{kArgSrc, m_src}, {kArgWeights, m_wei}, {kArgDst, m_dst}};
    int na = 3;
    if (m_bias) {
      a.memory_set(m_bias, const_cast<float *>(bias));
      args[na++] = {kArgBias, m_bias};
    }
    if (m_scratch) args[na++] = {kArgScratchpad, m_scratch};
    for (int i = 0; i < n_in; ++i) {
      a.memory_set(m_in[i], const_cast<float *>(ins[i]));
      args[na++] = {in_arg[i], m_in[i]};
    }
    if (Conv::check(e, where, "execution", a.prim_execute(prim, stream, na, args))) return 1;
    return Conv::check(e, where, "execution", a.stream_wait(stream));
  }
};

// The autotuners' timing drivers (targets/cpu/dnnl.py, dnnl_gemm.py): calls of `kiln` and
// `dnnl` alternating, at least 20 each and until min_s seconds in all; the fastest call of
// each in best[0] / best[1] (a call preempted on a shared machine only lengthens its own time)
template <class Kiln, class Dnnl>
inline void time_alternating(Kiln &&kiln, Dnnl &&dnnl, double min_s, double best[2]) {
  using clk = std::chrono::steady_clock;
  best[0] = best[1] = 1e30;
  double total = 0;
  for (int rep = 0; rep < 100000 && (rep < 20 || total < min_s); ++rep) {
    for (int c = 0; c < 2; ++c) {
      const auto t0 = clk::now();
      c ? dnnl() : kiln();
      const double dt = std::chrono::duration<double>(clk::now() - t0).count();
      total += dt;
      best[c] = std::min(best[c], dt);
    }
  }
}

}  // namespace dnnl
}  // namespace kl

#endif  // KILN_DNNL_H
