"""Lowering rules for elementwise ops: broadcasting, casts, and composite activations written
as Loop IR expression trees (gelu, silu, ...)."""

from __future__ import annotations

import math

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Index, Lazy, LowerCtx, pointwise


def broadcast_index(idx: Index, in_shape, out_shape) -> Index:
    offset = len(out_shape) - len(in_shape)
    out = []
    for k, d in enumerate(in_shape):
        o = out_shape[k + offset]
        out.append(sympy.Integer(0) if (d == 1 and o != 1) else idx[k + offset])
    return tuple(out)


def load_broadcast(lz: Lazy, idx: Index, out_shape) -> L.Expr:
    return lz.load(broadcast_index(idx, lz.shape, out_shape))


def cast(e: L.Expr, dt: dtypes.DType) -> L.Expr:
    if e.dtype == dt:
        return e
    if isinstance(e, L.Const):
        return L.Const(_py_value(e.value, dt), dt)
    return L.Op("cast", (e,), dt)


def _py_value(v, dt: dtypes.DType):
    if dt.name == "bool":
        return bool(v)
    if dt.is_float:
        return float(v)
    return int(v)


def const(v, dt: dtypes.DType) -> L.Const:
    return L.Const(_py_value(v, dt), dt)


def op(name: str, *args: L.Expr, dtype: dtypes.DType | None = None) -> L.Op:
    if dtype is None:
        dtype = args[1].dtype if name == "where" else args[0].dtype
    return L.Op(name, tuple(args), dtype)


def to_bool(e: L.Expr) -> L.Expr:
    return e if e.dtype == dtypes.bool_ else L.Op("to_bool", (e,), dtypes.bool_)


# -- composite activations -------------------------------------------------------------------
def gelu(x: L.Expr, approximate: str) -> L.Expr:
    dt = x.dtype
    half, one = const(0.5, dt), const(1.0, dt)
    if approximate == "tanh":
        inner = op("mul", const(math.sqrt(2 / math.pi), dt),
                   op("add", x, op("mul", const(0.044715, dt), op("mul", x, op("mul", x, x)))))
        return op("mul", op("mul", half, x), op("add", one, op("tanh", inner)))
    return op("mul", op("mul", half, x),
              op("add", one, op("erf", op("mul", x, const(1 / math.sqrt(2), dt)))))


def _silu(x):
    return op("mul", x, op("sigmoid", x))


def _hardsigmoid(x):
    dt = x.dtype
    return op("div", op("minimum", op("maximum", op("add", x, const(3, dt)), const(0, dt)),
                        const(6, dt)), const(6, dt))


def _softplus(x):
    return op("log1p", op("exp", x))


COMPOSITE_UNARY = {
    "silu": _silu,
    "hardsigmoid": _hardsigmoid,
    "hardswish": lambda x: op("mul", x, _hardsigmoid(x)),
    "mish": lambda x: op("mul", x, op("tanh", _softplus(x))),
    "softplus": _softplus,
}
BOOL_OUT_UNARY = {"isnan", "isinf", "logical_not", "signbit"}


def lower_unary(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    out_dt = node.type.dtype

    def fn(idx: Index) -> L.Expr:
        v = load_broadcast(x, idx, node.type.shape)
        if node.op == "logical_not" or (node.op == "bitwise_not" and out_dt == dtypes.bool_):
            return op("logical_not", to_bool(v), dtype=dtypes.bool_)
        if node.op in BOOL_OUT_UNARY:
            return op(node.op, v, dtype=dtypes.bool_)
        v = cast(v, out_dt)
        if node.op in COMPOSITE_UNARY:
            return COMPOSITE_UNARY[node.op](v)
        if node.op == "gelu":
            return gelu(v, node.attr("approximate", "none"))
        if node.op == "leaky_relu":
            s = const(node.attr("slope"), out_dt)
            return op("where", op("gt", v, const(0, out_dt), dtype=dtypes.bool_), v,
                      op("mul", v, s))
        if node.op == "clamp":
            lo, hi = node.attr("min"), node.attr("max")
            if lo is not None:
                v = op("maximum", v, const(lo, out_dt))
            if hi is not None:
                v = op("minimum", v, const(hi, out_dt))
            return v
        if node.op == "cast":
            return v
        return op(node.op, v)

    return pointwise(out_dt, node.type.shape, fn, x)


def lower_binary(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    a, b = args
    out_dt = node.type.dtype
    name = node.op
    if name == "div" and node.attr("rounding_mode") == "floor":
        name = "truediv_floor"
    elif name == "div" and node.attr("rounding_mode") == "trunc":
        name = "truediv_trunc"
    elif name == "floor_divide":
        name = "truediv_floor"

    def fn(idx: Index) -> L.Expr:
        x = load_broadcast(a, idx, node.type.shape)
        y = load_broadcast(b, idx, node.type.shape)
        if name.startswith("logical_"):
            return op(name, to_bool(x), to_bool(y), dtype=dtypes.bool_)
        if out_dt == dtypes.bool_ and name not in ("bitwise_and", "bitwise_or", "bitwise_xor"):
            return op(name, x, y, dtype=dtypes.bool_)
        return op(name, cast(x, out_dt), cast(y, out_dt))

    return pointwise(out_dt, node.type.shape, fn, a, b)


def lower_where(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    c, a, b = args
    shape, dt = node.type.shape, node.type.dtype

    def fn(idx: Index) -> L.Expr:
        return op("where", to_bool(load_broadcast(c, idx, shape)),
                  cast(load_broadcast(a, idx, shape), dt), cast(load_broadcast(b, idx, shape), dt))

    return pointwise(dt, shape, fn, c, a, b)


def lower_full(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    value = node.attr("value")
    dt = node.type.dtype
    if isinstance(value, sympy.Expr) and not value.is_Number:  # a size expression
        return Lazy(dt, node.type.shape, lambda idx: L.Index(value, dt))
    return Lazy(dt, node.type.shape, lambda idx: const(value, dt))


def lower_iota(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    start, step = node.attr("start"), node.attr("step")
    dt = node.type.dtype

    def fn(idx: Index) -> L.Expr:
        if isinstance(start, int) and isinstance(step, int) and not dt.is_float:
            return L.Index(sympy.expand(start + step * idx[0]), dt)
        return op("add", const(start, dt), op("mul", cast(L.Index(idx[0], dtypes.int64), dt),
                                              const(step, dt)))

    return Lazy(dt, node.type.shape, fn)
