"""Lowering state: lazily indexed tensors and the context that materialises them.

A `Lazy` is how lowering sees a graph value: a dtype, a shape and a `load(idx)` function giving
the Loop IR expression of one element. When the value is an affine view of a materialised
buffer, `view` also records (buffer, offset, strides) so extern calls can take it without a copy.
`LowerCtx.realize` turns a Lazy into a `Compute` writing a named buffer. Closures live only inside
this pass; what it returns is plain data (LoopProgram)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import sympy

from kiln.ir import loop as L
from kiln.ir.dtypes import DType
from kiln.ir.simplify import simplify_index
from kiln.ir.sym import FloorDiv, ModIdx, contiguous_strides, ivars, linear_index, rvars

Index = tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class View:
    buf: str
    offset: sympy.Expr
    strides: tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class Lazy:
    dtype: DType
    shape: tuple[sympy.Expr, ...]
    load: Callable[[Index], L.Expr]
    view: View | None = None
    cost: int = 0  # operators in one element's expression; 0 for loads
    origin: str = ""  # the graph node this value computes (names its buffer if materialised)

    @property
    def rank(self) -> int:
        return len(self.shape)


def from_view(dtype: DType, shape, v: View) -> Lazy:
    def load(idx: Index) -> L.Expr:
        return L.Load(v.buf, sympy.expand(v.offset + linear_index(idx, v.strides)), dtype)
    return Lazy(dtype, tuple(shape), load, v, 0)


def expr_cost(e: L.Expr) -> int:
    if isinstance(e, L.Op):
        return 1 + sum(expr_cost(a) for a in e.args)
    if isinstance(e, L.Load):
        return sum(expr_cost(i.value) for i in e.indirect)
    return 0


def simplify_body(e: L.Expr, ranges, memo=None) -> L.Expr:
    """`e` with every index expression simplified under the loop variables' ranges."""
    memo = {} if memo is None else memo
    if e in memo:
        return memo[e]
    out = e
    if isinstance(e, L.Load):
        ind = tuple(L.Indirect(i.var, simplify_body(i.value, ranges, memo), i.bound, i.wrap,
                               i.site) for i in e.indirect)
        index = simplify_index(e.index, ranges) if e.index.has(FloorDiv, ModIdx) else e.index
        out = L.Load(e.buf, index, e.dtype, ind)
    elif isinstance(e, L.Index) and e.expr.has(FloorDiv, ModIdx):
        out = L.Index(simplify_index(e.expr, ranges), e.dtype)
    elif isinstance(e, L.Op):
        out = L.Op(e.op, tuple(simplify_body(a, ranges, memo) for a in e.args), e.dtype)
    memo[e] = out
    return out


def loop_ranges(shape, sizes=()) -> dict:
    return {**dict(zip(ivars(len(shape)), shape)), **dict(zip(rvars(len(sizes)), sizes))}


def pointwise(dtype: DType, shape, fn: Callable[[Index], L.Expr], *parts: Lazy) -> Lazy:
    """A Lazy whose element is `fn(idx)`; cost estimated from one sample element."""
    probe = fn(ivars(len(shape)))
    return Lazy(dtype, tuple(shape), fn, None, expr_cost(probe))


@dataclass
class LowerCtx:
    #: lowers a whole region Graph to a LoopProgram (lowering.lower; control-flow rules call it
    #: for their branches and bodies)
    lower_graph: Callable = None
    buffers: list[L.Buffer] = field(default_factory=list)
    nodes: list[L.LoopNode] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    # nodes already emitted for one multi-result op (library calls: sort values + indices)
    shared: dict = field(default_factory=dict)
    indirect: list = field(default_factory=lambda: [0])  # index variables made so far
    #: attention calls may split their keys with a scratch output (CUDA; lowering.lower)
    attention_splits: bool = False

    def index_var(self) -> sympy.Symbol:
        """A fresh data-dependent index variable (x1, x2, ... per lowering: the same program
        always prints the same kernels, which the build caches rely on)."""
        self.indirect[0] += 1
        return sympy.Symbol(f"x{self.indirect[0]}", integer=True)

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def declare(self, name: str, dtype: DType, shape: Sequence[sympy.Expr], kind: str) -> None:
        self.names.add(name)
        self.buffers.append(L.Buffer(name, dtype, tuple(shape), kind))

    def buffer_lazy(self, name: str, dtype: DType, shape) -> Lazy:
        return from_view(dtype, shape, View(name, sympy.Integer(0), contiguous_strides(shape)))

    def realize(self, base: str, lz: Lazy, source: Sequence[str], kind: str = "temp") -> Lazy:
        name = self.unique(base)
        self.declare(name, lz.dtype, lz.shape, kind)
        body = simplify_body(lz.load(ivars(lz.rank)), loop_ranges(lz.shape))
        self.nodes.append(L.Compute(name, lz.dtype, lz.shape, body, None, tuple(source)))
        return self.buffer_lazy(name, lz.dtype, lz.shape)

    def cheap(self, lz: Lazy, base: str, source: Sequence[str], limit: int = 2) -> Lazy:
        """`lz` itself when re-evaluating it per use is cheap, else its materialised buffer.
        Rules that read an input several times (norms, softmax) call this first."""
        if lz.view is not None or lz.cost <= limit:
            return lz
        return self.realize(lz.origin or base, lz, source)

    def reduction(self, base: str, dtype: DType, out_shape, kind: str, sizes,
                  body: L.Expr, source: Sequence[str]) -> Lazy:
        name = self.unique(base)
        self.declare(name, dtype, out_shape, "temp")
        red = L.Reduce(kind, tuple(sizes))
        body = simplify_body(body, loop_ranges(out_shape, sizes))
        self.nodes.append(L.Compute(name, dtype, tuple(out_shape), body, red, tuple(source)))
        return self.buffer_lazy(name, dtype, out_shape)

    def is_whole_buffer(self, lz: Lazy) -> str | None:
        """The buffer name when `lz` reads one temp buffer entirely in row-major order."""
        v = lz.view
        if v is None or v.offset != 0:
            return None
        buf = next((b for b in self.buffers if b.name == v.buf), None)
        if buf is None or buf.kind != "temp":
            return None
        if sympy.expand(buf.numel - _numel(lz.shape)) != 0:
            return None
        if tuple(sympy.expand(s) for s in v.strides) != tuple(
                sympy.expand(s) for s in contiguous_strides(lz.shape)):
            return None
        return buf.name


def _numel(shape) -> sympy.Expr:
    out = sympy.Integer(1)
    for d in shape:
        out *= d
    return out

