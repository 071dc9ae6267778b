// cache.cpp - cache directory resolution and atomic extraction (see cache.h).
#include "cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "error.h"

namespace kiln {
namespace {

const char *env(const char *name) {
  const char *v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

void mkdirs(const std::string &path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i != path.size() && path[i] != '/') continue;
    std::string part = path.substr(0, i);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) {
      fail("kiln: cannot create cache directory '%s': %s", part.c_str(), std::strerror(errno));
    }
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    fail("kiln: cache path '%s' is not a directory", path.c_str());
  }
}

// True when the file at path holds exactly data[0..size).
bool same_content(const std::string &path, const unsigned char *data, uint64_t size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  bool same = ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) == size;
  std::vector<unsigned char> buf(1 << 16);
  uint64_t pos = 0;
  while (same && pos < size) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || static_cast<uint64_t>(n) > size - pos) {
      same = false;
      break;
    }
    same = std::memcmp(buf.data(), data + pos, static_cast<size_t>(n)) == 0;
    pos += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return same;
}

}  // namespace

std::string cache_root() {
  if (const char *d = env("KILN_CACHE_DIR")) return d;
  if (const char *x = env("XDG_CACHE_HOME")) return std::string(x) + "/kiln";
  if (const char *h = env("HOME")) return std::string(h) + "/.cache/kiln";
  fail("kiln: no cache directory: set KILN_CACHE_DIR (or XDG_CACHE_HOME or HOME)");
}

std::string extract_to_cache(const unsigned char *data, uint64_t size, uint32_t crc,
                             const std::string &what) {
  std::string dir = cache_root() + format("/lib/%08x%016llx", crc,
                                          static_cast<unsigned long long>(size));
  std::string path = dir + "/model.so";
  if (same_content(path, data, size)) return path;
  mkdirs(dir);
  std::string tmpl = dir + "/.model.so.XXXXXX";
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  int fd = ::mkstemp(name.data());
  if (fd < 0) {
    fail("kiln: %s: cannot create a file in cache directory '%s': %s", what.c_str(), dir.c_str(),
         std::strerror(errno));
  }
  uint64_t pos = 0;
  while (pos < size) {
    size_t chunk = static_cast<size_t>(size - pos < (1u << 30) ? size - pos : (1u << 30));
    ssize_t n = ::write(fd, data + pos, chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      ::unlink(name.data());
      fail("kiln: %s: cannot write '%s': %s", what.c_str(), name.data(), std::strerror(e));
    }
    pos += static_cast<uint64_t>(n);
  }
  ::fchmod(fd, 0755);
  if (::close(fd) != 0 || ::rename(name.data(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(name.data());
    fail("kiln: %s: cannot install '%s': %s", what.c_str(), path.c_str(), std::strerror(e));
  }
  return path;
}

}  // namespace kiln
