"""Program IR -> Program IR with arena offsets (the planning pass).

Collects one `Interval` per `Alloc` (step indices of its Alloc and Free), plans them with
`plan_memory`, verifies the plan, and writes each offset into its Alloc line. Programs with
dynamic sizes keep `offset=None` (the generated code plans at run time with the same greedy
algorithm, cached per distinct sizes); for them the plan at the example sizes is returned for
the report."""

from __future__ import annotations

from dataclasses import replace

from kiln.ir import program as P
from kiln.ir.sym import evaluate
from kiln.memory.intervals import Interval
from kiln.memory.planner import Plan, plan_memory
from kiln.memory.verify import verify_plan


def intervals(prog: P.Program, env: dict[str, int] | None = None) -> list[Interval]:
    """Lifetimes of the program's arena buffers, sizes evaluated with `env` for symbols."""
    step = -1
    start: dict[str, int] = {}
    size: dict[str, int] = {}
    out: list[Interval] = []
    for line in prog.lines:
        if isinstance(line, (P.CallKernel, P.CallGemm)):
            step += 1
        elif isinstance(line, P.Alloc):
            start[line.buf] = step + 1
            size[line.buf] = evaluate(line.nbytes, env or {})
        elif isinstance(line, P.Free):
            out.append(Interval(line.buf, size[line.buf], start[line.buf], max(step,
                                                                              start[line.buf])))
    return out


def example_env(prog: P.Program) -> dict[str, int]:
    return {s.name: s.example for s in prog.symbols}


def assign_offsets(prog: P.Program, verify: bool = True, budget_s: float = 0.5
                   ) -> tuple[P.Program, Plan, list[Interval]]:
    ivs = intervals(prog, example_env(prog))
    plan = plan_memory(ivs, alignment=prog.alignment, budget_s=budget_s)
    if verify:
        verify_plan(ivs, plan, alignment=prog.alignment)
    if prog.dynamic:
        return replace(prog, arena_bytes=None), plan, ivs
    lines = tuple(replace(x, offset=plan.offsets[x.buf]) if isinstance(x, P.Alloc) else x
                  for x in prog.lines)
    return replace(prog, lines=lines, arena_bytes=plan.arena_bytes), plan, ivs
