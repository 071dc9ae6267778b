"""Lowering of `qgemm` (passes/quant_weights.py; CPU builds): one `Extern` call of
kiln_qgemm.h's `kl::qgemm`, out [M, N] = x [M, K] @ B, B stored quantised (or bf16-packed)
in ir/quant.py's panel layout. x is passed as a strided view whose rows are contiguous (a
value that is not one is materialised); the stored weights are passed whole."""

from __future__ import annotations


from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Lazy, LowerCtx


def _rows(ctx: LowerCtx, lz: Lazy, name: str, source) -> L.LibArg:
    v = lz.view
    if v is None or v.strides[-1] != 1:
        lz = ctx.realize(lz.origin or name, lz, source)
        v = lz.view
    return L.LibArg(v.buf, v.offset, tuple(lz.shape), tuple(v.strides))


def _whole(lz: Lazy, name: str) -> L.LibArg:
    v = lz.view
    assert v is not None, f"qgemm operand {name} is not a stored weight"
    return L.LibArg(v.buf, v.offset, tuple(lz.shape), tuple(v.strides))


def lower_qgemm(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x, *parts = args
    src = (node.source or node.name,)
    ops = [_rows(ctx, x, node.name + "_lhs", src)]
    ops += [_whole(p, n) for p, n in zip(parts, node.inputs[1:])]
    out = ctx.unique(node.name)
    shape = node.type.shape
    ctx.declare(out, node.type.dtype, shape, "temp")
    # a bias is the operand after the stored weights (kl::qgemm's overloads tell them apart)
    attrs = tuple((k, int(v)) for k, v in node.attrs if k != "bias") + (("threads", 0),)
    ctx.nodes.append(L.Extern("qgemm", (out,), tuple(ops), attrs, src))
    return ctx.buffer_lazy(out, node.type.dtype, shape)


RULES = {"qgemm": lower_qgemm}

__all__ = ["RULES", "lower_qgemm"]
