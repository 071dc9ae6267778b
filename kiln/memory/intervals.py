"""Buffer lifetimes and the bounds and baselines every memory plan is measured against.

Input: a sequence of `Interval`s, one per intermediate buffer of a program: its unique name, its
size in bytes and the inclusive step range [start, end] during which it must hold its value.
Output: validated, aligned views of them (`Item`), and three numbers in bytes:
`lower_bound` (no plan can do better), `naive_bytes` (no reuse at all) and
`exact_size_reuse_bytes` (a per-size free-list pool, the baseline a planner has to beat).

Invariants: names are unique; sizes are integers >= 0; start <= end (whatever `operator.index`
accepts is an integer, e.g. a concrete sympy Integer; a symbolic size is refused). Every size is
rounded up to a multiple of `alignment` before it is summed, because every offset is such a
multiple, so a buffer of size 1 really occupies `alignment` bytes of the arena. Zero-size
buffers occupy nothing, conflict with nothing and are ignored by every bound.

Algorithms: the live load only grows at a start step, so `lower_bound` is the maximum, over the
distinct start steps, of the aligned bytes live there (a sweep over sorted events,
O(n log n)). The exact-size pool walks steps in order, releases the slots of buffers whose last
step has passed, then serves each starting buffer from the free slots of exactly its byte size
(lowest slot first), creating a new slot when none is free; its total is the sum of the slots.
"""
from __future__ import annotations

import bisect
import heapq
import operator
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from kiln.errors import PlanError


@dataclass(frozen=True)
class Interval:
    """One buffer: `size` bytes (>= 0) live from step `start` to step `end`, both inclusive."""

    name: str
    size: int
    start: int
    end: int


class Item(NamedTuple):
    """An interval as the planners see it: its input position and its aligned size."""

    pos: int  # position in the input sequence
    name: str
    size: int  # aligned bytes (a multiple of the alignment), > 0 for every planned item
    raw: int  # bytes as given
    start: int
    end: int


def align_up(nbytes: int, alignment: int) -> int:
    """The smallest multiple of `alignment` that is >= `nbytes`."""
    return -(-nbytes // alignment) * alignment


def check_alignment(alignment: int) -> None:
    """Raise PlanError unless `alignment` is a positive integer."""
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
        raise PlanError(f"alignment must be a positive integer, got {alignment!r}")


def _as_int(iv: Interval, field: str) -> int:
    """The field as a Python int (ints, numpy ints and concrete sympy Integers qualify)."""
    value = getattr(iv, field)
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise PlanError(
            f"buffer {iv.name!r}: {field} must be an integer, got {type(value).__name__} "
            f"{value!r} (plan symbolic sizes once per concrete size set)") from None


def items(intervals: Sequence[Interval], alignment: int) -> list[Item]:
    """Validated items of every interval (zero-size ones included), in input order.

    Raises PlanError naming the first malformed interval or the first duplicated name."""
    check_alignment(alignment)
    out: list[Item] = []
    seen: set[str] = set()
    for pos, iv in enumerate(intervals):
        size, start, end = (_as_int(iv, field) for field in ("size", "start", "end"))
        if size < 0:
            raise PlanError(f"buffer {iv.name!r}: size must be >= 0, got {size}")
        if end < start:
            raise PlanError(f"buffer {iv.name!r}: end step {end} is before start step {start}")
        if iv.name in seen:
            raise PlanError(f"buffer name {iv.name!r} appears more than once")
        seen.add(iv.name)
        out.append(Item(pos, iv.name, align_up(size, alignment), size, start, end))
    return out


def load_profile(its: Sequence[Item]) -> tuple[list[int], list[int]]:
    """(steps, loads): the distinct start steps, sorted, and the aligned bytes live at each.

    The live load is piecewise constant and only rises at a start step, so its maximum over any
    step range [s, e] is the maximum of these loads at the start steps inside [s, e].
    """
    steps = sorted({it.start for it in its if it.size > 0})
    if not steps:
        return [], []
    delta = [0] * (len(steps) + 1)
    for it in its:
        if it.size == 0:
            continue
        delta[bisect.bisect_left(steps, it.start)] += it.size
        delta[bisect.bisect_right(steps, it.end)] -= it.size
    loads, running = [], 0
    for d in delta[:-1]:
        running += d
        loads.append(running)
    return steps, loads


def lower_bound_items(its: Sequence[Item]) -> int:
    """The largest aligned load over all steps."""
    _, loads = load_profile(its)
    return max(loads, default=0)


def lower_bound(intervals: Sequence[Interval], alignment: int = 64) -> int:
    """Max over steps of the sum of the aligned sizes live at that step: no plan is smaller."""
    return lower_bound_items(items(intervals, alignment))


def naive_bytes(intervals: Sequence[Interval], alignment: int = 64) -> int:
    """Arena bytes when every buffer gets its own slot: the sum of the aligned sizes."""
    return sum(it.size for it in items(intervals, alignment))


def exact_size_reuse_bytes(intervals: Sequence[Interval], alignment: int = 64) -> int:
    """Arena bytes of a pool that reuses a freed slot only for a later buffer of the same size.

    A slot becomes free once the step after its buffer's end is reached; a buffer starting at
    step t takes the lowest-numbered free slot of exactly its byte size, else a new slot.
    """
    its = sorted((it for it in items(intervals, alignment) if it.size > 0),
                 key=lambda it: (it.start, it.end, it.name))
    free: dict[int, list[int]] = {}  # raw size -> sorted free slot ids
    busy: list[tuple[int, int, int]] = []  # heap of (end, slot id, raw size)
    slot_bytes: list[int] = []
    for it in its:
        while busy and busy[0][0] < it.start:
            _, slot, raw = heapq.heappop(busy)
            bisect.insort(free.setdefault(raw, []), slot)
        pool = free.get(it.raw)
        if pool:
            slot = pool.pop(0)
        else:
            slot = len(slot_bytes)
            slot_bytes.append(it.size)
        heapq.heappush(busy, (it.end, slot, it.raw))
    return sum(slot_bytes)
