"""CPU builds: low-precision GEMMs become ordinary float32 / int32 graph nodes.

`int_mm(a, b)` (int8 operands) becomes `matmul` with the int32 result type, which lowers to
kiln's exact integer GEMM (each product and the sum in int32, as eager). `scaled_mm(a, b, sa,
sb[, bias])` becomes, in float32, `(float(a) * sa) @ (float(b) * sb) [+ bias]` cast to the
output dtype, the order eager's CPU kernel computes in (tensor-wise results match it bit for
bit where the GEMM sums in the same order). Row-wise scales ([M, 1] and [1, N]) broadcast
the same way. CUDA builds keep both ops (lowering/lowp.py calls cuBLASLt).

Pure: returns a new Graph; nodes keep their names (the last node of each expansion)."""

from __future__ import annotations

from dataclasses import replace

from kiln.ir import dtypes
from kiln.ir.graph import Graph, Node, TensorType


def expand_lowp(g: Graph) -> Graph:
    if not any(n.op in ("int_mm", "scaled_mm") for n in g.nodes):
        return g
    types = g.types()
    names = set(types)
    nodes: list[Node] = []

    def emit(base: str, op: str, ins, t: TensorType, src: str) -> str:
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.add(name)
        nodes.append(Node(name, op, tuple(ins), t, (), src))
        return name

    for n in g.nodes:
        if n.op == "int_mm":
            nodes.append(replace(n, op="matmul"))
            continue
        if n.op != "scaled_mm":
            nodes.append(n)
            continue
        a, b, sa, sb, *bias = n.inputs
        src = n.source or n.name
        f32 = dtypes.float32

        def scaled(x: str, s: str, tag: str) -> str:
            t = TensorType(f32, types[x].shape)
            wide = emit(f"{n.name}_{tag}_f32", "cast", [x], t, src)
            return emit(f"{n.name}_{tag}_scaled", "mul", [wide, s], t, src)

        acc_t = TensorType(f32, n.type.shape)
        acc = emit(f"{n.name}_acc", "matmul", [scaled(a, sa, "a"), scaled(b, sb, "b")], acc_t,
                   src)
        if bias:
            x = bias[0]
            if types[x].dtype != f32:
                x = emit(f"{n.name}_bias_f32", "cast", [x], TensorType(f32, types[x].shape), src)
            acc = emit(f"{n.name}_biased", "add", [acc, x], acc_t, src)
        # the node's own name rounds to the output dtype (a copy for float32)
        nodes.append(replace(n, op="cast", inputs=(acc,), attrs=()))
    return replace(g, nodes=tuple(nodes))
