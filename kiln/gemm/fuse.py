"""CUDA: GEMMs that a generated kernel computes (the Triton template, or a CUTLASS kernel
with an epilogue visitor tree), with their epilogue.

Input: the schedule (steps), the autotuning choice per GEMM and the buffers that must be
stored (program outputs and new state values). Output: new steps where each GEMM whose choice
is "triton" is a `GemmKernel`: the GEMM plus, when the first later step reading the GEMM's
result is a kernel whose member reading it is pointwise and reads it only at the element it
stores, that member as its epilogue. The absorbed member leaves its kernel (a kernel left
empty disappears), so bias, activation, residual and cast ops are computed once, inside the
GEMM's tile, and the GEMM's own result buffer is never written (build_program allocates
nothing for it).

Moving the member up to the GEMM is sound when every other buffer it reads is written before
the GEMM (not by a step in between, nor by an earlier member of its kernel): those are then
live at the GEMM already (they are read later), so no lifetime shrinks but the GEMM result's,
which disappears, and the member's own result, which starts earlier. The GEMM result must
have no other reader (nor be an output or a new state value), else it would have to be
stored as well.

A "triton" choice whose config is a `GemvConfig` (M = 1, gemm/gemv.py) also absorbs the
row-wise producer of its A row as its prologue (gemm/prologue.py), recomputed in every
program."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import contiguous_strides, ivars, \
    linear_index, product
from kiln.gemm.configs import CutlassConfig, GemvConfig
from kiln.gemm.prologue import prologue_of
from kiln.gemm.cutlass_evt import Evt, from_epilogue
from kiln.ir.simplify import fold_divmod
from kiln.options import GemmBackend
from kiln.schedule import Kernel
from kiln.schedule.steps import CutlassGemm, GemmKernel


def _step_reads(step) -> set[str]:
    if isinstance(step, Kernel):
        return {ld.buf for m in step.members for ld in L.loads(m.body)}
    if isinstance(step, (GemmKernel, CutlassGemm)):
        return set(step.reads())
    return set(L.node_reads(step))


def epilogue_of(g: L.Gemm, m: L.Compute) -> bool:
    """`m` can be `g`'s epilogue: pointwise over g's elements (its shape may regroup g's dims,
    e.g. [b*s, n] read as [b, s, n]), reading g's result only at the element it computes (same
    row-major position); its other loads may gather (checked indices, as in any kernel)."""
    if m.reduce is not None or sympy.simplify(product(m.shape) - product(g.shape)) != 0:
        return False
    ident = linear_index(ivars(len(m.shape)), contiguous_strides(m.shape))
    # the variables of size-1 dims are 0 (lowering prints a [1, 1, C] row's index as
    # i0 + i1 + i2)
    ones = {v: 0 for v, d in zip(ivars(len(m.shape)), m.shape) if sympy.sympify(d) == 1}
    seen = False
    for ld in L.loads(m.body):
        if ld.buf == g.name:
            if ld.indirect:
                return False
            if sympy.simplify((fold_divmod(ld.index) - sympy.expand(ident)).subs(ones)) != 0:
                return False
            seen = True
    return seen


def _step_writes(step) -> set[str]:
    if isinstance(step, Kernel):
        return {m.name for m in step.members}
    if isinstance(step, (GemmKernel, CutlassGemm)):
        return {step.out}
    return set(L.node_writes(step))


def _find_epilogue(steps: list, i: int, outputs: set[str]) -> tuple[int, int] | None:
    """(step index, member index) of GEMM `steps[i]`'s epilogue, or None."""
    g = steps[i]
    if g.name in outputs:
        return None
    for j in range(i + 1, len(steps)):
        if g.name in _step_reads(steps[j]):
            break
    else:
        return None
    nxt = steps[j]
    if not isinstance(nxt, Kernel):
        return None
    pos = next(p for p, m in enumerate(nxt.members)
               if g.name in {ld.buf for ld in L.loads(m.body)})
    m = nxt.members[pos]
    if not epilogue_of(g, m):
        return None
    others = {ld.buf for q, mm in enumerate(nxt.members) if q != pos for ld in L.loads(mm.body)}
    later = set().union(set(), *[_step_reads(t) for t in steps[j + 1:]])
    if g.name in others or g.name in later:
        return None
    # what it reads must exist at the GEMM: written neither between them nor before it in
    # its own kernel
    between = set().union(set(), *[_step_writes(t) for t in steps[i + 1:j]],
                          {mm.name for mm in nxt.members[:pos]})
    if {ld.buf for ld in L.loads(m.body)} & between:
        return None
    return j, pos


def epilogue_member(steps, i: int, outputs: set[str]) -> L.Compute | None:
    """The member that GEMM `steps[i]` would absorb as its epilogue (what the autotuner
    profiles fused candidates with), or None."""
    found = _find_epilogue(list(steps), i, outputs)
    return None if found is None else steps[found[0]].members[found[1]]


def _fused_evt(g: L.Gemm, epi: L.Compute | None, config: CutlassConfig) -> bool:
    """A "cutlass" choice made for a fused epilogue still matches the member found here."""
    if epi is None or config.evt is None:
        return False
    evt = from_epilogue(g, epi)
    return isinstance(evt, Evt) and evt.key == config.evt


def fuse_gemms(steps: tuple, choices: dict, outputs: set[str]) -> tuple:
    """`choices`: GEMM name -> autotune Choice; `outputs`: buffers that must be stored
    (program outputs and new state values). "triton" GEMMs become `GemmKernel`s (with their
    epilogue when one is found); "cutlass" GEMMs whose choice fused an epilogue
    (`CutlassConfig.evt`) become `CutlassGemm`s when that epilogue is still found, else stay
    plain GEMMs (the plain kernel of the same name; the epilogue stays in its kernel)."""
    steps = list(steps)
    i = 0
    while i < len(steps):
        s = steps[i]
        c = choices.get(s.name) if isinstance(s, L.Gemm) else None
        if c is None or c.backend not in (GemmBackend.TRITON, GemmBackend.CUTLASS):
            i += 1
            continue
        pro = prologue_of(steps, i, outputs) if isinstance(c.config, GemvConfig) else None
        found = _find_epilogue(steps, i, outputs)
        epi = None if found is None else steps[found[0]].members[found[1]]
        if c.backend is GemmBackend.CUTLASS and not _fused_evt(s, epi, c.config):
            i += 1
            continue
        if found is not None:
            j, pos = found
            k = steps[j]
            rest = k.members[:pos] + k.members[pos + 1:]
            if rest:
                steps[j] = Kernel(k.name, k.outer, rest, k.locals, k.row_locals)
            else:
                del steps[j]
        steps[i] = GemmKernel(s, epi, c.config, pro[1] if pro else None) \
            if c.backend is GemmBackend.TRITON else CutlassGemm(s, epi, c.config)
        if pro is not None:  # the producer's kernel before the GEMM loses the row
            p, _, left = pro
            if left is None:
                del steps[p]
                i -= 1
            else:
                steps[p] = left
        i += 1
    return tuple(steps)
