// profile.cpp - see profile.h.
#include "profile.h"

#include <dlfcn.h>

#include <algorithm>
#include <numeric>

#include "error.h"

namespace kiln {

const kiln_model_prof *prof_table(const kiln_model_abi *abi) {
  if (!abi) return nullptr;
  // the table is static data of the model library: find that library, already loaded
  Dl_info info{};
  if (!::dladdr(static_cast<const void *>(abi), &info) || !info.dli_fname) return nullptr;
  void *lib = ::dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
  if (!lib) return nullptr;
  void *sym = ::dlsym(lib, KILN_MODEL_PROF_SYMBOL);
  ::dlclose(lib);  // drops the reference RTLD_NOLOAD took; the loader keeps its own
  if (!sym) return nullptr;
  const kiln_model_prof *t = reinterpret_cast<kiln_model_prof_fn>(sym)();
  return t && t->version >= 1 && t->n_steps >= 0 && t->attach &&
                 (t->n_steps == 0 || (t->step_names && t->step_kinds && t->step_sources))
             ? t
             : nullptr;
}

void Profile::reset() {
  const size_t n = table ? static_cast<size_t>(table->n_steps) : 0;
  last.assign(n, 0);
  total.assign(n, 0);
  runs = 0;
}

void Profile::begin(void *instance) {
  if (!table) return;
  if (last.size() != static_cast<size_t>(table->n_steps)) reset();
  std::fill(last.begin(), last.end(), 0);
  table->attach(instance, last.data());
}

void Profile::end(void *instance, bool ok) {
  if (!table) return;
  table->attach(instance, nullptr);
  if (!ok) return;
  for (size_t i = 0; i < last.size(); ++i) total[i] += last[i];
  ++runs;
}

std::string prof_summary(const Profile &p, const std::string &package, const std::string &entry) {
  std::string out = format("# kiln profile: package '%s', entry point %s, %lld profiled runs\n",
                           package.c_str(), entry.c_str(), static_cast<long long>(p.runs));
  if (!p.table) return out + "# (no profiling hooks: a CUDA package, or one compiled before "
                             "them; recompile it)\n";
  const uint64_t sum = std::accumulate(p.total.begin(), p.total.end(), uint64_t{0});
  std::vector<size_t> order(p.total.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return p.total[a] > p.total[b]; });
  out += "# step\tkind\ttotal_ms\tmean_us\tshare\tsource_ops\n";
  const double runs = p.runs > 0 ? static_cast<double>(p.runs) : 1.0;
  for (size_t i : order) {
    out += format("%s\t%s\t%.3f\t%.2f\t%.1f%%\t%s\n", p.table->step_names[i],
                  p.table->step_kinds[i], p.total[i] * 1e-6, p.total[i] * 1e-3 / runs,
                  sum ? 100.0 * static_cast<double>(p.total[i]) / static_cast<double>(sum) : 0.0,
                  p.table->step_sources[i]);
  }
  return out;
}

}  // namespace kiln
