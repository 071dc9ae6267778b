// safetensors.h - index of a safetensors blob held in memory (the package's mapped entry).
//
// Input: a byte span (8-byte little-endian header length N, N bytes of JSON header, data).
// Output: name -> {dtype, shape, data pointer, byte size}. Invariants: every tensor's
// [begin, end) data_offsets lie inside the data area; for known dtypes the byte size equals
// product(shape) * element size; tensors point into the span (no copy).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kiln {

struct SafeTensor {
  std::string dtype;  // "F32", "I64", ...
  std::vector<int64_t> shape;
  const unsigned char *data = nullptr;
  uint64_t nbytes = 0;
};

// `what` names the blob in messages (e.g. "package 'm.kiln': entry 'weights.safetensors'").
std::map<std::string, SafeTensor> parse_safetensors(const unsigned char *data, uint64_t size,
                                                    const std::string &what);

// Bytes per element of a safetensors dtype string, or 0 if unknown.
uint64_t safetensors_dtype_size(const std::string &dtype);

}  // namespace kiln
