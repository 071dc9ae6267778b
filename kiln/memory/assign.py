"""Program IR -> Program IR with arena offsets (the planning pass).

Input: a Program whose Alloc lines have no offsets. Output: the same Program with every static
Alloc at an arena offset (`arena_bytes` set), the `Plan` and the `Interval`s it was made from.
Allocs marked `heap` (sized by a data-dependent size without an upper bound) are not in the
arena: the generated code allocates them at run time. Invariants: an in-place Alloc
(`reuse=src`) joins `src`'s storage: the chain a -> b -> c of
reuses is one interval (named after its first buffer, from its Alloc to the last Free of the
chain) and every Alloc of the chain gets that interval's offset. Intervals are listed in name
order, which is the order the generated C++ feeds `kiln_rt::plan_greedy` (its last tie-break is
the index, the Python greedy's is the name, so the two agree bit for bit).

Dynamic programs (size symbols with `Dim` ranges) keep `offset=None`: the generated code plans
at run time with the C++ greedy-by-size (kiln/runtime/src/kiln_plan.h), cached per distinct
size tuple, and this pass returns the plan at the example sizes for the report. With `verify`,
the run-time plan is re-derived in Python (`greedy_by_size_offsets`, bit-identical to the C++)
and proven overlap-free at each of `sizes_tried` (the range minimum, the example, the maximum
and geometric steps between them); `plan_sizes` records arena and lower bound at each.

Why plan at run time rather than once symbolically (measured by bench/memory.py, see
BENCHMARKS.md, "Memory planning"): the C++ plan costs 0.1 us (mlp, 3 storages) to 2 us (gpt,
42 storages) per *distinct* size tuple (a cache hit is one memcmp of the size key), against
milliseconds per model run, and at every size tried it is within 1.00-1.02x of that size's
lower bound. One symbolic plan valid for the whole `Dim` range must place buffers so that no
two overlap at *any* size, which in practice means sizing for the range maximum: 43x (gpt) to
1024x (mlp) the arena the range minimum needs, and a symbolic placement cannot use gaps whose
fit depends on the sizes. Run-time planning is therefore kept; the example-size plan is still
computed here (for the report and, with `verify`, its proof)."""

from __future__ import annotations

import time
from dataclasses import replace

from kiln.ir import program as P
from kiln.ir.sym import evaluate
from kiln.memory.intervals import Interval, lower_bound
from kiln.memory.planner import Plan, greedy_by_size_offsets, plan_memory
from kiln.memory.verify import verify_plan


def roots(prog: P.Program) -> dict[str, str]:
    """buffer -> the first buffer of its in-place chain (itself when it reuses nothing)."""
    out: dict[str, str] = {}
    for line in P.walk(prog.lines):
        if isinstance(line, P.Alloc):
            out[line.buf] = out[line.reuse] if line.reuse is not None else line.buf
    return out


def _outside(prog: P.Program) -> set[str]:
    """Buffers not in the arena: a state's own storage (Alloc `state`)."""
    return {x.buf for x in P.walk(prog.lines) if isinstance(x, P.Alloc) and x.state is not None}


def intervals(prog: P.Program, env: dict[str, int] | None = None,
              inplace: bool = True) -> list[Interval]:
    """Lifetimes of the program's arena storages (one per in-place chain), in name order,
    sizes evaluated with `env` for symbols. `inplace=False` ignores `reuse` (every Alloc its
    own storage: the baseline in-place savings are measured against)."""
    step = -1
    root = roots(prog) if inplace else {}
    if not inplace:
        prog = replace(prog, lines=P.map_lines(prog.lines, lambda x: replace(x, reuse=None)
                                               if isinstance(x, P.Alloc) else x))
        root = roots(prog)
    start: dict[str, int] = {}
    end: dict[str, int] = {}
    size: dict[str, int] = {}
    outside = _outside(prog)
    for line in P.walk(prog.lines):  # nested blocks in their linear order (ir/program.py)
        if isinstance(line, P.STEPS):
            step += 1
        elif isinstance(line, P.Alloc) and line.buf in outside:
            continue
        elif isinstance(line, P.Alloc) and line.reuse is None and not line.heap:
            start[line.buf] = step + 1
            size[line.buf] = evaluate(line.nbytes, env or {})
        elif isinstance(line, P.Free) and line.buf not in outside and line.buf in root \
                and root[line.buf] in start:
            r = root[line.buf]
            end[r] = max(end.get(r, step), step, start[r])
    return [Interval(r, size[r], start[r], end[r]) for r in sorted(end)]


def example_env(prog: P.Program) -> dict[str, int]:
    return {s.name: s.example for s in prog.symbols}


def sizes_tried(prog: P.Program, between: int = 3) -> list[dict[str, int]]:
    """Size environments a dynamic program is checked and reported at: every symbol at its
    minimum, `between` geometric steps towards the maximum, the example and the maximum."""
    if not prog.symbols:
        return []
    envs = [{s.name: s.min for s in prog.symbols}]
    for j in range(1, between + 1):
        f = j / (between + 1)
        envs.append({s.name: max(s.min, min(s.max, round(max(s.min, 1) * (
            s.max / max(s.min, 1)) ** f))) for s in prog.symbols})
    envs += [example_env(prog), {s.name: s.max for s in prog.symbols}]
    out: list[dict[str, int]] = []
    for env in envs:
        if env not in out and _admissible(prog, env):
            out.append(env)
    return out


def _admissible(prog: P.Program, env: dict[str, int]) -> bool:
    """Whether a run at `env` passes the program's size relations (a reshape's element
    count, a non-zero divisor): sizes that fail them never reach the plan."""
    for x in prog.lines:
        if isinstance(x, P.CheckRelation):
            try:
                lhs, rhs = evaluate(x.lhs, env), evaluate(x.rhs, env)
            except ZeroDivisionError:
                return False
            if (lhs == rhs) != x.equal:
                return False
    return True


def runtime_plan(prog: P.Program, env: dict[str, int], verify: bool = True) -> dict:
    """The plan the generated code makes at sizes `env` (greedy by size), optionally proven."""
    ivs = intervals(prog, env)
    t0 = time.perf_counter()
    offsets, arena = greedy_by_size_offsets(ivs, prog.alignment)
    seconds = time.perf_counter() - t0
    lb = lower_bound(ivs, prog.alignment)
    if verify:
        verify_plan(ivs, Plan(offsets, arena, lb, "greedy_by_size", 0.0), prog.alignment)
    return {"sizes": dict(env), "arena_bytes": arena, "lower_bound_bytes": lb,
            "ratio": arena / lb if lb else 1.0, "planning_seconds": seconds}


# Total bytes beyond which sizes cannot be allocated in a 64-bit address space (and arena
# offsets would overflow int64): such environments are skipped.
ADDRESSABLE_BYTES = 2**62


def plan_sizes(prog: P.Program, verify: bool = True) -> list[dict]:
    """`runtime_plan` at every environment of `sizes_tried` (empty for static programs) whose
    storages fit in memory together: the maximum of a `Dim` without an upper bound, squared by
    an `x @ x.T`, would not."""
    return [runtime_plan(prog, env, verify) for env in sizes_tried(prog)
            if sum(iv.size for iv in intervals(prog, env)) < ADDRESSABLE_BYTES]


def assign_offsets(prog: P.Program, verify: bool = True, budget_s: float = 0.5
                   ) -> tuple[P.Program, Plan, list[Interval]]:
    """Plan `prog` (see the module docstring); a dynamic program's plan is the run-time one
    at the example sizes."""
    ivs = intervals(prog, example_env(prog))
    if prog.dynamic:
        t0 = time.perf_counter()
        offsets, arena = greedy_by_size_offsets(ivs, prog.alignment)
        plan = Plan(offsets, arena, lower_bound(ivs, prog.alignment), "greedy_by_size (run time)",
                    time.perf_counter() - t0, {"greedy_by_size": arena})
    else:
        plan = plan_memory(ivs, alignment=prog.alignment, budget_s=budget_s)
    if verify:
        verify_plan(ivs, plan, alignment=prog.alignment)
    if prog.dynamic:
        if verify:
            plan_sizes(prog, verify=True)
        return replace(prog, arena_bytes=None), plan, ivs
    root = roots(prog)
    lines = P.map_lines(prog.lines, lambda x: replace(x, offset=plan.offsets[root[x.buf]])
                        if isinstance(x, P.Alloc) and not x.heap and x.state is None else x)
    return replace(prog, lines=lines, arena_bytes=plan.arena_bytes), plan, ivs


def inplace_report(prog: P.Program, plan: Plan, budget_s: float = 0.5) -> dict:
    """In-place pairs and what they save at the example sizes: the arena planned the same way
    (best-of for static programs, run-time greedy for dynamic ones) with every Alloc on its own
    storage, minus the arena of `plan`."""
    pairs = [{"buffer": x.buf, "reuses": x.reuse} for x in P.walk(prog.lines)
             if isinstance(x, P.Alloc) and x.reuse is not None]
    ivs = intervals(prog, example_env(prog), inplace=False)
    if prog.dynamic:
        without = greedy_by_size_offsets(ivs, prog.alignment)[1]
    else:
        without = plan_memory(ivs, alignment=prog.alignment, budget_s=budget_s).arena_bytes
    return {"pairs": pairs, "arena_without_inplace_bytes": without,
            "lower_bound_without_inplace_bytes": lower_bound(ivs, prog.alignment),
            "saved_bytes": without - plan.arena_bytes}
