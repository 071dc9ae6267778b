"""Lowering rules for data-dependent indexing: embedding, advanced indexing (index.Tensor,
index_select) and gather. Each produces a Load whose index uses `Indirect` temporaries; the
generated code wraps negative indices and rejects out-of-range ones at run time."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Index, Lazy, LowerCtx
from kiln.lowering.pointwise import broadcast_index
from kiln.ops.build import cast


def _base(ctx: LowerCtx, x: Lazy, name: str) -> Lazy:
    return x if x.view is not None else ctx.realize(name + "_src", x, (name,))


def indirect_load(ctx: LowerCtx, x: Lazy, src_index: list, replace: dict[int, L.Expr],
                  wrap: bool = True, site: str = "") -> L.Expr:
    """Load x at `src_index`, where dims in `replace` take a data-dependent index (each a
    fresh variable of this lowering: `ctx.index_var`). `site`: the node lowered (what an
    index out of range names, wherever the load is fused)."""
    inds = []
    idx = list(src_index)
    for d, value in replace.items():
        v = ctx.index_var()
        inds.append(L.Indirect(v, cast(value, dtypes.int64), x.shape[d], wrap, site))
        idx[d] = v
    ld = x.load(tuple(idx))
    assert isinstance(ld, L.Load)
    return L.Load(ld.buf, ld.index, ld.dtype, ld.indirect + tuple(inds))


def lower_embedding(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    w, ids = args
    w = _base(ctx, w, node.name)
    k = ids.rank

    def fn(idx: Index) -> L.Expr:
        return indirect_load(ctx, w, [None, idx[k]], {0: ids.load(tuple(idx[:k]))}, wrap=False,
                             site=node.name)

    return Lazy(w.dtype, node.type.shape, fn, None, 1)


def lower_index(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x, *indices = args
    x = _base(ctx, x, node.name)
    positions = node.attr("positions")
    out_shape = node.type.shape
    adjacent = list(positions) == list(range(positions[0], positions[0] + len(positions)))
    bshape = _broadcast_shapes([i.shape for i in indices])
    nb = len(bshape)
    first = positions[0] if adjacent else 0

    def fn(idx: Index) -> L.Expr:
        bidx = tuple(idx[first:first + nb])
        rest = list(idx[:first]) + list(idx[first + nb:])
        src: list = []
        it = iter(rest)
        for d in range(x.rank):
            src.append(None if d in positions else next(it))
        repl = {d: t.load(broadcast_index(bidx, t.shape, bshape))
                for d, t in zip(positions, indices)}
        return indirect_load(ctx, x, src, repl, wrap=not node.attr("select", False),
                             site=node.name)

    if len(out_shape) != x.rank - len(positions) + nb:
        raise UnsupportedError(f"index pattern of node {node.name} (shape {out_shape})")
    return Lazy(x.dtype, out_shape, fn, None, len(indices))


def _broadcast_shapes(shapes):
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        size = sympy.Integer(1)
        for s in shapes:
            j = k - (rank - len(s))
            if j >= 0 and s[j] != 1:
                size = s[j]
        out.append(size)
    return tuple(out)


def lower_gather(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x, ids = args
    x = _base(ctx, x, node.name)
    dim = node.attr("dim")

    def fn(idx: Index) -> L.Expr:
        src = list(idx)
        return indirect_load(ctx, x, src, {dim: ids.load(idx)}, wrap=False, site=node.name)

    return Lazy(x.dtype, node.type.shape, fn, None, 1)
