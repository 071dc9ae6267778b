"""Lowering rules for ops computed by library calls: matmul (mm / bmm) as a `Gemm` and 2-D
convolution as an im2col `Compute` followed by a batched `Gemm`. Bias and activations that
follow are ordinary pointwise ops, so they fuse into the consumer kernel."""

from __future__ import annotations

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import FloorDiv, ModIdx, contiguous_strides, ivars, rvars
from kiln.lowering.core import Lazy, LowerCtx, View, from_view
from kiln.lowering.pointwise import cast, const, op


def _blas_ok(strides) -> bool:
    return strides[-1] == 1 or strides[-2] == 1


def operand(ctx: LowerCtx, lz: Lazy, name: str, source) -> tuple[L.Operand, Lazy]:
    """A GEMM operand for `lz` ([..., rows, cols]); materialise it when not BLAS-compatible."""
    if lz.view is None or not _blas_ok(lz.view.strides):
        lz = ctx.realize(lz.origin or name, lz, source)
    v = lz.view
    return L.Operand(v.buf, v.offset, tuple(v.strides[:-2]), v.strides[-2], v.strides[-1]), lz


def gemm(ctx: LowerCtx, name: str, a: Lazy, b: Lazy, batch, source, dt) -> Lazy:
    oa, a = operand(ctx, a, name + "_lhs", source)
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
    if node.type.dtype.name not in ("float32", "float64"):
        from kiln.errors import UnsupportedError
        raise UnsupportedError(f"matmul of dtype {node.type.dtype} (node {node.name})")
    return gemm(ctx, node.name, a, b, batch, (node.source or node.name,), node.type.dtype)


def int_matmul(ctx: LowerCtx, node: Node, a: Lazy, b: Lazy) -> Lazy:
    """Integer matmul (BLAS has none): a generated reduction over k, exact, wrapping on
    overflow in the output dtype like eager."""
    dt = node.type.dtype
    if dt == dtypes.bool_:
        from kiln.errors import UnsupportedError
        raise UnsupportedError(f"matmul of dtype bool (node {node.name})")
    nb = len(node.type.shape) - 2
    iv, (r,) = ivars(nb + 2), rvars(1)
    body = op("mul", cast(a.load((*iv[:nb], iv[nb], r)), dt),
              cast(b.load((*iv[:nb], r, iv[nb + 1])), dt))
    return ctx.reduction(node.name, dt, node.type.shape, "sum", (a.shape[-1],), body,
                         (node.source or node.name,))


def lower_conv2d(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x, w = args
    stride, padding = node.attr("stride"), node.attr("padding")
    dilation, groups = node.attr("dilation"), node.attr("groups")
    dt = node.type.dtype
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    _, _, oh, ow = node.type.shape
    src = (node.source or node.name,)
    g = groups
    og = o // g
    ckk = cg * kh * kw
    pointwise_1x1 = (kh, kw) == (1, 1) and tuple(stride) == (1, 1) and tuple(padding) == (0, 0)
    if pointwise_1x1:
        if x.view is None:
            x = ctx.realize(node.name + "_input", x, src)
        cols = ctx.buffer_lazy(x.view.buf, dt, (n, g, cg, h * wd)) if x.view.offset == 0 and \
            tuple(x.view.strides) == contiguous_strides(x.shape) else None
        if cols is None:
            x = ctx.realize(node.name + "_input", x, src)
            cols = ctx.buffer_lazy(x.view.buf, dt, (n, g, cg, h * wd))
    else:
        cols = ctx.realize(node.name + "_im2col", _im2col(x, (n, g, ckk, oh * ow), cg, (kh, kw),
                                                          stride, padding, dilation, ow), src)
    wv = w if w.view is not None else ctx.realize(node.name + "_weight", w, src)
    wmat = from_view(dt, (n, g, og, ckk), View(wv.view.buf, wv.view.offset,
                                               (sympy.Integer(0), og * ckk, ckk, sympy.Integer(1))))
    out = gemm(ctx, node.name, wmat, cols, (n, g), src, dt)
    return from_view(dt, node.type.shape, View(out.view.buf, sympy.Integer(0),
                                               contiguous_strides(node.type.shape)))


def _im2col(x: Lazy, shape, cg, kernel, stride, padding, dilation, ow) -> Lazy:
    kh, kw = kernel
    h, w = x.shape[2], x.shape[3]
    dt = x.dtype

    def fn(idx):
        b, g, row, col = idx
        ci = FloorDiv(row, kh * kw)
        rem = ModIdx(row, kh * kw)
        ky, kx = FloorDiv(rem, kw), ModIdx(rem, kw)
        oy, ox = FloorDiv(col, ow), ModIdx(col, ow)
        y = oy * stride[0] + ky * dilation[0] - padding[0]
        xx = ox * stride[1] + kx * dilation[1] - padding[1]
        conds = []
        if padding[0] or padding[1]:
            for pos, size in ((y, h), (xx, w)):
                conds.append(op("ge", L.Index(pos, dtypes.int64), const(0, dtypes.int64),
                                dtype=dtypes.bool_))
                conds.append(op("lt", L.Index(pos, dtypes.int64), L.Index(size, dtypes.int64),
                                dtype=dtypes.bool_))
            y = sympy.Max(0, sympy.Min(y, h - 1))
            xx = sympy.Max(0, sympy.Min(xx, w - 1))
        v = x.load((b, g * cg + ci, y, xx))
        if not conds:
            return v
        cond = conds[0]
        for cc in conds[1:]:
            cond = op("logical_and", cond, cc, dtype=dtypes.bool_)
        return op("where", cond, v, const(0, dt))

    return Lazy(dt, tuple(shape), fn, None, 6)


__all__ = ["lower_matmul", "lower_conv2d", "ivars"]
