/* kiln_plan.h - run-time arena planner for programs whose buffer sizes depend on input sizes.
 *
 * Input: n buffers, buffer i of sizes[i] bytes (>= 0) live from step start[i] to step end[i]
 * (both inclusive, end >= start), and the alignment (> 0) of every offset.
 * Output: offsets_out[i], the byte offset of buffer i in one arena; returns the arena size in
 * bytes (a multiple of alignment).
 *
 * Invariants: every offset is a multiple of alignment; two buffers of size > 0 whose lifetimes
 * overlap share no byte; zero-size buffers get offset 0; the result is a pure function of the
 * input and equals kiln.memory's greedy_by_size_offsets bit for bit when buffer i is the i-th
 * interval in name order (the Python planner breaks its last ties by name, this one by index).
 *
 * Algorithm (greedy by size, best fit), identical to kiln/memory/greedy.py:
 *   1. aligned size a_i = ceil(sizes[i] / alignment) * alignment.
 *   2. order buffers with a_i > 0 by (a_i desc, sizes[i] desc, start asc, end asc, index asc).
 *   3. for each buffer in that order: take the already placed buffers whose lifetimes overlap
 *      it, sorted by offset; walk them keeping top = max end byte seen so far (from 0); every
 *      offset > top opens the gap [top, offset). Place the buffer in the smallest gap that holds
 *      it (ties: the lowest), else at the final top.
 * Cost: O(n^2 log n) worst case, one pass over the placed buffers per buffer. Meant to be run
 * once per distinct set of input sizes (the caller caches the result). Allocation: a few
 * std::vectors per call, none per buffer.
 */
#ifndef KILN_PLAN_H
#define KILN_PLAN_H

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace kiln_rt {

inline int64_t plan_greedy(int64_t n, const int64_t *sizes, const int32_t *start,
                           const int32_t *end, int64_t alignment, int64_t *offsets_out) {
  if (n <= 0) return 0;
  if (alignment <= 0) alignment = 1;
  std::vector<int64_t> aligned(static_cast<size_t>(n));
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    aligned[i] = (sizes[i] + alignment - 1) / alignment * alignment;
    offsets_out[i] = 0;
    if (aligned[i] > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (aligned[a] != aligned[b]) return aligned[a] > aligned[b];
    if (sizes[a] != sizes[b]) return sizes[a] > sizes[b];
    if (start[a] != start[b]) return start[a] < start[b];
    if (end[a] != end[b]) return end[a] < end[b];
    return a < b;
  });
  std::vector<int64_t> placed;  // buffer indices, in placement order
  placed.reserve(order.size());
  std::vector<std::pair<int64_t, int64_t>> spans;  // (offset, offset + size) of overlapping ones
  spans.reserve(order.size());
  int64_t arena = 0;
  for (int64_t i : order) {
    spans.clear();
    for (int64_t j : placed) {
      if (start[j] <= end[i] && end[j] >= start[i])
        spans.emplace_back(offsets_out[j], offsets_out[j] + aligned[j]);
    }
    std::sort(spans.begin(), spans.end());
    int64_t top = 0, best_gap = -1, best_at = 0;
    for (const auto &s : spans) {
      const int64_t gap = s.first - top;
      if (gap >= aligned[i] && (best_gap < 0 || gap < best_gap)) {
        best_gap = gap;
        best_at = top;
      }
      top = std::max(top, s.second);
    }
    const int64_t offset = best_gap >= 0 ? best_at : top;
    offsets_out[i] = offset;
    arena = std::max(arena, offset + aligned[i]);
    placed.push_back(i);
  }
  return arena;
}

}  // namespace kiln_rt

#endif  // KILN_PLAN_H
