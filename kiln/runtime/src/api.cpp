// api.cpp - the exported C functions of kiln.h.
//
// kiln_model_load: map + verify the package, pick the build this CPU runs (a portable package
// carries one library per -march level: the first whose CPU features this CPU has; others
// lib/model.so), extract and dlopen it, bind the weights
// (pointers into the mapping) and create the model instance (on the device the caller names,
// which must be the device the package was compiled for: manifest "device"). kiln_model_run /
// kiln_model_run_on_stream: validate argument counts and pointers, serialise on the model's
// mutex, bind the inputs (CPU inputs with other strides copied compact: copy_in.h), call the
// model, translate its error.
// Invariants: no exception and no NULL dereference crosses this file's boundary; each failure
// sets the thread-local error; a model library is never dlclose'd (output deleters live in it).
//
// Thread budget (CPU models): a run sets the calling thread's team size for its duration and
// restores it after, through the model library's kiln_pool_set_num_threads (kiln's own pool,
// runtime/model/kiln_pool.h: a per-thread setting read when the run starts; packages built
// before the pool: the omp_set_num_threads of their libgomp). The size is the handle's budget
// (kiln_model_set_num_threads), else max(1, T / active) where T is the library's
// kiln_pool_get_max_threads() for the calling thread (OMP_NUM_THREADS, else the CPUs the
// process may use) and active the number of CPU runs in flight in the process (all handles,
// all models), counted while they hold their model's mutex. Concurrent runs thus share the
// cores instead of each waking a full team whose threads spin while the other team runs.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "cpu.h"
#include "../include/kiln.h"
#include "../include/kiln_model_abi.h"
#include "cache.h"
#include "comm.h"
#include "copy_in.h"
#include "error.h"
#include "json.h"
#include "profile.h"
#include "safetensors.h"
#include "sha256.h"
#include "zip_reader.h"

static_assert(sizeof(DLDevice) == 8, "DLDevice layout");
static_assert(sizeof(DLDataType) == 4, "DLDataType layout");
static_assert(sizeof(void *) != 8 || sizeof(DLTensor) == 48, "DLTensor layout");
static_assert(sizeof(void *) != 8 || offsetof(DLTensor, ndim) == 16, "DLTensor layout");
static_assert(sizeof(void *) != 8 || offsetof(DLTensor, shape) == 24, "DLTensor layout");
static_assert(sizeof(void *) != 8 || sizeof(DLManagedTensor) == 64, "DLManagedTensor layout");

namespace kiln {
// A read-only mapping of a whole file (weights given to kiln_model_update_weights).
class FileMap {
 public:
  explicit FileMap(const char *path) : path_(path) {
    int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("kiln: cannot open weights file '%s': %s", path, std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail("kiln: weights file '%s' is not a regular file", path);
    }
    size_ = static_cast<uint64_t>(st.st_size);
    if (size_ > 0) {
      void *p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        fail("kiln: cannot map weights file '%s': %s", path, std::strerror(errno));
      }
      data_ = static_cast<const unsigned char *>(p);
    }
    ::close(fd);
  }
  ~FileMap() {
    if (data_) ::munmap(const_cast<unsigned char *>(data_), size_);
  }
  FileMap(const FileMap &) = delete;
  FileMap &operator=(const FileMap &) = delete;
  const unsigned char *data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string &path() const { return path_; }

 private:
  std::string path_;
  const unsigned char *data_ = nullptr;
  uint64_t size_ = 0;
};
}  // namespace kiln

namespace kiln {
// One build of the package's code: its library entry, the -march it was compiled with and
// the instruction-set extensions it executes.
struct CpuLevel {
  std::string march;
  std::string library = "lib/model.so";
  std::vector<std::string> features;
};

// A weight an entry point reads as a row range of another stored weight (kiln/package/
// entries.py: e.g. prefill's q/k/v in decode's merged q/k/v weight): not stored itself.
struct WeightView {
  std::string key;      // the stored tensor's key in the weights blob
  uint64_t offset = 0;  // bytes into it
};

// A flat input of an entry point as the manifest records it (kiln_model_entry_input_*).
struct InputRecord {
  std::string name;
  std::vector<int64_t> shape;  // -1: a dynamic dim
};

// An entry point of the package (manifest "entries"; a package without them has one, the
// default, named "forward"): its library and its instance.
struct ModelEntry {
  std::string name;
  std::vector<InputRecord> inputs;  // manifest "inputs" (empty in a package without them)
  std::map<std::string, std::string> keys;  // library weight name -> weights blob key
  std::map<std::string, WeightView> views;  // library weight name -> its bytes in another
  std::vector<CpuLevel> levels;  // requires.cpu_levels, else the one build
  bool portable = false;
  const kiln_model_abi *abi = nullptr;
  void *instance = nullptr;
  Profile prof;  // per-step times (kiln_model_set_profiling; under the model's mutex)
};

// A state buffer (a weight the programs update: a KV cache), one per loaded model, shared by
// every entry that reads it: owned by the instance of entry `entry` (its weight k).
struct StateSlot {
  std::string key;  // its key in the weights blob
  size_t entry = 0;
  int64_t k = 0;
  int64_t nbytes = 0;
  const void *initial = nullptr;  // its value in the weights blob (kiln_model_reset_state)
};
}  // namespace kiln

struct kiln_model {
  std::unique_ptr<kiln::ZipReader> package;  // owns the mapping the weights point into
  std::unique_ptr<kiln::FileMap> weights_file;  // set once weights were replaced
  std::vector<kiln::ModelEntry> entries;  // [0]: the default entry (kiln_model_run)
  bool state_abi = false;  // the tables have the state functions (manifest "state_abi")
  // device models: one upload of each weight key per loaded package (manifest "state_abi" >= 2)
  bool share_weights = false;
  std::set<std::string> state_keys;  // weights blob keys of the state buffers
  std::vector<kiln::StateSlot> state;  // under mu
  int32_t device_type = kDLCPU;  // kDLCUDA: the table's device fields are valid
  int32_t device_id = 0;
  std::map<std::string, std::vector<int64_t>> weight_shapes;  // from the manifest, by name
  std::mutex mu;
  // the team-size setting of the model library: its kiln pool's (kiln_pool_get_max_threads /
  // kiln_pool_set_num_threads), or, in packages built before the pool, its OpenMP's; NULL
  // when it has neither (CUDA models)
  int (*get_max_threads)(void) = nullptr;
  void (*set_num_threads)(int) = nullptr;
  std::atomic<int> num_threads{0};  // kiln_model_set_num_threads; 0: automatic
  std::string cpu_level;  // the -march of the loaded code (kiln_model_cpu_level)
  kiln::CopyIn copy_in;  // CPU inputs with other strides, copied compact (under mu)
  bool profiling = false;  // kiln_model_set_profiling, or KILN_PROFILE (under mu)
  std::string profile_to;  // KILN_PROFILE: "1" stderr, else a file the summary is appended to
};

namespace {

constexpr const char *kFormat = "kiln.package/1";
constexpr int kMaxThreads = 4096;  // kiln_model_set_num_threads refuses more

// CPU runs in flight in this process (inside their model's mutex), for the automatic budget.
std::atomic<int> g_active_runs{0};

// Sets the calling thread's team size for one run and restores it (and the count of
// active runs) when the run ends, however it ends.
class ThreadBudget {
 public:
  explicit ThreadBudget(kiln_model *m) : m_(m) {
    const int active = g_active_runs.fetch_add(1) + 1;
    if (!m->get_max_threads || !m->set_num_threads) return;
    saved_ = m->get_max_threads();
    const int fixed = m->num_threads.load(std::memory_order_relaxed);
    const int n = fixed > 0 ? fixed : std::max(1, saved_ / active);
    if (n != saved_) m->set_num_threads(n);
    else saved_ = 0;  // nothing to restore
  }
  ~ThreadBudget() {
    if (saved_ > 0) m_->set_num_threads(saved_);
    g_active_runs.fetch_sub(1);
  }
  ThreadBudget(const ThreadBudget &) = delete;
  ThreadBudget &operator=(const ThreadBudget &) = delete;

 private:
  kiln_model *m_;
  int saved_ = 0;
};

// Binds the team-size entry points of the model library: its kiln pool's, else (a package
// built before the pool) those of the OpenMP it links (its libgomp: the process may hold
// another copy, e.g. torch's), or leaves them NULL.
void bind_threads(kiln_model *m, void *lib) {
  void *get = ::dlsym(lib, "kiln_pool_get_max_threads");
  void *set = ::dlsym(lib, "kiln_pool_set_num_threads");
  if (!get || !set) {
    get = ::dlsym(lib, "omp_get_max_threads");
    set = ::dlsym(lib, "omp_set_num_threads");
  }
  if (!get || !set) return;
  std::memcpy(&m->get_max_threads, &get, sizeof get);
  std::memcpy(&m->set_num_threads, &set, sizeof set);
}

template <class F>
int guarded(F &&body) {
  try {
    body();
    return 0;
  } catch (const std::bad_alloc &) {
    kiln::set_last_error("kiln: out of memory");
  } catch (const std::exception &e) {
    kiln::set_last_error(e.what());
  } catch (...) {
    kiln::set_last_error("kiln: unknown internal error");
  }
  return 1;
}

// Returns the manifest's "device" ("cpu" when absent: packages from before device support).
constexpr const char *kSchema = "kiln.manifest/1";
constexpr int64_t kManifestAbi = 1;

using kiln::CpuLevel;
using kiln::ModelEntry;

struct ManifestInfo {
  std::string device;
  std::map<std::string, std::vector<int64_t>> weight_shapes;
  // per entry point: requires.cpu_levels of a portable package (best first), else the one
  // build: its library, requires.cpu_features, build.march
  std::vector<ModelEntry> entries;
  bool state_abi = false;
  bool share_weights = false;  // "state_abi" >= 2: weight_buffer / share_weight (devices)
  bool links_openmp = false;  // requires.shared_libraries names libgomp (built before the pool)
  std::set<std::string> state_keys;  // weights records with "state": true
};

// A list of strings (`key` of `obj`; absent: empty, as in packages from before it).
std::vector<std::string> strings(const kiln::Json *obj, const char *key, const std::string &what) {
  std::vector<std::string> out;
  const kiln::Json *fs = obj && obj->type == kiln::Json::Object ? obj->get(key) : nullptr;
  if (!fs) return out;
  if (fs->type != kiln::Json::Array) kiln::fail("%s: %s is not a list", what.c_str(), key);
  for (const kiln::Json &f : fs->items) {
    if (f.type != kiln::Json::String) kiln::fail("%s: %s holds a non-string", what.c_str(), key);
    out.push_back(f.str);
  }
  return out;
}

std::string string_field(const kiln::Json *obj, const char *key) {
  const kiln::Json *v = obj && obj->type == kiln::Json::Object ? obj->get(key) : nullptr;
  return v && v->type == kiln::Json::String ? v->str : std::string();
}

// requires.cpu_levels (a portable package), else one level from requires.cpu_features.
void cpu_levels(const kiln::Json *req, const std::string &march, const std::string &library,
                const std::string &what, ModelEntry *info) {
  const kiln::Json *ls = req && req->type == kiln::Json::Object ? req->get("cpu_levels")
                                                                : nullptr;
  if (!ls) {
    info->levels.push_back({march, library, strings(req, "cpu_features", what + ": requires")});
    return;
  }
  if (ls->type != kiln::Json::Array || ls->items.empty()) {
    kiln::fail("%s: requires.cpu_levels is not a non-empty list", what.c_str());
  }
  info->portable = true;
  for (const kiln::Json &l : ls->items) {
    CpuLevel lv{string_field(&l, "march"), string_field(&l, "library"),
                strings(&l, "cpu_features", what + ": a level of requires.cpu_levels")};
    if (lv.march.empty() || lv.library.rfind("lib/", 0) != 0) {
      kiln::fail("%s: a level of requires.cpu_levels lacks its \"march\" or its \"library\" "
                 "(lib/...)", what.c_str());
    }
    info->levels.push_back(std::move(lv));
  }
}

// The features of `level` this CPU lacks (and those this libkiln does not know), as lists.
void lacking(const CpuLevel &level, std::string *missing, std::string *unknown) {
  for (const std::string &f : level.features) {
    const int ok = kiln::cpu_supports(f.c_str());
    if (ok == 0) *missing += (missing->empty() ? "" : ", ") + f;
    if (ok < 0) *unknown += (unknown->empty() ? "" : ", ") + f;
  }
}

// The first level whose features this CPU has; fails, naming what each level lacks, when
// there is none (before any of the package's code is mapped).
const CpuLevel &pick_level(const ModelEntry &info, const char *path) {
  std::string why;
  for (const CpuLevel &lv : info.levels) {
    std::string missing, unknown;
    lacking(lv, &missing, &unknown);
    if (missing.empty() && unknown.empty()) return lv;
    if (!info.portable && !unknown.empty()) {
      kiln::fail("kiln_model_load: package '%s' needs CPU features this libkiln does not know "
                 "(%s): load it with the kiln version that compiled it", path, unknown.c_str());
    }
    if (!info.portable) {
      kiln::fail("kiln_model_load: package '%s' needs CPU features this CPU lacks: %s (it was "
                 "compiled with -march=%s). Recompile with kiln.Options(march=\"x86-64-v2\") "
                 "or another level this CPU has (march=\"\": any x86-64; march=\"portable\": "
                 "several levels, picked at load)", path, missing.c_str(),
                 lv.march.empty() ? "(none)" : lv.march.c_str());
    }
    why += kiln::format("%s-march=%s lacks %s%s%s", why.empty() ? "" : "; ", lv.march.c_str(),
                        missing.c_str(), missing.empty() || unknown.empty() ? "" : ", ",
                        unknown.empty() ? "" : ("features this libkiln does not know: " +
                                                unknown).c_str());
  }
  kiln::fail("kiln_model_load: package '%s' has no build this CPU can run: this CPU lacks "
             "features of every level it carries (%s). Recompile with a lower level in "
             "kiln.Options(cpu_levels=...), e.g. \"x86-64\"", path, why.c_str());
}

// Expected weight shapes by name (a package from another version or a hand-made package
// may lack them: then only dtype and size are checked).
std::map<std::string, std::vector<int64_t>> weight_shapes(const kiln::Json &man) {
  std::map<std::string, std::vector<int64_t>> out;
  const kiln::Json *ws = man.get("weights");
  if (!ws || ws->type != kiln::Json::Array) return out;
  for (const kiln::Json &w : ws->items) {
    const kiln::Json *name = w.get("name");
    const kiln::Json *shape = w.get("shape");
    if (!name || name->type != kiln::Json::String || !shape ||
        shape->type != kiln::Json::Array) continue;
    std::vector<int64_t> dims;
    for (const kiln::Json &d : shape->items) dims.push_back(d.is_int ? d.integer : -1);
    out[name->str] = dims;
  }
  return out;
}

// An entry's "inputs" records (name, shape) from its manifest object.
std::vector<kiln::InputRecord> input_records(const kiln::Json *ins) {
  std::vector<kiln::InputRecord> out;
  if (!ins || ins->type != kiln::Json::Array) return out;
  for (const kiln::Json &i : ins->items) {
    kiln::InputRecord r;
    const kiln::Json *name = i.get("name");
    const kiln::Json *shape = i.get("shape");
    if (name && name->type == kiln::Json::String) r.name = name->str;
    if (shape && shape->type == kiln::Json::Array)
      for (const kiln::Json &d : shape->items) r.shape.push_back(d.is_int ? d.integer : -1);
    out.push_back(std::move(r));
  }
  return out;
}

std::string shape_text(const std::vector<int64_t> &shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return out + "]";
}

// manifest.json's bytes against manifest.sha256 (kiln/package/format.py): a hand-edited
// manifest is refused. Packages written before the hash existed have none to check.
void check_manifest_hash(const kiln::ZipReader &zip, kiln::Span manifest) {
  if (!zip.has("manifest.sha256")) return;
  kiln::Span h = zip.entry("manifest.sha256");
  std::string want(reinterpret_cast<const char *>(h.data), static_cast<size_t>(h.size));
  std::string got = kiln::sha256_hex(manifest.data, static_cast<size_t>(manifest.size));
  if (got != want) {
    kiln::fail("kiln: package '%s': 'manifest.json' was changed after the package was written "
               "(its sha256 %s is not the recorded %.64s); a hand-edited manifest is refused: "
               "recompile the model instead", zip.path().c_str(), got.c_str(), want.c_str());
  }
}

ManifestInfo check_manifest(const kiln::ZipReader &zip) {
  const std::string what = kiln::format("kiln: package '%s': entry 'manifest.json'",
                                        zip.path().c_str());
  kiln::Span s = zip.entry("manifest.json");
  check_manifest_hash(zip, s);
  kiln::Json man = kiln::parse_json(reinterpret_cast<const char *>(s.data),
                                    static_cast<size_t>(s.size), what);
  if (man.type != kiln::Json::Object) kiln::fail("%s: not a JSON object", what.c_str());
  const kiln::Json *fmt = man.get("format");
  if (!fmt || fmt->type != kiln::Json::String) {
    kiln::fail("%s: no \"format\" string (expected \"%s\")", what.c_str(), kFormat);
  }
  if (fmt->str != kFormat) {
    kiln::fail("%s: unsupported package format \"%s\" (this libkiln reads \"%s\")",
               what.c_str(), fmt->str.c_str(), kFormat);
  }
  const kiln::Json *schema = man.get("schema");
  if (schema && (schema->type != kiln::Json::String || schema->str != kSchema)) {
    kiln::fail("%s: manifest schema \"%s\" is not the one this libkiln reads (\"%s\"); "
               "recompile the model with this kiln version", what.c_str(),
               schema->type == kiln::Json::String ? schema->str.c_str() : "?", kSchema);
  }
  const kiln::Json *abi = man.get("abi_version");
  if (abi && (!abi->is_int || abi->integer != kManifestAbi)) {
    kiln::fail("%s: abi_version %lld is not supported (this libkiln supports %lld)",
               what.c_str(), static_cast<long long>(abi->is_int ? abi->integer : -1),
               static_cast<long long>(kManifestAbi));
  }
  const kiln::Json *dev = man.get("device");
  ManifestInfo info;
  info.device = dev && dev->type == kiln::Json::String ? dev->str : std::string("cpu");
  info.weight_shapes = weight_shapes(man);
  const kiln::Json *sa = man.get("state_abi");
  info.state_abi = sa && sa->is_int && sa->integer >= 1;
  for (const std::string &lib : strings(man.get("requires"), "shared_libraries", "manifest"))
    if (lib.find("libgomp") != std::string::npos) info.links_openmp = true;
  info.share_weights = sa && sa->is_int && sa->integer >= 2;
  if (const kiln::Json *ws = man.get("weights"); ws && ws->type == kiln::Json::Array) {
    for (const kiln::Json &w : ws->items) {
      const kiln::Json *name = w.get("name");
      const kiln::Json *st = w.get("state");
      if (name && name->type == kiln::Json::String && st && st->type == kiln::Json::Bool &&
          st->boolean)
        info.state_keys.insert(name->str);
    }
  }
  const std::string march = string_field(man.get("build"), "march");
  const kiln::Json *es = man.get("entries");
  if (!es) {  // one entry point: the package's top level
    ModelEntry e;
    e.name = "forward";
    e.inputs = input_records(man.get("inputs"));
    cpu_levels(man.get("requires"), march, "lib/model.so", what, &e);
    info.entries.push_back(std::move(e));
    return info;
  }
  if (es->type != kiln::Json::Array || es->items.empty()) {
    kiln::fail("%s: \"entries\" is not a non-empty list", what.c_str());
  }
  for (const kiln::Json &j : es->items) {
    ModelEntry e;
    e.name = string_field(&j, "name");
    const std::string library = string_field(&j, "library");
    if (e.name.empty() || library.empty()) {
      kiln::fail("%s: an entry of \"entries\" lacks its \"name\" or \"library\"", what.c_str());
    }
    e.inputs = input_records(j.get("inputs"));
    const kiln::Json *keys = j.get("weights");
    if (keys && keys->type == kiln::Json::Object) {
      for (const auto &kv : keys->members) {
        if (kv.second.type == kiln::Json::Object) {  // a view: {"key", "offset", ...}
          const kiln::Json *key = kv.second.get("key");
          const kiln::Json *off = kv.second.get("offset");
          if (!key || key->type != kiln::Json::String || !off || !off->is_int ||
              off->integer < 0) {
            kiln::fail("%s: entry '%s': weights[%s] is a view without a \"key\" string and "
                       "an \"offset\" >= 0", what.c_str(), e.name.c_str(), kv.first.c_str());
          }
          e.views[kv.first] = {key->str, static_cast<uint64_t>(off->integer)};
          continue;
        }
        if (kv.second.type != kiln::Json::String) {
          kiln::fail("%s: entry '%s': weights[%s] is not a string or a view", what.c_str(),
                     e.name.c_str(), kv.first.c_str());
        }
        e.keys[kv.first] = kv.second.str;
      }
    }
    cpu_levels(j.get("requires"), march, library, what + ": entry '" + e.name + "'", &e);
    info.entries.push_back(std::move(e));
  }
  return info;
}

// "cpu" -> (kDLCPU, 0); "cuda" -> (kDLCUDA, 0); "cuda:N" -> (kDLCUDA, N); else fails.
void parse_device(const char *device, int32_t *type, int32_t *id) {
  *id = 0;
  if (std::strcmp(device, "cpu") == 0) { *type = kDLCPU; return; }
  if (std::strncmp(device, "cuda", 4) == 0) {
    *type = kDLCUDA;
    if (device[4] == '\0') return;
    char *end = nullptr;
    long v = device[4] == ':' && device[5] ? std::strtol(device + 5, &end, 10) : -1;
    if (end && *end == '\0' && v >= 0 && v < 1 << 20) { *id = static_cast<int32_t>(v); return; }
  }
  kiln::fail("kiln_model_load: unsupported device '%s' (use \"cpu\", \"cuda\" or \"cuda:N\")",
             device);
}

void *create_instance(kiln_model *m, const kiln_model_abi *abi,
                      const std::vector<const void *> &w, char *err, size_t n) {
  const void *const *p = w.empty() ? nullptr : w.data();
  if (m->device_type == kDLCUDA) return abi->create_on_device(m->device_id, p, err, n);
  return abi->create(p, err, n);
}

const kiln_model_abi *open_library(const kiln::ZipReader &zip, const std::string &entry,
                                   void **handle) {
  const char *p = zip.path().c_str();
  kiln::Span so = zip.entry(entry.c_str());
  uint32_t crc = 0;
  for (const kiln::ZipEntry &e : zip.entries()) {
    if (e.name == entry) crc = e.crc;
  }
  std::string what = kiln::format("package '%s': entry '%s'", p, entry.c_str());
  std::string path = kiln::extract_to_cache(so.data, so.size, crc, what);
  void *h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = ::dlerror();
    kiln::fail("kiln: %s: cannot load '%s': %s", what.c_str(), path.c_str(), e ? e : "?");
  }
  *handle = h;
  void *sym = ::dlsym(h, KILN_MODEL_ABI_SYMBOL);
  if (!sym) {
    kiln::fail("kiln: %s: library does not export %s (built with -fvisibility=hidden and no "
               "export attribute?)", what.c_str(), KILN_MODEL_ABI_SYMBOL);
  }
  kiln_model_abi_fn fn = nullptr;
  std::memcpy(&fn, &sym, sizeof fn);
  const kiln_model_abi *abi = fn();
  if (!abi) kiln::fail("kiln: %s: %s() returned NULL", what.c_str(), KILN_MODEL_ABI_SYMBOL);
  if (abi->abi_version != KILN_MODEL_ABI_VERSION) {
    kiln::fail("kiln: %s: model ABI version %u, this libkiln supports %u", what.c_str(),
               abi->abi_version, KILN_MODEL_ABI_VERSION);
  }
  if (abi->n_inputs < 0 || abi->n_outputs < 0 || abi->n_weights < 0 || !abi->create ||
      !abi->run || !abi->destroy ||
      (abi->n_weights > 0 && (!abi->weight_names || !abi->weight_nbytes ||
                              !abi->weight_dtypes))) {
    kiln::fail("kiln: %s: malformed model ABI table", what.c_str());
  }
  return abi;
}

std::vector<const void *> bind_blob(const unsigned char *data, uint64_t size,
                                    const kiln_model_abi *abi, const std::string &what,
                                    const std::map<std::string, std::vector<int64_t>> &shapes,
                                    const std::map<std::string, std::string> &keys = {},
                                    const std::map<std::string, kiln::WeightView> &views = {}) {
  std::vector<const void *> ptrs;
  auto tensors = kiln::parse_safetensors(data, size, what);
  for (int64_t i = 0; i < abi->n_weights; ++i) {
    const char *own = abi->weight_names[i];
    const char *dtype = abi->weight_dtypes[i];
    if (!own || !dtype) kiln::fail("kiln: %s: model weight %lld has no name or dtype",
                                   what.c_str(), static_cast<long long>(i));
    auto view = views.find(own);  // bytes inside another stored weight
    if (view != views.end()) {
      auto it = tensors.find(view->second.key);
      if (it == tensors.end()) {
        kiln::fail("%s: missing weight '%s' (weight '%s' is a view into it)", what.c_str(),
                   view->second.key.c_str(), own);
      }
      const kiln::SafeTensor &t = it->second;
      const uint64_t off = view->second.offset;
      if (t.dtype != dtype) {
        kiln::fail("%s: weight '%s' (a view into '%s') has dtype %s, the model expects %s",
                   what.c_str(), own, view->second.key.c_str(), t.dtype.c_str(), dtype);
      }
      if (abi->weight_nbytes[i] < 0 || off > t.nbytes ||
          static_cast<uint64_t>(abi->weight_nbytes[i]) > t.nbytes - off) {
        kiln::fail("%s: weight '%s' is %lld bytes at offset %llu of '%s', which has %llu",
                   what.c_str(), own, static_cast<long long>(abi->weight_nbytes[i]),
                   static_cast<unsigned long long>(off), view->second.key.c_str(),
                   static_cast<unsigned long long>(t.nbytes));
      }
      ptrs.push_back(t.data + off);
      continue;
    }
    auto key = keys.find(own);  // an entry point's weight may be stored under another key
    const char *name = key == keys.end() ? own : key->second.c_str();
    auto it = tensors.find(name);
    if (it == tensors.end()) kiln::fail("%s: missing weight '%s'", what.c_str(), name);
    const kiln::SafeTensor &t = it->second;
    if (t.dtype != dtype) {
      kiln::fail("%s: weight '%s' has dtype %s, the model expects %s", what.c_str(), name,
                 t.dtype.c_str(), dtype);
    }
    auto want = shapes.find(name);
    if (want != shapes.end() && want->second != t.shape) {
      kiln::fail("%s: weight '%s' has shape %s, the model expects %s", what.c_str(), name,
                 shape_text(t.shape).c_str(), shape_text(want->second).c_str());
    }
    if (abi->weight_nbytes[i] < 0 || t.nbytes != static_cast<uint64_t>(abi->weight_nbytes[i])) {
      kiln::fail("%s: weight '%s' has %llu bytes, the model expects %lld", what.c_str(), name,
                 static_cast<unsigned long long>(t.nbytes),
                 static_cast<long long>(abi->weight_nbytes[i]));
    }
    ptrs.push_back(t.data);
  }
  return ptrs;
}

// The weights blob the instances are created on: the file given to
// kiln_model_update_weights, else the package's weights.safetensors (NULL when it has none).
kiln::Span current_blob(const kiln_model *m, std::string *what) {
  if (m->weights_file) {
    *what = kiln::format("kiln: weights file '%s'", m->weights_file->path().c_str());
    return {m->weights_file->data(), m->weights_file->size()};
  }
  const char *entry = "weights.safetensors";
  *what = kiln::format("kiln: package '%s': entry '%s'", m->package->path().c_str(), entry);
  if (!m->package->has(entry)) return {nullptr, 0};
  return m->package->entry(entry);
}

// Fresh instances of every entry point on the weights blob `data`, their state buffers
// shared (one per key: the first entry that has it owns it), or a failure with nothing left
// allocated.
struct Instances {
  std::vector<void *> inst;
  std::vector<kiln::StateSlot> state;
};

void destroy_all(const kiln_model *m, const std::vector<void *> &inst) {
  for (size_t i = inst.size(); i-- > 0;) {  // owners of shared state last
    if (inst[i]) m->entries[i].abi->destroy(inst[i]);
  }
}

Instances create_all(kiln_model *m, const unsigned char *data, uint64_t size,
                     const std::string &what) {
  Instances out;
  // device models: the first entry that has a weight key uploads it, later ones share it
  std::map<std::string, std::pair<size_t, int64_t>> uploaded;  // key -> (entry, weight k)
  // views into a key some entry reads whole: not uploaded, given that upload at their offset
  // once every instance exists (the entry that uploads it may come later)
  std::set<std::string> whole;
  struct Pending { size_t entry; int64_t k; kiln::WeightView view; };
  std::vector<Pending> pending;
  if (m->share_weights) {
    for (const ModelEntry &ent : m->entries) {
      for (int64_t k = 0; k < ent.abi->n_weights; ++k) {
        const char *own = ent.abi->weight_names[k];
        if (!own || ent.views.count(own)) continue;
        auto key = ent.keys.find(own);
        whole.insert(key == ent.keys.end() ? std::string(own) : key->second);
      }
    }
  }
  try {
    for (size_t e = 0; e < m->entries.size(); ++e) {
      const ModelEntry &ent = m->entries[e];
      const kiln_model_abi *abi = ent.abi;
      if (!data && abi->n_weights > 0) {
        kiln::fail("kiln: package '%s': missing entry 'weights.safetensors' (the model needs "
                   "%lld weights)", m->package->path().c_str(),
                   static_cast<long long>(abi->n_weights));
      }
      std::vector<const void *> w = abi->n_weights > 0
          ? bind_blob(data, size, abi, what, m->weight_shapes, ent.keys, ent.views)
          : std::vector<const void *>();
      auto key_of = [&](int64_t k) {  // "" for a view: it is no stored weight of its own
        if (ent.views.count(abi->weight_names[k])) return std::string();
        auto key = ent.keys.find(abi->weight_names[k]);
        return key == ent.keys.end() ? std::string(abi->weight_names[k]) : key->second;
      };
      std::vector<char> skipped(w.size(), 0);  // not uploaded: shared after create
      if (m->share_weights) {
        for (int64_t k = 0; k < abi->n_weights; ++k) {
          auto view = ent.views.find(abi->weight_names[k]);
          if (view != ent.views.end()) {
            if (whole.count(view->second.key) && abi->weight_nbytes[k] > 0) {
              w[k] = nullptr;
              skipped[k] = 1;
              pending.push_back({e, k, view->second});
            }
            continue;
          }
          const std::string name = key_of(k);
          if (uploaded.count(name) && abi->weight_nbytes[k] > 0) {
            w[k] = nullptr;
            skipped[k] = 1;
          }
        }
      }
      char err[1024] = {0};
      void *inst = create_instance(m, abi, w, err, sizeof err);
      err[sizeof err - 1] = '\0';
      if (!inst) {
        kiln::fail("%s: model creation failed%s%s: %s", what.c_str(),
                   m->entries.size() > 1 ? " for entry point " : "",
                   m->entries.size() > 1 ? ent.name.c_str() : "", err[0] ? err : "(no message)");
      }
      out.inst.push_back(inst);
      if (m->share_weights) {
        for (int64_t k = 0; k < abi->n_weights; ++k) {
          const std::string name = key_of(k);
          if (name.empty()) continue;  // a view: shared below, once its owner exists
          auto up = uploaded.find(name);
          if (up == uploaded.end()) {
            uploaded[name] = {e, k};
            continue;
          }
          if (!skipped[k] || m->state_keys.count(name)) continue;  // state: share_state below
          const ModelEntry &owner = m->entries[up->second.first];
          void *buf = owner.abi->weight_buffer(out.inst[up->second.first], up->second.second);
          if (!buf || abi->share_weight(inst, k, buf, err, sizeof err) != 0) {
            err[sizeof err - 1] = '\0';
            kiln::fail("%s: entry point %s cannot share weight '%s': %s", what.c_str(),
                       ent.name.c_str(), name.c_str(), buf ? err : "its owner has no copy");
          }
        }
      }
      if (!m->state_abi || !abi->state_buffer) continue;
      for (int64_t k = 0; k < abi->n_weights; ++k) {
        void *buf = abi->state_buffer(inst, k);
        if (!buf && !skipped[k]) continue;  // skipped state: not uploaded, shared below
        const std::string name = key_of(k);
        if (!buf && !m->state_keys.count(name)) continue;
        auto slot = std::find_if(out.state.begin(), out.state.end(),
                                 [&](const kiln::StateSlot &s) { return s.key == name; });
        if (slot == out.state.end()) {
          out.state.push_back({name, e, k, abi->weight_nbytes[k], w[k]});
          continue;
        }
        if (slot->nbytes != abi->weight_nbytes[k]) {
          kiln::fail("%s: state buffer '%s' has %lld bytes in entry point %s, %lld in %s",
                     what.c_str(), name.c_str(), static_cast<long long>(abi->weight_nbytes[k]),
                     ent.name.c_str(), static_cast<long long>(slot->nbytes),
                     m->entries[slot->entry].name.c_str());
        }
        const ModelEntry &owner = m->entries[slot->entry];
        void *shared = owner.abi->state_buffer(out.inst[slot->entry], slot->k);
        if (abi->share_state(inst, k, shared, err, sizeof err) != 0) {
          err[sizeof err - 1] = '\0';
          kiln::fail("%s: entry point %s cannot share state buffer '%s': %s", what.c_str(),
                     ent.name.c_str(), name.c_str(), err);
        }
      }
    }
    for (const Pending &p : pending) {  // views: the upload of their stored weight, offset
      const ModelEntry &ent = m->entries[p.entry];
      auto up = uploaded.find(p.view.key);
      const ModelEntry *owner = up == uploaded.end() ? nullptr : &m->entries[up->second.first];
      void *buf = owner ? owner->abi->weight_buffer(out.inst[up->second.first],
                                                    up->second.second) : nullptr;
      char err[1024] = {0};
      if (!buf || ent.abi->share_weight(out.inst[p.entry], p.k,
                                        static_cast<char *>(buf) + p.view.offset, err,
                                        sizeof err) != 0) {
        err[sizeof err - 1] = '\0';
        kiln::fail("%s: entry point %s cannot share weight '%s' (a view into '%s'): %s",
                   what.c_str(), ent.name.c_str(), ent.abi->weight_names[p.k],
                   p.view.key.c_str(), buf ? err : "no copy of it was uploaded");
      }
    }
  } catch (...) {
    destroy_all(m, out.inst);
    throw;
  }
  return out;
}

void free_outputs(DLManagedTensor **outputs, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (outputs[i] && outputs[i]->deleter) outputs[i]->deleter(outputs[i]);
    outputs[i] = nullptr;
  }
}

}  // namespace

extern "C" {

KILN_API int kiln_abi_version(void) { return KILN_ABI_VERSION; }

KILN_API int kiln_abi_minor(void) { return KILN_ABI_MINOR; }

KILN_API int kiln_cpu_supports(const char *feature) {
  return feature ? kiln::cpu_supports(feature) : -1;
}

KILN_API int kiln_model_load(const char *package_path, const char *device, kiln_model **out) {
  if (out) *out = nullptr;
  return guarded([&] {
    if (!out) kiln::fail("kiln_model_load: out is NULL");
    if (!package_path) kiln::fail("kiln_model_load: package_path is NULL");
    if (!device) kiln::fail("kiln_model_load: device is NULL (use \"cpu\")");
    auto m = std::make_unique<kiln_model>();
    parse_device(device, &m->device_type, &m->device_id);
    m->package = std::make_unique<kiln::ZipReader>(package_path);
    ManifestInfo info = check_manifest(*m->package);
    const std::string &built_for = info.device;
    m->weight_shapes = info.weight_shapes;
    m->state_abi = info.state_abi;
    m->share_weights = info.share_weights && m->device_type == kDLCUDA;
    m->state_keys = info.state_keys;
    const bool want_cuda = m->device_type == kDLCUDA;
    if (built_for != (want_cuda ? "cuda" : "cpu")) {
      kiln::fail("kiln_model_load: package '%s' was compiled for device \"%s\", cannot load it "
                 "on \"%s\" (compile with device=\"%s\")", package_path, built_for.c_str(),
                 device, want_cuda ? "cuda" : "cpu");
    }
    m->entries = std::move(info.entries);
    for (size_t e = 0; e < m->entries.size(); ++e) {
      ModelEntry &ent = m->entries[e];
      // before any of the package's code is mapped: a CPU without its features fails by name
      const CpuLevel &level = pick_level(ent, package_path);
      if (e == 0) m->cpu_level = level.march;
      void *lib = nullptr;
      // a package built before kiln's pool links libgomp: its spin count, before it loads
      if (!want_cuda && e == 0 && info.links_openmp) kiln::set_openmp_spin_policy();
      ent.abi = open_library(*m->package, level.library, &lib);
      if (!want_cuda && e == 0) bind_threads(m.get(), lib);
      if (want_cuda && (ent.abi->device_type != kDLCUDA || !ent.abi->create_on_device ||
                        !ent.abi->run_on_stream)) {
        kiln::fail("kiln: package '%s': its manifest says cuda but %s is not a CUDA model",
                   package_path, level.library.c_str());
      }
      if (!want_cuda) {  // per-step profiling hooks (kiln_model_prof_v1), when printed
        ent.prof.table = kiln::prof_table(ent.abi);
        ent.prof.reset();
      }
      if (m->state_abi && (!ent.abi->state_buffer || !ent.abi->share_state ||
                           !ent.abi->read_state || !ent.abi->write_state ||
                           (m->share_weights && (!ent.abi->weight_buffer ||
                                                 !ent.abi->share_weight)))) {
        kiln::fail("kiln: package '%s': %s lacks the state functions its manifest promises",
                   package_path, level.library.c_str());
      }
    }
    std::string what;
    kiln::Span blob = current_blob(m.get(), &what);
    Instances made = create_all(m.get(), blob.data, blob.size, what);
    for (size_t e = 0; e < m->entries.size(); ++e) m->entries[e].instance = made.inst[e];
    m->state = std::move(made.state);
    const char *prof = std::getenv("KILN_PROFILE");  // profile every run, summary at free
    if (prof && *prof && std::strcmp(prof, "0") != 0) {
      m->profiling = true;
      m->profile_to = prof;
    }
    *out = m.release();
  });
}

KILN_API const char *kiln_model_cpu_level(const kiln_model *m) {
  if (!m) {
    kiln::set_last_error("kiln_model_cpu_level: model is NULL");
    return nullptr;
  }
  return m->cpu_level.c_str();
}

namespace {
// The entry point `name` of m (NULL: the default one), or a failure naming the ones it has.
size_t find_entry(const kiln_model *m, const char *name, const char *fn) {
  if (!name) kiln::fail("%s: entry name is NULL", fn);
  for (size_t e = 0; e < m->entries.size(); ++e) {
    if (m->entries[e].name == name) return e;
  }
  std::string names;
  for (const ModelEntry &e : m->entries) names += (names.empty() ? "" : ", ") + e.name;
  kiln::fail("%s: package '%s' has no entry point '%s' (its entry points: %s)", fn,
             m->package->path().c_str(), name, names.c_str());
}
}  // namespace

KILN_API int64_t kiln_model_num_inputs(const kiln_model *m) {
  if (!m) {
    kiln::set_last_error("kiln_model_num_inputs: model is NULL");
    return -1;
  }
  return m->entries[0].abi->n_inputs;
}

KILN_API int64_t kiln_model_num_outputs(const kiln_model *m) {
  if (!m) {
    kiln::set_last_error("kiln_model_num_outputs: model is NULL");
    return -1;
  }
  return m->entries[0].abi->n_outputs;
}

static int run_impl(kiln_model *m, const char *entry, const DLTensor *const *inputs,
                    int64_t n_inputs, DLManagedTensor **outputs, int64_t n_outputs,
                    bool on_stream, void *stream) {
  return guarded([&] {
    const char *fn = entry ? "kiln_model_run_entry" : "kiln_model_run";
    if (!m) kiln::fail("%s: model is NULL", fn);
    if (on_stream && stream && m->device_type != kDLCUDA) {
      kiln::fail("kiln_model_run_on_stream: this model runs on the cpu; a stream applies only "
                 "to cuda models (pass NULL)");
    }
    ModelEntry &ent = m->entries[entry ? find_entry(m, entry, fn) : 0];
    const kiln_model_abi *abi = ent.abi;
    const std::string at = entry ? kiln::format("%s(%s)", fn, entry) : std::string(fn);
    if (n_inputs != abi->n_inputs) {
      kiln::fail("%s: expected %lld inputs, got %lld", at.c_str(),
                 static_cast<long long>(abi->n_inputs), static_cast<long long>(n_inputs));
    }
    if (n_outputs != abi->n_outputs) {
      kiln::fail("%s: expected %lld outputs, got %lld", at.c_str(),
                 static_cast<long long>(abi->n_outputs), static_cast<long long>(n_outputs));
    }
    if (!inputs && n_inputs > 0) kiln::fail("%s: inputs is NULL", at.c_str());
    if (!outputs && n_outputs > 0) kiln::fail("%s: outputs is NULL", at.c_str());
    for (int64_t i = 0; i < n_inputs; ++i) {
      if (!inputs[i]) kiln::fail("%s: input %lld is NULL", at.c_str(), static_cast<long long>(i));
    }
    for (int64_t i = 0; i < n_outputs; ++i) outputs[i] = nullptr;
    char err[1024] = {0};
    int rc;
    {
      std::lock_guard<std::mutex> lock(m->mu);
      std::optional<ThreadBudget> budget;
      if (m->device_type != kDLCUDA) budget.emplace(m);
      const bool profiled = m->profiling && ent.prof.table;
      if (profiled) ent.prof.begin(ent.instance);
      rc = m->device_type == kDLCUDA
               ? abi->run_on_stream(ent.instance, inputs, n_inputs, outputs, n_outputs, stream,
                                    err, sizeof err)
               : abi->run(ent.instance, m->copy_in.bind(inputs, n_inputs), n_inputs, outputs,
                          n_outputs, err, sizeof err);
      if (profiled) ent.prof.end(ent.instance, rc == 0);
    }
    err[sizeof err - 1] = '\0';
    if (rc != 0) {
      free_outputs(outputs, n_outputs);
      kiln::fail("%s", err[0] ? err : (at + ": the model failed (no message)").c_str());
    }
    for (int64_t i = 0; i < n_outputs; ++i) {
      if (!outputs[i]) {
        free_outputs(outputs, n_outputs);
        kiln::fail("%s: the model returned no tensor for output %lld", at.c_str(),
                   static_cast<long long>(i));
      }
    }
  });
}

KILN_API int kiln_model_run(kiln_model *m, const DLTensor *const *inputs, int64_t n_inputs,
                            DLManagedTensor **outputs, int64_t n_outputs) {
  return run_impl(m, nullptr, inputs, n_inputs, outputs, n_outputs, false, nullptr);
}

KILN_API int kiln_model_run_on_stream(kiln_model *m, const DLTensor *const *inputs,
                                      int64_t n_inputs, DLManagedTensor **outputs,
                                      int64_t n_outputs, void *cuda_stream) {
  return run_impl(m, nullptr, inputs, n_inputs, outputs, n_outputs, true, cuda_stream);
}

KILN_API int kiln_model_run_entry(kiln_model *m, const char *entry, const DLTensor *const *inputs,
                                  int64_t n_inputs, DLManagedTensor **outputs,
                                  int64_t n_outputs) {
  if (!entry) {
    kiln::set_last_error("kiln_model_run_entry: entry is NULL");
    return 1;
  }
  return run_impl(m, entry, inputs, n_inputs, outputs, n_outputs, false, nullptr);
}

KILN_API int kiln_model_run_entry_on_stream(kiln_model *m, const char *entry,
                                            const DLTensor *const *inputs, int64_t n_inputs,
                                            DLManagedTensor **outputs, int64_t n_outputs,
                                            void *cuda_stream) {
  if (!entry) {
    kiln::set_last_error("kiln_model_run_entry_on_stream: entry is NULL");
    return 1;
  }
  return run_impl(m, entry, inputs, n_inputs, outputs, n_outputs, true, cuda_stream);
}

KILN_API int64_t kiln_model_num_entries(const kiln_model *m) {
  if (!m) {
    kiln::set_last_error("kiln_model_num_entries: model is NULL");
    return -1;
  }
  return static_cast<int64_t>(m->entries.size());
}

KILN_API const char *kiln_model_entry_name(const kiln_model *m, int64_t i) {
  if (!m || i < 0 || i >= static_cast<int64_t>(m->entries.size())) {
    kiln::set_last_error(m ? kiln::format("kiln_model_entry_name: index %lld out of range (the "
                                          "package has %zu entry points)",
                                          static_cast<long long>(i), m->entries.size())
                           : std::string("kiln_model_entry_name: model is NULL"));
    return nullptr;
  }
  return m->entries[static_cast<size_t>(i)].name.c_str();
}

static int64_t entry_count(const kiln_model *m, const char *entry, bool inputs) {
  const char *fn = inputs ? "kiln_model_entry_num_inputs" : "kiln_model_entry_num_outputs";
  int64_t n = -1;
  if (guarded([&] {
        if (!m) kiln::fail("%s: model is NULL", fn);
        const kiln_model_abi *abi = m->entries[find_entry(m, entry, fn)].abi;
        n = inputs ? abi->n_inputs : abi->n_outputs;
      }) != 0) {
    return -1;
  }
  return n;
}

KILN_API int64_t kiln_model_entry_num_inputs(const kiln_model *m, const char *entry) {
  return entry_count(m, entry, true);
}

KILN_API int64_t kiln_model_entry_num_outputs(const kiln_model *m, const char *entry) {
  return entry_count(m, entry, false);
}

namespace {
// Swaps in fresh instances (and their state), handing a collective package's communicator
// over, and destroys the old ones after the swap (a run in flight completes on them).
void swap_instances(kiln_model *m, Instances fresh, std::unique_ptr<kiln::FileMap> file) {
  std::vector<void *> old;
  std::unique_ptr<kiln::FileMap> old_file;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    for (size_t e = 0; e < m->entries.size(); ++e) {
      old.push_back(m->entries[e].instance);
      kiln::comm_move(m->entries[e].abi, old.back(), fresh.inst[e]);
      m->entries[e].instance = fresh.inst[e];
    }
    m->state = std::move(fresh.state);
    if (file) {
      old_file = std::move(m->weights_file);
      m->weights_file = std::move(file);
    }
  }
  destroy_all(m, old);
}

const kiln::StateSlot &state_slot(const kiln_model *m, int64_t i, const char *fn) {
  if (!m->state_abi) {
    kiln::fail("%s: package '%s' was written by a kiln without state functions: recompile it "
               "to read or write its state", fn, m->package->path().c_str());
  }
  if (i < 0 || i >= static_cast<int64_t>(m->state.size())) {
    kiln::fail("%s: state index %lld out of range (the model has %zu state buffers)", fn,
               static_cast<long long>(i), m->state.size());
  }
  return m->state[static_cast<size_t>(i)];
}

void state_io(kiln_model *m, int64_t i, void *to, const void *from, size_t nbytes,
              const char *fn) {
  const kiln::StateSlot &s = state_slot(m, i, fn);
  if (nbytes != static_cast<size_t>(s.nbytes)) {
    kiln::fail("%s: state buffer '%s' has %lld bytes, got a buffer of %zu", fn, s.key.c_str(),
               static_cast<long long>(s.nbytes), nbytes);
  }
  if (!(to ? to : from)) kiln::fail("%s: buffer is NULL", fn);
  const ModelEntry &owner = m->entries[s.entry];
  char err[1024] = {0};
  const int rc = to ? owner.abi->read_state(owner.instance, s.k, to, err, sizeof err)
                    : owner.abi->write_state(owner.instance, s.k, from, err, sizeof err);
  err[sizeof err - 1] = '\0';
  if (rc != 0) kiln::fail("%s: state buffer '%s': %s", fn, s.key.c_str(), err);
}
}  // namespace

KILN_API int kiln_model_update_weights(kiln_model *m, const char *safetensors_path) {
  return guarded([&] {
    if (!m) kiln::fail("kiln_model_update_weights: model is NULL");
    if (!safetensors_path) kiln::fail("kiln_model_update_weights: safetensors_path is NULL");
    auto file = std::make_unique<kiln::FileMap>(safetensors_path);
    std::string what = kiln::format("kiln: weights file '%s'", safetensors_path);
    Instances fresh = create_all(m, file->data(), file->size(), what);
    swap_instances(m, std::move(fresh), std::move(file));
  });
}

KILN_API int kiln_model_reset_state(kiln_model *m) {
  return guarded([&] {
    if (!m) kiln::fail("kiln_model_reset_state: model is NULL");
    if (m->state_abi) {  // each state buffer back to its value in the weights blob
      std::lock_guard<std::mutex> lock(m->mu);
      for (size_t i = 0; i < m->state.size(); ++i) {
        const kiln::StateSlot &s = m->state[i];
        state_io(m, static_cast<int64_t>(i), nullptr, s.initial,
                 static_cast<size_t>(s.nbytes), "kiln_model_reset_state");
      }
      return;
    }
    std::string what;  // an older package: fresh instances on the same weights
    kiln::Span blob = current_blob(m, &what);
    swap_instances(m, create_all(m, blob.data, blob.size, what), nullptr);
  });
}

KILN_API int64_t kiln_model_num_state(const kiln_model *m) {
  if (!m) {
    kiln::set_last_error("kiln_model_num_state: model is NULL");
    return -1;
  }
  return static_cast<int64_t>(m->state.size());
}

KILN_API const char *kiln_model_state_name(const kiln_model *m, int64_t i) {
  const char *out = nullptr;
  guarded([&] {
    if (!m) kiln::fail("kiln_model_state_name: model is NULL");
    out = state_slot(m, i, "kiln_model_state_name").key.c_str();
  });
  return out;
}

KILN_API int64_t kiln_model_state_nbytes(const kiln_model *m, int64_t i) {
  int64_t out = -1;
  guarded([&] {
    if (!m) kiln::fail("kiln_model_state_nbytes: model is NULL");
    out = state_slot(m, i, "kiln_model_state_nbytes").nbytes;
  });
  return out;
}

namespace {
// Copies shape into out[0..min(ndim, capacity)) and returns ndim.
int64_t put_shape(const std::vector<int64_t> &shape, int64_t *out, int64_t capacity,
                  const char *fn) {
  if (capacity < 0 || (capacity > 0 && !out))
    kiln::fail("%s: shape is NULL or capacity %lld < 0", fn, static_cast<long long>(capacity));
  const int64_t n = static_cast<int64_t>(shape.size());
  for (int64_t d = 0; d < n && d < capacity; ++d) out[d] = shape[static_cast<size_t>(d)];
  return n;
}

const kiln::InputRecord &input_record(const kiln_model *m, const char *entry, int64_t i,
                                      const char *fn) {
  if (!m) kiln::fail("%s: model is NULL", fn);
  const kiln::ModelEntry &e = m->entries[find_entry(m, entry, fn)];
  if (e.inputs.empty())
    kiln::fail("%s: the package records no inputs of entry point '%s' (written by an older "
               "kiln)", fn, e.name.c_str());
  if (i < 0 || i >= static_cast<int64_t>(e.inputs.size()))
    kiln::fail("%s: input %lld out of range (entry point '%s' has %zu inputs)", fn,
               static_cast<long long>(i), e.name.c_str(), e.inputs.size());
  return e.inputs[static_cast<size_t>(i)];
}
}  // namespace

KILN_API const char *kiln_model_entry_input_name(const kiln_model *m, const char *entry,
                                                 int64_t i) {
  const char *out = nullptr;
  guarded([&] {
    out = input_record(m, entry, i, "kiln_model_entry_input_name").name.c_str();
  });
  return out;
}

KILN_API int64_t kiln_model_entry_input_shape(const kiln_model *m, const char *entry,
                                              int64_t i, int64_t *shape, int64_t capacity) {
  int64_t out = -1;
  guarded([&] {
    const char *fn = "kiln_model_entry_input_shape";
    out = put_shape(input_record(m, entry, i, fn).shape, shape, capacity, fn);
  });
  return out;
}

KILN_API int64_t kiln_model_state_shape(const kiln_model *m, int64_t i, int64_t *shape,
                                        int64_t capacity) {
  int64_t out = -1;
  guarded([&] {
    const char *fn = "kiln_model_state_shape";
    if (!m) kiln::fail("%s: model is NULL", fn);
    const std::string &key = state_slot(m, i, fn).key;
    auto it = m->weight_shapes.find(key);
    if (it == m->weight_shapes.end())
      kiln::fail("%s: the package records no shape of state buffer '%s'", fn, key.c_str());
    out = put_shape(it->second, shape, capacity, fn);
  });
  return out;
}

KILN_API int kiln_model_read_state(kiln_model *m, int64_t i, void *host, size_t nbytes) {
  return guarded([&] {
    if (!m) kiln::fail("kiln_model_read_state: model is NULL");
    std::lock_guard<std::mutex> lock(m->mu);
    state_io(m, i, host, nullptr, nbytes, "kiln_model_read_state");
  });
}

KILN_API int kiln_model_write_state(kiln_model *m, int64_t i, const void *host, size_t nbytes) {
  return guarded([&] {
    if (!m) kiln::fail("kiln_model_write_state: model is NULL");
    std::lock_guard<std::mutex> lock(m->mu);
    state_io(m, i, nullptr, host, nbytes, "kiln_model_write_state");
  });
}

KILN_API int kiln_model_copy_state(kiln_model *dst, kiln_model *src) {
  return guarded([&] {
    const char *fn = "kiln_model_copy_state";
    if (!dst || !src) kiln::fail("%s: model is NULL", fn);
    if (dst == src) return;
    if (dst->state.size() != src->state.size()) {
      kiln::fail("%s: the models have %zu and %zu state buffers (copy between handles of one "
                 "package)", fn, dst->state.size(), src->state.size());
    }
    for (size_t i = 0; i < src->state.size(); ++i) {
      if (src->state[i].key != dst->state[i].key ||
          src->state[i].nbytes != dst->state[i].nbytes) {
        kiln::fail("%s: state buffer %zu is '%s' (%lld bytes) in the source, '%s' (%lld bytes) "
                   "in the destination (copy between handles of one package)", fn, i,
                   src->state[i].key.c_str(), static_cast<long long>(src->state[i].nbytes),
                   dst->state[i].key.c_str(), static_cast<long long>(dst->state[i].nbytes));
      }
    }
    std::vector<unsigned char> host;
    for (size_t i = 0; i < src->state.size(); ++i) {  // through host memory (any device)
      host.resize(static_cast<size_t>(src->state[i].nbytes));
      {
        std::lock_guard<std::mutex> lock(src->mu);
        state_io(src, static_cast<int64_t>(i), host.data(), nullptr, host.size(), fn);
      }
      std::lock_guard<std::mutex> lock(dst->mu);
      state_io(dst, static_cast<int64_t>(i), nullptr, host.data(), host.size(), fn);
    }
  });
}

KILN_API int kiln_model_set_num_threads(kiln_model *m, int num_threads) {
  return guarded([&] {
    if (!m) kiln::fail("kiln_model_set_num_threads: model is NULL");
    if (num_threads < 0 || num_threads > kMaxThreads) {
      kiln::fail("kiln_model_set_num_threads: num_threads must be in [0, %d] (0: automatic), "
                 "got %d", kMaxThreads, num_threads);
    }
    m->num_threads.store(num_threads);
  });
}

KILN_API int kiln_model_num_threads(const kiln_model *m) {
  if (!m) {
    kiln::set_last_error("kiln_model_num_threads: model is NULL");
    return -1;
  }
  return m->num_threads.load();
}

KILN_API int kiln_model_set_comm(kiln_model *m, int rank, int world_size, const void *comm_id,
                                 size_t comm_id_len) {
  return guarded([&] {
    if (!m) kiln::fail("kiln_model_set_comm: model is NULL");
    std::lock_guard<std::mutex> lock(m->mu);  // not while a run is in flight
    bool any = false;  // every entry point whose program runs collectives
    for (const ModelEntry &e : m->entries) {
      if (!kiln::comm_table(e.abi)) continue;
      kiln::comm_attach(e.abi, e.instance, rank, world_size, comm_id, comm_id_len);
      any = true;
    }
    if (!any) {  // fails naming why
      kiln::comm_attach(m->entries[0].abi, m->entries[0].instance, rank, world_size, comm_id,
                        comm_id_len);
    }
  });
}

KILN_API const char *kiln_last_error(void) { return kiln::last_error(); }

namespace {
// The profile summaries of every entry point (kiln_model_profile_write, KILN_PROFILE).
std::string profile_text(kiln_model *m) {
  std::lock_guard<std::mutex> lock(m->mu);
  std::string text;
  for (const ModelEntry &e : m->entries) {
    text += kiln::prof_summary(e.prof, m->package->path(), e.name);
  }
  return text;
}

void write_text(const std::string &text, const char *path) {
  const bool err = !path || !*path || std::strcmp(path, "-") == 0 || std::strcmp(path, "1") == 0;
  FILE *f = err ? stderr : std::fopen(path, "a");
  if (!f) kiln::fail("kiln_model_profile_write: cannot open '%s': %s", path, std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (!err && std::fclose(f) != 0) kiln::fail("kiln_model_profile_write: cannot write '%s'", path);
  if (!ok) kiln::fail("kiln_model_profile_write: short write to '%s'", err ? "stderr" : path);
}

kiln::Profile &profile_of(kiln_model *m, const char *entry, const char *fn) {
  if (!m) kiln::fail("%s: model is NULL", fn);
  return m->entries[entry ? find_entry(m, entry, fn) : 0].prof;
}
}  // namespace

KILN_API int kiln_model_set_profiling(kiln_model *m, int on) {
  return guarded([&] {
    if (!m) kiln::fail("kiln_model_set_profiling: model is NULL");
    std::lock_guard<std::mutex> lock(m->mu);
    if (on && m->device_type == kDLCUDA) {
      kiln::fail("kiln_model_set_profiling: package '%s' is a CUDA package; its kernels are "
                 "timed on the device (kiln profile, CUPTI), not by the host", m->package->path().c_str());
    }
    if (on && !m->profiling) {
      for (ModelEntry &e : m->entries) e.prof.reset();
    }
    m->profiling = on != 0;
  });
}

KILN_API int64_t kiln_model_profile_num_steps(kiln_model *m, const char *entry) {
  int64_t n = -1;
  if (guarded([&] {
        const kiln::Profile &p = profile_of(m, entry, "kiln_model_profile_num_steps");
        n = p.table ? p.table->n_steps : 0;
      }) != 0) {
    return -1;
  }
  return n;
}

KILN_API int64_t kiln_model_profile_runs(kiln_model *m, const char *entry) {
  int64_t n = -1;
  if (guarded([&] {
        const kiln::Profile &p = profile_of(m, entry, "kiln_model_profile_runs");
        std::lock_guard<std::mutex> lock(m->mu);
        n = p.runs;
      }) != 0) {
    return -1;
  }
  return n;
}

KILN_API int kiln_model_profile_step(kiln_model *m, const char *entry, int64_t i,
                                     const char **name, const char **kind,
                                     const char **source_ops, double *last_seconds,
                                     double *total_seconds) {
  return guarded([&] {
    const char *fn = "kiln_model_profile_step";
    const kiln::Profile &p = profile_of(m, entry, fn);
    const int64_t n = p.table ? p.table->n_steps : 0;
    if (i < 0 || i >= n) {
      kiln::fail("%s: step %lld out of range (the entry point has %lld profiled steps%s)", fn,
                 static_cast<long long>(i), static_cast<long long>(n),
                 p.table ? "" : ": a CUDA package or one compiled before profiling hooks");
    }
    std::lock_guard<std::mutex> lock(m->mu);
    const size_t k = static_cast<size_t>(i);
    if (name) *name = p.table->step_names[k];
    if (kind) *kind = p.table->step_kinds[k];
    if (source_ops) *source_ops = p.table->step_sources[k];
    if (last_seconds) *last_seconds = k < p.last.size() ? p.last[k] * 1e-9 : 0.0;
    if (total_seconds) *total_seconds = k < p.total.size() ? p.total[k] * 1e-9 : 0.0;
  });
}

KILN_API int kiln_model_profile_write(kiln_model *m, const char *path) {
  return guarded([&] {
    if (!m) kiln::fail("kiln_model_profile_write: model is NULL");
    write_text(profile_text(m), path);
  });
}

KILN_API void kiln_model_free(kiln_model *m) {
  if (!m) return;
  if (!m->profile_to.empty()) {  // KILN_PROFILE: the summary, best effort
    guarded([&] { write_text(profile_text(m), m->profile_to.c_str()); });
  }
  std::vector<void *> inst;
  for (const ModelEntry &e : m->entries) inst.push_back(e.instance);
  destroy_all(m, inst);
  delete m;
}

}  // extern "C"
