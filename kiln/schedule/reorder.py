"""Memory-aware reordering of independent steps (kernels and GEMMs).

Input: the scheduled steps in program order. Output: the same steps in an order that respects
every data dependence (a step runs after the steps that write what it reads) and lowers the
peak of live temp bytes, or the original order when it does not.

Algorithm: list scheduling. Among the ready steps, run the one with the smallest net growth of
live bytes (bytes it allocates minus bytes of temps whose last reader it is); ties keep program
order. The peak of both orders is measured (sizes at the symbols' example values) and the lower
one is kept, so the pass never makes the plan's lower bound worse."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import data_dependent_symbols, evaluate
from kiln.schedule import Kernel, Step


def _io(step: Step) -> tuple[set[str], set[str]]:
    if isinstance(step, L.CALLS):
        return L.node_reads(step), set(L.node_writes(step))
    if isinstance(step, L.CONTROL):
        return set(step.reads), set(step.writes)
    writes = {m.name for m in step.members}
    reads = {ld.buf for m in step.members for ld in L.loads(m.body)} - writes
    return reads, writes


def _binds(step: Step) -> set[str]:
    if isinstance(step, L.AtenCall):
        return {name for _, name, _ in step.all_binds()}
    if isinstance(step, L.ReadSize):
        return {name for _, name, _ in step.binds}
    return set()


def _data_sizes(x, seen=None) -> set[str]:
    """The data-dependent size symbols (u0, ...) anywhere in step `x` (shapes, indexing,
    values), found by walking its fields."""
    if isinstance(x, sympy.Basic):
        return {s.name for s in data_dependent_symbols(x)}
    if isinstance(x, (tuple, list)):
        return {u for v in x for u in _data_sizes(v)}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {u for f in dataclasses.fields(x) for u in _data_sizes(getattr(x, f.name))}
    return set()


def _peak(order: Sequence[int], io, sizes: Mapping[str, int], temps: set[str]) -> int:
    readers: dict[str, int] = {}
    for k in order:
        for b in io[k][0]:
            readers[b] = readers.get(b, 0) + 1
    live, peak = 0, 0
    for k in order:
        reads, writes = io[k]
        live += sum(sizes[b] for b in writes if b in temps)
        peak = max(peak, live)
        for b in reads:
            readers[b] -= 1
            if readers[b] == 0 and b in temps:
                live -= sizes[b]
    return peak


def reorder_for_memory(steps: tuple[Step, ...], prog: L.LoopProgram,
                       env: Mapping[str, int]) -> tuple[tuple[Step, ...], int, int]:
    """(steps in the better order, peak bytes before, peak bytes after)."""
    buffers = {b.name: b for b in prog.buffers}
    keep_alive = {src for _, src in prog.mutations}
    temps = {n for n, b in buffers.items() if b.kind == "temp" and n not in keep_alive}
    sizes = {n: evaluate(b.numel, dict(env)) * b.dtype.itemsize for n, b in buffers.items()}
    io = [_io(s) for s in steps]
    producer = {b: k for k, (_, w) in enumerate(io) for b in w}
    deps = [{producer[b] for b in r if b in producer and producer[b] != k}
            for k, (r, _) in enumerate(io)]
    binder = {name: k for k, st in enumerate(steps) for name in _binds(st)}
    for k, st in enumerate(steps if binder else ()):  # a step using a data-dependent size
        # runs after the step that binds it
        deps[k] |= {binder[u] for u in _data_sizes(st) if u in binder and binder[u] != k}
    readers: dict[str, int] = {}
    for r, _ in io:
        for b in r:
            readers[b] = readers.get(b, 0) + 1
    done: set[int] = set()
    order: list[int] = []
    remaining = dict(readers)
    while len(order) < len(steps):
        ready = [k for k in range(len(steps)) if k not in done and deps[k] <= done]

        def growth(k: int) -> tuple[int, int]:
            reads, writes = io[k]
            freed = sum(sizes[b] for b in reads if b in temps and remaining.get(b) == 1)
            return sum(sizes[b] for b in writes if b in temps) - freed, k

        k = min(ready, key=growth)
        order.append(k)
        done.add(k)
        for b in io[k][0]:
            remaining[b] -= 1
    before = _peak(range(len(steps)), io, sizes, temps)
    after = _peak(order, io, sizes, temps)
    if after >= before:
        return steps, before, before
    return tuple(steps[k] for k in order), before, after


__all__ = ["reorder_for_memory", "Kernel"]
