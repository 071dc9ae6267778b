// error.h - thread-local error state of libkiln and the exception used internally.
//
// Internals throw kiln::Error(message); every exported function catches it (and any other
// exception) at the boundary and stores the message with set_last_error. Nothing throws across
// the C ABI.
#pragma once
#include <stdexcept>
#include <string>

namespace kiln {

// An error whose message is meant for the user as is.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string &msg) : std::runtime_error(msg) {}
};

// printf-style formatting into a std::string.
std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// Throws kiln::Error(format(fmt, ...)).
[[noreturn]] void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

void set_last_error(const std::string &msg);
const char *last_error();

}  // namespace kiln
