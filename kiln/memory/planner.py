"""The arena memory planner: one byte offset per intermediate buffer, smallest arena wins.

Input: `Interval`s (unique names, integer sizes >= 0, inclusive step lifetimes), an alignment
and a time budget in seconds. Output: a `Plan`: an aligned offset for every interval, the arena
size, the load lower bound, the winning algorithm, the planning time and the arena every
algorithm tried reached.

Invariants of every returned plan (checked by kiln.memory.verify.verify_plan): every interval
has an offset; offsets and the arena are multiples of the alignment; offset + size <= arena;
two buffers whose lifetimes overlap (and whose sizes are > 0) share no byte. Zero-size buffers
get offset 0. Results are deterministic: the inputs alone fix every order and tie-break; the
budget only decides which algorithms run (greedy-by-size always runs, the other greedy orders
run while time is left and no plan has met the lower bound yet, the exact search only for small
instances and within the budget (it returns at once when the lower bound is met); an exact
search cut short by the budget is reported as "exact_incomplete").

Algorithms (see greedy.py and exact.py):
  * "greedy_by_size": size descending, best-fit gap. Mirrors kiln_plan.h's plan_greedy.
  * "greedy_by_breadth": buffers of the heaviest steps first, best-fit gap.
  * "greedy_by_start": in order of first use (bigger first within a step), best-fit gap:
    chains of short-lived buffers (im2col -> conv -> ...) stack without fragmenting.
  * "greedy_by_lifetime": longest-lived first (then bigger), best-fit gap: long-lived buffers
    (skip connections) take the bottom, short-lived ones share the space above.
  * "exact": branch and bound, for at most EXACT_MAX_BUFFERS buffers of size > 0; optimal over
    every placement of the aligned sizes when it completes. It stops after EXACT_MAX_NODES
    search nodes (deterministic) or at the budget's deadline (a safety net), whichever comes
    first. It is seeded with the best greedy arena and only replaces it when strictly smaller,
    so ties keep the greedy's name.
The candidate with the smallest arena wins; ties go to the earlier algorithm in that list.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from kiln.memory.exact import exact_place
from kiln.memory.greedy import breadth_order, lifetime_order, place, size_order, start_order
from kiln.memory.intervals import Interval, align_up, items, lower_bound_items

EXACT_MAX_BUFFERS = 12
EXACT_MAX_NODES = 20_000  # search nodes (about 0.3 s of CPython); a cap keeps results repeatable


@dataclass(frozen=True)
class Plan:
    """Where every buffer lives in the arena, and how the plan was found."""

    offsets: Mapping[str, int]
    arena_bytes: int
    lower_bound_bytes: int
    algorithm: str
    seconds: float
    candidates: Mapping[str, int] = field(default_factory=dict)


def greedy_by_size_offsets(intervals: Sequence[Interval],
                           alignment: int = 64) -> tuple[dict[str, int], int]:
    """Algorithm 1 alone: ({name: offset}, arena bytes). The reference for kiln_plan.h."""
    its = items(intervals, alignment)
    by_index, arena = place(size_order([it for it in its if it.size > 0]))
    return {it.name: by_index.get(it.pos, 0) for it in its}, arena


def plan_memory(intervals: Sequence[Interval], alignment: int = 64,
                budget_s: float = 0.5) -> Plan:
    """Plan an arena for `intervals` with every algorithm that fits `budget_s`; keep the best."""
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    its = items(intervals, alignment)
    live = [it for it in its if it.size > 0]
    floor = lower_bound_items(live)
    candidates: dict[str, int] = {}
    best_name, (best_offsets, best_arena) = "greedy_by_size", place(size_order(live))
    candidates[best_name] = best_arena
    for name, order in (("greedy_by_breadth", breadth_order), ("greedy_by_start", start_order),
                        ("greedy_by_lifetime", lifetime_order)):
        if best_arena <= floor or time.perf_counter() >= deadline:
            break
        offsets, arena = place(order(live))
        candidates[name] = arena
        if arena < best_arena:
            best_name, best_offsets, best_arena = name, offsets, arena
    if len(live) <= EXACT_MAX_BUFFERS and time.perf_counter() < deadline:
        result = exact_place(live, upper=best_arena, deadline=deadline,
                             max_nodes=EXACT_MAX_NODES)
        candidates["exact" if result.proven else "exact_incomplete"] = result.arena
        if result.offsets is not None:
            best_name = "exact" if result.proven else "exact_incomplete"
            best_offsets, best_arena = result.offsets, result.arena
    return Plan(
        offsets={it.name: best_offsets.get(it.pos, 0) for it in its},
        arena_bytes=align_up(best_arena, alignment),
        lower_bound_bytes=floor,
        algorithm=best_name,
        seconds=time.perf_counter() - t0,
        candidates=candidates,
    )
