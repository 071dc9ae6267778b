"""Range-aware simplification of index expressions.

Loop variables have known ranges (i_k in [0, shape_k), r_k in [0, sizes_k)); size symbols are
>= 1. With those, `FloorDiv(q*c + r, c)` becomes `q + FloorDiv(r, c)` and `FloorDiv(r, c)`
becomes 0 when 0 <= r < c is provable; `ModIdx` likewise. Reshapes of reshapes produce such
expressions; simplifying them keeps generated indices short and vectorisable.

Soundness: every rewrite requires a proof of the bound; `_nonneg` proves p >= 0 for a polynomial
p in size symbols by substituting s = t + 1 (t >= 0) and checking all coefficients are >= 0.
When anything is unknown the expression is left as it was."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import sympy

from kiln.ir.sym import FloorDiv, ModIdx

Bounds = tuple[sympy.Expr, sympy.Expr]


@lru_cache(maxsize=65536)
def _nonneg(e: sympy.Expr) -> bool:
    e = sympy.expand(e)
    if e.is_number:
        return bool(e >= 0)
    syms = sorted(e.free_symbols, key=lambda s: s.name)
    if any(s.name[0] != "s" for s in syms):
        return False
    ts = {s: sympy.Symbol(f"_t_{s.name}", nonnegative=True) + 1 for s in syms}
    p = sympy.Poly(sympy.expand(e.xreplace(ts)))
    return all(c >= 0 for c in p.coeffs())


def bounds(e: sympy.Expr, ranges: Mapping[sympy.Symbol, sympy.Expr]) -> Bounds | None:
    """Inclusive (lo, hi) of `e`, or None when unknown."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return e, e
    if e.is_Symbol:
        if e in ranges:
            return sympy.Integer(0), ranges[e] - 1
        if e.name.startswith("s"):
            return e, e
        return None
    if e.is_Add:
        lo, hi = sympy.Integer(0), sympy.Integer(0)
        for a in e.args:
            b = bounds(a, ranges)
            if b is None:
                return None
            lo, hi = lo + b[0], hi + b[1]
        return lo, hi
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        parts = rest.args if rest.is_Mul else (rest,)
        lo, hi = sympy.Integer(1), sympy.Integer(1)
        for a in parts:
            b = bounds(a, ranges)
            if b is None or not _nonneg(b[0]):
                return None
            lo, hi = lo * b[0], hi * b[1]
        return (coeff * lo, coeff * hi) if coeff >= 0 else (coeff * hi, coeff * lo)
    if isinstance(e, FloorDiv):
        b = bounds(e.args[0], ranges)
        if b is None or not _nonneg(b[0]):
            return None
        return sympy.Integer(0), b[1] / e.args[1]
    if isinstance(e, ModIdx):
        return sympy.Integer(0), e.args[1] - 1
    return None


@lru_cache(maxsize=65536)
def _split(x: sympy.Expr, c: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """x = q*c + r where q collects the terms of x divisible by c."""
    q, r = sympy.Integer(0), sympy.Integer(0)
    for t in sympy.Add.make_args(sympy.expand(x)):
        ratio = sympy.cancel(t / c)
        num, den = sympy.fraction(ratio)
        if den == 1 and ratio.is_integer:
            q += ratio
        else:
            r += t
    return q, r


def _below(b: Bounds | None, c: sympy.Expr) -> bool:
    return b is not None and _nonneg(b[0]) and _nonneg(c - 1 - b[1])


@lru_cache(maxsize=65536)
def _divides(c: sympy.Expr, g: sympy.Expr) -> sympy.Expr | None:
    ratio = sympy.cancel(c / g)
    num, den = sympy.fraction(ratio)
    if den == 1 and ratio.is_integer:
        return ratio
    return None


def _factor_out(x: sympy.Expr, c: sympy.Expr, ranges) -> tuple | None:
    """x = g*y + r with 0 <= r < g and g dividing c, for some g taken from x's terms."""
    terms = sympy.Add.make_args(sympy.expand(x))
    for t in terms:
        for v in (a for a in t.free_symbols if a in ranges):
            g = sympy.cancel(t / v)
            if g == 1 or _divides(c, g) is None:
                continue
            y, r = _split(x, g)
            if y != 0 and _below(bounds(r, ranges), g):
                return g, y, r
    return None


def simplify_index(e: sympy.Expr, ranges: Mapping[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
    """`e` simplified under the loop variables' `ranges` (memoised: reshapes repeat)."""
    e = sympy.sympify(e)
    if not e.has(FloorDiv, ModIdx):
        return e
    return _simplify_cached(e, frozenset(ranges.items()))


@lru_cache(maxsize=65536)
def _simplify_cached(e: sympy.Expr, ranges_key: frozenset) -> sympy.Expr:
    return _simplify(e, dict(ranges_key))


def _simplify(e: sympy.Expr, ranges: Mapping[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
    if not e.has(FloorDiv, ModIdx):
        return e
    if isinstance(e, (FloorDiv, ModIdx)):
        x = simplify_index(e.args[0], ranges)
        c = e.args[1]
        q, r = _split(x, c)
        rb = bounds(r, ranges)
        if not _below(rb, c):
            found = _factor_out(x, c, ranges)
            if found is not None:
                g, y, r = found
                inner = simplify_index(type(e)(y, _divides(c, g)), ranges)
                return inner if isinstance(e, FloorDiv) else sympy.expand(g * inner + r)
        if isinstance(e, FloorDiv):
            if _below(rb, c):
                return sympy.expand(q)
            return sympy.expand(q + FloorDiv(r, c)) if q != 0 and rb is not None and \
                _nonneg(rb[0]) else FloorDiv(x, c)
        if _below(rb, c):
            return r
        return ModIdx(r, c) if q != 0 and rb is not None and _nonneg(rb[0]) else ModIdx(x, c)
    if e.args:
        return sympy.expand(e.func(*[simplify_index(a, ranges) for a in e.args]))
    return e


def fold_divmod(e) -> sympy.Expr:
    """`e` with every `c*s*FloorDiv(a, s) + c*ModIdx(a, s)` rewritten to `c*a` (exact for
    non-negative integers: a = s * (a // s) + a % s), as reshapes of reshapes produce."""
    e = sympy.expand(sympy.sympify(e))
    changed = True
    while changed and e.is_Add:
        changed = False
        terms = e.as_coefficients_dict()
        for t, c in terms.items():
            if isinstance(t, ModIdx):
                a, d = t.args
                fd = FloorDiv(a, d)
                if sympy.simplify(terms.get(fd, 0) - c * d) == 0 or \
                        sympy.simplify(_coeff(e, fd) - c * d) == 0:
                    e = sympy.expand(e - c * t - c * d * fd + c * a)
                    changed = True
                    break
    return e


def _coeff(e, atom) -> sympy.Expr:
    """The coefficient of `atom` in the sum `e` (symbolic coefficients included)."""
    return sympy.expand(e).coeff(atom)
