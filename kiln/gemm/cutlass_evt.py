"""Epilogue visitor trees (CUTLASS 3.x, sm_90): a GEMM's absorbed epilogue as one fused
CUTLASS kernel.

Input: a Loop IR `Gemm` and the epilogue member `gemm/fuse.py` absorbs for it (a
pointwise `Compute` reading the GEMM's result at its own element; the same description the
Triton template prints). Output: an `Evt` (a tree of visitor nodes, the tensors it reads and
the output dtype) or an `EvtRefusal` saying what CUTLASS cannot express; then the epilogue
stays a kiln kernel after a plain CUTLASS GEMM, and the autotuning report says why.

Values follow the Triton template's rules (kiln/targets/cuda/gemm_template.py): the
accumulator is rounded to the GEMM's dtype (what its stored result would hold), every operator
computes in float32, and a value is rounded to 16 bits only where it is explicitly cast and
where it is stored (the root rounds to the output dtype, CUTLASS's ElementD).

Node kinds, in CUTLASS's coordinates (CUTLASS computes kiln's row-major C[M, N] as the
column-major C^T[N, M], so CUTLASS's M is kiln's N):

| kiln load                               | node                                    |
| --------------------------------------- | --------------------------------------- |
| the GEMM result                         | Sm90AccFetch, rounded by an Identity     |
| a [M, N] tensor at the GEMM's element   | Sm90SrcFetch (the kernel's C operand)    |
| a vector over N (bias of a Linear)      | Sm90ColBroadcast (one value per C^T row) |
| a vector over M                         | Sm90RowBroadcast                        |
| a 0-d tensor                            | Sm90ScalarBroadcast from a pointer      |
| a float constant                        | Sm90ScalarBroadcast of the value        |

Operators map through `FUNCTORS` (one row per form of kiln's op table, kiln/ops/table.py:
the CUTLASS functor template and arity). A form whose body is more than one operator is
recognised by matching the epilogue against the row's own body (kiln/ops/match.py), before
single operators: erf-GELU (form `gelu`: CUTLASS's `GELU`, exact erf for float, as torch's
default gelu), tanh-GELU (form `gelu_tanh`: kiln's own functor with `tanhf`: CUTLASS's
`GELU_taylor` uses the approximate hardware tanh) and clamp with both bounds (form `clamp`:
`minimum(maximum(x, a), b)`, CUTLASS's `Clamp`, NaN-propagating like torch's clamp)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.simplify import fold_divmod
from kiln.ir.sym import contiguous_strides, ivars, linear_index, unravel
from kiln.ops import ROWS, form, is_primitive, match
import torch

#: form of kiln's op table (kiln/ops/table.py; "identity": the rounding node, no form) ->
#: (CUTLASS functor template, arity). Every functor is applied to Array<float, N>
#: (Sm90Compute converts its inputs to float first). The torch twin of each, for the
#: profiling child's reference, is its row's (`_torch_fn`).
FUNCTORS: dict[str, tuple[str, int]] = {
    "identity": ("cutlass::epilogue::thread::Identity", 1),
    "add": ("cutlass::plus", 2),
    "sub": ("cutlass::minus", 2),
    "mul": ("cutlass::multiplies", 2),
    "div": ("cutlass::divides", 2),
    "neg": ("cutlass::negate", 1),
    "maximum": ("kiln_evt::maximum_nan", 2),
    "minimum": ("kiln_evt::minimum_nan", 2),
    "relu": ("cutlass::epilogue::thread::ReLu", 1),
    "clamp": ("cutlass::epilogue::thread::Clamp", 1),
    "gelu": ("cutlass::epilogue::thread::GELU", 1),
    "gelu_tanh": ("kiln_evt::gelu_tanh", 1),
    "exp": ("kiln_evt::exp", 1),
    "tanh": ("kiln_evt::tanh", 1),
    "sigmoid": ("kiln_evt::sigmoid", 1),
    "erf": ("kiln_evt::erf", 1),
}

#: kiln's own functors (namespace kiln_evt, printed into the source only when used); the
#: unary ones loop over the Array<float, N> fragments Sm90Compute hands them.
_KILN_BINARY = {
    "maximum_nan": "cutlass::maximum<T, true>{}(a, b)",
    "minimum_nan": "cutlass::minimum<T, true>{}(a, b)",
}
_KILN_UNARY = {  # of one float x
    "exp": "expf(x)",
    "tanh": "tanhf(x)",
    "sigmoid": "1.0f / (1.0f + expf(-x))",
    "erf": "erff(x)",
    "gelu_tanh": "0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)))",
}

#: the fusable forms that are not one Loop IR operator, matched first (ops.match)
COMPOUND = tuple(f for f in FUNCTORS if f != "identity" and not is_primitive(f))

ELEMENT = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t", "float32": "float"}
FLOATS = tuple(ELEMENT)
MAX_NODES = 40  # a larger tree is refused (compile time and registers grow with it)


@dataclass(frozen=True)
class Node:
    kind: str  # "acc" | "src" | "col" | "row" | "scalar" | "const" | "compute"
    fn: str = ""  # compute: a key of FUNCTORS
    args: tuple = ()  # compute: child nodes
    out: str = "float32"  # compute: the dtype it rounds its result to
    operand: int = -1  # src / col / row / scalar: index into Evt.operands
    value: float = 0.0  # const
    params: tuple = ()  # clamp: (lower, upper)

    def text(self, operands, root: bool = False) -> str:
        if self.kind == "compute":
            p = f"[{','.join(map(repr, self.params))}]" if self.params else ""
            r = "" if self.out == "float32" or root else f"->{self.out}"
            return f"{self.fn}{p}({','.join(a.text(operands) for a in self.args)}){r}"
        if self.kind == "const":
            return repr(float(self.value))
        if self.kind == "acc":
            return "acc"
        o = operands[self.operand]
        return f"{self.kind}{self.operand}:{o.dtype}" + (f"/{o.align}" if o.align > 1 else "")

    def count(self) -> int:
        return 1 + sum(a.count() for a in self.args)


@dataclass(frozen=True)
class Operand:
    role: str  # "src" | "col" | "row" | "scalar"
    buf: str
    offset: sympy.Expr  # element offset of the first value read
    dtype: str
    align: int = 1  # col / row: the vector width its loads may use (elements)


@dataclass(frozen=True)
class Evt:
    root: Node
    operands: tuple[Operand, ...]
    out_dtype: str
    gemm_dtype: str

    @property
    def key(self) -> str:
        """The tree as text (no buffer names): part of the autotuning problem and cache key."""
        return f"evt {self.root.text(self.operands, True)} -> {self.out_dtype}"

    @property
    def src(self) -> Operand | None:
        return next((o for o in self.operands if o.role == "src"), None)

    @property
    def ext(self) -> tuple[Operand, ...]:
        """The operands passed through the entry's `ext` pointer array (all but C)."""
        return tuple(o for o in self.operands if o.role != "src")

    def to_json(self) -> dict:
        return {"root": _node_json(self.root), "out": self.out_dtype, "gemm": self.gemm_dtype,
                "operands": [[o.role, o.dtype] for o in self.operands]}


@dataclass(frozen=True)
class EvtRefusal:
    reason: str


def _node_json(n: Node) -> dict:
    d = {"kind": n.kind}
    if n.kind == "compute":
        d.update(fn=n.fn, out=n.out, args=[_node_json(a) for a in n.args],
                 params=list(n.params))
    elif n.kind == "const":
        d["value"] = n.value
    elif n.kind != "acc":
        d["operand"] = n.operand
    return d


class _Refuse(Exception):
    pass


class _Builder:
    def __init__(self, g: L.Gemm, epi: L.Compute, names: dict, m, n, b):
        self.g, self.epi, self.names = g, epi, names
        self.m, self.n, self.b = m, n, b
        self.operands: list[Operand] = []

    def operand(self, role: str, buf: str, offset, dtype: str) -> int:
        extent = {"col": self.g.n, "row": self.g.m}.get(role)
        op = Operand(role, buf, offset, dtype, _align(offset, dtype, extent) if extent else 1)
        if op in self.operands:
            return self.operands.index(op)
        if role == "src" and any(o.role == "src" for o in self.operands):
            raise _Refuse("it reads two full [M, N] tensors; a CUTLASS kernel reads one (as C)")
        self.operands.append(op)
        return len(self.operands) - 1

    def load(self, ld: L.Load) -> Node:
        g = self.g
        if ld.indirect:
            raise _Refuse(f"it gathers from {ld.buf} (an indirect index)")
        if ld.buf == g.name:
            return Node("compute", "identity", (Node("acc"),), g.dtype.name)
        if ld.dtype.name not in FLOATS:
            raise _Refuse(f"it reads {ld.buf} of dtype {ld.dtype.name} (CUTLASS epilogue "
                          f"operands here are {', '.join(FLOATS)})")
        idx = sympy.expand(fold_divmod(sympy.sympify(ld.index).xreplace(self.names)))
        m, n, b = self.m, self.n, self.b
        off = idx.xreplace({m: 0, n: 0, b: 0})
        cm, cn, cb = (sympy.sympify(sympy.expand(idx.coeff(v))) for v in (m, n, b))
        off = sympy.sympify(off)
        loopish = {m, n, b}
        if sympy.expand(idx - off - cm * m - cn * n - cb * b) != 0 or any(
                c.free_symbols & loopish for c in (off, cm, cn, cb)):
            raise _Refuse(f"it reads {ld.buf} at {ld.index}, not an affine map of the GEMM's "
                          "element")
        batch = g.m * g.n if g.batch else 0
        zero = lambda c: sympy.simplify(c) == 0  # noqa: E731
        if sympy.simplify(cn - 1) == 0 and sympy.simplify(cm - g.n) == 0 and \
                (not g.batch or sympy.simplify(cb - batch) == 0) and zero(off):
            return Node("src", operand=self.operand("src", ld.buf, off, ld.dtype.name))
        if not zero(cb) and g.batch:
            raise _Refuse(f"it reads {ld.buf} differently per batch entry and not as the "
                          "GEMM's element")
        if sympy.simplify(cn - 1) == 0 and zero(cm):
            return Node("col", operand=self.operand("col", ld.buf, off, ld.dtype.name))
        if sympy.simplify(cm - 1) == 0 and zero(cn):
            return Node("row", operand=self.operand("row", ld.buf, off, ld.dtype.name))
        if zero(cm) and zero(cn):
            return Node("scalar", operand=self.operand("scalar", ld.buf, off, ld.dtype.name))
        raise _Refuse(f"it reads {ld.buf} at {ld.index}: neither the GEMM's element, a vector "
                      "over its rows or columns, nor a scalar")

    def node(self, e) -> Node:
        if isinstance(e, L.Const):
            if e.dtype.name == "bool":
                raise _Refuse(f"it uses the boolean constant {e.value!r}")
            return Node("const", value=float(e.value))
        if isinstance(e, L.Load):
            return self.load(e)
        if isinstance(e, L.Index):
            raise _Refuse("it uses an element's index as a value")
        if e.dtype.name not in FLOATS:
            raise _Refuse(f"operator {e.op} computes {e.dtype.name} (CUTLASS epilogues here "
                          "compute in float)")
        for name in COMPOUND:
            m = match(name, e)
            if m is not None:
                return Node("compute", name, tuple(self.node(x) for x in m.operands),
                            params=m.params)
        if e.op == "cast":
            x = e.args[0]
            if x.dtype.name not in FLOATS:
                raise _Refuse(f"it casts from {x.dtype.name}")
            child = self.node(x)
            if e.dtype.name == "float32" or e.dtype == x.dtype:
                return child  # values are float32 already: nothing rounds
            return Node("compute", "identity", (child,), e.dtype.name)
        m = match(e.op, e) if e.op in FUNCTORS and e.op not in COMPOUND else None
        if m is None:
            raise _Refuse(f"operator {e.op} has no CUTLASS epilogue functor in kiln's table")
        return Node("compute", e.op, tuple(self.node(x) for x in m.operands))


def _names(g: L.Gemm, epi: L.Compute, m, n, b) -> dict:
    """The epilogue's index variables as expressions of the GEMM element (b, m, n)."""
    iv = ivars(len(epi.shape))
    same = len(epi.shape) == len(g.shape) and all(
        sympy.simplify(sympy.sympify(x) - y) == 0 for x, y in zip(epi.shape, g.shape))
    if same:
        return {**({iv[0]: b} if g.batch else {}), iv[-2]: m, iv[-1]: n}
    if not g.batch and sympy.simplify(sympy.sympify(epi.shape[-1]) - g.n) == 0:
        lead = unravel(m, epi.shape[:-1])
        return {**dict(zip(iv[:-1], lead)), iv[-1]: n}
    raise _Refuse("its shape regroups the GEMM's dims in a way the visitor tree does not "
                  "index")


def from_epilogue(g: L.Gemm, epi: L.Compute) -> Evt | EvtRefusal:
    """The visitor tree computing epilogue `epi` of GEMM `g`, or why there is none."""
    m, n, b = (sympy.Symbol(f"kiln_evt_{v}", integer=True, nonnegative=True)
               for v in "mnb")
    try:
        if g.dtype.name not in ("float16", "bfloat16"):
            raise _Refuse(f"the GEMM is {g.dtype.name}")
        if len(g.batch) > 1:
            raise _Refuse("the GEMM has more than one batch dim")
        if g.mixed is not None or g.lowp is not None:
            raise _Refuse("the GEMM's operands are of another dtype than its result")
        if epi.reduce is not None:
            raise _Refuse("the epilogue reduces")
        if epi.dtype.name not in FLOATS:
            raise _Refuse(f"the output dtype is {epi.dtype.name}")
        bld = _Builder(g, epi, _names(g, epi, m, n, b), m, n, b)
        root = bld.node(epi.body)
        if root.kind != "compute":
            root = Node("compute", "identity", (root,))
        root = Node("compute", root.fn, root.args, epi.dtype.name, params=root.params)
        if root.count() > MAX_NODES:
            raise _Refuse(f"its visitor tree has {root.count()} nodes (kiln's limit: "
                          f"{MAX_NODES})")
        _check_identity(g, epi, m, n, b)
        return Evt(root, tuple(bld.operands), epi.dtype.name, g.dtype.name)
    except _Refuse as r:
        return EvtRefusal(f"epilogue {epi.name} stays a separate kernel: {r}")


def _check_identity(g, epi, m, n, b) -> None:
    """The epilogue's element is the GEMM's (same row-major position), so D is written with
    the GEMM's strides."""
    flat = linear_index(ivars(len(epi.shape)), contiguous_strides(epi.shape))
    want = linear_index([b, m, n] if g.batch else [m, n], contiguous_strides(g.shape))
    got = fold_divmod(sympy.sympify(flat).xreplace(_names(g, epi, m, n, b)))
    if sympy.simplify(got - want) != 0:
        raise _Refuse("it does not store at the GEMM's element")


# -- C++ ------------------------------------------------------------------------------------

def _literal(v: float) -> str:
    if v != v:
        return "NAN"
    if v in (math.inf, -math.inf):
        return "INFINITY" if v > 0 else "-INFINITY"
    return f"{float(v)!r}f"


def _align(offset, dtype: str, extent=None) -> int:
    """Vector width (elements) a broadcast load may use: 16 bytes, as far as the first
    element's offset and the vector's length allow (a vector load is predicated on its first
    element only, so the length must be a multiple of it)."""
    bits = dtypes.dtype(dtype).bits
    a = 128 // bits
    for v in (offset, extent):
        if v is None:
            continue
        v = sympy.sympify(v)
        if not v.is_Integer:
            return 1
        while a > 1 and int(v) % a:
            a //= 2
    return a


def render_types(evt: Evt, tile: str) -> tuple[str, str, str]:
    """(functor definitions, the EVT type, its arguments expression). `tile`: the CTA tile
    shape (cute::Shape<...>). Arguments read operand k of `ext` (the C entry's array of
    operand pointers, C excluded) as `ext[k]`."""
    used: set[str] = set()
    ext_index = {id(o): k for k, o in enumerate(evt.ext)}
    fus = "cutlass::epilogue::fusion::"

    def ty(nd: Node, depth: int = 1) -> str:
        if nd.kind == "acc":
            return f"{fus}Sm90AccFetch"
        if nd.kind == "const":
            return f"{fus}Sm90ScalarBroadcast<float, cute::Stride<cute::_0, cute::_0, int64_t>>"
        if nd.kind != "compute":
            o = evt.operands[nd.operand]
            el = ELEMENT[o.dtype]
            if nd.kind == "src":
                return f"{fus}Sm90SrcFetch<{el}>"
            if nd.kind == "scalar":
                return f"{fus}Sm90ScalarBroadcast<{el}, cute::Stride<cute::_0, cute::_0, int64_t>>"
            if nd.kind == "col":  # over CUTLASS's M = kiln's N
                return (f"{fus}Sm90ColBroadcast<0, {tile}, {el}, float, cute::Stride<cute::_1, "
                        f"cute::_0, int64_t>, {o.align}>")
            return (f"{fus}Sm90RowBroadcast<0, {tile}, {el}, float, cute::Stride<cute::_0, "
                    f"cute::_1, int64_t>, {o.align}>")
        fn = FUNCTORS[nd.fn][0]
        if fn.startswith("kiln_evt::"):
            used.add(fn.split("::")[1])
        pad = "\n" + "  " * depth
        kids = "".join(f",{pad}{ty(a, depth + 1)}" for a in nd.args)
        return (f"{fus}Sm90EVT<{fus}Sm90Compute<{fn}, {ELEMENT[nd.out]}, float, "
                f"cutlass::FloatRoundStyle::round_to_nearest>{kids}>")

    def args(nd: Node, depth: int) -> str:
        if nd.kind in ("acc", "src"):
            return "{}"
        if nd.kind == "const":
            return f"{{{{{_literal(nd.value)}}}}}"
        if nd.kind != "compute":
            o = evt.operands[nd.operand]
            ptr = f"static_cast<const {ELEMENT[o.dtype]} *>(ext[{ext_index[id(o)]}])"
            return f"{{{{}}, {{{ptr}}}}}" if nd.kind == "scalar" else f"{{{ptr}}}"
        pad = "\n" + "  " * (depth + 1)
        own = "{" + ", ".join(_literal(p) for p in nd.params) + "}" if nd.params else "{}"
        kids = [args(a, depth + 1) for a in nd.args]
        return "{" + pad + ("," + pad).join(kids + [own]) + "}"

    t = ty(evt.root)
    defs = [_functor(name) for name in sorted(used)]
    return "\n".join(defs), t, args(evt.root, 1)


def _functor(name: str) -> str:
    if name in _KILN_BINARY:
        return (f"template <class T> struct {name} {{\n"
                f"  CUTLASS_HOST_DEVICE T operator()(T const &a, T const &b) const {{\n"
                f"    return {_KILN_BINARY[name]};\n  }}\n}};")
    return (f"template <class T> struct {name} {{  // elementwise over an Array<float, N>\n"
            f"  CUTLASS_HOST_DEVICE T operator()(T const &v) const {{\n"
            f"    T y;\n    CUTLASS_PRAGMA_UNROLL\n"
            f"    for (int i = 0; i < T::kElements; ++i) {{\n"
            f"      const float x = v[i];\n      y[i] = {_KILN_UNARY[name]};\n    }}\n"
            f"    return y;\n  }}\n}};")


# -- reference (the profiling child checks fused candidates against it) ---------------------

def _torch_fn(fn: str, params=()):
    """The torch twin of functor `fn` (a form's row's, its open attributes set to `params`)."""
    if fn == "identity":
        return lambda x: x
    f = form(fn)
    twin, attrs = ROWS[f.row].torch, f.values(params)
    return lambda *xs: twin(*xs, **attrs)


def evaluate_torch(tree: dict, acc, operands: list, m: int, n: int):
    """The tree (`Evt.to_json()`) evaluated with torch in float32, as the kernel computes it:
    `acc` the float32 product [B, M, N]; `operands` the tensors of the tree's operands in
    order (src [B, M, N], col [N], row [M], scalar [1])."""

    def ev(nd):
        k = nd["kind"]
        if k == "acc":
            return acc.float()
        if k == "const":
            return torch.tensor(nd["value"], dtype=torch.float32, device=acc.device)
        if k != "compute":
            t = operands[nd["operand"]].float()
            return t.reshape(-1, m, n) if k == "src" else t.reshape(m, 1) if k == "row" else \
                t.reshape(n) if k == "col" else t.reshape(())
        xs = [ev(a) for a in nd["args"]]
        y = _torch_fn(nd["fn"], nd["params"])(*xs)
        return y.to(dtypes.dtype(nd["out"]).torch).float()
    return ev(tree["root"]).to(dtypes.dtype(tree["out"]).torch)
