"""Lowering rules for reductions and the normalisations built on them: sum/mean/max/...,
argmax, var, softmax, log_softmax, layer_norm, batch_norm (inference). Pooling is in spatial.py."""

from __future__ import annotations

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import ivars, product, rvars
from kiln.lowering.core import Index, Lazy, LowerCtx, pointwise
from kiln.lowering.pointwise import broadcast_index
from kiln.ops.build import cast, const, op, to_bool


def reduce_lazy(ctx: LowerCtx, base: str, x: Lazy, dims, keepdim: bool, kind: str,
                dtype, source, transform=None) -> Lazy:
    """Reduce `x` over `dims`; `transform(expr, full_index)` maps each element first."""
    dims = tuple(sorted(d for d in dims if d < x.rank))  # a 0-d tensor reduces over nothing
    out_shape = tuple(sympy.Integer(1) if d in dims else s for d, s in enumerate(x.shape)
                      if keepdim or d not in dims)
    iv, rv = ivars(len(out_shape)), rvars(len(dims))
    idx, ki, ri = [], 0, 0
    for d in range(x.rank):
        if d in dims:
            idx.append(rv[ri])
            ri += 1
            ki += keepdim
        else:
            idx.append(iv[ki])
            ki += 1
    body = x.load(tuple(idx))
    if transform is not None:
        body = transform(body, tuple(idx))
    if kind in ("any", "all"):
        body = to_bool(body)
    elif kind not in ("argmax", "argmin"):
        body = cast(body, dtype)
    sizes = tuple(x.shape[d] for d in dims)
    return ctx.reduction(base, dtype, out_shape, kind, sizes, body, source)


def _keep_index(idx: Index, dims) -> Index:
    return tuple(sympy.Integer(0) if d in dims else i for d, i in enumerate(idx))


def lower_reduce(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    kind, keep = node.attr("kind"), node.attr("keepdim")
    dims = tuple(d for d in node.attr("dims") if d < x.rank)  # a 0-d input reduces over nothing
    dt = node.type.dtype
    src = (node.source or node.name,)
    if kind in ("argmax", "argmin") and not dims:
        return Lazy(dt, node.type.shape, lambda idx: const(0, dt))
    if kind != "mean":
        return reduce_lazy(ctx, node.name, x, dims, keep, kind, dt, src)
    acc = dtypes.acc_dtype(dt)
    s = reduce_lazy(ctx, node.name + "_sum", x, dims, keep, "sum", acc, src)
    n = product([x.shape[d] for d in dims])
    return pointwise(dt, s.shape, lambda idx: cast(op("div", s.load(idx), _size_value(n, acc)),
                                                   dt), s)


def _size_value(n, dt) -> L.Expr:
    n = sympy.sympify(n)
    if n.is_Integer:
        return const(int(n), dt)
    return cast(L.Index(n, dtypes.int64), dt)


def _mean_var(ctx, base, x: Lazy, dims, dt, source, correction=0):
    n = product([x.shape[d] for d in dims])
    s = reduce_lazy(ctx, base + "_sum", x, dims, True, "sum", dt, source)

    def mean_at(idx):
        return op("div", s.load(_keep_index(idx, dims)), _size_value(n, dt))

    def sq_dev(e, idx):
        d = op("sub", cast(e, dt), mean_at(idx))
        return op("mul", d, d)

    ss = reduce_lazy(ctx, base + "_sqsum", x, dims, True, "sum", dt, source, sq_dev)
    denom = sympy.Max(n - correction, 0) if correction else n
    return mean_at, (lambda idx: op("div", ss.load(_keep_index(idx, dims)),
                                    _size_value(denom, dt))), s, ss


def lower_var(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x = ctx.cheap(args[0], node.name + "_input", (node.source,))
    dims, keep = node.attr("dims"), node.attr("keepdim")
    dt = node.type.dtype
    _, var_at, _, ss = _mean_var(ctx, node.name, x, dims, dtypes.acc_dtype(dt), (node.source,),
                                 node.attr("correction"))
    full = [None] * x.rank

    def fn(idx: Index) -> L.Expr:
        it = iter(idx)
        src = []
        for d in range(x.rank):
            if d in dims:
                src.append(sympy.Integer(0))
                if keep:
                    next(it)
            else:
                src.append(next(it))
        return cast(var_at(tuple(src)), dt)

    del full
    return pointwise(dt, node.type.shape, fn, ss)


def lower_softmax(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x = ctx.cheap(args[0], node.name + "_input", (node.source,))
    dim, out_dt = node.attr("dim"), node.type.dtype
    dt = dtypes.acc_dtype(out_dt)  # 16-bit floats: max, sum and quotient in float32
    src = (node.source,)
    m = reduce_lazy(ctx, node.name + "_max", x, (dim,), True, "max", dt, src)

    def shifted(e, idx):
        return op("sub", cast(e, dt), m.load(_keep_index(idx, (dim,))))

    def exp_shifted(e, idx):
        return op("exp", shifted(e, idx))

    s = reduce_lazy(ctx, node.name + "_sum", x, (dim,), True, "sum", dt, src, exp_shifted)

    def fn(idx: Index) -> L.Expr:
        v = x.load(idx)
        if node.op == "log_softmax":
            y = op("sub", shifted(v, idx), op("log", s.load(_keep_index(idx, (dim,)))))
        else:
            y = op("div", exp_shifted(v, idx), s.load(_keep_index(idx, (dim,))))
        return cast(y, out_dt)

    return pointwise(out_dt, x.shape, fn, m, s)


def lower_layer_norm(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x, *rest = args
    x = ctx.cheap(x, node.name + "_input", (node.source,))
    k, eps, out_dt = node.attr("norm_rank"), node.attr("eps"), node.type.dtype
    dt = dtypes.acc_dtype(out_dt)  # 16-bit floats: statistics and arithmetic in float32
    w = rest.pop(0) if node.attr("has_weight") else None
    b = rest.pop(0) if node.attr("has_bias") else None
    dims = tuple(range(x.rank - k, x.rank))
    mean_at, var_at, _, _ = _mean_var(ctx, node.name, x, dims, dt, (node.source,))

    def fn(idx: Index) -> L.Expr:
        y = op("mul", op("sub", cast(x.load(idx), dt), mean_at(idx)),
               op("rsqrt", op("add", var_at(idx), const(eps, dt))))
        tail = idx[x.rank - k:]
        if w is not None:
            y = op("mul", y, cast(w.load(tail), dt))
        # no bias: + 0 all the same, as eager's CPU kernel adds a bias of 0 (an exact zero
        # comes out +0 there, never -0, whatever the weight's sign)
        y = op("add", y, cast(b.load(tail), dt) if b is not None else const(0.0, dt))
        return cast(y, out_dt)

    return pointwise(out_dt, x.shape, fn, x)


def lower_batch_norm(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x, mean, var, *rest = args
    eps, dt = node.attr("eps"), node.type.dtype
    w = rest.pop(0) if node.attr("has_weight") else None
    b = rest.pop(0) if node.attr("has_bias") else None

    def fn(idx: Index) -> L.Expr:
        c = (idx[1],) if x.rank > 1 else (sympy.Integer(0),)
        y = op("mul", op("sub", cast(x.load(idx), dt), cast(mean.load(c), dt)),
               op("rsqrt", op("add", cast(var.load(c), dt), const(eps, dt))))
        if w is not None:
            y = op("mul", y, cast(w.load(c), dt))
        # no bias: + 0 (an exact zero is +0, as eager's x * alpha + beta gives)
        return op("add", y, cast(b.load(c), dt) if b is not None else const(0.0, dt))

    return pointwise(dt, x.shape, fn, x)


__all__ = ["lower_reduce", "lower_var", "lower_softmax", "lower_layer_norm", "lower_batch_norm",
           "broadcast_index"]
