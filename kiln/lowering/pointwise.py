"""Lowering rules for elementwise ops: broadcasting, the op table's rows, constants and ranges.

Input: a Graph IR node and its operands as `Lazy` values. Output: a `Lazy` whose element is
the node's value at an index. What a pointwise op computes (conversions, decomposition of
gelu, silu, ...) is its row in kiln/ops/table.py; this module only broadcasts the operands
and hands the row the node's dtype and attributes."""

from __future__ import annotations

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Index, Lazy, LowerCtx, pointwise
from kiln.ops import ROWS
from kiln.ops.build import cast, const, op


def broadcast_index(idx: Index, in_shape, out_shape) -> Index:
    offset = len(out_shape) - len(in_shape)
    out = []
    for k, d in enumerate(in_shape):
        o = out_shape[k + offset]
        out.append(sympy.Integer(0) if (d == 1 and o != 1) else idx[k + offset])
    return tuple(out)


def load_broadcast(lz: Lazy, idx: Index, out_shape) -> L.Expr:
    return lz.load(broadcast_index(idx, lz.shape, out_shape))


def lower_pointwise(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """A row of the op table (kiln/ops/table.py): its expression on the broadcast operands,
    computing in the node's dtype, with the attributes the row reads."""
    row = ROWS[node.op]
    out_dt, shape = node.type.dtype, node.type.shape
    attrs = {k: node.attr(k, default) for k, default in row.attrs}

    def fn(idx: Index) -> L.Expr:
        return row.expr([load_broadcast(a, idx, shape) for a in args], out_dt, attrs)

    return pointwise(out_dt, shape, fn, *args)


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
