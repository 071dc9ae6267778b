"""KV-cache writes in the launch of the kernel before them (issue 17.3): a decode step writes
each layer's new key and value rows into the static cache with two `put` calls (index_put,
mode set), right after the small kernel that computes the keys' rotary embedding (and, with
schedule's `tiny`, the queries'). Each was a launch of its own; here they become one
`PutKernel` (schedule/steps.py): one program runs that kernel's members, then the scatters.

Rule, over a schedule (CUDA, after fuse_gemms). A run of consecutive steps
    [K] P1 ... Pn
where each Pj is a `put` Extern (mode set) of at most `TINY` static elements (its values'
shape: the iteration space), and K (optional) is a `Kernel` whose outer is one row (one
program runs all of it) and whose members are each at most `TINY` elements, becomes one
`PutKernel(K, (P1..Pn))` when it removes a launch (K present or n >= 2) and:
  - no Pj's `self` is written inside the run (its copy kernel, when the update is not in
    place, runs before the fused launch, so it must read what existed before it);
  - no Pj reads an earlier Pi's output (the scatters of one program are not ordered with
    each other's loads: no barrier between them).
Pj's values and indices may read K's members: K's stores come first, then a barrier, then
the scatters. Everything else runs in program order, as before. Pure: returns new steps."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import product
from kiln.schedule import TINY, Kernel
from kiln.schedule.steps import PutKernel


def _static_small(n) -> bool:
    n = sympy.sympify(n)
    return n.is_Integer and int(n) <= TINY


def fusable_put(s) -> bool:
    """A `put` Extern the fused kernel prints: mode set, static and small."""
    return (isinstance(s, L.Extern) and s.routine == "put" and s.attr("mode") == 0 and
            s.attr("include_self", True) and _static_small(product(s.args[1].shape)))


def _one_row(k) -> bool:
    if not isinstance(k, Kernel) or sympy.sympify(product(k.outer)) != 1:
        return False
    return all(_static_small(product(m.shape) * (product(m.reduce.sizes) if m.reduce else 1))
               for m in k.members)


def _group_ok(kernel: Kernel | None, puts: list[L.Extern]) -> bool:
    inside = {m.name for m in kernel.members} if kernel is not None else set()
    for j, p in enumerate(puts):
        if p.args[0].buf in inside or {a.buf for a in p.args} & {q.name for q in puts[:j]}:
            return False
        inside.add(p.name)
    return True


def fuse_puts(steps: tuple) -> tuple:
    out: list = []
    i = 0
    steps = list(steps)
    while i < len(steps):
        s = steps[i]
        if not fusable_put(s):
            out.append(s)
            i += 1
            continue
        j = i
        while j < len(steps) and fusable_put(steps[j]):
            j += 1
        puts = steps[i:j]
        kernel = out[-1] if out and _one_row(out[-1]) else None
        while puts and not _group_ok(kernel, puts):
            puts = puts[:-1]  # the longest prefix that may run in one program
        if kernel is not None and puts:
            out[-1] = PutKernel(kernel, tuple(puts))
        elif len(puts) >= 2:
            out.append(PutKernel(None, tuple(puts)))
        else:
            puts = steps[i:i + 1]
            out.append(s)
        i += max(1, len(puts))
    return tuple(out)
