"""Lowering rules for reductions and the normalisations built on them: sum/mean/max/...,
argmax, var, softmax, log_softmax, layer_norm, batch_norm (inference), pooling."""

from __future__ import annotations

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import ivars, product, rvars
from kiln.lowering.core import Index, Lazy, LowerCtx, pointwise
from kiln.lowering.pointwise import broadcast_index, cast, const, op, to_bool


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
        if b is not None:
            y = op("add", y, cast(b.load(tail), dt))
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
        if b is not None:
            y = op("add", y, cast(b.load(c), dt))
        return y

    return pointwise(dt, x.shape, fn, x)


def _window(x: Lazy, idx, r, kernel, stride, padding, dilation):
    """Source index and in-bounds condition of window element r of output idx (NCHW)."""
    src = [idx[0], idx[1]]
    conds = []
    for a in range(2):
        pos = sympy.expand(idx[2 + a] * stride[a] + r[a] * dilation[a] - padding[a])
        size = x.shape[2 + a]
        if padding[a]:
            conds.append(op("ge", L.Index(pos, dtypes.int64), const(0, dtypes.int64),
                            dtype=dtypes.bool_))
            conds.append(op("lt", L.Index(pos, dtypes.int64), L.Index(size, dtypes.int64),
                            dtype=dtypes.bool_))
            pos = sympy.Max(sympy.Integer(0), sympy.Min(pos, size - 1))
        src.append(pos)
    cond = None
    for c in conds:
        cond = c if cond is None else op("logical_and", cond, c, dtype=dtypes.bool_)
    return tuple(src), cond


def _lowest(dt):
    """Padding value of a max pool: -inf, or the smallest integer (int64: INT64_MIN + 1, which
    C++ can spell as a literal; it differs only for a window whose elements all equal
    INT64_MIN)."""
    if dt.is_float:
        return float("-inf")
    if not dt.is_signed:
        return 0
    return -(2 ** (8 * dt.itemsize - 1)) + (dt.itemsize == 8)


def lower_max_pool2d(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    kernel, stride = node.attr("kernel"), node.attr("stride")
    padding, dilation = node.attr("padding"), node.attr("dilation")
    dt = node.type.dtype
    iv, rv = ivars(4), rvars(2)
    src, cond = _window(x, iv, rv, kernel, stride, padding, dilation)
    body = cast(x.load(src), dt)
    if cond is not None or node.attr("ceil_mode"):
        if node.attr("ceil_mode"):
            for a in range(2):
                pos = sympy.expand(iv[2 + a] * stride[a] + rv[a] * dilation[a] - padding[a])
                c = op("lt", L.Index(pos, dtypes.int64), L.Index(x.shape[2 + a], dtypes.int64),
                       dtype=dtypes.bool_)
                cond = c if cond is None else op("logical_and", cond, c, dtype=dtypes.bool_)
        body = op("where", cond, body, const(_lowest(dt), dt))
    return ctx.reduction(node.name, dt, node.type.shape, "max", tuple(kernel), body,
                         (node.source,))


def lower_avg_pool2d(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    kernel, stride, padding = node.attr("kernel"), node.attr("stride"), node.attr("padding")
    if node.attr("ceil_mode"):
        from kiln.errors import UnsupportedError
        raise UnsupportedError(f"avg_pool2d with ceil_mode=True (node {node.name})")
    dt = node.type.dtype
    iv, rv = ivars(4), rvars(2)
    src, cond = _window(x, iv, rv, kernel, stride, padding, (1, 1))
    body = cast(x.load(src), dt)
    if cond is not None:
        body = op("where", cond, body, const(0, dt))
    s = ctx.reduction(node.name + "_sum", dt, node.type.shape, "sum", tuple(kernel), body,
                      (node.source,))
    if node.attr("divisor"):
        count = sympy.Integer(node.attr("divisor"))
    elif node.attr("count_include_pad") or not any(padding):
        count = sympy.Integer(kernel[0] * kernel[1])
    else:
        count = sympy.Integer(1)
        for a in range(2):
            lo = iv[2 + a] * stride[a] - padding[a]
            count = count * (sympy.Min(lo + kernel[a], x.shape[2 + a]) - sympy.Max(lo, 0))
    return pointwise(dt, node.type.shape,
                     lambda idx: op("div", s.load(idx), _size_value(count.subs(
                         dict(zip(iv, idx))), dt)), s)


def lower_adaptive_avg_pool2d(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    dt = node.type.dtype
    oh, ow = node.type.shape[2], node.type.shape[3]
    h, w = x.shape[2], x.shape[3]
    iv = ivars(4)
    starts = [sympy.floor(iv[2] * h / oh), sympy.floor(iv[3] * w / ow)]
    ends = [sympy.ceiling((iv[2] + 1) * h / oh), sympy.ceiling((iv[3] + 1) * w / ow)]
    if all(sympy.sympify(d).is_Integer for d in (oh, ow, h, w)) and int(h) % int(oh) == 0 \
            and int(w) % int(ow) == 0:
        kh, kw = int(h) // int(oh), int(w) // int(ow)
        rv = rvars(2)
        body = cast(x.load((iv[0], iv[1], iv[2] * kh + rv[0], iv[3] * kw + rv[1])), dt)
        s = ctx.reduction(node.name + "_sum", dt, node.type.shape, "sum", (kh, kw), body,
                          (node.source,))
        return pointwise(dt, node.type.shape, lambda idx: op("div", s.load(idx),
                                                             const(kh * kw, dt)), s)
    from kiln.errors import UnsupportedError
    raise UnsupportedError(f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow} (node {node.name}): "
                           f"only evenly dividing sizes are supported; window {starts}..{ends}")


__all__ = ["lower_reduce", "lower_var", "lower_softmax", "lower_layer_norm", "lower_batch_norm",
           "lower_max_pool2d", "lower_avg_pool2d", "lower_adaptive_avg_pool2d",
           "broadcast_index"]
