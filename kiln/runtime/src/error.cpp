// error.cpp - thread-local last-error message and formatting helpers (see error.h).
#include "error.h"

#include <cstdarg>
#include <cstdio>
#include <vector>

namespace kiln {
namespace {
thread_local std::string g_last_error;

std::string vformat(const char *fmt, va_list ap) {
  va_list ap2;
  va_copy(ap2, ap);
  char small[512];
  int n = std::vsnprintf(small, sizeof small, fmt, ap);
  std::string out;
  if (n < 0) {
    out = "kiln: error while formatting an error message";
  } else if (static_cast<size_t>(n) < sizeof small) {
    out.assign(small, static_cast<size_t>(n));
  } else {
    std::vector<char> big(static_cast<size_t>(n) + 1);
    std::vsnprintf(big.data(), big.size(), fmt, ap2);
    out.assign(big.data(), static_cast<size_t>(n));
  }
  va_end(ap2);
  return out;
}
}  // namespace

std::string format(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  throw Error(s);
}

void set_last_error(const std::string &msg) {
  try {
    g_last_error = msg;
  } catch (...) {
    g_last_error.clear();  // out of memory: keep the state valid
  }
}

const char *last_error() { return g_last_error.c_str(); }

}  // namespace kiln
