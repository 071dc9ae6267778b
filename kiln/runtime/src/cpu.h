// The instruction-set extensions of the CPU libkiln runs on, by the names a package's manifest
// records (requires.cpu_features, from the compiler's flags: kiln/toolchain/cxx.py
// CPU_FEATURES), so that loading refuses a package whose code this CPU cannot execute instead
// of dying with an illegal instruction.
#pragma once

namespace kiln {

// 1: the CPU and the OS support `name` (for AVX / AVX-512 / AMX also the OS saving the
// registers: XGETBV); 0: they do not; -1: `name` is not a feature this libkiln knows.
int cpu_supports(const char *name);

}  // namespace kiln
