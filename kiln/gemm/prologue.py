"""GEMV prologues (issue 17.3): a GEMV (M = 1) recomputes the row-wise producer of its A row
in every program instead of reading it from memory, so the producer's kernel loses that
member (and disappears when nothing is left).

Rule, in Loop IR terms. GEMM `g` at step i with M = 1 (gemm/gemv.py `applies`) whose A
operand is the contiguous row of buffer X (offset 0, column stride 1): X is a pointwise
member `row` of a schedule `Kernel` at step p < i (however that kernel walks it: the member's
body is evaluated at A's K positions), `row` has K elements, X is no output and nothing but
`g` reads X (no later step, no other member).
What `row` loads is one of:
  - a whole-row "sum" reduction R of the same kernel (one element; typically a norm's
    mean of squares): recomputed in the prologue, first, over its own loads;
  - a stored (non-register) pointwise member of the same kernel: it stays in the kernel,
    which still runs before the GEMV, and is loaded;
  - a buffer the kernel does not write;
and what a recomputed R loads is one of the last two. Every buffer the prologue loads must
not be written between steps p and i (else moving its reads to the GEMV would change them).
`row` leaves the kernel; a recomputed R leaves it too when nothing else (a remaining member,
a later step, the outputs) reads it. Register locals of the kernel are never loaded by the
prologue (they are not stored), except a reduction it recomputes.

Typical producers: RMSNorm (x * rsqrt(mean(x^2) + eps) * w, x possibly itself a residual
sum recomputed from its terms), silu(gate) * up of a merged gate/up GEMM's output, a cast.
`prologue_of` is pure: it returns what to change, `fuse_gemms` changes it."""

from __future__ import annotations

import sympy

from kiln.gemm.gemv import applies
from kiln.ir import loop as L
from kiln.ir.dtypes import float32 as _F32
from kiln.ir.sym import product
from kiln.schedule import Kernel
from kiln.schedule.steps import CutlassGemm, GemmKernel, Prologue


def _writes(step) -> set[str]:
    if isinstance(step, Kernel):
        return {m.name for m in step.members}
    if isinstance(step, (GemmKernel, CutlassGemm)):
        return {step.out}
    return set(L.node_writes(step))


def _reads(step) -> set[str]:
    if isinstance(step, Kernel):
        return {ld.buf for m in step.members for ld in L.loads(m.body)}
    if isinstance(step, (GemmKernel, CutlassGemm)):
        return set(step.reads())
    return set(L.node_reads(step))


def _is(e, n: int) -> bool:
    return sympy.simplify(sympy.sympify(e) - n) == 0


def prologue_of(steps, i: int, outputs: set[str]
                ) -> tuple[int, Prologue, Kernel | None] | None:
    """(p, prologue, what kernel p becomes: None when it is left empty) for GEMM `steps[i]`,
    or None when its A row has no producer the rule above takes."""
    steps = list(steps)
    g = steps[i]
    if not isinstance(g, L.Gemm) or not applies(g):
        return None
    x = g.a.buf
    if x == g.b.buf or x in outputs or not _is(g.a.offset, 0) or \
            not (_is(g.a.cols, 1) or _is(g.k, 1)):
        return None
    p = next((j for j in range(i - 1, -1, -1) if x in _writes(steps[j])), None)
    if p is None or not isinstance(steps[p], Kernel):
        return None
    kern = steps[p]
    members = {m.name: m for m in kern.members}
    row = members[x]
    if row.reduce is not None or not _is(product(row.shape), g.k):
        return None
    if any(x in {ld.buf for ld in L.loads(m.body)} for m in kern.members if m is not row):
        return None
    if any(x in _reads(s) for j, s in enumerate(steps) if j > p and j != i):
        return None
    private = kern.locals | kern.row_locals
    reductions: list[L.Compute] = []

    def loadable(buf: str) -> bool:  # a buffer the prologue may load
        m = members.get(buf)
        return m is None or (m.reduce is None and m is not row and buf not in private)

    for ld in L.loads(row.body):
        m = members.get(ld.buf)
        if m is not None and m.reduce is not None:
            if m.reduce.kind != "sum" or not _is(product(m.shape), 1) or ld.indirect:
                return None
            if m not in reductions:
                if not all(loadable(r.buf) for r in L.loads(m.body)):
                    return None
                reductions.append(m)
        elif not loadable(ld.buf):
            return None
    pro = Prologue(row, tuple(sorted(reductions, key=kern.members.index)))
    between = set().union(set(), *[_writes(s) for s in steps[p + 1:i]])
    if {ld.buf for ld in pro.loads()} & between:
        return None
    # what leaves kernel p: the row, and each recomputed reduction nothing else reads
    gone = {x}
    later = set().union(set(), *[_reads(s) for j, s in enumerate(steps) if j > p and j != i])
    for r in reductions:
        others = {ld.buf for m in kern.members if m.name not in (x, r.name)
                  for ld in L.loads(m.body)}
        if r.name not in outputs and r.name not in later and r.name not in others:
            gone.add(r.name)
    rest = tuple(m for m in kern.members if m.name not in gone)
    left = Kernel(kern.name, kern.outer, rest, kern.locals - gone, kern.row_locals - gone) \
        if rest else None
    return p, pro, left


def _k_free(e: L.Expr, regs: set[str]) -> bool:
    """`e` reads nothing but the whole-row reductions `regs` and constants: one value for the
    whole row (no Index, no other load)."""
    if isinstance(e, L.Const):
        return True
    if isinstance(e, L.Load):
        return e.buf in regs and not e.indirect
    if isinstance(e, L.Op):
        return all(_k_free(a, regs) for a in e.args)
    return False


def factor_row(body: L.Expr, regs: set[str]) -> tuple[L.Expr, L.Expr] | None:
    """(scale, rest) with `body` = scale * rest, where `scale` reads only the whole-row
    reductions `regs` (and constants) and `rest` none of them; None when `body` is not such a
    product (LayerNorm's x - mean, a reduction under a non-linear op of the row).

    The GEMV then multiplies its dot product of `rest` by `scale` once per output instead of
    computing the reductions before its K loop (sum_k W[n, k] * s * r[k] = s * sum_k W[n, k] *
    r[k]), so the reductions accumulate in the same loop as the dot product, and the weight
    loads start at once. RMSNorm's row, w[k] * cast(x[k] * rsqrt(mean(x^2) + eps)), factors as
    rsqrt(...) times w[k] * cast(x[k]). A float-to-float cast is moved onto `rest`: the row's
    elements are then rounded without the scale (a different rounding of the same product,
    one rounding error of the row's dtype per element, as before)."""

    def split(e):
        if not any(ld.buf in regs for ld in L.loads(e)):
            return None, e
        if _k_free(e, regs):
            return e, None
        if isinstance(e, L.Op) and e.op == "mul":
            a, b = split(e.args[0]), split(e.args[1])
            if a is None or b is None:
                return None
            scales = [s for s in (a[0], b[0]) if s is not None]
            rests = [r for r in (a[1], b[1]) if r is not None]
            scale = scales[0] if len(scales) == 1 else L.Op("mul", tuple(scales), _F32)
            rest = rests[0] if len(rests) == 1 else (
                L.Op("mul", tuple(rests), e.dtype) if rests else None)
            return scale, rest
        if isinstance(e, L.Op) and e.op == "cast" and e.dtype.is_float and \
                e.args[0].dtype.is_float:
            s = split(e.args[0])
            if s is None or s[1] is None:
                return None
            return s[0], L.Op("cast", (s[1],), e.dtype)
        return None

    out = split(body)
    if out is None or out[0] is None or out[1] is None:
        return None
    scale, rest = out
    if scale.dtype != _F32:
        scale = L.Op("cast", (scale,), _F32)
    return scale, rest
