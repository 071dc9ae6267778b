"""Recognising a form of an op in lowered code, from the op's own definition.

`pattern(name)` is form `name`'s row expression (table.py `Row.expr`) built on placeholder
operands (`Hole`) with its open attributes as `Param` constants; `match(name, e)` says whether
Loop IR expression `e` is that pattern with some expressions for the holes and some float
constants for the params, and returns them. Recognisers (gemm/cutlass_evt.py) thus follow
the body lowering emits: there is no second, hand-written description of gelu.

Matching rules: operators match by name and operand count (dtypes are the caller's to check:
a pattern is built in float32); `add` and `mul` also match with their two operands swapped
(the written order is tried first, so a single operator binds its operands in order); a hole
matches any expression, the same one wherever it occurs; a literal constant matches a float
constant within a relative 1e-6; a param matches any float constant. The first match in that
search order (written before swapped, left to right) is returned."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ops.build import Param
from kiln.ops.table import ROWS, form

COMMUTATIVE = frozenset({"add", "mul"})
TOLERANCE = 1e-6


@dataclass(frozen=True)
class Hole:
    """Operand `k` of a pattern (an expression of dtype `dtype` to the op bodies)."""

    k: int
    dtype: dtypes.DType


@dataclass(frozen=True)
class Match:
    operands: tuple  # the expression bound to each hole, in operand order
    params: tuple[float, ...] = ()  # the open attributes' values, in the form's order


@cache
def pattern(name: str) -> L.Expr:
    """Form `name`'s expression on holes 0..arity-1 (float32)."""
    f = form(name)
    row = ROWS[f.row]
    holes = tuple(Hole(k, dtypes.float32) for k in range(row.arity))
    return row.expr(holes, dtypes.float32, f.pattern_attrs())


def is_primitive(name: str) -> bool:
    """Form `name` is one Loop IR operator applied to its operands in order."""
    p = pattern(name)
    return isinstance(p, L.Op) and all(isinstance(a, Hole) and a.k == k
                                       for k, a in enumerate(p.args))


def match(name: str, e: L.Expr) -> Match | None:
    """The operands (and open attribute values) for which `e` is form `name`, or None."""
    f = form(name)
    env = next(_matches(pattern(name), e, {}), None)
    if env is None:
        return None
    arity = ROWS[f.row].arity
    return Match(tuple(env[k] for k in range(arity)),
                 tuple(float(env[Param(p)]) for p in f.params))


def _matches(p, e, env: dict) -> Iterator[dict]:
    if isinstance(p, Hole):
        if p.k not in env:
            yield {**env, p.k: e}
        elif env[p.k] == e:
            yield env
        return
    if isinstance(p, L.Const):
        if not isinstance(e, L.Const) or e.dtype.is_float != p.dtype.is_float:
            return
        if isinstance(p.value, Param):
            if p.dtype.is_float and (p.value not in env or env[p.value] == e.value):
                yield {**env, p.value: e.value}
        elif _close(e.value, p.value, p.dtype.is_float):
            yield env
        return
    if isinstance(p, L.Op):
        if not isinstance(e, L.Op) or e.op != p.op or len(e.args) != len(p.args):
            return
        yield from _all(p.args, e.args, env)
        if p.op in COMMUTATIVE and len(p.args) == 2:
            yield from _all(p.args, e.args[::-1], env)
        return
    if p == e:
        yield env


def _all(ps, es, env: dict) -> Iterator[dict]:
    if not ps:
        yield env
        return
    for env1 in _matches(ps[0], es[0], env):
        yield from _all(ps[1:], es[1:], env1)


def _close(got, want, is_float: bool) -> bool:
    if not is_float:
        return got == want
    return abs(float(got) - float(want)) <= TOLERANCE * max(1.0, abs(float(want)))
