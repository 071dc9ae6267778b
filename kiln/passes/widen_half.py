"""Narrow floats (float16, bfloat16, float8_e4m3fn, float8_e5m2 and the two fnuz variants) are
storage types: no kernel computes in them ("half" below stands for all of them).

This pass rewrites the graph so that every op that computes reads float32 and writes float32:
a half operand is cast to float32 first, and a half result is computed in float32 under the
name `<node>_f32`, then cast back to the half type under the node's own name (so consumers,
outputs and mutations keep their names). Casts round on store, after each aten op, like eager
on the CPU, which computes most half ops in float32 and rounds each op's result; the steps of
one aten op (the nodes its converter emitted, sharing `source`) stay float32 between them.
Ops that only move data (views; index_put without accumulate) keep the half type: their loads
and stores copy 16-bit values.
GEMMs and convolutions thereby run in float32 on converted operands.

Pure: returns a new Graph."""

from __future__ import annotations

from dataclasses import replace

from kiln.ir import dtypes
from kiln.ir.graph import Graph, Node, TensorType, fresh_name

# ops that only move elements: they never compute on a value, so they keep half types (a
# gather from a half embedding table reads its rows, not a float32 copy of the whole table)
MOVES = frozenset({"view", "permute", "expand", "slice", "select", "cast", "embedding",
                   "gather", "index"})
# ops that read and write half types themselves: kiln_qgemm.h's bf16 GEMM
NATIVE = frozenset({"qgemm"})


def _half_operands(n: Node, types) -> frozenset[int]:
    """Operands `n` reads in their half type: fused attention's bfloat16 keys and values
    (kiln_attention.h converts them as it loads them, so a bf16 KV cache is not widened whole
    on every decode step); q, the mask and the result are float32 as for other ops."""
    if (n.op == "attention" and len(n.inputs) >= 3
            and types[n.inputs[1]].dtype == types[n.inputs[2]].dtype == dtypes.bfloat16):
        return frozenset((1, 2))
    return frozenset()


def widen_half(g: Graph) -> Graph:
    types = g.types()
    if not any(dtypes.is_narrow(t.dtype) for t in types.values()):
        return g
    nodes: list[Node] = []
    widened: dict[str, str] = {}  # half value -> its float32 cast
    names = set(types)

    def as_f32(x: str, source: str) -> str:
        if x not in widened:
            name = fresh_name(f"{x}_f32", names)
            t = types[x]
            nodes.append(Node(name, "cast", (x,), TensorType(dtypes.float32, t.shape), (),
                              source))
            widened[x] = name
        return widened[x]

    inner = _internal(g)
    for n in g.nodes:
        if n.op in MOVES or n.op in NATIVE or _storing_put(n, types):
            nodes.append(n)
            continue
        keep = _half_operands(n, types)
        ins = tuple(as_f32(x, n.source) if dtypes.is_narrow(types[x].dtype) and i not in keep
                    else x for i, x in enumerate(n.inputs))
        if not dtypes.is_narrow(n.type.dtype):
            nodes.append(replace(n, inputs=ins))
            continue
        if n.name in inner:  # a step inside one aten op: stays float32, rounds with the op
            t = TensorType(dtypes.float32, n.type.shape)
            types[n.name] = t
            nodes.append(replace(n, inputs=ins, type=t))
            continue
        wide = fresh_name(f"{n.name}_f32", names)
        nodes.append(replace(n, name=wide, inputs=ins,
                             type=TensorType(dtypes.float32, n.type.shape)))
        nodes.append(Node(n.name, "cast", (wide,), n.type, (), n.source))
    return replace(g, nodes=tuple(nodes))


def _storing_put(n: Node, types) -> bool:
    """index_put without accumulate, its values of its own dtype: it only stores elements
    (a KV cache's index_copy_), so it keeps a half type (the state is then updated in place,
    memory/inplace.py, not widened, scattered and narrowed whole)."""
    return (n.op == "index_put" and not n.attr("accumulate") and dtypes.is_narrow(n.type.dtype)
            and types[n.inputs[1]].dtype == n.type.dtype)


def _internal(g: Graph) -> set[str]:
    """Computing nodes whose every user belongs to the same aten op (same `source`), e.g. the
    GEMM before a convolution's bias add: eager rounds only the op's final result."""
    users: dict[str, list[Node]] = {}
    for n in g.nodes:
        for x in n.inputs:
            users.setdefault(x, []).append(n)
    kept = set(g.outputs) | {v for _, v in g.mutations}
    return {n.name for n in g.nodes
            if n.op not in MOVES and n.name not in kept and n.source and users.get(n.name)
            and all(u.source == n.source and u.op not in MOVES for u in users[n.name])}
