// zip_reader.h - read-only view of a kiln package: a memory-mapped zip file whose entries are all
// STORED (uncompressed).
//
// Input: a path. Output: the list of entries and, for each entry used, a pointer/size span into
// the mapping. Invariants: every span handed out lies inside the mapping; the zip structure
// (end of central directory, zip64 records, central directory, local headers) is checked before
// use; entry(name) verifies the entry's CRC32 once. Every error message names the package path
// and, where there is one, the entry.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

// A read-only private mapping of a whole file. The file descriptor is closed right after
// mapping, so an open package holds no descriptor.
class MappedFile {
 public:
  explicit MappedFile(const std::string &path);
  ~MappedFile();
  MappedFile(const MappedFile &) = delete;
  MappedFile &operator=(const MappedFile &) = delete;
  const unsigned char *data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  const unsigned char *data_ = nullptr;
  uint64_t size_ = 0;
};

struct ZipEntry {
  std::string name;
  uint64_t local_header_offset = 0;
  uint64_t size = 0;  // compressed == uncompressed size (STORED)
  uint32_t crc = 0;
};

struct Span {
  const unsigned char *data = nullptr;
  uint64_t size = 0;
};

class ZipReader {
 public:
  explicit ZipReader(const std::string &path);  // maps and indexes; throws kiln::Error
  const std::string &path() const { return path_; }
  const std::vector<ZipEntry> &entries() const { return entries_; }
  bool has(const std::string &name) const;
  // Locates the entry's data through its local header, checks bounds and CRC32.
  Span entry(const std::string &name) const;
  // Byte offset of an entry's data in the file (alignment checks, diagnostics).
  uint64_t data_offset(const ZipEntry &e) const;

 private:
  [[noreturn]] void bad(const char *what) const;
  void index();
  std::string path_;
  MappedFile file_;
  std::vector<ZipEntry> entries_;
};

}  // namespace kiln
