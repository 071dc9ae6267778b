// copy_in.h - the input-binding step of a CPU run: inputs whose strides are not compact
// row-major are copied into compact scratch buffers before the model sees them.
//
// Generated CPU models read every input as a compact row-major array (the manifest says so per
// input: "layout"). Any other DLPack layout is still a valid input: transposed or sliced views,
// channels-last, broadcast (stride 0) and negative strides. CopyIn::bind returns the inputs to
// pass to the model: the caller's own DLTensors when all are compact (no copy, no allocation),
// else an array in which each non-compact one is replaced by a compact copy in a scratch buffer
// this object owns (one per input position, 64-byte aligned, grown as needed and reused by the
// next run). A tensor the model would refuse anyway (NULL fields, another device, a bad dtype,
// negative sizes, byte offsets that overflow) is passed through untouched, so the model reports
// the error as before. One CopyIn belongs to one model handle and is used under its run mutex.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../include/dlpack.h"

namespace kiln {

// Whether `t` is a CPU tensor the model could take once compact and whose strides are not
// compact (dims of size 1, and tensors without elements, may have any strides).
bool needs_copy_in(const DLTensor *t);

// Copies the elements of `t` (any strides, needs_copy_in(t)) into `dst`, compact row-major.
void copy_compact(const DLTensor *t, void *dst);

class CopyIn {
 public:
  CopyIn() = default;
  CopyIn(const CopyIn &) = delete;
  CopyIn &operator=(const CopyIn &) = delete;
  ~CopyIn();
  // The inputs to give the model (valid until the next bind on this object).
  const DLTensor *const *bind(const DLTensor *const *inputs, int64_t n);

 private:
  struct Block {
    void *data = nullptr;
    size_t bytes = 0;
  };
  std::vector<Block> blocks_;             // scratch per input position
  std::vector<DLTensor> copies_;          // the compact DLTensors handed to the model
  std::vector<const DLTensor *> bound_;   // the array handed to the model
};

}  // namespace kiln
