// crc32.h - CRC-32 (ISO-HDLC / zip polynomial 0xEDB88320, reflected, init and xorout 0xFFFFFFFF).
//
// crc32(data, n) equals Python's zlib.crc32(data). Table driven, 8 bytes per step.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kiln {
// Continues a running CRC: crc32_update(crc32_update(0, a), b) == crc32 of a followed by b.
uint32_t crc32_update(uint32_t crc, const void *data, size_t n);
inline uint32_t crc32(const void *data, size_t n) { return crc32_update(0, data, n); }
}  // namespace kiln
