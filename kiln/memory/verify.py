"""Independent checker of memory plans: trust no planner, check the plan against the intervals.

Input: the `Interval`s, a `Plan` and the alignment the plan was made for.
Output: None when the plan is valid; otherwise PlanError naming the first fault found:
  * a malformed interval, a non-positive alignment,
  * an interval without an offset, or an offset for no interval,
  * an arena size that is negative or not a multiple of the alignment,
  * an offset that is negative or not a multiple of the alignment,
  * a buffer reaching past the arena (offset + size > arena_bytes),
  * two buffers of size > 0 with overlapping lifetimes and overlapping byte ranges; the message
    names both, with their lifetimes and byte ranges.
Byte ranges are checked with the sizes as given: with aligned offsets, raw ranges are disjoint
exactly when aligned ones are.

Algorithm: sort the buffers by start step; a sweep keeps the buffers still live and compares
each new buffer with them (numpy, O(n * live)); the first conflict in (start, name) order wins.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kiln.errors import PlanError
from kiln.memory.intervals import Interval, Item, items
from kiln.memory.planner import Plan


def _describe(it: Item, offset: int) -> str:
    return f"{it.name!r} (steps {it.start}..{it.end}, bytes [{offset}, {offset + it.raw}))"


def verify_plan(intervals: Sequence[Interval], plan: Plan, alignment: int = 64) -> None:
    """Raise PlanError unless `plan` is a valid arena placement of `intervals`."""
    its = items(intervals, alignment)
    arena = plan.arena_bytes
    if not isinstance(arena, int) or arena < 0 or arena % alignment:
        raise PlanError(f"arena size {arena!r} is not a non-negative multiple of {alignment}")
    names = {it.name for it in its}
    extra = sorted(set(plan.offsets) - names)
    if extra:
        raise PlanError(f"the plan places {extra[0]!r}, which is not among the intervals")
    for iv in its:
        if iv.name not in plan.offsets:
            raise PlanError(f"buffer {iv.name!r} (steps {iv.start}..{iv.end}) has no offset")
        offset = plan.offsets[iv.name]
        if not isinstance(offset, int) or offset < 0 or offset % alignment:
            raise PlanError(
                f"buffer {iv.name!r}: offset {offset!r} is not a non-negative multiple of "
                f"the alignment {alignment}")
        if offset + iv.raw > arena:
            raise PlanError(
                f"buffer {_describe(iv, offset)} reaches past the arena of {arena} bytes")
    live = sorted((it for it in its if it.size > 0), key=lambda it: (it.start, it.name))
    n = len(live)
    start = np.array([it.start for it in live], dtype=np.int64)
    end = np.array([it.end for it in live], dtype=np.int64)
    lo = np.array([plan.offsets[it.name] for it in live], dtype=np.int64)
    hi = lo + np.array([it.raw for it in live], dtype=np.int64)
    # Sweep: buffer i conflicts with a later-starting j when start[j] <= end[i] (then both are
    # live at start[j]) and their byte ranges intersect.
    for i in range(n):
        stop = int(np.searchsorted(start, end[i], side="right"))
        if stop <= i + 1:
            continue
        j = slice(i + 1, stop)
        clash = np.flatnonzero((lo[j] < hi[i]) & (lo[i] < hi[j]))
        if clash.size:
            other = live[i + 1 + int(clash[0])]
            a, b = live[i], other
            raise PlanError(
                f"buffers {_describe(a, int(lo[i]))} and {_describe(b, plan.offsets[b.name])} "
                f"are live at the same time and share bytes")
