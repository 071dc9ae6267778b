"""Lowering rules for ops computed by library calls: float matmul (mm / bmm) as a `Gemm`
(convolution builds on `gemm`: spatial.py); integer matmul as a generated reduction. Bias and
activations that follow are ordinary pointwise ops, so they fuse into the consumer kernel."""

from __future__ import annotations


import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.simplify import simplify_index
from kiln.ir.sym import FloorDiv, ModIdx, contiguous_strides, ivars, rvars
from kiln.lowering.core import Lazy, LowerCtx, View, from_view, pointwise
from kiln.ops.build import cast, op
from kiln.errors import UnsupportedError


def _reads_transposed(lz: Lazy) -> bool:
    """Whether `lz`'s element (..., r, c) reads its sources column by column: every load's
    index steps further along c than along r (a converted Linear weight, cast(W).t())."""
    if lz.rank < 2:
        return False
    iv = ivars(lz.rank)
    lds = L.loads(lz.load(iv))
    if not lds:
        return False
    for ld in lds:
        idx = sympy.expand(ld.index)
        cr, cc = idx.coeff(iv[-2], 1), idx.coeff(iv[-1], 1)
        if not (cr.is_Integer and cc.is_Integer and abs(cc) > abs(cr)):
            return False
    return True


def _overlapping_rows(lz: Lazy) -> bool:
    """Whether `lz` is a view of unit column stride whose rows start a positive static stride
    apart, overlapping or not (the im2col view of passes/conv1d_gemm.py)."""
    if lz.view is None:
        return False
    rs, cs = (sympy.sympify(x) for x in lz.view.strides[-2:])
    return cs == 1 and rs.is_Integer and int(rs) > 0 and all(
        sympy.sympify(x).is_nonnegative is True for x in (*lz.view.strides[:-2], lz.view.offset))


def operand(ctx: LowerCtx, lz: Lazy, name: str, source, overlap: bool = False
            ) -> tuple[L.Operand, Lazy]:
    """A GEMM operand for `lz` ([..., rows, cols]); materialise it when not BLAS-compatible,
    in its sources' order: an operand read column by column (a bf16 Linear weight converted,
    then transposed) is stored transposed and passed as a transposed view, so the copy reads
    and writes memory in order. `overlap`: a view whose rows overlap is taken as it is (only
    kiln's CPU GEMM reads it: L.Gemm.blas_operands)."""
    in_place = overlap and _overlapping_rows(lz)
    if not in_place and (lz.view is None or not L.blas_ok(lz.view.strides, lz.shape)):
        if lz.view is None and _reads_transposed(lz):
            src = lz
            shape = (*lz.shape[:-2], lz.shape[-1], lz.shape[-2])
            t = ctx.realize(lz.origin or name, pointwise(
                lz.dtype, shape, lambda idx: src.load((*idx[:-2], idx[-1], idx[-2])), src),
                source)
            st = t.view.strides
            lz = from_view(lz.dtype, lz.shape, View(t.view.buf, t.view.offset,
                                                    (*st[:-2], st[-1], st[-2])))
        else:
            lz = ctx.realize(lz.origin or name, lz, source)
    v = lz.view
    return L.Operand(v.buf, v.offset, tuple(v.strides[:-2]), v.strides[-2], v.strides[-1]), lz


def _probe(lz: Lazy, batch, split) -> tuple[L.Operand, object] | None:
    """Operand `lz` ([*batch, rows, cols], not a view) read in place, with batch dim d split
    into (batch[d] / r, r) when `split` = (d, r): its element is one load (times constant
    factors, returned apart) at an index affine in the split loop variables. A GQA key
    `k.expand(b, kv, rep, s, e).reshape(b, kv * rep, s, e)` (scaled by sdpa's decomposition) is
    such a view with batch strides (kv stride, 0): no copy of the repeated cache."""
    nb = len(batch)
    d, r = split if split is not None else (None, 1)
    shape = list(batch) if d is None else list(batch[:d]) + [batch[d] // r, r] + list(
        batch[d + 1:])
    shape += list(lz.shape[-2:])
    iv = ivars(len(shape))
    idx = list(iv[:-2]) if d is None else list(iv[:d]) + [r * iv[d] + iv[d + 1]] + list(
        iv[d + 2:nb + 1])
    e = lz.load(tuple(idx) + tuple(iv[-2:]))
    scale = 1
    while isinstance(e, L.Op) and e.op == "mul" and len(e.args) == 2 and sum(
            isinstance(x, L.Const) for x in e.args) == 1:
        c = next(x for x in e.args if isinstance(x, L.Const))
        if not isinstance(c.value, (int, float)) or isinstance(c.value, bool):
            return None
        scale *= c.value
        e = next(x for x in e.args if not isinstance(x, L.Const))
    if not isinstance(e, L.Load) or e.indirect or e.dtype != lz.dtype:
        return None
    ranges = dict(zip(iv, shape))
    index = e.index
    if index.has(FloorDiv, ModIdx):
        index = simplify_index(index, ranges)
    index = sympy.expand(index)
    if index.has(FloorDiv, ModIdx):
        return None
    coeffs = [index.coeff(v, 1) for v in iv]
    off = index.subs({v: 0 for v in iv})
    if any(c.free_symbols & set(iv) for c in coeffs) or off.free_symbols & set(iv) or \
            sympy.expand(index - off - sum(c * v for c, v in zip(coeffs, iv))) != 0:
        return None
    if not L.blas_ok(coeffs[-2:], shape[-2:]) or any(sympy.sympify(c).is_nonnegative is not True
                                        for c in (off, *coeffs)):
        return None
    return L.Operand(e.buf, off, tuple(coeffs[:-2]), coeffs[-2], coeffs[-1]), scale


def _in_place(ctx: LowerCtx, a: Lazy, b: Lazy, batch, name: str, source):
    """(split, A operand, B operand, constant factor) when an operand that is not a view
    (see `_probe`) can be read in place, else None. An operand read in place under no split
    is materialised (a fused expression: the query); both operands then take the first split
    that suits both: none, else a static batch dim split into two (the CPU GEMM's limit of two
    batch dims), smallest factor first."""
    if all(x.view is not None and L.blas_ok(x.view.strides, x.shape) for x in (a, b)):
        return None
    splits = [None]
    if len(batch) == 1 and isinstance(sympy.sympify(batch[0]), sympy.Integer):
        n = int(batch[0])
        splits += [(0, r) for r in range(2, n) if n % r == 0]
    probes = []
    for x in (a, b):
        got = {split: _probe(x, batch, split) for split in splits}
        probes.append(got)
    nonview = [j for j, x in enumerate((a, b))
               if not (x.view is not None and L.blas_ok(x.view.strides, x.shape))]
    if not any(p is not None for j in nonview for p in probes[j].values()):
        return None
    ops = [a, b]
    for j, x in enumerate((a, b)):
        if all(p is None for p in probes[j].values()):
            if x.view is not None and L.blas_ok(x.view.strides, x.shape):
                continue
            ops[j] = ctx.realize(x.origin or f"{name}_{'lhs' if j == 0 else 'rhs'}", x, source)
            probes[j] = {split: _probe(ops[j], batch, split) for split in splits}
    for split in splits:
        pa, pb = probes[0][split], probes[1][split]
        if pa is not None and pb is not None:
            return split, pa[0], pb[0], pa[1] * pb[1]
    return None


def gemm(ctx: LowerCtx, name: str, a: Lazy, b: Lazy, batch, source, dt,
         overlap_a: bool = False) -> Lazy:
    """out = a @ b as an L.Gemm; `overlap_a`: A may be a view whose rows overlap, read in
    place (a matmul node's `rows_overlap`, set by passes/conv1d_gemm.py)."""
    overlap_a = overlap_a and _overlapping_rows(a)
    found = _in_place(ctx, a, b, batch, name, source) if dt.is_float and not overlap_a \
        else None
    if found is not None:
        split, oa, ob, scale = found
        gbatch = tuple(batch) if split is None else (batch[0] // split[1], split[1])
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        out = ctx.unique(name)
        ctx.declare(out, dt, (*gbatch, m, n), "temp")
        ctx.nodes.append(L.Gemm(out, dt, gbatch, m, n, k, oa, ob, tuple(source)))
        shape = (*batch, m, n)
        res = from_view(dt, shape, View(out, sympy.Integer(0), contiguous_strides(shape)))
        if scale == 1:
            return res
        return pointwise(dt, shape, lambda idx: op("mul", res.load(idx), L.Const(scale, dt)),
                         res)
    oa, a = operand(ctx, a, name + "_lhs", source, overlap_a)
    ob, b = operand(ctx, b, name + "_rhs", source)
    out = ctx.unique(name)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    shape = (*batch, m, n)
    ctx.declare(out, dt, shape, "temp")
    ctx.nodes.append(L.Gemm(out, dt, tuple(batch), m, n, k, oa, ob, tuple(source)))
    return ctx.buffer_lazy(out, dt, shape)


def lower_matmul(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    a, b = args
    batch = node.type.shape[:-2]
    if not node.type.dtype.is_float:
        return int_matmul(ctx, node, a, b)
    if node.type.dtype.name not in ("float32", "float64", "float16", "bfloat16"):
        raise UnsupportedError(f"matmul of dtype {node.type.dtype} (node {node.name})")
    if a.shape[-1] == 1 and len(a.shape) == len(b.shape) == len(node.type.shape):
        return outer_product(node, a, b)
    return gemm(ctx, node.name, a, b, batch, (node.source or node.name,), node.type.dtype,
                bool(node.attr("rows_overlap", False)))


def outer_product(node: Node, a: Lazy, b: Lazy) -> Lazy:
    """A float matmul over K = 1 (rotary frequencies times positions, a rank-1 update): each
    element is one product, a pointwise op that fuses into its neighbours instead of a library
    call. 16-bit operands multiply in float32 and round once, as a GEMM's float32 accumulator
    does; batch dims of size 1 broadcast as matmul's do."""
    dt, shape = node.type.dtype, tuple(node.type.shape)
    nb = len(shape) - 2
    wide = dtypes.float32 if dt.name in ("float16", "bfloat16") else dt

    def at(lz: Lazy, idx, last):
        batch = [i if lz.shape[d] == shape[d] else sympy.Integer(0)
                 for d, i in enumerate(idx[:nb])]
        return cast(lz.load((*batch, *last)), wide)

    def fn(idx):
        zero = sympy.Integer(0)
        return cast(op("mul", at(a, idx, (idx[nb], zero)), at(b, idx, (zero, idx[nb + 1]))), dt)
    return pointwise(dt, shape, fn, a, b)


def int_matmul(ctx: LowerCtx, node: Node, a: Lazy, b: Lazy) -> Lazy:
    """Integer matmul (BLAS has none): a generated reduction over k, exact, wrapping on
    overflow in the output dtype like eager."""
    dt = node.type.dtype
    if dt == dtypes.bool_:
        raise UnsupportedError(f"matmul of dtype bool (node {node.name})")
    nb = len(node.type.shape) - 2
    iv, (r,) = ivars(nb + 2), rvars(1)
    body = op("mul", cast(a.load((*iv[:nb], iv[nb], r)), dt),
              cast(b.load((*iv[:nb], r, iv[nb + 1])), dt))
    return ctx.reduction(node.name, dt, node.type.shape, "sum", (a.shape[-1],), body,
                         (node.source or node.name,))


__all__ = ["lower_matmul", "int_matmul", "outer_product", "gemm", "ivars"]
