// safetensors.cpp - bounds-checked safetensors header parsing (see safetensors.h).
#include "safetensors.h"

#include "error.h"
#include "json.h"

namespace kiln {

uint64_t safetensors_dtype_size(const std::string &dt) {
  if (dt == "F64" || dt == "I64" || dt == "U64" || dt == "C64") return 8;
  if (dt == "F32" || dt == "I32" || dt == "U32") return 4;
  if (dt == "F16" || dt == "BF16" || dt == "I16" || dt == "U16") return 2;
  if (dt == "I8" || dt == "U8" || dt == "BOOL" || dt == "F8_E4M3" || dt == "F8_E5M2" ||
      dt == "F8_E4M3FNUZ" || dt == "F8_E5M2FNUZ")
    return 1;
  return 0;
}

std::map<std::string, SafeTensor> parse_safetensors(const unsigned char *data, uint64_t size,
                                                    const std::string &what) {
  const char *w = what.c_str();
  if (size < 8) fail("%s: safetensors blob too short (%llu bytes)", w,
                     static_cast<unsigned long long>(size));
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; --k) hlen = (hlen << 8) | data[k];
  if (hlen > size - 8) {
    fail("%s: safetensors header length %llu exceeds the blob (%llu bytes)", w,
         static_cast<unsigned long long>(hlen), static_cast<unsigned long long>(size));
  }
  Json header = parse_json(reinterpret_cast<const char *>(data + 8), static_cast<size_t>(hlen),
                           what + ": safetensors header");
  if (header.type != Json::Object) fail("%s: safetensors header is not a JSON object", w);
  const unsigned char *blob = data + 8 + hlen;
  const uint64_t blob_size = size - 8 - hlen;
  std::map<std::string, SafeTensor> out;
  for (const auto &m : header.members) {
    const std::string &name = m.first;
    const char *n = name.c_str();
    if (name == "__metadata__") {
      if (m.second.type != Json::Object) fail("%s: __metadata__ is not an object", w);
      continue;
    }
    const Json &t = m.second;
    if (t.type != Json::Object) fail("%s: tensor '%s' is not described by an object", w, n);
    const Json *dtype = t.get("dtype"), *shape = t.get("shape"), *offs = t.get("data_offsets");
    if (!dtype || dtype->type != Json::String) fail("%s: tensor '%s' has no dtype string", w, n);
    if (!shape || shape->type != Json::Array) fail("%s: tensor '%s' has no shape list", w, n);
    if (!offs || offs->type != Json::Array || offs->items.size() != 2) {
      fail("%s: tensor '%s' has no [begin, end] data_offsets", w, n);
    }
    SafeTensor st;
    st.dtype = dtype->str;
    uint64_t numel = 1;
    bool overflow = false;
    for (const Json &d : shape->items) {
      if (d.type != Json::Number || !d.is_int || d.integer < 0) {
        fail("%s: tensor '%s' has an invalid shape entry", w, n);
      }
      st.shape.push_back(d.integer);
      uint64_t dim = static_cast<uint64_t>(d.integer);
      if (dim != 0 && numel > UINT64_MAX / dim) overflow = true;
      numel *= dim;
    }
    for (const Json &o : offs->items) {
      if (o.type != Json::Number || !o.is_int || o.integer < 0) {
        fail("%s: tensor '%s' has invalid data_offsets", w, n);
      }
    }
    uint64_t b = static_cast<uint64_t>(offs->items[0].integer);
    uint64_t e = static_cast<uint64_t>(offs->items[1].integer);
    if (b > e || e > blob_size) {
      fail("%s: tensor '%s' data_offsets [%llu, %llu] out of bounds (data area is %llu bytes)",
           w, n, static_cast<unsigned long long>(b), static_cast<unsigned long long>(e),
           static_cast<unsigned long long>(blob_size));
    }
    uint64_t esize = safetensors_dtype_size(st.dtype);
    if (esize != 0 && (overflow || numel > UINT64_MAX / esize || numel * esize != e - b)) {
      fail("%s: tensor '%s' byte size %llu does not match dtype %s and its shape", w, n,
           static_cast<unsigned long long>(e - b), st.dtype.c_str());
    }
    st.data = blob + b;
    st.nbytes = e - b;
    if (!out.emplace(name, std::move(st)).second) fail("%s: duplicate tensor '%s'", w, n);
  }
  return out;
}

}  // namespace kiln
