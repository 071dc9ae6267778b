"""Lowering rules for complex values as pairs of real parts.

The frontend (frontend/aten_complex.py) writes every complex op it computes as real arithmetic
on the parts, between two Graph IR ops only: `view_as_real` (a complex tensor of shape S read
as the real tensor S + [2], torch's layout: no copy) and `complex` (two real tensors joined,
broadcast to the node's shape). So Loop IR sees complex values only as loads from complex
buffers, the operator `complex` (a stored element made of its parts) and the parts `real` /
`imag` of a loaded element; `part` reads a part straight through the moves lowering makes of
complex values (where, casts between complex types), so a chain of complex ops fuses into
real arithmetic."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Index, Lazy, LowerCtx
from kiln.lowering.pointwise import load_broadcast
from kiln.ops.build import cast, const, op


def _parts(e: L.Expr) -> tuple[L.Expr, L.Expr]:
    """(real, imaginary) of the complex element `e`, as real expressions."""
    dt = dtypes.complex_part(e.dtype)
    if isinstance(e, L.Const):
        v = complex(e.value)
        return const(v.real, dt), const(v.imag, dt)
    if isinstance(e, L.Load):
        return L.Op("real", (e,), dt), L.Op("imag", (e,), dt)
    if e.op == "complex":
        return cast(e.args[0], dt), cast(e.args[1], dt)
    if e.op == "where":
        (a, b), (c, d) = _parts(e.args[1]), _parts(e.args[2])
        return (op("where", e.args[0], cast(a, dt), cast(c, dt)),
                op("where", e.args[0], cast(b, dt), cast(d, dt)))
    if e.op == "cast":
        x = e.args[0]
        if x.dtype.is_complex:
            a, b = _parts(x)
            return cast(a, dt), cast(b, dt)
        return cast(x, dt), const(0.0, dt)
    raise UnsupportedError(f"a complex value computed by {e.op} cannot be split into parts")


def part(e: L.Expr, k: sympy.Expr) -> L.Expr:
    """Part k (0 real, 1 imaginary; an index expression) of the complex element `e`."""
    a, b = _parts(e)
    k = sympy.sympify(k)
    if k.is_Integer:
        return a if int(k) == 0 else b
    first = op("eq", L.Index(k, dtypes.int64), const(0, dtypes.int64), dtype=dtypes.bool_)
    return op("where", first, a, b)


def lower_view_as_real(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """A complex tensor of shape S as the real tensor S + [2] of its parts (no copy)."""
    (x,) = args

    def fn(idx: Index) -> L.Expr:
        return part(x.load(tuple(idx[:-1])), idx[-1])

    return Lazy(node.type.dtype, node.type.shape, fn, None, x.cost + 1)


def lower_complex(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """The complex tensor with real part args[0] and imaginary part args[1] (broadcast)."""
    re, im = args
    dt, shape = node.type.dtype, node.type.shape
    pdt = dtypes.complex_part(dt)

    def fn(idx: Index) -> L.Expr:
        return L.Op("complex", (cast(load_broadcast(re, idx, shape), pdt),
                                cast(load_broadcast(im, idx, shape), pdt)), dt)

    return Lazy(dt, shape, fn, None, re.cost + im.cost + 1)


RULES = {"view_as_real": lower_view_as_real, "complex": lower_complex}
