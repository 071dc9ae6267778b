"""Greedy arena placement: buffers are placed one by one, in a chosen order, at a best-fit gap.

Input: `Item`s (aligned sizes, inclusive lifetimes) with size > 0, and an order over them.
Output: an offset per item index and the arena size (the highest occupied byte).

Placement rule (`place`), shared bit for bit with `plan_greedy` in kiln/runtime/src/kiln_plan.h:
the buffers already placed whose lifetimes overlap the new one are sorted by offset; walking them
with a running maximum `top` of their end bytes (starting at 0), every offset > top opens a gap
[top, offset). The new buffer goes to the smallest gap that holds it (ties: the lowest gap);
when none does, it goes to the final `top` (0 when nothing overlaps). Every offset is a sum of
aligned sizes, hence aligned, and no two lifetime-overlapping buffers share a byte.

Orders:
  * by size: size descending, then start, end, name ascending (`size_order`). The C++ planner
    has no names and uses the input index instead; callers feed it buffers in name order.
  * by breadth: every buffer is keyed by the heaviest step of its lifetime (the live load there,
    then the step), so buffers live at the heaviest step come first, then those first met at the
    next heaviest step, and so on; within one step, bigger first (`breadth_order`).
  * by start (`start_order`) and by lifetime, longest first (`lifetime_order`).

Cost: O(k log k) per buffer for k overlapping placed buffers, done with numpy, so O(n^2 log n)
worst case and near O(n log n) for the chain-like lifetimes compilers produce.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from kiln.memory.intervals import Item, load_profile


def size_order(its: Sequence[Item]) -> list[Item]:
    """Size descending, then start, end and name ascending (raw size breaks aligned ties)."""
    return sorted(its, key=lambda it: (-it.size, -it.raw, it.start, it.end, it.name))


def start_order(its: Sequence[Item]) -> list[Item]:
    """First use ascending, then size descending (then end, name)."""
    return sorted(its, key=lambda it: (it.start, -it.size, -it.raw, it.end, it.name))


def lifetime_order(its: Sequence[Item]) -> list[Item]:
    """Longest lifetime first, then size descending (then start, name)."""
    return sorted(its, key=lambda it: (it.start - it.end, -it.size, -it.raw, it.start, it.name))


def breadth_order(its: Sequence[Item]) -> list[Item]:
    """Heaviest step of the lifetime first (load, then step), then size order within a step."""
    steps, loads = load_profile(its)
    arr = np.asarray(loads, dtype=np.int64)

    def key(it: Item) -> tuple[int, int, int, int, int, int, str]:
        lo = bisect.bisect_left(steps, it.start)
        hi = bisect.bisect_right(steps, it.end)
        at = lo + int(np.argmax(arr[lo:hi]))  # the earliest step of the heaviest load
        return (-int(arr[at]), steps[at], -it.size, -it.raw, it.start, it.end, it.name)

    return sorted(its, key=key)


def place(order: Sequence[Item]) -> tuple[dict[int, int], int]:
    """Best-fit placement of `order` (items of size > 0): ({index: offset}, arena bytes)."""
    n = len(order)
    p_start = np.empty(n, dtype=np.int64)
    p_end = np.empty(n, dtype=np.int64)
    p_off = np.empty(n, dtype=np.int64)
    p_top = np.empty(n, dtype=np.int64)
    offsets: dict[int, int] = {}
    arena = 0
    for k, it in enumerate(order):
        hit = np.flatnonzero((p_start[:k] <= it.end) & (p_end[:k] >= it.start))
        offset = 0
        if hit.size:
            offs, tops = p_off[hit], p_top[hit]
            by_off = np.argsort(offs, kind="stable")
            offs, tops = offs[by_off], tops[by_off]
            running = np.maximum.accumulate(tops)
            before = np.concatenate(([0], running[:-1]))
            gaps = offs - before
            fits = np.flatnonzero(gaps >= it.size)
            if fits.size:
                best = fits[int(np.argmin(gaps[fits]))]  # first minimum = lowest gap
                offset = int(before[best])
            else:
                offset = int(running[-1])
        p_start[k], p_end[k], p_off[k], p_top[k] = it.start, it.end, offset, offset + it.size
        offsets[it.pos] = offset
        arena = max(arena, offset + it.size)
    return offsets, arena
