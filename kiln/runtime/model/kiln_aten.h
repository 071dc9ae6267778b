// kiln_aten.h - calls into ATen for the ops kiln does not lower ("ATen fallback").
//
// Only packages whose manifest lists `aten_fallback` ops include this header. It goes through
// torch's stable C interface (the `aoti_torch_*` / `torch_*` functions exported by
// libtorch_cpu.so): no C++ ATen header is included and nothing is linked at build time. The
// functions are looked up once, when a model instance is created, in the libtorch_cpu.so already
// loaded in the process (Python: `import torch`), else by dlopen on the library search path
// (C: put libtorch's lib directory on LD_LIBRARY_PATH). A missing libtorch is an error at load
// that names the ops which need it.
//
// One call: the arguments are pushed in schema order onto a stack of 64-bit values (tensors as
// owning handles to views of kiln's buffers, ints, doubles, bools, lists as stable list handles,
// absent optionals as 0, present ones as a pointer to a heap value), the op is called through
// the dispatcher, and each returned tensor is copied into kiln's (contiguous) result buffer.
// The encoding is the one of torch's stable ABI at version 2.10, which libtorch 2.10 and later
// accept.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "kiln_model_rt.h"

namespace kr_aten {

using Handle = void*;  // AtenTensorHandle / StableListHandle
using Value = uint64_t;  // StableIValue
constexpr uint64_t kStableVersion = (2ULL << 56) | (10ULL << 48);  // torch 2.10.0

struct Api {
  int32_t (*create_from_blob)(void*, int64_t, const int64_t*, const int64_t*, int64_t, int32_t,
                              int32_t, int32_t, Handle*);
  int32_t (*delete_tensor)(Handle);
  int32_t (*copy_)(Handle, Handle);
  int32_t (*get_dim)(Handle, int64_t*);
  int32_t (*get_sizes)(Handle, int64_t**);
  int32_t (*call)(const char*, const char*, Value*, uint64_t);
  int32_t (*list_new)(size_t, Handle*);
  int32_t (*list_push)(Handle, Value);
  int32_t (*list_delete)(Handle);
  int32_t (*string_new)(const char*, size_t, Handle*);
  const char* (*what)();  // newer libtorch only; may be null
  int32_t cpu = 0;
  bool ok = false;
  char missing[128] = {0};
  // CUDA packages: torch's CUDA device type and a guard making kiln's stream torch's current
  // one for the call (libtorch_cuda.so); looked up with the rest, needed only on CUDA
  int32_t cuda = 1;
  int32_t (*stream_guard_new)(void*, int32_t, Handle*) = nullptr;
  int32_t (*stream_guard_delete)(Handle) = nullptr;
  bool cuda_ok = false;
  char cuda_missing[128] = {0};
};

inline void* find_libtorch() {
  void* h = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_GLOBAL);
  return h;
}

template <class F>
inline bool bind(void* lib, const char* name, F& slot, Api& api) {
  slot = reinterpret_cast<F>(dlsym(lib, name));
  if (!slot && !api.missing[0]) std::snprintf(api.missing, sizeof api.missing, "%s", name);
  return slot != nullptr;
}

inline const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = find_libtorch();
    if (!lib) {
      std::snprintf(a.missing, sizeof a.missing, "libtorch_cpu.so");
      return;
    }
    int32_t (*device_cpu)() = nullptr;
    bool ok = bind(lib, "aoti_torch_create_tensor_from_blob", a.create_from_blob, a) &
              bind(lib, "aoti_torch_delete_tensor_object", a.delete_tensor, a) &
              bind(lib, "aoti_torch_copy_", a.copy_, a) &
              bind(lib, "aoti_torch_get_dim", a.get_dim, a) &
              bind(lib, "aoti_torch_get_sizes", a.get_sizes, a) &
              bind(lib, "torch_call_dispatcher", a.call, a) &
              bind(lib, "torch_new_list_reserve_size", a.list_new, a) &
              bind(lib, "torch_list_push_back", a.list_push, a) &
              bind(lib, "torch_delete_list", a.list_delete, a) &
              bind(lib, "torch_new_string_handle", a.string_new, a) &
              bind(lib, "aoti_torch_device_type_cpu", device_cpu, a);
    a.what = reinterpret_cast<const char* (*)()>(dlsym(lib, "torch_exception_get_what"));
    if (ok) a.cpu = device_cpu();
    a.ok = ok;
    void* cuda = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda) cuda = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL);
    auto device_cuda = reinterpret_cast<int32_t (*)()>(dlsym(lib, "aoti_torch_device_type_cuda"));
    if (!cuda || !device_cuda) {
      std::snprintf(a.cuda_missing, sizeof a.cuda_missing, "%s",
                    cuda ? "aoti_torch_device_type_cuda" : "libtorch_cuda.so");
      return;
    }
    a.cuda = device_cuda();
    a.stream_guard_new = reinterpret_cast<int32_t (*)(void*, int32_t, Handle*)>(
        dlsym(cuda, "aoti_torch_create_cuda_stream_guard"));
    a.stream_guard_delete = reinterpret_cast<int32_t (*)(Handle)>(
        dlsym(cuda, "aoti_torch_delete_cuda_stream_guard"));
    a.cuda_ok = a.stream_guard_new && a.stream_guard_delete;
    if (!a.cuda_ok)
      std::snprintf(a.cuda_missing, sizeof a.cuda_missing, "aoti_torch_create_cuda_stream_guard");
  });
  return a;
}

// Called when an instance is created: a package that needs libtorch fails to load without it.
inline int require(kr::Err& e, const char* ops, bool cuda = false) {
  const Api& a = api();
  if (a.ok && (!cuda || a.cuda_ok)) return 0;
  return e.fail("this package calls ATen for %s and needs libtorch (%s, torch >= 2.10) loaded "
                "in the process: `import torch` first, or put torch's lib directory on "
                "LD_LIBRARY_PATH (missing: %s)", ops,
                cuda ? "libtorch_cpu.so and libtorch_cuda.so" : "libtorch_cpu.so",
                a.ok ? a.cuda_missing : a.missing);
}

// One dispatcher call under construction. On any failure `e` holds the message and the owned
// values pushed so far are released by the callee or here.
class Call {
 public:
  Call(kr::Err& e, const char* op, const char* overload)
      : e_(e), op_(op), ov_(overload), device_(api().cpu) {}
  ~Call() {
    for (Handle h : results_) if (h) api().delete_tensor(h);
    if (guard_) api().stream_guard_delete(guard_);  // after the results: on kiln's stream
  }

  // A call on CUDA device `index`: tensors live there and torch runs the op (and the result
  // copies) on `stream`, kiln's stream, which stays torch's current stream until the call ends.
  bool on_cuda(int32_t index, void* stream) {
    device_ = api().cuda;
    index_ = index;
    if (api().stream_guard_new(stream, index, &guard_)) {
      guard_ = nullptr;
      return fail("could not make kiln's stream torch's current CUDA stream");
    }
    return true;
  }

  // A tensor argument: a view of `data` with the given sizes/strides (elements).
  bool tensor(const void* data, int64_t ndim, const int64_t* sizes, const int64_t* strides,
              int32_t dtype) {
    Handle h = nullptr;
    if (api().create_from_blob(const_cast<void*>(data), ndim, sizes, strides, 0, dtype,
                               device_, index_, &h)) {
      return fail("could not wrap an argument as a tensor");
    }
    stack_.push_back(reinterpret_cast<Value>(h));
    return true;
  }
  void none() { stack_.push_back(0); }
  void i64(int64_t v) { stack_.push_back(static_cast<Value>(v)); }
  void f64(double v) {
    Value x;
    std::memcpy(&x, &v, sizeof v);
    stack_.push_back(x);
  }
  void boolean(bool v) { stack_.push_back(v ? 1 : 0); }
  bool str(const char* v) {
    Handle h = nullptr;
    if (api().string_new(v, std::strlen(v), &h)) return fail("could not create a string argument");
    stack_.push_back(reinterpret_cast<Value>(h));
    return true;
  }
  // Wrap the value pushed last as a present optional (`T?` in the schema).
  void optional() {
    Value* boxed = new Value(stack_.back());
    stack_.back() = reinterpret_cast<Value>(boxed);
  }
  // Turn the last `n` values pushed into one list argument (`int[]`, `Tensor[]`).
  bool list(size_t n) {
    Handle l = nullptr;
    if (api().list_new(n, &l)) return fail("could not create a list argument");
    for (size_t i = stack_.size() - n; i < stack_.size(); ++i) api().list_push(l, stack_[i]);
    stack_.resize(stack_.size() - n);
    stack_.push_back(reinterpret_cast<Value>(l));
    return true;
  }

  // Runs the op; `n_results` tensors come back.
  bool run(size_t n_results) {
    if (stack_.size() < n_results) stack_.resize(n_results, 0);
    if (api().call(op_, ov_, stack_.data(), kStableVersion)) {
      const char* why = api().what ? api().what() : nullptr;
      e_.fail("ATen fallback %s.%s failed%s%s", op_, ov_[0] ? ov_ : "default",
              why ? ": " : "", why ? why : " (libtorch printed the reason)");
      return false;
    }
    results_.assign(n_results, nullptr);
    for (size_t i = 0; i < n_results; ++i) results_[i] = reinterpret_cast<Handle>(stack_[i]);
    return true;
  }

  // Size `d` of result `k` (a data-dependent size); -1 if it cannot be read.
  int64_t result_size(size_t k, int64_t d) {
    int64_t dim = -1;
    int64_t* sizes = nullptr;
    if (api().get_dim(results_[k], &dim) || d >= dim || api().get_sizes(results_[k], &sizes))
      return -1;
    return sizes[d];
  }

  // Copies result `k` into kiln's contiguous buffer `out` after checking its sizes.
  bool copy_out(size_t k, void* out, int64_t ndim, const int64_t* sizes, int32_t dtype) {
    Handle r = results_[k];
    int64_t got_dim = -1;
    int64_t* got = nullptr;
    if (api().get_dim(r, &got_dim) || api().get_sizes(r, &got)) return fail("bad result");
    bool same = got_dim == ndim;
    for (int64_t d = 0; same && d < ndim; ++d) same = got[d] == sizes[d];
    if (!same) {
      e_.fail("ATen fallback %s: result %zu has shape %s, expected %s", op_, k,
              shape_text(got, got_dim).c_str(), shape_text(sizes, ndim).c_str());
      return false;
    }
    std::vector<int64_t> strides(ndim > 0 ? ndim : 1, 1);
    for (int64_t d = ndim - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
    Handle dst = nullptr;
    if (api().create_from_blob(out, ndim, sizes, strides.data(), 0, dtype, device_, index_,
                               &dst))
      return fail("could not wrap a result buffer");
    int32_t rc = api().copy_(dst, r);
    api().delete_tensor(dst);
    if (rc) return fail("could not copy a result");
    return true;
  }

 private:
  static std::string shape_text(const int64_t* s, int64_t n) {
    std::string t = "[";
    for (int64_t d = 0; d < n; ++d) t += (d ? ", " : "") + std::to_string(s[d]);
    return t + "]";
  }
  bool fail(const char* what) {
    e_.fail("ATen fallback %s: %s", op_, what);
    return false;
  }
  kr::Err& e_;
  const char* op_;
  const char* ov_;
  int32_t device_;
  int32_t index_ = 0;
  Handle guard_ = nullptr;
  std::vector<Value> stack_;
  std::vector<Handle> results_;
};

}  // namespace kr_aten
