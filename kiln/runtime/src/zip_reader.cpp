// zip_reader.cpp - memory-mapped, bounds-checked reader of STORED zip files (see zip_reader.h).
#include "zip_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "crc32.h"
#include "error.h"

namespace kiln {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50u;
constexpr uint32_t kCentralSig = 0x02014b50u;
constexpr uint32_t kEocdSig = 0x06054b50u;
constexpr uint32_t kEocd64Sig = 0x06064b50u;
constexpr uint32_t kLocatorSig = 0x07064b50u;
constexpr uint64_t kEocdSize = 22, kLocatorSize = 20, kEocd64Size = 56;
constexpr uint64_t kCentralSize = 46, kLocalSize = 30;

uint16_t rd16(const unsigned char *p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t rd32(const unsigned char *p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t rd64(const unsigned char *p) {
  return static_cast<uint64_t>(rd32(p)) | (static_cast<uint64_t>(rd32(p + 4)) << 32);
}
// True when [off, off + len) lies inside [0, limit) without overflow.
bool fits(uint64_t off, uint64_t len, uint64_t limit) { return off <= limit && len <= limit - off; }

}  // namespace

MappedFile::MappedFile(const std::string &path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("kiln: cannot open package '%s': %s", path.c_str(), std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail("kiln: cannot stat package '%s': %s", path.c_str(), std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("kiln: package '%s' is not a regular file", path.c_str());
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd);
    fail("kiln: package '%s' is empty (truncated?)", path.c_str());
  }
  void *p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) fail("kiln: cannot map package '%s': %s", path.c_str(), std::strerror(e));
  data_ = static_cast<const unsigned char *>(p);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<unsigned char *>(data_), size_);
}

ZipReader::ZipReader(const std::string &path) : path_(path), file_(path) { index(); }

void ZipReader::bad(const char *what) const {
  fail("kiln: package '%s' is not a valid kiln package (truncated or corrupt?): %s",
       path_.c_str(), what);
}

void ZipReader::index() {
  const unsigned char *d = file_.data();
  const uint64_t size = file_.size();
  if (size < kEocdSize) bad("file too short for a zip end of central directory record");
  // Scan backwards for the end of central directory record whose comment ends the file.
  uint64_t eocd = UINT64_MAX;
  uint64_t lowest = size - kEocdSize > 0xFFFF ? size - kEocdSize - 0xFFFF : 0;
  for (uint64_t pos = size - kEocdSize + 1; pos-- > lowest;) {
    if (rd32(d + pos) == kEocdSig && pos + kEocdSize + rd16(d + pos + 20) == size) {
      eocd = pos;
      break;
    }
  }
  if (eocd == UINT64_MAX) bad("no zip end of central directory record at the end of the file");
  uint64_t count = rd16(d + eocd + 10);
  uint64_t cd_size = rd32(d + eocd + 12);
  uint64_t cd_off = rd32(d + eocd + 16);
  uint64_t cd_limit = eocd;  // the central directory ends before this offset
  if (rd16(d + eocd + 4) != 0 || rd16(d + eocd + 6) != 0) bad("multi-disk zip archives");
  if (eocd >= kLocatorSize && rd32(d + eocd - kLocatorSize) == kLocatorSig) {
    uint64_t e64 = rd64(d + eocd - kLocatorSize + 8);
    if (!fits(e64, kEocd64Size, eocd - kLocatorSize) || rd32(d + e64) != kEocd64Sig) {
      bad("zip64 end of central directory record out of bounds or with a bad signature");
    }
    count = rd64(d + e64 + 32);
    cd_size = rd64(d + e64 + 40);
    cd_off = rd64(d + e64 + 48);
    cd_limit = e64;
  } else if (count == 0xFFFF || cd_size == 0xFFFFFFFFu || cd_off == 0xFFFFFFFFu) {
    bad("zip64 archive without a zip64 end of central directory locator");
  }
  if (!fits(cd_off, cd_size, cd_limit)) bad("central directory out of file bounds");
  if (count > cd_size / kCentralSize) bad("central directory entry count exceeds its size");
  std::set<std::string> seen;
  const unsigned char *cd = d + cd_off;
  uint64_t pos = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (!fits(pos, kCentralSize, cd_size)) bad("central directory entry out of bounds");
    const unsigned char *h = cd + pos;
    if (rd32(h) != kCentralSig) bad("bad central directory entry signature");
    uint16_t flags = rd16(h + 8), method = rd16(h + 10);
    uint64_t csize = rd32(h + 20), usize = rd32(h + 24);
    uint64_t nlen = rd16(h + 28), xlen = rd16(h + 30), clen = rd16(h + 32);
    uint64_t lho = rd32(h + 42);
    if (!fits(pos + kCentralSize, nlen + xlen + clen, cd_size)) {
      bad("central directory entry name or extra field out of bounds");
    }
    ZipEntry e;
    e.name.assign(reinterpret_cast<const char *>(h + kCentralSize), nlen);
    const unsigned char *x = h + kCentralSize + nlen, *xend = x + xlen;
    while (xend - x >= 4) {
      uint16_t id = rd16(x), len = rd16(x + 2);
      if (static_cast<uint64_t>(xend - x - 4) < len) break;
      if (id == 1) {  // zip64 extended information, fields present only when saturated
        const unsigned char *z = x + 4, *zend = z + len;
        uint64_t *fields[3] = {&usize, &csize, &lho};
        for (uint64_t *f : fields) {
          if (*f != 0xFFFFFFFFu) continue;
          if (zend - z < 8) bad("truncated zip64 extra field");
          *f = rd64(z);
          z += 8;
        }
      }
      x += 4 + len;
    }
    const char *n = e.name.c_str();
    if (flags & 1u) fail("kiln: package '%s': entry '%s' is encrypted", path_.c_str(), n);
    if (method != 0 || csize != usize) {
      fail("kiln: package '%s': entry '%s' is compressed (method %u); kiln packages store every "
           "entry uncompressed (ZIP_STORED)", path_.c_str(), n, static_cast<unsigned>(method));
    }
    if (!seen.insert(e.name).second) {
      fail("kiln: package '%s': duplicate entry '%s'", path_.c_str(), n);
    }
    e.local_header_offset = lho;
    e.size = usize;
    e.crc = rd32(h + 16);
    uint64_t data_off = data_offset(e);  // validates the local header
    if (!fits(data_off, e.size, cd_off)) {
      fail("kiln: package '%s': entry '%s' (%llu bytes at offset %llu) lies outside the file "
           "data area (truncated or corrupt?)", path_.c_str(), n,
           static_cast<unsigned long long>(e.size), static_cast<unsigned long long>(data_off));
    }
    entries_.push_back(std::move(e));
    pos += kCentralSize + nlen + xlen + clen;
  }
}

uint64_t ZipReader::data_offset(const ZipEntry &e) const {
  const unsigned char *d = file_.data();
  const char *n = e.name.c_str();
  if (!fits(e.local_header_offset, kLocalSize, file_.size())) {
    fail("kiln: package '%s': local header of entry '%s' out of file bounds (truncated?)",
         path_.c_str(), n);
  }
  const unsigned char *h = d + e.local_header_offset;
  if (rd32(h) != kLocalSig) {
    fail("kiln: package '%s': bad local header signature for entry '%s' (corrupt?)",
         path_.c_str(), n);
  }
  uint64_t nlen = rd16(h + 26), xlen = rd16(h + 28);
  uint64_t name_off = e.local_header_offset + kLocalSize;
  if (!fits(name_off, nlen + xlen, file_.size())) {
    fail("kiln: package '%s': local header of entry '%s' out of file bounds (truncated?)",
         path_.c_str(), n);
  }
  if (nlen != e.name.size() || std::memcmp(d + name_off, e.name.data(), nlen) != 0) {
    fail("kiln: package '%s': local header name differs from central directory for entry '%s'",
         path_.c_str(), n);
  }
  if (rd16(h + 8) != 0) {
    fail("kiln: package '%s': entry '%s' is compressed in its local header", path_.c_str(), n);
  }
  return name_off + nlen + xlen;
}

bool ZipReader::has(const std::string &name) const {
  for (const ZipEntry &e : entries_) {
    if (e.name == name) return true;
  }
  return false;
}

Span ZipReader::entry(const std::string &name) const {
  for (const ZipEntry &e : entries_) {
    if (e.name != name) continue;
    Span s;
    s.data = file_.data() + data_offset(e);
    s.size = e.size;
    uint32_t got = crc32(s.data, static_cast<size_t>(s.size));
    if (got != e.crc) {
      fail("kiln: package '%s': entry '%s' is corrupt: CRC32 mismatch (expected 0x%08x, got "
           "0x%08x)", path_.c_str(), name.c_str(), e.crc, got);
    }
    return s;
  }
  fail("kiln: package '%s': missing entry '%s'", path_.c_str(), name.c_str());
}

}  // namespace kiln
