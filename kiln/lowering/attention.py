"""Lowering of the fused `attention` op (frontend/aten_high.py emits it for
scaled_dot_product_attention when `Builder.fused_attention` is set: CUDA and CPU targets, with
Options.fused_attention) to one `Extern` step,
routine "attention": out[b, h, l, :] = softmax(scale * q[b, h, l] . k[b, h, :]^T + mask) @ v[b, h].

Operands are strided views (`LibArg`), so q / k / v sliced and transposed out of a QKV
projection are read in place; a value that is not a view of a buffer is materialised first.
The mask is broadcast to [B, H, L, S] with stride 0 along its broadcast dims. The output is a
contiguous [B, H, L, Ev] buffer of q's dtype. Attributes: causal (top-left aligned: key j is
kept for query i when j <= i), scale, mask kind (MASK_KINDS: none / bool, keep where true /
float, added), group (grouped-query attention, passes/gqa_attention.py: k and v have
H / group heads, query head h reads kv head h // group). CUDA builds run it as a generated
Triton flash-attention kernel (targets/cuda/attention.py), CPU builds as `kl::attention`
(targets/cpu/include/kiln_attention.h, float32 operands); `ir/interp.py` has its numpy
twin."""

from __future__ import annotations

from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Lazy, LowerCtx
from kiln.lowering.library import _arg, _emit, _viewed

MASK_KINDS = {"none": 0, "bool": 1, "float": 2}


def lower_attention(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    q, k, v = (_viewed(ctx, a, f"{node.name}_{n}", node) for a, n in zip(args[:3], "qkv"))
    b, _, lq, _ = q.shape
    h = q.shape[1]
    s = k.shape[2]
    ops = [_arg(q), _arg(k), _arg(v)]
    kind = node.attr("mask")
    if kind != "none":
        m = _viewed(ctx, args[3], f"{node.name}_mask", node)
        ops.append(_arg(m, shape=(b, h, lq, s)))
    attrs = (("causal", bool(node.attr("causal"))), ("scale", float(node.attr("scale"))),
             ("mask", MASK_KINDS[kind]))
    if node.attr("group", 1) > 1:  # grouped queries: head h reads kv head h // group
        attrs += (("group", int(node.attr("group"))),)
    shape = node.type.shape
    (out,) = _emit(ctx, node, "attention", [("", node.type.dtype, shape)], ops, attrs)
    return ctx.buffer_lazy(out, node.type.dtype, shape)


__all__ = ["lower_attention", "MASK_KINDS", "L"]
