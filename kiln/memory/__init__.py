"""Arena memory planning for kiln programs.

Input: one `Interval` per intermediate buffer (name, bytes, first and last step, inclusive).
Output: a `Plan` giving every buffer an aligned byte offset in a single arena, such that buffers
live at the same step never share a byte, with the arena as small as the algorithms can make it.

Modules: intervals (the data, bounds and baselines), greedy and exact (the algorithms), planner
(`plan_memory`, which runs them within a time budget), inplace (which kernel outputs may take a
dying input's bytes), assign (the Program IR pass), verify (`verify_plan`, an independent
checker) and report (a JSON summary and a timeline PNG). The C++ twin of the size-ordered greedy,
for sizes only known at run time, is kiln/runtime/src/kiln_plan.h.
"""
from kiln.errors import PlanError
from kiln.memory.intervals import (Interval, exact_size_reuse_bytes, lower_bound,
                                   naive_bytes)
from kiln.memory.planner import Plan, greedy_by_size_offsets, plan_memory
from kiln.memory.report import plan_summary
from kiln.memory.verify import verify_plan

__all__ = [
    "Interval", "Plan", "PlanError", "exact_size_reuse_bytes", "greedy_by_size_offsets",
    "lower_bound", "naive_bytes", "plan_memory", "plan_summary",
    "verify_plan",
]
