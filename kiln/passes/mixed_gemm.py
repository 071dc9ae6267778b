"""CUDA builds with the Triton GEMM template allowed: GEMMs that read an int8 tensor converted
to their float type (weight-only quantisation) read the int8 tensor itself.

The pattern, on either GEMM operand (B first):

    matmul(x, V(mul(cast(q), s)))     q: int8 / uint8, cast to the GEMM's dtype
    matmul(x, V(cast(q)))             s: a scale that does not vary along K
                                      V: views that commute with the dequantisation

becomes `mixed_mm(x, V(q), V'(s))` (attrs: `side` "a" | "b", `scaled`): V re-applied to the
int8 tensor (views move bytes, so V(cast(q)) = cast(V(q))) and to the scale, padded to the
product's rank first (V'), which then broadcasts over the GEMM's output [*batch, M, N]. The
scale leaves the dot product: sum_k x[m, k] * (q[k, n] * s[n]) = s[n] * sum_k x[m, k] * q[k, n].
So the package keeps int8 weights (frontend/fold.py does not widen them) and the GEMM kernel
loads int8 tiles, converts them in registers and scales the float32 accumulator (lowering/
mixed.py, targets/cuda/gemm_template.py).

Where the pattern does not match (a scale varying along K, another producer, a dtype the
template does not take), or the Triton template is not allowed (cuBLAS has no float16 x int8
GEMM), nothing changes: the converted operand is materialised per run by a kiln kernel and
multiplied by any backend. GEMMs inside control-flow regions are left alone (they run on
cuBLAS). Pure: returns a new Graph (dead producers removed by passes/dce.py)."""

from __future__ import annotations

from dataclasses import replace

import sympy

from kiln.ir.graph import Graph, Node, TensorType
from kiln.passes.dce import dce

QUANT_DTYPES = ("int8", "uint8")  # integer storage the GEMM converts as it loads
GEMM_DTYPES = ("float16", "bfloat16", "float32")  # the Triton template's
VIEWS = ("permute", "expand")  # views re-applied to the int8 tensor and the scale
SCALE_OPS = ("mul",)  # dequantisation: x * s or s * x


def _one(e) -> bool:
    return sympy.sympify(e) == 1


def _match(x: str, dtype, prod: dict[str, Node], types) -> tuple | None:
    """(q, scale or None, views outermost first, rank of the dequantised value) when GEMM
    operand `x` dequantises q."""
    views = []
    while x in prod and prod[x].op in VIEWS:
        views.append(prod[x])
        x = prod[x].inputs[0]
    scale, rank = None, len(types[x].shape)
    if x in prod and prod[x].op in SCALE_OPS and len(prod[x].inputs) == 2:
        m = prod[x]
        casts = [k for k, y in enumerate(m.inputs) if y in prod and prod[y].op == "cast"
                 and types[prod[y].inputs[0]].dtype.name in QUANT_DTYPES]
        if not casts or m.type.dtype != dtype:
            return None
        x, scale = m.inputs[casts[0]], m.inputs[1 - casts[0]]
        if not types[scale].dtype.is_float:
            return None
    if x not in prod or prod[x].op != "cast" or types[x].dtype != dtype:
        return None
    q = prod[x].inputs[0]
    if types[q].dtype.name not in QUANT_DTYPES:
        return None
    if scale is not None and len(types[scale].shape) > len(types[x].shape):
        return None
    return q, scale, views, rank


class _Emit:
    def __init__(self, g: Graph):
        self.names = set(g.types())
        self.nodes: list[Node] = []

    def __call__(self, base: str, op: str, ins, t: TensorType, attrs=(), src="") -> str:
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        self.nodes.append(Node(name, op, tuple(ins), t, tuple(attrs), src))
        return name


def _scale_view(emit, mm: Node, scale: str, rank: int, views, types) -> tuple:
    """(name, shape) of the scale padded to the product's rank and viewed like the
    operand."""
    st = types[scale]
    shape = (1,) * (rank - len(st.shape)) + tuple(st.shape)
    src = mm.source or mm.name
    if len(shape) != len(st.shape):
        scale = emit(f"{mm.name}_scale", "view", [scale], TensorType(st.dtype, shape), (),
                     src)
    for v in reversed(views):
        if v.op == "permute":
            dims = tuple(v.attr("dims"))
            shape = tuple(shape[d] for d in dims)
            scale = emit(f"{mm.name}_scale", "permute", [scale], TensorType(st.dtype, shape),
                         (("dims", dims),), src)
        else:  # expand: broadcasting does it; only new leading dims are added
            out = types[v.name].shape
            if len(out) > len(shape):
                shape = (1,) * (len(out) - len(shape)) + shape
                scale = emit(f"{mm.name}_scale", "view", [scale],
                             TensorType(st.dtype, shape), (), src)
    return scale, shape


def _rewrite(emit, n: Node, side: str, found, types) -> bool:
    """Emit `n` as a mixed GEMM reading the int8 tensor on `side`; False (nothing emitted)
    when the scale varies along K."""
    q, scale, views, rank = found
    k = 1 if side == "b" else 0
    src = n.source or n.name
    before = len(emit.nodes)
    ins = []
    if scale is not None:
        scale, shape = _scale_view(emit, n, scale, rank, views, types)
        kdim = -2 if side == "b" else -1  # the operand's K dim
        if len(shape) != len(types[n.inputs[k]].shape) or not _one(shape[kdim]):
            del emit.nodes[before:]  # not a scale of the output
            return False
        ins = [scale]
    qv = q
    for v in reversed(views):
        qv = emit(f"{n.name}_q", v.op, [qv], TensorType(types[q].dtype, types[v.name].shape),
                  v.attrs, src)
    ops = [n.inputs[0], qv] if side == "b" else [qv, n.inputs[1]]
    emit.nodes.append(replace(n, op="mixed_mm", inputs=tuple(ops + ins),
                              attrs=(("side", side), ("scaled", scale is not None))))
    return True


def mixed_gemms(g: Graph) -> Graph:
    types = g.types()
    prod = {n.name: n for n in g.nodes}
    emit = _Emit(g)
    changed = False
    for n in g.nodes:
        done = False
        if n.op == "matmul" and len(n.inputs) == 2 and n.type.dtype.name in GEMM_DTYPES:
            for side, k in (("b", 1), ("a", 0)):
                found = _match(n.inputs[k], n.type.dtype, prod, types)
                if found is not None and _rewrite(emit, n, side, found, types):
                    done = True
                    break
        if not done:
            emit.nodes.append(n)
        changed = changed or done
    if not changed:
        return g
    return dce(replace(g, nodes=tuple(emit.nodes)))
