"""Lowering of `aten` nodes (the ATen fallback, see frontend/fallback.py) to `AtenCall`.

Tensor arguments are passed to ATen as strided views of kiln's buffers: an affine view (a
transpose, a slice, an expand) costs nothing; any other value is materialised first. The
result is copied by ATen into a contiguous kiln buffer, so everything downstream is ordinary."""

from __future__ import annotations

from dataclasses import replace

from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Lazy, LowerCtx


def _tensor_arg(ctx: LowerCtx, node: Node, lz: Lazy, k: int) -> L.AtenTensor:
    if lz.view is None:
        lz = ctx.realize(f"{node.name}_arg{k}", lz, (node.source or node.name,))
    v = lz.view
    return L.AtenTensor(v.buf, lz.dtype, tuple(lz.shape), tuple(v.strides), v.offset)


def _arg(ctx: LowerCtx, node: Node, a: L.AtenArg, args: list[Lazy]) -> L.AtenArg:
    """Graph IR argument `a` with its tensor operands made strided views of buffers."""
    return L.map_aten_tensors(a, lambda t: _tensor_arg(ctx, node, args[t.index], t.index))


def lower_read_size(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    src = args[0]
    if src.view is None or src.view.offset != 0:
        src = ctx.realize(f"{node.name}_value", src, (node.source or node.name,))
    ((_, symbol, hi),) = node.attr("binds")
    name = ctx.unique(node.name)
    ctx.declare(name, node.type.dtype, (), "temp")
    ctx.nodes.append(L.ReadSize(name, node.type.dtype, src.view.buf, symbol, node.attr("lo"), hi,
                                (node.source or node.name,)))
    return ctx.buffer_lazy(name, node.type.dtype, ())


def lower_aten(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    name = ctx.unique(node.name)
    t = node.type
    ctx.declare(name, t.dtype, t.shape, "temp")
    binds = tuple(node.attr("binds", ()))
    key = ("aten", node.attr("aten_op"), node.attr("overload"), repr(node.attr("args")),
           tuple(node.inputs))
    at = ctx.shared.get(key) if node.attr("n_results") > 1 else None
    if at is not None:  # another result of a call already emitted
        head = ctx.nodes[at]
        src = node.source or node.name
        ctx.nodes[at] = replace(
            head, also=(*head.also, L.AtenResult(node.attr("index"), name, t.dtype,
                                                 tuple(t.shape), binds)),
            source=head.source + ((src,) if src not in head.source else ()))
        return ctx.buffer_lazy(name, t.dtype, t.shape)
    call_args = tuple(_arg(ctx, node, a, args) for a in node.attr("args"))
    ctx.shared[key] = len(ctx.nodes)
    ctx.nodes.append(L.AtenCall(name, t.dtype, tuple(t.shape), node.attr("aten_op"),
                                node.attr("overload"), call_args, node.attr("index"),
                                node.attr("n_results"), node.attr("keywords"),
                                (node.source or node.name,), binds))
    return ctx.buffer_lazy(name, t.dtype, t.shape)

