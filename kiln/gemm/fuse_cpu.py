"""CPU: pointwise epilogues fused into GEMMs (bias, activation, residual add, scale).

Input: the schedule (steps) and the buffers that must be stored (program outputs and new
state values). Output: new steps where a top-level GEMM whose result is read only by one
pointwise member of a later kernel, at the element that member stores (the rule of
kiln/gemm/fuse.py, `_find_epilogue`), carries that member as `L.Gemm.epilogue`: the member
leaves its kernel (a kernel left empty disappears), the GEMM takes the member's name, so it
stores into the member's buffer, and the GEMM's own result buffer is never allocated.

The epilogue runs in place, on each part of the result as soon as that part is final (a row
block of a thread's panels for the packed "cpp" kernel, a thread's share for the others:
kr::gemm_cpp_packed / kr::gemm_split), so bias, activation and residual are applied while the
tile is in cache instead of in a separate pass over memory with its own parallel region. That
needs the member's dtype to be the GEMM's (the result and the member's output share the
bytes) and its last dimension to be the GEMM's N (a row of the member is a row of C); the
member's other loads must not gather through data. A BLAS GEMM applies the same epilogue
after the call (`epi_<name>`, one pass, as the separate kernel did)."""

from __future__ import annotations

from dataclasses import replace

import sympy

from kiln.gemm.fuse import _find_epilogue
from kiln.ir import loop as L
from kiln.schedule import Kernel


def _rename_loads(e: L.Expr, old: str, new: str) -> L.Expr:
    if isinstance(e, L.Load):
        return replace(e, buf=new) if e.buf == old else e
    if isinstance(e, L.Op):
        return replace(e, args=tuple(_rename_loads(a, old, new) for a in e.args))
    return e


def fusible(g: L.Gemm, m: L.Compute, kernel: Kernel) -> bool:
    """The CPU conditions on top of `_find_epilogue`'s (see the module docstring)."""
    return (g.lowp is None and g.mixed is None and g.epilogue is None and len(g.batch) <= 2
            and m.dtype == g.dtype and len(m.shape) >= 1
            and sympy.simplify(m.shape[-1] - g.n) == 0
            and m.name not in kernel.locals and m.name not in kernel.row_locals
            and not any(ld.indirect for ld in L.loads(m.body)))


def fuse_epilogues(steps: tuple, outputs: set[str]) -> tuple:
    """`steps` with each fusible GEMM's epilogue absorbed (top-level steps only)."""
    steps = list(steps)
    i = 0
    while i < len(steps):
        g = steps[i]
        found = _find_epilogue(steps, i, outputs) if isinstance(g, L.Gemm) else None
        if found is not None and fusible(g, steps[found[0]].members[found[1]], steps[found[0]]):
            j, pos = found
            k = steps[j]
            m = k.members[pos]
            epi = replace(m, body=_rename_loads(m.body, g.name, m.name))
            source = tuple(dict.fromkeys((*g.source, *m.source)))
            steps[i] = replace(g, name=m.name, source=source, epilogue=epi)
            rest = k.members[:pos] + k.members[pos + 1:]
            if rest:
                steps[j] = Kernel(k.name, k.outer, rest, k.locals, k.row_locals)
            else:
                del steps[j]
        i += 1
    return tuple(steps)
