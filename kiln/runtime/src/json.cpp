// json.cpp - recursive-descent JSON parser with explicit bounds checks (see json.h).
#include "json.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "error.h"

namespace kiln {
namespace {

class Parser {
 public:
  Parser(const char *p, size_t n, const std::string &what) : p_(p), n_(n), what_(what) {}

  Json document() {
    Json v = value(0);
    skip_ws();
    if (i_ != n_) err("unexpected data after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void err(const char *msg) const {
    fail("%s: invalid JSON: %s at byte %zu", what_.c_str(), msg, i_);
  }
  bool at_end() const { return i_ >= n_; }
  char peek() const { return at_end() ? '\0' : p_[i_]; }
  void skip_ws() {
    while (!at_end() && (p_[i_] == ' ' || p_[i_] == '\t' || p_[i_] == '\n' || p_[i_] == '\r')) {
      ++i_;
    }
  }
  void expect_word(const char *w) {
    size_t len = std::strlen(w);
    if (n_ - i_ < len || std::memcmp(p_ + i_, w, len) != 0) err("invalid literal");
    i_ += len;
  }

  Json value(int depth) {
    if (depth > kMaxDepth) err("nesting too deep");
    skip_ws();
    if (at_end()) err("unexpected end of input");
    Json v;
    char c = p_[i_];
    if (c == '{') {
      v.type = Json::Object;
      ++i_;
      skip_ws();
      if (peek() == '}') {
        ++i_;
        return v;
      }
      for (;;) {
        skip_ws();
        if (peek() != '"') err("expected a string key");
        std::string key = string();
        skip_ws();
        if (peek() != ':') err("expected ':'");
        ++i_;
        Json member = value(depth + 1);
        v.members.emplace_back(std::move(key), std::move(member));
        skip_ws();
        if (peek() == ',') {
          ++i_;
        } else if (peek() == '}') {
          ++i_;
          return v;
        } else {
          err("expected ',' or '}'");
        }
      }
    }
    if (c == '[') {
      v.type = Json::Array;
      ++i_;
      skip_ws();
      if (peek() == ']') {
        ++i_;
        return v;
      }
      for (;;) {
        v.items.push_back(value(depth + 1));
        skip_ws();
        if (peek() == ',') {
          ++i_;
        } else if (peek() == ']') {
          ++i_;
          return v;
        } else {
          err("expected ',' or ']'");
        }
      }
    }
    if (c == '"') {
      v.type = Json::String;
      v.str = string();
      return v;
    }
    if (c == 't') {
      expect_word("true");
      v.type = Json::Bool;
      v.boolean = true;
      return v;
    }
    if (c == 'f') {
      expect_word("false");
      v.type = Json::Bool;
      return v;
    }
    if (c == 'n') {
      expect_word("null");
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    err("unexpected character");
  }

  static bool digit(char c) { return c >= '0' && c <= '9'; }

  Json number() {
    size_t start = i_;
    bool integral = true;
    if (peek() == '-') ++i_;
    if (peek() == '0') {
      ++i_;
    } else if (digit(peek())) {
      while (digit(peek())) ++i_;
    } else {
      err("invalid number");
    }
    if (peek() == '.') {
      integral = false;
      ++i_;
      if (!digit(peek())) err("invalid number");
      while (digit(peek())) ++i_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++i_;
      if (peek() == '+' || peek() == '-') ++i_;
      if (!digit(peek())) err("invalid number");
      while (digit(peek())) ++i_;
    }
    std::string text(p_ + start, i_ - start);  // NUL-terminated copy for strto*
    Json v;
    v.type = Json::Number;
    v.number = std::strtod(text.c_str(), nullptr);
    if (integral) {
      errno = 0;
      long long x = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == 0) {
        v.is_int = true;
        v.integer = static_cast<int64_t>(x);
      }
    }
    return v;
  }

  unsigned hex4() {
    if (n_ - i_ < 4) err("truncated \\u escape");
    unsigned u = 0;
    for (int k = 0; k < 4; ++k) {
      char c = p_[i_++];
      u <<= 4;
      if (c >= '0' && c <= '9') u |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') u |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') u |= static_cast<unsigned>(c - 'A' + 10);
      else err("invalid \\u escape");
    }
    return u;
  }

  static void put_utf8(std::string &out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    ++i_;  // opening quote
    std::string out;
    for (;;) {
      if (at_end()) err("unterminated string");
      char c = p_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) err("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_end()) err("unterminated escape");
      char e = p_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (n_ - i_ < 2 || p_[i_] != '\\' || p_[i_ + 1] != 'u') err("lone surrogate");
            i_ += 2;
            unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) err("invalid surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            err("lone surrogate");
          }
          put_utf8(out, cp);
          break;
        }
        default: err("invalid escape");
      }
    }
  }

  const char *p_;
  size_t n_;
  size_t i_ = 0;
  const std::string &what_;
};

}  // namespace

const Json *Json::get(const std::string &key) const {
  for (const auto &m : members) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}

Json parse_json(const char *text, size_t n, const std::string &what) {
  return Parser(text, n, what).document();
}

}  // namespace kiln
