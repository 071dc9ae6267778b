"""Symbolic integers for sizes and index expressions, on top of sympy.

Sizes are sympy expressions over positive integer symbols (one per dynamic dim, e.g. `s0`).
Index expressions are sympy expressions over loop variables `i0, i1, ...` (output indices) and
`r0, r1, ...` (reduction indices), plus `FloorDiv` / `ModIdx` for reshapes that cannot be
expressed with strides. `to_c` prints any of them as a C++ int64 expression."""

from __future__ import annotations

from collections.abc import Sequence

import sympy

Expr = sympy.Expr


def size_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, positive=True)


def unbacked_symbol(name: str) -> sympy.Symbol:
    """A size known only once the op that produces it has run (e.g. the row count of
    `nonzero`): named u0, u1, ...; may be 0."""
    return sympy.Symbol(name, integer=True, nonnegative=True)


# a data-dependent size without an upper bound has itself as its bound (frontend/symbols.py):
# buffers whose size still mentions one after bounds are substituted are allocated at run time,
# outside the arena; compile-time heuristics (GEMM profiling, step reordering) assume this size
UNBOUNDED_NOMINAL = 1024


def data_dependent_symbols(e) -> set[sympy.Symbol]:
    """The data-dependent size symbols (u0, u1, ...) in size expression `e`."""
    return {s for s in sympy.sympify(e).free_symbols
            if s.name[:1] == "u" and s.name[1:].isdigit()}


def unbounded(name: str, bound) -> bool:
    """Whether data-dependent size `name` has no upper bound (its bound mentions a
    data-dependent size, itself or an earlier unbounded one)."""
    return bool(data_dependent_symbols(bound))


def index_var(prefix: str, k: int) -> sympy.Symbol:
    return sympy.Symbol(f"{prefix}{k}", integer=True, nonnegative=True)


def ivars(n: int) -> tuple[sympy.Symbol, ...]:
    return tuple(index_var("i", k) for k in range(n))


def rvars(n: int) -> tuple[sympy.Symbol, ...]:
    return tuple(index_var("r", k) for k in range(n))


class FloorDiv(sympy.Function):
    """Integer floor division of non-negative operands."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if a == 0:
            return sympy.Integer(0)
        return None


class ModIdx(sympy.Function):
    """Integer remainder of non-negative operands."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))
        if a == 0:
            return sympy.Integer(0)
        return None


def product(xs: Sequence) -> Expr:
    out = sympy.Integer(1)
    for x in xs:
        out = out * x
    return out


def contiguous_strides(shape: Sequence[Expr]) -> tuple[Expr, ...]:
    strides: list[Expr] = []
    acc: Expr = sympy.Integer(1)
    for size in reversed(shape):
        strides.append(acc)
        acc = acc * size
    return tuple(reversed(strides))


def linear_index(idx: Sequence[Expr], strides: Sequence[Expr]) -> Expr:
    return sympy.expand(sum((i * s for i, s in zip(idx, strides)), sympy.Integer(0)))


def unravel(flat: Expr, shape: Sequence[Expr]) -> tuple[Expr, ...]:
    """Indices into `shape` (row-major) of the flat position `flat`."""
    out: list[Expr] = []
    for k in range(len(shape)):
        inner = product(shape[k + 1 :])
        q = FloorDiv(flat, inner) if inner != 1 else flat
        out.append(q if k == 0 else ModIdx(q, shape[k]))
    return tuple(out)


def free_size_symbols(e: Expr) -> set[sympy.Symbol]:
    return {s for s in sympy.sympify(e).free_symbols if s.name[0] in "su"}


def _c(e: Expr, kernel: bool = False) -> str:
    def c(x: Expr) -> str:
        return _c(x, kernel)
    if e.is_Integer:
        v = int(e)
        return f"{v}" if -(2**31) < v < 2**31 else f"INT64_C({v})"
    if e.is_Symbol:
        return e.name
    if isinstance(e, FloorDiv):
        return f"({c(e.args[0])} / {c(e.args[1])})"
    if isinstance(e, ModIdx):
        return f"({c(e.args[0])} % {c(e.args[1])})"
    if e.is_Add:
        terms = [c(a) for a in sorted(e.args, key=sympy.default_sort_key)]
        return "(" + " + ".join(terms) + ")"
    if e.is_Mul:
        return "(" + " * ".join(c(a) for a in sorted(e.args, key=sympy.default_sort_key)) + ")"
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        return "(" + " * ".join([c(e.base)] * int(e.exp)) + ")"
    if isinstance(e, (sympy.Max, sympy.Min)):
        big = isinstance(e, sympy.Max)
        f = ("kr::imax" if big else "kr::imin") if kernel else \
            ("std::max<int64_t>" if big else "std::min<int64_t>")
        out = c(e.args[0])
        for a in e.args[1:]:
            out = f"{f}({out}, {c(a)})"
        return out
    raise ValueError(f"cannot print index expression {e!r} as C")


def to_c(e, kernel: bool = False) -> str:
    """Print a size or index expression as a C++ int64 expression; `kernel`: for generated
    kernels, Max / Min as kiln_kernels.h's by-value kr::imax / kr::imin (std::max's references
    to temporaries keep GCC from vectorising an `omp simd` loop)."""
    return _c(sympy.sympify(e), kernel)


def _py(e: Expr) -> str:
    if isinstance(e, FloorDiv):
        return f"({_py(e.args[0])} // {_py(e.args[1])})"
    if isinstance(e, ModIdx):
        return f"({_py(e.args[0])} % {_py(e.args[1])})"
    if e.is_Integer or e.is_Symbol:
        return str(e)
    if e.is_Add:
        return "(" + " + ".join(_py(a) for a in sorted(e.args, key=sympy.default_sort_key)) + ")"
    if e.is_Mul:
        return "(" + " * ".join(_py(a) for a in sorted(e.args, key=sympy.default_sort_key)) + ")"
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        return f"({_py(e.base)} ** {int(e.exp)})"
    if isinstance(e, (sympy.Max, sympy.Min)):
        return f"{type(e).__name__.lower()}({', '.join(_py(a) for a in e.args)})"
    raise ValueError(f"cannot print size expression {e!r} as Python")


def to_py(e) -> str:
    """Print a size or index expression as Python (for the Python wrapper)."""
    return _py(sympy.sympify(e))


def evaluate(e, env: dict[str, int]) -> int:
    e = sympy.sympify(e)
    val = e.subs({s: env[s.name] for s in e.free_symbols if s.name in env})
    return int(val)
