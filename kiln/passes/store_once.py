"""Store-once of GEMM sums (issue 17.3): which pointwise values lowering must materialise so
that a GEMM can take them as its epilogue.

Lowering inlines a cheap pointwise value into each of its consumers (lowering/__init__.py:
at most `CHEAP` operators are recomputed per use). For a residual add `h = x + matmul(...)`
read by the next norm and by the next residual add, that leaves the GEMM's raw result read by
several kernels, each recomputing `x + y`: the GEMM cannot absorb the add as its epilogue
(gemm/fuse.py takes an epilogue only when nothing else reads the GEMM's result), so the sum
is recomputed by every reader and the GEMM's result is stored besides.

Rule, in Graph IR terms: a pointwise node P (an op of kiln/ops ROWS) with two or more users
that reads the result of a `matmul` (or `mixed_mm`) M, directly or through `view`s, where P
(through those views) is the only reader of M, and whose uses do not meet again in one
pointwise node, is materialised. Uses meet again when following each user of P along nodes of
one user each (pointwise ops and views, stopping before any other op and at graph outputs)
ends at the same node for all of them: then lowering inlines P into that one node, which the
GEMM takes whole as its epilogue (`where(t > 0, t, 0.1 * t)` of `t = x W + b`, a decomposed
GELU or SiLU). Where they do not (a residual sum read by the next norm's reduction and by the
next residual add), the GEMM's one reader is P's Compute, which reads the GEMM at its own
element: P becomes the GEMM's epilogue (a GEMV with a residual add at M = 1), stored once, and
P's users read it. Nothing is recomputed in more places than before (P's users load P instead
of its terms), and no GEMM result is stored in addition, so the rule costs at most one store
of P where no GEMM fuses.

`gemm_sums(graph)` is pure: the names of the nodes to materialise; `lower(graph, realize=)`
takes them."""

from __future__ import annotations

from kiln.ir.graph import Graph
from kiln.ops import ROWS

VIEWS = ("view",)
GEMMS = ("matmul", "mixed_mm")  # (mixed_mm: GEMMs of int8 / int4 weights, passes/mixed_gemm.py,
#                                targets/cuda/quant.py)


def gemm_sums(g: Graph) -> frozenset[str]:
    nodes = {n.name: n for n in g.nodes}
    users = g.users()
    readers: dict[str, list[str]] = {}
    for n in g.nodes:
        for x in n.inputs:
            readers.setdefault(x, []).append(n.name)

    def gemm_of(name: str, via: str) -> str | None:
        """The matmul `name` is (through views read only by the next), or None."""
        while True:
            n = nodes.get(name)
            if n is None:
                return None
            if readers.get(name, []) != [via] or name in g.outputs:
                return None
            if n.op in GEMMS:
                return name
            if n.op not in VIEWS:
                return None
            via, name = name, n.inputs[0]

    def end(u: str) -> str:
        """Where the single-user chain of pointwise ops and views from `u` ends."""
        while nodes[u].op in ROWS or nodes[u].op in VIEWS:
            rs = readers.get(u, [])
            if len(rs) != 1 or u in g.outputs or (nodes[rs[0]].op not in ROWS and
                                                  nodes[rs[0]].op not in VIEWS):
                break
            u = rs[0]
        return u

    out = set()
    for n in g.nodes:
        if n.op not in ROWS or users.get(n.name, 0) < 2:
            continue
        if any(gemm_of(x, n.name) for x in dict.fromkeys(n.inputs)) and \
                len({end(u) for u in readers.get(n.name, [])}) > 1:
            out.add(n.name)
    return frozenset(out)
