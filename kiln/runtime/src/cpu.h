// The instruction-set extensions of the CPU libkiln runs on, by the names a package's manifest
// records (requires.cpu_features, from the compiler's flags: kiln/toolchain/cxx.py
// CPU_FEATURES), so that loading refuses a package whose code this CPU cannot execute instead
// of dying with an illegal instruction.
#pragma once

namespace kiln {

// 1: the CPU and the OS support `name` (for AVX / AVX-512 / AMX also the OS saving the
// registers: XGETBV); 0: they do not; -1: `name` is not a feature this libkiln knows.
int cpu_supports(const char *name);

// Packages compiled before kiln's own pool (kiln_pool.h) only, whose manifest names libgomp:
// the spin-wait of the OpenMP pool a CPU package's code starts (GNU libgomp), decided before
// the package's library is first loaded: idle team threads spin GOMP_SPINCOUNT pause
// iterations before they sleep. libgomp's default (300000, ~7 ms at ~24 ns a pause on the
// development VM's AMD EPYC) keeps a finished thread on its core while a team member that the
// OS descheduled waits for one: on a loaded machine 2 threads then ran 2 to 20 times slower
// than 1 (BENCHMARKS.md, "CPU: 1 thread against 2 threads"). kSpinCount (~25 us there) still
// covers the gap between two kernels of a run (the next parallel region finds the team
// awake) and gives the core away within tens of microseconds otherwise. Sets GOMP_SPINCOUNT
// only where the process has not loaded libgomp yet (a process that already has it, e.g. one
// that imported torch, keeps that pool's settings: they are read once, when libgomp loads)
// and the user set neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT. Returns whether it set it.
constexpr const char *kSpinCount = "1000";
bool set_openmp_spin_policy();

}  // namespace kiln
