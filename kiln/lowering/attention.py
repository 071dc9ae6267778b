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
twin.

Decode scratch: a call with few query rows (L static, at most DECODE_MAX_L) and a static batch
may split its keys among programs (the CUDA kernel's split-K decode path, flash-decoding); the
split programs' partial softmax states then need a float32 scratch, declared here as the
call's second output `<name>_part` of shape [B * H * L, splits, Ev + 2] (per query row and
split: running maximum, running sum, the Ev accumulator), so the program plans it in the arena
like any temp (no allocation per call). Attribute `splits` is the most splits the kernel may
use (`decode_splits`: a function of the static sizes only); nothing reads the scratch after
the call."""

from __future__ import annotations

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Lazy, LowerCtx
from kiln.lowering.library import _arg, _emit, _viewed

MASK_KINDS = {"none": 0, "bool": 1, "float": 2}
#: query rows per head the decode path (GQA packing, split-K) handles at most
DECODE_MAX_L = 16
#: split programs (batch x kv heads x splits) at most: a few waves of a large GPU's SMs
DECODE_PROGRAMS = 512
#: key splits at most, and the fewest keys one split covers
DECODE_MAX_SPLITS = 64
DECODE_MIN_KEYS = 64


def decode_splits(b, hkv: int, lq, s) -> int:
    """The most key splits a decode-path attention call may use (1: no split, no scratch):
    L and B static, L <= DECODE_MAX_L; at most DECODE_MAX_SPLITS, B * Hkv * splits <=
    DECODE_PROGRAMS, and (S static) at least DECODE_MIN_KEYS keys a split."""
    b, lq, s = (sympy.sympify(x) for x in (b, lq, s))
    if not (lq.is_Integer and b.is_Integer) or int(lq) > DECODE_MAX_L:
        return 1
    n = min(DECODE_MAX_SPLITS, DECODE_PROGRAMS // max(1, int(b) * hkv))
    if s.is_Integer:
        n = min(n, -(-int(s) // DECODE_MIN_KEYS))
    return max(1, n)


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
    group = int(node.attr("group", 1))
    if group > 1:  # grouped queries: head h reads kv head h // group
        attrs += (("group", group),)
    shape = node.type.shape
    outs = [("", node.type.dtype, shape)]
    hkv = int(h) // group if sympy.sympify(h).is_Integer else 0
    splits = decode_splits(b, int(hkv), lq, s) if hkv and ctx.attention_splits else 1
    if splits > 1:  # the split programs' partial states (see the docstring)
        attrs += (("splits", splits),)
        outs.append(("part", dtypes.float32, (b * h * lq, sympy.Integer(splits),
                                             v.shape[3] + 2)))
    out = _emit(ctx, node, "attention", outs, ops, attrs)[0]
    return ctx.buffer_lazy(out, node.type.dtype, shape)


__all__ = ["lower_attention", "decode_splits", "MASK_KINDS", "DECODE_MAX_L", "L"]
