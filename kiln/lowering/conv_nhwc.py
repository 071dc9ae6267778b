"""Lowering rules for the channels-last ops of the CUDA convolution (passes/conv_nhwc.py):

    conv_nhwc      attribute "gemm" (1x1 stride-1 unpadded dense, Options.max_autotune):
                   a plain `Gemm` on the NHWC matrix
                   [N*H*W, C] @ W[C, OC] (cuBLAS, the Triton template or CUTLASS by the GEMM
                   autotuner), its epilogue act(acc * scale + shift [+ residual]) a pointwise value
                   realised under the node's name (the GEMM absorbs it: gemm/fuse.py);
                   otherwise one `Extern` step, routine "conv2d_nhwc" (an implicit-GEMM or,
                   for depthwise, a direct Triton kernel: targets/cuda/conv_template.py;
                   numpy twin in ir/interp.py)
    to_nhwc        NCHW -> NHWC, always materialised (`<value>_nhwc`)
    from_nhwc      NHWC -> NCHW, an index map that fuses into its readers
    max_pool_nhwc  2-D max pooling from NHWC into NHWC (padding never wins)"""

from __future__ import annotations

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import ivars, rvars
from kiln.lowering.conv_nchwc import _operand
from kiln.lowering.core import Lazy, LowerCtx, pointwise
from kiln.lowering.extern import gemm
from kiln.lowering.spatial import _window, lowest
from kiln.ops.build import cast, const, op

ROUTINE = "conv2d_nhwc"
ACTS = {"none": 0, "relu": 1, "clamp": 2, "silu": 3}  # the kernels' activation codes
F32 = dtypes.float32


def lower_to_nhwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """y[n, h, w, c] = x[n, c, h, w]: a buffer of its own, however many convolutions read it."""
    (x,) = args
    return ctx.realize(node.name, pointwise(node.type.dtype, node.type.shape, lambda idx: x.load(
        (idx[0], idx[3], idx[1], idx[2])), x), (node.source or node.name,))


def lower_from_nhwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """x[n, c, h, w] = y[n, h, w, c]."""
    (y,) = args
    return pointwise(node.type.dtype, node.type.shape, lambda idx: y.load(
        (idx[0], idx[2], idx[3], idx[1])), y)


def lower_max_pool_nhwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (y,) = args
    kernel, stride, padding = node.attr("kernel"), node.attr("stride"), node.attr("padding")
    dilation, ceil = node.attr("dilation"), node.attr("ceil_mode")
    iv, rv = ivars(4), rvars(2)
    # _window reads spatial dims at y.shape[lead + a]: NHWC's are dims 1, 2
    src, cond = _window(y, 1, iv[1:3], rv, kernel, stride, padding, dilation, ceil)
    dt = node.type.dtype
    body = y.load((iv[0], src[0], src[1], iv[3]))
    if cond is not None:
        body = op("where", cond, body, const(lowest(dt), dt))
    return ctx.reduction(node.name, dt, node.type.shape, "max", tuple(kernel), body,
                         (node.source or node.name,))


def is_pointwise_gemm(node: Node) -> bool:
    """A 1x1, stride-1, unpadded, ungrouped convolution: a GEMM on the NHWC matrix."""
    return (tuple(node.attr("kernel")) == (1, 1) and set(node.attr("stride")) == {1}
            and not any(node.attr("padding")) and node.attr("groups") == 1)


def epilogue(v: L.Expr, b: Lazy, oc, res: L.Expr | None, node: Node) -> L.Expr:
    """act(v * scale + shift [+ res]) in float32 (v, res of the convolution's dtype; b the
    [2 * OC] scale and shift)."""
    n_oc = node.type.shape[3]
    y = op("add", op("mul", cast(v, F32), b.load((oc,))), b.load((oc + n_oc,)))
    if res is not None:
        y = op("add", y, cast(res, F32))
    act = node.attr("act")
    if act == "relu":
        y = op("relu", y)
    elif act == "silu":
        y = op("mul", y, op("sigmoid", y))
    elif act == "clamp":
        if node.attr("lo") != float("-inf"):
            y = op("maximum", y, const(node.attr("lo"), F32))
        if node.attr("hi") != float("inf"):
            y = op("minimum", y, const(node.attr("hi"), F32))
    return y


def _input(ctx: LowerCtx, x: Lazy, name: str, source) -> L.LibArg:
    """The convolution's input as the kernel reads it: a strided view as it is (an NHWC view
    of an NCHW value: the kernels take any strides), else a contiguous buffer."""
    v = x.view
    if v is not None and x.cost == 0:
        return L.LibArg(v.buf, v.offset, tuple(x.shape), tuple(v.strides))
    return _operand(ctx, x, name, source)


def _gemm_conv(ctx: LowerCtx, node: Node, args: list[Lazy], src) -> Lazy:
    x, w, b = args[:3]
    res = args[3] if len(args) > 3 else None
    dt = node.type.dtype
    n, h, wd, c = x.shape
    oc = node.type.shape[3]
    m = n * h * wd
    a = _operand(ctx, x, node.inputs[0], src)  # contiguous, at offset 0
    amat = ctx.buffer_lazy(a.buf, dt, (m, c))
    wmat = ctx.buffer_lazy(_operand(ctx, w, node.inputs[1], src).buf, dt, (c, oc))
    prod = gemm(ctx, node.name + "_gemm", amat, wmat, (), src, dt)
    shape = node.type.shape

    def fn(idx):
        row = ((idx[0] * h + idx[1]) * wd + idx[2])
        v = prod.load((row, idx[3]))
        r = res.load(idx) if res is not None else None
        return cast(epilogue(v, b, idx[3], r, node), dt)

    deps = [prod, b] + ([res] if res is not None else [])
    return ctx.realize(node.name, pointwise(dt, shape, fn, *deps), src)


def lower_conv_nhwc(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    src = tuple(node.attr("fused")) or (node.source or node.name,)
    if node.attr("gemm") and is_pointwise_gemm(node):
        return _gemm_conv(ctx, node, args, src)
    split = int(node.attr("split", 1))
    if split > 1:
        return _split_conv(ctx, node, args, src, split)
    ops = [_input(ctx, args[0], node.inputs[0], src)] + [
        _operand(ctx, a, n, src) for a, n in zip(args[1:], node.inputs[1:])]
    out = ctx.unique(node.name)
    shape = node.type.shape
    ctx.declare(out, node.type.dtype, shape, "temp")
    ctx.nodes.append(L.Extern(ROUTINE, (out,), tuple(ops), _attrs(node), src))
    return ctx.buffer_lazy(out, node.type.dtype, shape)


def _attrs(node: Node, split: int = 1) -> tuple:
    (sh, sw), (ph, pw), (dh, dw) = (node.attr(k) for k in ("stride", "padding", "dilation"))
    kh, kw = node.attr("kernel")
    return (("kh", kh), ("kw", kw), ("sh", sh), ("sw", sw), ("ph", ph), ("pw", pw),
            ("dh", dh), ("dw", dw), ("groups", int(node.attr("groups"))),
            ("depthwise", bool(node.attr("depthwise"))), ("act", ACTS[node.attr("act")]),
            ("lo", float(node.attr("lo"))), ("hi", float(node.attr("hi"))), ("split", split))


def _split_conv(ctx: LowerCtx, node: Node, args: list[Lazy], src, split: int) -> Lazy:
    """Split-K: the kernel writes `split` float32 partial sums [S, N, OH, OW, OC] (its
    operands x and w only); the epilogue act(sum over S * scale + shift [+ residual]) is a
    pointwise value realised under the node's name, adding the S partials itself."""
    x, w, b = args[:3]
    res = args[3] if len(args) > 3 else None
    ops = [_input(ctx, args[0], node.inputs[0], src),
           _operand(ctx, args[1], node.inputs[1], src)]
    shape = node.type.shape
    part = ctx.unique(node.name + "_partial")
    ctx.declare(part, F32, (split, *shape), "temp")
    ctx.nodes.append(L.Extern(ROUTINE, (part,), tuple(ops), _attrs(node, split), src))
    parts = ctx.buffer_lazy(part, F32, (split, *shape))

    def fn(idx):
        # the S partial sums added in order inside the epilogue's pointwise kernel (S <= 8):
        # one thread per output element. A separate reduction over S made the scheduler
        # loop over the channels inside each program of a pixel-row kernel (105 us for a
        # 7x7x512 output on the H200, where this reads 0.8 MB)
        total = parts.load((0, *idx))
        for s in range(1, split):
            total = op("add", total, parts.load((s, *idx)))
        r = res.load(idx) if res is not None else None
        return cast(epilogue(total, b, idx[3], r, node), node.type.dtype)

    deps = [parts, b] + ([res] if res is not None else [])
    return ctx.realize(node.name, pointwise(node.type.dtype, shape, fn, *deps), src)


RULES = {"to_nhwc": lower_to_nhwc, "from_nhwc": lower_from_nhwc,
         "conv_nhwc": lower_conv_nhwc, "max_pool_nhwc": lower_max_pool_nhwc}
