// sha256.h - SHA-256 (FIPS 180-4), for the package's manifest hash (manifest.sha256).
//
// sha256_hex(data, n) equals Python's hashlib.sha256(data).hexdigest().
#pragma once
#include <cstddef>
#include <string>

namespace kiln {
std::string sha256_hex(const void *data, size_t n);
}  // namespace kiln
