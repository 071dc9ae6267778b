// profile.h - per-step profiling of CPU models (kiln.h: kiln_model_set_profiling and the
// kiln_model_profile_* functions; KILN_PROFILE in the environment). The model library times
// its own steps into counters libkiln attaches for the length of one run (kiln_model_prof in
// kiln_model_abi.h); here: finding that table, the counters of one entry point, the text
// summary.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kiln_model_abi.h"

namespace kiln {

// The profiling table of the library holding `abi`, or NULL when it was printed without hooks
// (CUDA models, packages from before profiling).
const kiln_model_prof *prof_table(const kiln_model_abi *abi);

// The counters of one entry point.
struct Profile {
  const kiln_model_prof *table = nullptr;  // NULL: no hooks
  std::vector<uint64_t> last;  // ns per step in the last profiled run
  std::vector<uint64_t> total;  // ns per step, summed over the profiled runs
  int64_t runs = 0;  // profiled runs that succeeded

  void reset();
  // Around one run of `instance` (under the model's mutex): attach zeroed counters, and
  // detach them after, adding them to the totals when the run succeeded.
  void begin(void *instance);
  void end(void *instance, bool ok);
};

// The profile of one entry point as text: a header line, then a row per step (name, kind,
// runs, total ms, mean us, share of the steps' total, source ops), slowest first.
std::string prof_summary(const Profile &p, const std::string &package, const std::string &entry);

}  // namespace kiln
