// CPUID-based feature detection (see cpu.h). Bits from the Intel SDM / AMD APM, leaf.subleaf
// and register per feature; each AVX-class feature also needs the OS to save its state.
#include "cpu.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kiln {
namespace {

enum Reg { EAX, EBX, ECX, EDX };
enum State { NONE, AVX_STATE, AVX512_STATE, AMX_STATE };

struct Feature {
  const char *name;
  unsigned leaf, sub;
  Reg reg;
  int bit;
  State state;
};

constexpr Feature kFeatures[] = {
    {"sse3", 1, 0, ECX, 0, NONE},          {"ssse3", 1, 0, ECX, 9, NONE},
    {"fma", 1, 0, ECX, 12, AVX_STATE},     {"sse4.1", 1, 0, ECX, 19, NONE},
    {"sse4.2", 1, 0, ECX, 20, NONE},       {"movbe", 1, 0, ECX, 22, NONE},
    {"popcnt", 1, 0, ECX, 23, NONE},       {"avx", 1, 0, ECX, 28, AVX_STATE},
    {"f16c", 1, 0, ECX, 29, AVX_STATE},    {"bmi", 7, 0, EBX, 3, NONE},
    {"avx2", 7, 0, EBX, 5, AVX_STATE},     {"bmi2", 7, 0, EBX, 8, NONE},
    {"avx512f", 7, 0, EBX, 16, AVX512_STATE},   {"avx512dq", 7, 0, EBX, 17, AVX512_STATE},
    {"avx512ifma", 7, 0, EBX, 21, AVX512_STATE}, {"avx512cd", 7, 0, EBX, 28, AVX512_STATE},
    {"avx512bw", 7, 0, EBX, 30, AVX512_STATE},  {"avx512vl", 7, 0, EBX, 31, AVX512_STATE},
    {"avx512vbmi", 7, 0, ECX, 1, AVX512_STATE}, {"avx512vbmi2", 7, 0, ECX, 6, AVX512_STATE},
    {"gfni", 7, 0, ECX, 8, NONE},          {"vaes", 7, 0, ECX, 9, AVX_STATE},
    {"vpclmulqdq", 7, 0, ECX, 10, AVX_STATE},   {"avx512vnni", 7, 0, ECX, 11, AVX512_STATE},
    {"avx512bitalg", 7, 0, ECX, 12, AVX512_STATE},
    {"avx512vpopcntdq", 7, 0, ECX, 14, AVX512_STATE},
    {"amx-bf16", 7, 0, EDX, 22, AMX_STATE}, {"avx512fp16", 7, 0, EDX, 23, AVX512_STATE},
    {"amx-tile", 7, 0, EDX, 24, AMX_STATE}, {"amx-int8", 7, 0, EDX, 25, AMX_STATE},
    {"avxvnni", 7, 1, EAX, 4, AVX_STATE},  {"avx512bf16", 7, 1, EAX, 5, AVX512_STATE},
    {"lzcnt", 0x80000001u, 0, ECX, 5, NONE},
};

#if defined(__x86_64__) || defined(__i386__)
bool cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
  const unsigned max = __get_cpuid_max(leaf & 0x80000000u, nullptr);
  if (max < leaf) return false;
  __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
  return true;
}

// The register state the OS saves on a context switch (XCR0), 0 without OSXSAVE.
unsigned long long xcr0() {
  unsigned r[4];
  if (!cpuid(1, 0, r) || !(r[ECX] & (1u << 27))) return 0;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

bool state_saved(State s) {
  const unsigned long long x = xcr0();
  switch (s) {
    case NONE: return true;
    case AVX_STATE: return (x & 0x6) == 0x6;                  // SSE + AVX
    case AVX512_STATE: return (x & 0xe6) == 0xe6;             // + opmask, ZMM_Hi256, Hi16_ZMM
    case AMX_STATE: return (x & 0x60000ull) == 0x60000ull;    // XTILECFG, XTILEDATA
  }
  return false;
}
#endif

}  // namespace

int cpu_supports(const char *name) {
  for (const Feature &f : kFeatures) {
    if (std::strcmp(f.name, name) != 0) continue;
#if defined(__x86_64__) || defined(__i386__)
    unsigned r[4];
    if (!cpuid(f.leaf, f.sub, r) || !(r[f.reg] & (1u << f.bit))) return 0;
    return state_saved(f.state) ? 1 : 0;
#else
    return 0;  // an x86 extension: never on this CPU
#endif
  }
  return -1;
}

bool set_openmp_spin_policy() {
  static std::once_flag once;
  static bool set = false;
  std::call_once(once, [] {
    if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
    if (void *gomp = ::dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD)) {
      ::dlclose(gomp);  // (drops the reference NOLOAD took) already initialised: keep it
      return;
    }
    set = ::setenv("GOMP_SPINCOUNT", kSpinCount, 0) == 0;
  });
  return set;
}

}  // namespace kiln
