"""Converters for the high-level aten ops `torch.export` emits before decomposition (linear,
layer_norm, scaled_dot_product_attention, batch_norm, ...; convolutions are in aten_spatial.py).
When every op of a program is known here or in aten_table.py, import skips `run_decompositions`
(a full re-trace that costs about a second); anything unusual raises `Fallback` and the
program is decomposed."""

from __future__ import annotations

import math
import operator

import sympy

from kiln.errors import UnsupportedError
from kiln.frontend.aten_table import TABLE, register
from kiln.frontend.builder import to_dtype
from kiln.ir import dtypes
import torch


class Fallback(UnsupportedError):
    """This form of the op is not handled here: decompose the program instead."""


def _shape(b, x):
    return tuple(b.shape(x))


@register("aten.linear.default")
def _linear(b, n):
    x, w = n.args[0], n.args[1]
    bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    xs, ws = _shape(b, x), _shape(b, w)
    rows = sympy.Integer(1)
    for d in xs[:-1]:
        rows = rows * d
    flat = b.tensor(x) if len(xs) == 2 else b.emit("view", [b.tensor(x)], None, like=n,
                                                    shape=(rows, xs[-1]))
    wt = b.emit("permute", [b.tensor(w)], None, like=n, shape=(ws[1], ws[0]), dims=(1, 0))
    mm = b.emit("matmul", [flat, wt], None, like=n, shape=(rows, ws[0]))
    out = mm if bias is None else b.emit("add", [mm, b.tensor(bias)], None, like=n,
                                         shape=(rows, ws[0]))
    return b.emit("view", [out], n) if len(xs) != 2 else b.alias(n, out)


@register("aten.layer_norm.default")
def _layer_norm(b, n):
    args = list(n.args) + [None] * 6
    x, shape, w, bias = args[0], args[1], args[2], args[3]
    eps = args[4] if args[4] is not None else n.kwargs.get("eps", 1e-5)
    ins = [b.tensor(x)] + [b.tensor(t) for t in (w, bias) if t is not None]
    return b.emit("layer_norm", ins, n, norm_rank=len(shape), eps=float(eps),
                  has_weight=w is not None, has_bias=bias is not None)


# (dropout_ mutates nothing when not training)
@register("aten.dropout.default", "aten.feature_dropout.default", "aten.dropout_.default")
def _dropout(b, n):
    p, train = n.args[1], n.args[2]
    if train and p > 0:
        raise Fallback("dropout in training mode")
    return b.alias(n, b.tensor(n.args[0]))


@register("aten.diff.default")
def _diff(b, n):
    """torch.diff: x with `prepend` / `append` joined along dim, then `n` times y[1:] - y[:-1]
    (bool: y[1:] != y[:-1]), as eager computes it."""
    args = list(n.args) + [None] * 5
    kw = n.kwargs
    order = args[1] if args[1] is not None else kw.get("n", 1)
    dim = args[2] if args[2] is not None else kw.get("dim", -1)
    pre = args[3] if args[3] is not None else kw.get("prepend")
    post = args[4] if args[4] is not None else kw.get("append")
    rank = b.rank(n.args[0])
    dim %= rank
    parts = [v for v in (pre, n.args[0], post) if v is not None]
    if not isinstance(order, int) or order < 1 or any(
            not isinstance(v, torch.fx.Node) or b.rank(v) != rank or
            b.meta_dtype(v) != b.meta_dtype(n.args[0]) for v in parts):
        raise Fallback("diff with a scalar, another rank or dtype to join, or a symbolic order")
    shape = list(_shape(b, n.args[0]))
    shape[dim] = sum((_shape(b, v)[dim] for v in parts), sympy.Integer(0))
    y = b.tensor(n.args[0])
    if len(parts) > 1:
        y = b.emit("cat", [b.tensor(v) for v in parts], None, like=n, shape=shape, dim=dim)
    op = "logical_xor" if b.meta_dtype(n) == torch.bool else "sub"
    for k in range(order):
        size = shape[dim]
        shape[dim] = size - 1
        hi = b.emit("slice", [y], None, like=n, shape=shape, dim=dim, start=1, end=size, step=1)
        lo = b.emit("slice", [y], None, like=n, shape=shape, dim=dim, start=0, end=size - 1,
                    step=1)
        y = b.emit(op, [hi, lo], n if k == order - 1 else None, like=n, shape=shape)
    return y


@register("aten.pad.default")
def _pad_any(b, n):
    mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
    if mode != "constant":
        raise Fallback(f"pad mode {mode!r}")  # the decomposition's reflection / replication pads
    value = n.args[3] if len(n.args) > 3 else n.kwargs.get("value")
    return b.emit("pad", [b.tensor(n.args[0])], n, pad=tuple(n.args[1]),
                  value=0 if value is None else value)


def _alias_free(x: torch.fx.Node, n: torch.fx.Node) -> bool:
    """In-place op `n` mutating `x` may read as its out-of-place form: `x` is the result of an
    op that made a new tensor (not an input, a weight, a constant or a view or in-place result
    aliasing another tensor), every tensor operand has `x`'s dtype (eager computes an in-place
    op in the operands' common dtype, then casts), nothing reads `x` after `n` (export makes
    later reads read n's result, the same tensor) and no view of `x` exists."""
    if not isinstance(x, torch.fx.Node) or x.op != "call_function" or \
            x.target is operator.getitem:
        return False
    schema = getattr(x.target, "_schema", None)
    if str(x.target) in _INPLACE:  # x aliases the tensor an earlier in-place op mutated
        if not _alias_free(x.args[0], x):
            return False
    elif schema is None or any(r.alias_info is not None for r in schema.returns):
        return False
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    for a in n.args[1:]:
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if isinstance(v, torch.Tensor) and v.dtype != val.dtype:
            return False
    if n.meta.get("val") is None or n.meta["val"].dtype != val.dtype:
        return False
    after = False
    for m in x.graph.nodes:  # a user of x after n would see the mutated values, and a view
        if m is n:  # of x made before n would show them wherever it is read
            after = True
        elif x in m.all_input_nodes:
            m_schema = getattr(m.target, "_schema", None)
            if after or m_schema is None or \
                    any(r.alias_info is not None for r in m_schema.returns):
                return False
    return True


def _inplace(out_of_place: str):
    def conv(b, n):
        if not _alias_free(n.args[0], n):
            raise Fallback(f"{n.target} mutates a tensor read elsewhere")
        return TABLE[out_of_place](b, n)
    return conv


# in-place pointwise ops as exported (HF ResNet's `hidden += residual`): without converters
# here the whole program is re-traced by run_decompositions (about 3 s for a ResNet-50 held on
# the GPU) only to functionalise them
_INPLACE = {f"aten.{op}_.{ov}": f"aten.{op}.{ov}"
            for op in ("add", "sub", "mul", "div") for ov in ("Tensor", "Scalar")}
_INPLACE.update({f"aten.{op}_.default": f"aten.{op}.default"
                 for op in ("relu", "sigmoid", "tanh", "neg", "hardtanh", "silu", "gelu")})
for _name, _functional in _INPLACE.items():
    register(_name)(_inplace(_functional))


@register("aten.scaled_dot_product_attention.default")
def _sdpa(b, n):
    args = list(n.args) + [None] * 8
    mask = args[3] if args[3] is not None else n.kwargs.get("attn_mask")
    dropout = args[4] if args[4] is not None else n.kwargs.get("dropout_p", 0.0)
    causal = args[5] if args[5] is not None else n.kwargs.get("is_causal", False)
    scale = args[6] if args[6] is not None else n.kwargs.get("scale")
    group = 1
    if n.kwargs.get("enable_gqa"):
        h, hkv = _shape(b, args[0])[1], _shape(b, args[1])[1]
        if not (h.is_Integer and hkv.is_Integer and int(h) % int(hkv) == 0):
            raise Fallback("attention with grouped queries and dynamic head counts")
        group = int(h) // int(hkv)
    return _attention(b, n, args[:3], mask, dropout, causal, scale, None, group=group)[0]


@register("aten._scaled_dot_product_flash_attention_for_cpu.default")
def _sdpa_flash_cpu(b, n):
    """The CPU flash kernel's op (what AOTAutograd's training graphs carry): the attention and
    its logsumexp [B, H, L] over the scaled, masked scores (float32; -inf for a query row with
    no key), which its backward reads. torch's own decomposition of this op returns the
    attention weights [B, H, L, S] in place of the logsumexp, so kiln builds both itself."""
    args = list(n.args) + [None] * 4
    dropout = args[3] if args[3] is not None else n.kwargs.get("dropout_p", 0.0)
    causal = args[4] if args[4] is not None else n.kwargs.get("is_causal", False)
    out, scores = _attention(b, n, args[:3], n.kwargs.get("attn_mask"), dropout, causal,
                             n.kwargs.get("scale"), 0, need_scores=True)
    return [out, _logsumexp(b, n, scores, (*_shape(b, args[0])[:3], _shape(b, args[1])[2]))]


# The CUDA fused-attention ops a GPU export carries (after run_decompositions; bf16 / fp16
# programs pick cudnn or flash, others efficient): result 0 is the attention, result 1 its
# logsumexp; the others (sequence offsets, max lengths, RNG state, debug mask) describe dropout
# and variable-length batches, which kiln does not take.
_CUDA_SDPA = ("aten._scaled_dot_product_cudnn_attention.default",
              "aten._scaled_dot_product_flash_attention.default",
              "aten._scaled_dot_product_efficient_attention.default")


@register(*_CUDA_SDPA)
def _sdpa_cuda(b, n):
    """Lowered like scaled_dot_product_attention (the fused step on CUDA targets when it
    applies, else the decomposition); the logsumexp is built from the scores when used."""
    names = [a.name for a in n.target._schema.arguments]
    a = {nm: (n.args[i] if i < len(n.args) else n.kwargs.get(nm)) for i, nm in enumerate(names)}
    vals = n.meta["val"]
    for k in range(2, len(vals)):
        if _used_result(n, k):
            raise UnsupportedError(f"result {k} of {n.target} (node {n.name}) is used; kiln "
                                   "computes only the attention (0) and its logsumexp (1)")
    mask, dropout = a.get("attn_bias"), a.get("dropout_p") or 0.0
    causal, scale = bool(a.get("is_causal") or False), a.get("scale")
    qkv = (a["query"], a["key"], a["value"])
    out = [None] * len(vals)
    if not _used_result(n, 1):
        out[0] = _attention(b, n, qkv, mask, dropout, causal, scale, 0)[0]
        return out
    q, k = _shape(b, a["query"]), _shape(b, a["key"])
    lse_shape = tuple(b.syms.shape(vals[1].shape))
    if len(lse_shape) < 3 or any(sympy.expand(x - y) != 0 for x, y in zip(lse_shape, q[:3])) \
            or any(d != 1 for d in lse_shape[3:]):  # the efficient op pads L to 32
        raise UnsupportedError(f"the logsumexp of {n.target} (node {n.name}) has shape "
                               f"{lse_shape}; kiln builds it as [B, H, L] only")
    out[0], scores = _attention(b, n, qkv, mask, dropout, causal, scale, 0, need_scores=True)
    lse = _logsumexp(b, n, scores, (*q[:3], k[2]))
    if len(lse_shape) != 3:
        lse = b.emit("view", [lse], None, like=n, result=1, shape=(*q[:3],) + (1,) * (
            len(lse_shape) - 3), dtype=dtypes.float32)
    out[1] = lse
    return out


def _used_result(n, k: int) -> bool:
    return any(u.target is operator.getitem and u.args[1] == k and u.users for u in n.users)


def _attention(b, n, qkv, mask, dropout, causal, scale, result, need_scores=False, group=1):
    """(output, scores) of softmax(q k^T * scale + mask) v; `result`: the output's index in a
    multi-result op (None for a one-result op). `scores` is None when the fused step computes
    the call (CUDA; never with `need_scores`)."""
    q, k, v = qkv
    if dropout:
        raise Fallback("attention with dropout")
    qs, ks, vs = _shape(b, q), _shape(b, k), _shape(b, v)
    if group > 1:  # enable_gqa: query head h reads kv head h // group
        if len(qs) != 4 or len(ks) != 4 or ks[:2] != vs[:2] or qs[0] != ks[0] or \
                sympy.expand(qs[1] - group * ks[1]) != 0:
            raise Fallback("attention with grouped queries of unexpected shapes")
        if not (b.fused_attention and not need_scores and _fusable(b, n, q, k, v, mask)):
            raise Fallback("attention with grouped queries (fused kernel not applicable)")
    elif len(qs) != 4 or qs[:2] != ks[:2] or ks[:2] != vs[:2]:
        raise Fallback("attention with broadcast or non-4D operands")
    lq, s, e = qs[2], ks[2], qs[3]
    if mask is not None and _noop_mask(b, mask, (*qs[:2], lq, s)):
        mask = None
    if scale is None:
        if not e.is_Integer:
            raise Fallback("attention with a dynamic head size")
        scale = 1.0 / math.sqrt(int(e))
    node = n if result is None else None
    if b.fused_attention and not need_scores and _fusable(b, n, q, k, v, mask):
        kind = "none" if mask is None else "bool" if b.meta_dtype(mask) == torch.bool \
            else "float"
        ins = [b.tensor(q), b.tensor(k), b.tensor(v)] + ([b.tensor(mask)] if kind != "none"
                                                         else [])
        extra = {"group": group} if group > 1 else {}
        return b.emit("attention", ins, node, like=n, result=result, causal=bool(causal),
                      scale=float(scale), mask=kind, **extra), None
    shape = (*qs[:2], lq, s)
    dt = b.meta_dtype(q)
    kt = b.emit("permute", [b.tensor(k)], None, like=n, shape=(*ks[:2], ks[3], ks[2]),
                dims=(0, 1, 3, 2), dtype=to_dtype(dt))
    scores = b.emit("matmul", [b.tensor(q), kt], None, like=n, shape=shape, dtype=to_dtype(dt))
    scores = b.emit("mul", [scores, b.scalar(float(scale), dt)], None, like=n, shape=shape,
                    dtype=to_dtype(dt))
    if causal:
        scores = _causal(b, n, scores, shape)
    if mask is not None:
        if b.meta_dtype(mask).is_floating_point:
            scores = b.emit("add", [scores, b.tensor(mask)], None, like=n, shape=shape,
                            dtype=to_dtype(dt))
        else:
            ninf = b.scalar(float("-inf"), dt)
            scores = b.emit("where", [b.tensor(mask), scores, ninf], None, like=n, shape=shape,
                            dtype=to_dtype(dt))
    probs = _safe_softmax(b, n, scores, shape)
    return b.emit("matmul", [probs, b.tensor(v)], node, like=n, result=result), scores


_NOOP_MASK_NODES, _NOOP_MASK_NUMEL = 64, 1 << 24


def _noop_mask(b, mask, scores_shape) -> bool:
    """Whether an attention mask computed from no input and no weight keeps every key: a bool
    mask all true, or a float mask all zeros, broadcast to the scores without growing them.
    Hugging Face builds such masks for encoders called without a padding mask (ViT:
    `arange(S) + 0 >= 0`, expanded to [1, 1, L, S]); the attention then skips the mask's work
    (the fused CPU kernel: 15% of ViT-base's attention). The mask stays in the program if
    anything else reads it."""
    if not isinstance(mask, torch.fx.Node):
        return False
    shape = tuple(mask.meta["val"].shape) if isinstance(mask.meta.get("val"), torch.Tensor) \
        else None
    if shape is None or len(shape) > len(scores_shape) or any(
            not isinstance(d, int) or (d != 1 and not (
                sympy.sympify(want).is_Integer and int(want) == d))
            for d, want in zip(reversed(shape), reversed(scores_shape))):
        return False
    if mask not in b.noop_masks:  # one evaluation per mask node (every layer reads the same one)
        b.noop_masks[mask] = _keeps_every_key(mask)
    return b.noop_masks[mask]


def _keeps_every_key(mask) -> bool:
    """The mask's subgraph (at most _NOOP_MASK_NODES deterministic ops of static shapes, no
    placeholder: no input, weight or buffer) evaluated with torch: all true, or all zeros."""
    seen, stack = {}, [mask]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        t = x.target
        if x.op != "call_function" or len(seen) >= _NOOP_MASK_NODES or not isinstance(
                t, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in t.tags or any(
                a.alias_info is not None and a.alias_info.is_write for a in t._schema.arguments):
            return False
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape) \
                or val.numel() > _NOOP_MASK_NUMEL:
            return False
        seen[x] = None
        stack.extend(x.all_input_nodes)
    pos = {x: i for i, x in enumerate(mask.graph.nodes)}
    values: dict = {}
    with torch.no_grad():
        for x in sorted(seen, key=pos.__getitem__):
            args = torch.fx.node.map_arg(x.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(x.kwargs, values.__getitem__)
            values[x] = x.target(*args, **kwargs)
    out = values[mask]
    if out.dtype == torch.bool:
        return bool(out.all())
    return out.is_floating_point() and bool((out == 0).all())


def _logsumexp(b, n, scores, shape):
    """log(sum(exp(scores))) over the keys in float32, shifted by the row's maximum; 0 for a
    query row whose scores are all -inf (no key), as eager's kernel gives (torch 2.13)."""
    row, f32 = (*shape[:3], 1), dtypes.float32
    x = b.emit("cast", [scores], None, like=n, shape=shape, dtype=f32)
    top = b.emit("reduce", [x], None, like=n, shape=row, dtype=f32, kind="max", dims=(3,),
                 keepdim=True)
    ninf = b.scalar(float("-inf"), torch.float32)
    empty = b.emit("eq", [top, ninf], None, like=n, shape=row, dtype=dtypes.bool_)
    top = b.emit("where", [empty, b.scalar(0.0, torch.float32), top], None, like=n, shape=row,
                 dtype=f32)
    e = b.emit("exp", [b.emit("sub", [x, top], None, like=n, shape=shape, dtype=f32)], None,
               like=n, shape=shape, dtype=f32)
    total = b.emit("reduce", [e], None, like=n, shape=row, dtype=f32, kind="sum", dims=(3,),
                   keepdim=True)
    lse = b.emit("add", [b.emit("log", [total], None, like=n, shape=row, dtype=f32), top],
                 None, like=n, shape=row, dtype=f32)
    lse = b.emit("where", [empty, b.scalar(0.0, torch.float32), lse], None, like=n, shape=row,
                 dtype=f32)
    return b.emit("view", [lse], None, like=n, result=1, shape=shape[:3], dtype=f32)


def _safe_softmax(b, n, scores, shape):
    """softmax over the keys, with zeros for a query row whose scores are all -inf (every key
    masked): eager's scaled_dot_product_attention on every CPU path (math: aten._safe_softmax;
    flash) and the CUDA fused kernel (targets/cuda/attention.py) give 0 there, a plain softmax
    NaN. A NaN score still gives NaN, as in eager."""
    probs = b.emit("softmax", [scores], None, like=n, shape=shape, dim=3)
    ninf = b.scalar(float("-inf"), b.meta_dtype(n))
    masked = b.emit("eq", [scores, ninf], None, like=n, shape=shape, dtype=dtypes.bool_)
    row = (*shape[:3], 1)
    empty = b.emit("reduce", [masked], None, like=n, shape=row, dtype=dtypes.bool_, kind="all",
                   dims=(3,), keepdim=True)
    zero = b.scalar(0.0, b.meta_dtype(n))
    return b.emit("where", [empty, zero, probs], None, like=n, shape=shape)


MAX_HEAD_DIM = 256  # the fused kernel keeps a [BLOCK_M, head dim] accumulator in registers


def _fusable(b, n, q, k, v, mask) -> bool:
    """Whether the fused flash-attention step (CUDA targets with `Builder.fused_attention`)
    computes this call: q, k, v of one float type (float32 / float16 / bfloat16), static head
    dims of at most MAX_HEAD_DIM, and a mask (if any) that is bool or float and broadcasts to
    [B, H, L, S] from the right. Anything else is decomposed (permute, matmul, softmax, ...)."""

    dt = b.meta_dtype(q)
    if dt not in (torch.float32, torch.float16, torch.bfloat16) or \
            b.meta_dtype(k) != dt or b.meta_dtype(v) != dt or b.meta_dtype(n) != dt:
        return False
    e, ev = _shape(b, q)[3], _shape(b, v)[3]
    if not (e.is_Integer and ev.is_Integer and 0 < int(e) <= MAX_HEAD_DIM and
            0 < int(ev) <= MAX_HEAD_DIM):
        return False
    if mask is None:
        return True
    if not isinstance(mask, torch.fx.Node):
        return False
    md, ms = b.meta_dtype(mask), _shape(b, mask)
    full = (*_shape(b, q)[:3], _shape(b, k)[2])
    if md != torch.bool and not md.is_floating_point or len(ms) > 4:
        return False
    return all(m == 1 or sympy.expand(m - f) == 0 for m, f in zip(ms[::-1], full[::-1]))


def _causal(b, n, scores, shape):
    """scores where column <= row (top-left aligned, like torch), else -inf."""
    lq, s = shape[2], shape[3]
    rows = b.emit("iota", [], None, like=n, shape=(lq,), dtype=dtypes.int64, start=0, step=1)
    cols = b.emit("iota", [], None, like=n, shape=(s,), dtype=dtypes.int64, start=0, step=1)
    rows = b.emit("view", [rows], None, like=n, shape=(lq, 1), dtype=dtypes.int64)
    cols = b.emit("view", [cols], None, like=n, shape=(1, s), dtype=dtypes.int64)
    keep = b.emit("ge", [rows, cols], None, like=n, shape=(lq, s), dtype=dtypes.bool_)
    ninf = b.scalar(float("-inf"), b.meta_dtype(n))
    return b.emit("where", [keep, scores, ninf], None, like=n, shape=shape)


@register("aten.batch_norm.default")
def _batch_norm(b, n):
    x, w, bias, mean, var, training, _momentum, eps = list(n.args)[:8]
    if training:
        raise Fallback("batch norm in training mode")
    ins = [b.tensor(x), b.tensor(mean), b.tensor(var)]
    ins += [b.tensor(t) for t in (w, bias) if t is not None]
    return b.emit("batch_norm", ins, n, eps=float(eps), has_weight=w is not None,
                  has_bias=bias is not None)


@register("aten.matmul.default")
def _matmul(b, n):
    """2-D @ 2-D and batched @ batched of equal batch shape; other broadcasts decompose."""
    x, y = n.args[0], n.args[1]
    xs, ys = _shape(b, x), _shape(b, y)
    if len(xs) < 2 or len(ys) < 2 or len(xs) != len(ys) or len(xs) > 4 or xs[:-2] != ys[:-2]:
        raise Fallback("matmul with broadcasting or vectors")
    return b.emit("matmul", [b.tensor(x), b.tensor(y)], n)
