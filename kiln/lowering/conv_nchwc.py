"""Lowering rules for the blocked-layout ops of the CPU direct convolution
(passes/conv_nchwc.py): `conv_nchwc` is one `Extern` step (routine "conv2d_nchwc",
kiln/targets/cpu/include/kiln_conv.h; numpy twin in ir/interp.py), `max_pool_nchwc` another
("max_pool2d_nchwc"), `conv_block_nchwc` (passes/conv_block.py) a third
("conv2d_block_nchwc"), `to_nchwc` and
`from_nchwc` are index maps: NCHW -> NCHWc is always materialised (a buffer named
`<value>_nchwc`, however many convolutions read it), NCHWc -> NCHW is a pointwise value that
fuses into the ops that read it."""

from __future__ import annotations

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import FloorDiv, ModIdx, contiguous_strides
from kiln.lowering.core import Lazy, LowerCtx, pointwise
from kiln.ops.build import const, op

ACTS = {"none": 0, "relu": 1, "clamp": 2, "silu": 3}  # kiln_conv.h's activation codes


def lower_to_nchwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """y[n, cb, h, w, i] = x[n, cb * B + i, h, w], 0 for the padding channels: always a buffer
    of its own (`<value>_nchwc`), however many convolutions read it."""
    (x,) = args
    block, c = node.attr("block"), x.shape[1]
    dt = node.type.dtype

    def fn(idx):
        n, cb, h, w, i = idx
        ch = cb * block + i
        if sympy.sympify(c) % block == 0:
            return x.load((n, ch, h, w))
        inside = op("lt", L.Index(ch, dtypes.int64), L.Index(sympy.sympify(c), dtypes.int64),
                    dtype=dtypes.bool_)
        return op("where", inside, x.load((n, sympy.Min(ch, c - 1), h, w)), const(0, dt))

    return ctx.realize(node.name, pointwise(dt, node.type.shape, fn, x),
                       (node.source or node.name,))


def lower_from_nchwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """x[n, c, h, w] = y[n, c // B, h, w, c % B]."""
    (y,) = args
    block = node.attr("block")
    return pointwise(node.type.dtype, node.type.shape, lambda idx: y.load(
        (idx[0], FloorDiv(idx[1], block), idx[2], idx[3], ModIdx(idx[1], block))), y)


def _operand(ctx: LowerCtx, lz: Lazy, name: str, source) -> L.LibArg:
    """A contiguous buffer holding `lz` (materialised under `name` unless it is one)."""
    v = lz.view
    if v is None or v.offset != 0 or tuple(v.strides) != contiguous_strides(lz.shape):
        lz = ctx.realize(lz.origin or name, lz, source)
        v = lz.view
    return L.LibArg(v.buf, v.offset, tuple(lz.shape), tuple(v.strides))


def lower_conv_nchwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    src = tuple(node.attr("fused")) or (node.source or node.name,)
    names = (node.inputs[0], node.inputs[1], node.inputs[2]) + tuple(node.inputs[3:])
    ops = [_operand(ctx, a, n, src) for a, n in zip(args, names)]
    out = ctx.unique(node.name)
    shape = node.type.shape
    ctx.declare(out, node.type.dtype, shape, "temp")
    (sh, sw), (ph, pw), (dh, dw) = (node.attr(k) for k in ("stride", "padding", "dilation"))
    attrs = (("oh", int(shape[2])), ("ow", int(shape[3])), ("sh", sh), ("sw", sw), ("ph", ph),
             ("pw", pw), ("dh", dh), ("dw", dw), ("depthwise", bool(node.attr("depthwise"))),
             ("act", ACTS[node.attr("act")]), ("lo", float(node.attr("lo"))),
             ("hi", float(node.attr("hi"))), ("threads", int(node.attr("threads"))))
    ctx.nodes.append(L.Extern("conv2d_nchwc", (out,), tuple(ops), attrs, src))
    return ctx.buffer_lazy(out, node.type.dtype, shape)


def lower_conv_block_nchwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """An inverted residual block (expand 1x1 -> depthwise -> project 1x1 [+ residual]): one
    `Extern` step (routine "conv2d_block_nchwc"), the three stages' epilogues as attributes."""
    src = tuple(node.attr("fused")) or (node.source or node.name,)
    ops = [_operand(ctx, a, n, src) for a, n in zip(args, node.inputs)]
    out = ctx.unique(node.name)
    shape = node.type.shape
    ctx.declare(out, node.type.dtype, shape, "temp")
    (sh, sw), (ph, pw), (dh, dw) = (node.attr(k) for k in ("stride", "padding", "dilation"))
    attrs = [("oh", int(shape[2])), ("ow", int(shape[3])), ("sh", sh), ("sw", sw), ("ph", ph),
             ("pw", pw), ("dh", dh), ("dw", dw)]
    for i, (act, lo, hi) in enumerate(zip(*(node.attr(k) for k in ("acts", "los", "his"))), 1):
        attrs += [(f"act{i}", ACTS[act]), (f"lo{i}", float(lo)), (f"hi{i}", float(hi))]
    attrs.append(("threads", int(node.attr("threads"))))
    ctx.nodes.append(L.Extern("conv2d_block_nchwc", (out,), tuple(ops), tuple(attrs), src))
    return ctx.buffer_lazy(out, node.type.dtype, shape)


def lower_max_pool_nchwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """2-D max pooling of an NCHWc value into NCHWc: one `Extern` step (routine
    "max_pool2d_nchwc", kiln_conv.h: B channels per vector; numpy twin in ir/interp.py), the
    window clipped to the input (padding never wins)."""
    (y,) = args
    src = (node.source or node.name,)
    x = _operand(ctx, y, node.inputs[0], src)
    out = ctx.unique(node.name)
    shape = node.type.shape
    ctx.declare(out, node.type.dtype, shape, "temp")
    (kh, kw), (sh, sw) = node.attr("kernel"), node.attr("stride")
    (ph, pw), (dh, dw) = node.attr("padding"), node.attr("dilation")
    attrs = (("oh", int(shape[2])), ("ow", int(shape[3])), ("kh", kh), ("kw", kw), ("sh", sh),
             ("sw", sw), ("ph", ph), ("pw", pw), ("dh", dh), ("dw", dw),
             ("threads", int(node.attr("threads"))))
    ctx.nodes.append(L.Extern("max_pool2d_nchwc", (out,), (x,), attrs, src))
    return ctx.buffer_lazy(out, node.type.dtype, shape)


RULES = {"to_nchwc": lower_to_nchwc, "from_nchwc": lower_from_nchwc,
         "conv_nchwc": lower_conv_nchwc, "max_pool_nchwc": lower_max_pool_nchwc,
         "conv_block_nchwc": lower_conv_block_nchwc}
