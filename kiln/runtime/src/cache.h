// cache.h - the on-disk cache where model libraries are extracted before dlopen.
//
// Root: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else $HOME/.cache/kiln.
// A library with CRC32 c and size s lives at <root>/lib/<c:08x><s:016x>/model.so.
// Invariants: a file at that path is only ever created by an atomic rename of a fully written
// temporary file from the same directory; an existing file is reused only if its size and bytes
// equal the package entry, else it is replaced (atomically).
#pragma once
#include <cstdint>
#include <string>

namespace kiln {

std::string cache_root();

// Returns the path of a file equal to data[0..size) in the cache, writing it if needed.
std::string extract_to_cache(const unsigned char *data, uint64_t size, uint32_t crc,
                             const std::string &what);

}  // namespace kiln
