// json.h - a small, bounds-checked JSON parser (RFC 8259) for package metadata.
//
// Input: a byte span (not NUL-terminated). Output: a Json tree. Invariants: never reads outside
// the span; nesting depth is limited (kMaxDepth) so hostile input cannot exhaust the stack;
// strings are decoded to UTF-8 (\uXXXX escapes incl. surrogate pairs); integers without fraction
// or exponent that fit in int64 keep their exact value; only whitespace may follow the value.
// Errors throw kiln::Error with "<what> at byte <offset>".
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

struct Json {
  enum Type { Null, Bool, Number, String, Array, Object };
  Type type = Null;
  bool boolean = false;
  double number = 0.0;
  bool is_int = false;  // number is an integer that fits in int64 (value in integer)
  int64_t integer = 0;
  std::string str;
  std::vector<Json> items;                            // Array
  std::vector<std::pair<std::string, Json>> members;  // Object, in document order

  // Object member lookup (first match) or nullptr.
  const Json *get(const std::string &key) const;
};

constexpr int kMaxDepth = 64;

// Parses text[0..n). `what` names the document in error messages.
Json parse_json(const char *text, size_t n, const std::string &what);

}  // namespace kiln
