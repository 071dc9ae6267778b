"""Lowering of `mixed_mm` (passes/mixed_gemm.py; CUDA builds only): one `Gemm` with `mixed`
set. The int8 operand is passed as it is (a strided view of the int8 weight, or a contiguous
int8 copy when its strides are not a matrix's); the scale becomes a strided view broadcast
over the output [*batch, M, N] (materialised first when it is computed, e.g. a constant).
With attr `group` (int4 weights, targets/cuda/quant.py): B is the [K / 2, N] view of the
packed bytes and the scale the [K / group, N] view of the per-group scales (ir/loop.py's
MixedGemm); attr `tc`: the bytes in int4_tc.py's `pack_tc` order (`MixedGemm.tc`)."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Lazy, LowerCtx
from kiln.lowering.extern import operand


def _scale(ctx: LowerCtx, s: Lazy, out_shape, name: str, source) -> L.Operand:
    if s.view is None:
        s = ctx.realize(name, s, source)
    v = s.view
    pad = len(out_shape) - s.rank
    strides = [sympy.Integer(0)] * pad + [
        sympy.Integer(0) if sympy.sympify(d) == 1 else st for d, st in zip(s.shape, v.strides)]
    return L.Operand(v.buf, v.offset, tuple(strides[:-2]), strides[-2], strides[-1])


def lower_mixed_mm(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    a, b, *scale = args
    side = node.attr("side")
    dt = node.type.dtype
    source = (node.source or node.name,)
    batch, shape = node.type.shape[:-2], node.type.shape
    oa, a = operand(ctx, a, node.name + "_lhs", source)
    ob, b = operand(ctx, b, node.name + "_rhs", source)
    q = a if side == "a" else b
    group = node.attr("group", 0)
    sshape = (scale[0].shape if group else shape) if scale else shape
    so = _scale(ctx, scale[0], sshape, node.name + "_scale", source) if scale else None
    mixed = L.MixedGemm(side, q.dtype, so, scale[0].dtype if scale else None, group,
                        bool(node.attr("tc", False)))
    out = ctx.unique(node.name)
    ctx.declare(out, dt, shape, "temp")
    ctx.nodes.append(L.Gemm(out, dt, tuple(batch), a.shape[-2], b.shape[-1], a.shape[-1], oa,
                            ob, source, mixed=mixed))
    return ctx.buffer_lazy(out, dt, shape)
