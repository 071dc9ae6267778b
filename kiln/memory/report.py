"""Human-facing view of a memory plan: a JSON summary.

Input: the `Interval`s and the `Plan` made for them. Output: `plan_summary` returns a
JSON-serialisable dict (plain ints, floats, strings, lists); it does not change its inputs.
The timeline picture is drawn from a package's manifest by matplotlib (kiln/cli/plots.py,
the optional `report` extra)."""
from __future__ import annotations

from typing import Any, Sequence

from kiln.memory.intervals import Interval, exact_size_reuse_bytes, naive_bytes
from kiln.memory.planner import Plan


def plan_summary(intervals: Sequence[Interval], plan: Plan, alignment: int = 64,
                 top: int = 10) -> dict[str, Any]:
    """Arena, bounds, baselines, algorithms and the `top` largest buffers of a plan."""
    biggest = sorted(intervals, key=lambda iv: (-iv.size, iv.start, iv.name))[:top]
    return {
        "arena_bytes": int(plan.arena_bytes),
        "lower_bound_bytes": int(plan.lower_bound_bytes),
        "ratio": (plan.arena_bytes / plan.lower_bound_bytes) if plan.lower_bound_bytes else 1.0,
        "naive_bytes": naive_bytes(intervals, alignment),
        "exact_size_reuse_bytes": exact_size_reuse_bytes(intervals, alignment),
        "algorithm": plan.algorithm,
        "planning_seconds": float(plan.seconds),
        "candidates": {name: int(v) for name, v in plan.candidates.items()},
        "n_buffers": len(intervals),
        "top_buffers": [
            {"name": iv.name, "size": int(iv.size), "start": int(iv.start), "end": int(iv.end),
             "offset": int(plan.offsets[iv.name])}
            for iv in biggest
        ],
    }
