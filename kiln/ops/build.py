"""Loop IR expression builders shared by the op bodies (table.py) and lowering.

Input: Loop IR expressions (or `match.Hole` placeholders, which carry a dtype like any
expression) and Python values. Output: frozen Loop IR expressions. Invariants: `const` stores
a value of its dtype's Python type (bool / float / int), or a `Param` as it is (a pattern's
attribute placeholder, see match.py); `cast` and `to_bool` add no operator when the value has
the dtype already."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import dtypes
from kiln.ir import loop as L


@dataclass(frozen=True)
class Param:
    """An attribute left open in a pattern: the constant it becomes matches any float
    constant, whose value the match reports (clamp's bounds)."""

    name: str


def py_value(v, dt: dtypes.DType):
    if dt.name == "bool":
        return bool(v)
    if dt.is_float:
        return float(v)
    return int(v)


def const(v, dt: dtypes.DType) -> L.Const:
    return L.Const(v if isinstance(v, Param) else py_value(v, dt), dt)


def cast(e: L.Expr, dt: dtypes.DType) -> L.Expr:
    if e.dtype == dt:
        return e
    if isinstance(e, L.Const):
        return L.Const(py_value(e.value, dt), dt)
    return L.Op("cast", (e,), dt)


def op(name: str, *args: L.Expr, dtype: dtypes.DType | None = None) -> L.Op:
    """Loop IR operator `name` on `args`; its dtype defaults to the first value operand's
    (the second for `where`)."""
    if dtype is None:
        dtype = args[1].dtype if name == "where" else args[0].dtype
    return L.Op(name, tuple(args), dtype)


def to_bool(e: L.Expr) -> L.Expr:
    return e if e.dtype == dtypes.bool_ else L.Op("to_bool", (e,), dtypes.bool_)
