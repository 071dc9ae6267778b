"""Lowering rules for spatial ops, generic over the number of spatial dims (1-D, 2-D, 3-D):
pooling (max with indices, avg, adaptive), convolution (im2col + batched GEMM; transposed
convolution as a GEMM followed by a gathering col2im reduction), upsampling and
grid sampling (gather-style index maps: pointwise values that fuse into their consumers).

Tensors are [*lead, *spatial] with the spatial dims last (NC* or C*)."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import FloorDiv, ModIdx, contiguous_strides, ivars, product, rvars
from kiln.lowering.core import Lazy, LowerCtx, View, from_view, pointwise
from kiln.lowering.extern import gemm
from kiln.lowering.indexing import indirect_load
from kiln.ops.build import cast, const, op
import numpy as np

I64, BOOL = dtypes.int64, dtypes.bool_


def _all(conds):
    out = None
    for c in conds:
        out = c if out is None else op("logical_and", out, c, dtype=BOOL)
    return out


def _cmp(name: str, a: sympy.Expr, b: sympy.Expr) -> L.Expr:
    return op(name, L.Index(sympy.sympify(a), I64), L.Index(sympy.sympify(b), I64), dtype=BOOL)


def _clamp(pos, size):
    return sympy.Max(sympy.Integer(0), sympy.Min(pos, size - 1))


def lowest(dt):
    """Padding value of a max pool: -inf, or the smallest integer (int64: INT64_MIN + 1, which
    C++ can spell as a literal; it differs only for a window whose elements all equal
    INT64_MIN)."""
    if dt.is_float:
        return float("-inf")
    if not dt.is_signed:
        return 0
    return -(2 ** (8 * dt.itemsize - 1)) + (dt.itemsize == 8)


def _size_value(n, dt) -> L.Expr:
    n = sympy.sympify(n)
    if n.is_Integer:
        return const(int(n), dt)
    return cast(L.Index(n, I64), dt)


# -- pooling -----------------------------------------------------------------------------------
def _window(x: Lazy, lead: int, out_idx, r, kernel, stride, padding, dilation, ceil_mode):
    """Source index (positions clamped into the input) and in-bounds condition of window
    element r of the output at out_idx (spatial part)."""
    src, conds = [], []
    for a in range(len(kernel)):
        pos = sympy.expand(out_idx[a] * stride[a] + r[a] * dilation[a] - padding[a])
        size = x.shape[lead + a]
        if padding[a]:
            conds.append(_cmp("ge", pos, 0))
        if padding[a] or ceil_mode:
            conds.append(_cmp("lt", pos, size))
            pos = _clamp(pos, size)
        src.append(pos)
    return src, _all(conds)


def _pool_reduce(ctx, node, x, kind, name, pad_value, want_dtype):
    kernel, stride = node.attr("kernel"), node.attr("stride")
    padding = node.attr("padding")
    dilation = node.attr("dilation", (1,) * len(kernel))
    d = len(kernel)
    lead = x.rank - d
    iv, rv = ivars(x.rank), rvars(d)
    src, cond = _window(x, lead, iv[lead:], rv, kernel, stride, padding, dilation,
                        node.attr("ceil_mode"))
    body = cast(x.load((*iv[:lead], *src)), x.dtype if kind == "argmax" else want_dtype)
    if cond is not None:
        body = op("where", cond, body, const(pad_value, body.dtype))
    return ctx.reduction(name, want_dtype if kind != "argmax" else I64, node.type.shape, kind,
                         tuple(kernel), body, (node.source or node.name,))


def lower_max_pool(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """Values: a max over the window (padding never wins). Indices: the argmax over the same
    window, mapped back to the flat position in the input's spatial dims (like eager)."""
    (x,) = args
    dt = node.type.dtype
    if node.attr("want") == "values":
        return _pool_reduce(ctx, node, x, "max", node.name, lowest(dt), dt)
    best = _pool_reduce(ctx, node, x, "argmax", node.name + "_arg", lowest(x.dtype), I64)
    kernel, stride, padding = node.attr("kernel"), node.attr("stride"), node.attr("padding")
    dilation = node.attr("dilation")
    d = len(kernel)
    lead = x.rank - d
    in_strides = contiguous_strides(x.shape[lead:])
    k_strides = contiguous_strides(kernel)

    def fn(idx):
        k = best.load(idx)
        flat = None
        for a in range(d):
            ra = op("remainder", op("truediv_floor", k, const(k_strides[a], I64)),
                    const(kernel[a], I64))
            pos = op("add", L.Index(sympy.expand(idx[lead + a] * stride[a] - padding[a]), I64),
                     op("mul", ra, const(dilation[a], I64)))
            term = op("mul", pos, _size_value(in_strides[a], I64))
            flat = term if flat is None else op("add", flat, term)
        return flat

    return pointwise(I64, node.type.shape, fn, best)


def lower_avg_pool(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    kernel, stride, padding = node.attr("kernel"), node.attr("stride"), node.attr("padding")
    d = len(kernel)
    lead = x.rank - d
    dt = node.type.dtype
    s = _pool_reduce(ctx, node, x, "sum", node.name + "_sum", 0, dt)
    iv = ivars(x.rank)
    if node.attr("divisor"):
        count = sympy.Integer(node.attr("divisor"))
    else:
        count = sympy.Integer(1)
        for a in range(d):
            start = iv[lead + a] * stride[a] - padding[a]
            size = x.shape[lead + a]
            if node.attr("count_include_pad"):  # the window clipped to the padded input
                count = count * (sympy.Min(start + kernel[a], size + padding[a]) - start)
            else:  # the window clipped to the input
                count = count * (sympy.Min(start + kernel[a], size) - sympy.Max(start, 0))
    return pointwise(dt, node.type.shape, lambda idx: op(
        "div", s.load(idx), _size_value(count.subs(dict(zip(iv, idx)), simultaneous=True), dt)),
        s)


def _adaptive_bounds(i, size, out):
    """[start, end) of adaptive window i: floor(i * size / out), ceil((i + 1) * size / out)."""
    return FloorDiv(i * size, out), FloorDiv((i + 1) * size + out - 1, out)


def _max_window(size, out):
    """An upper bound of the adaptive window length over all outputs (exact for static sizes)."""
    size, out = sympy.sympify(size), sympy.sympify(out)
    if size.is_Integer and out.is_Integer:
        s, o = int(size), int(out)
        return sympy.Integer(max(((i + 1) * s + o - 1) // o - (i * s) // o for i in range(o))
                             if o else 0)
    return FloorDiv(size + out - 1, out) + 1


def lower_adaptive_pool(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """Windows of varying length: a reduction over the longest window, masking the rest."""
    (x,) = args
    d = node.attr("dims")
    lead = x.rank - d
    dt = node.type.dtype
    out_sp, in_sp = node.type.shape[lead:], x.shape[lead:]
    iv = ivars(x.rank)
    bounds = [_adaptive_bounds(iv[lead + a], in_sp[a], out_sp[a]) for a in range(d)]
    sizes = tuple(_max_window(in_sp[a], out_sp[a]) for a in range(d))
    rv = rvars(d)
    src, conds = [], []
    for a in range(d):
        start, end = bounds[a]
        pos = start + rv[a]
        length = sympy.sympify(end - start)
        if not (sizes[a].is_Integer and length.is_Integer and length == sizes[a]):
            conds.append(_cmp("lt", pos, end))
            pos = sympy.Min(pos, in_sp[a] - 1)
        src.append(pos)
    cond = _all(conds)
    kind = node.attr("kind")
    source = (node.source or node.name,)
    if kind == "avg":
        body = cast(x.load((*iv[:lead], *src)), dt)
        if cond is not None:
            body = op("where", cond, body, const(0, dt))
        s = ctx.reduction(node.name + "_sum", dt, node.type.shape, "sum", sizes, body, source)
        count = product([end - start for start, end in bounds])
        return pointwise(dt, node.type.shape, lambda idx: op(
            "div", s.load(idx), _size_value(count.subs(dict(zip(iv, idx)), simultaneous=True),
                                            dt)), s)
    body = x.load((*iv[:lead], *src))
    if cond is not None:
        body = op("where", cond, body, const(lowest(x.dtype), x.dtype))
    if node.attr("want") == "values":
        return ctx.reduction(node.name, dt, node.type.shape, "max", sizes, body, source)
    best = ctx.reduction(node.name + "_arg", I64, node.type.shape, "argmax", sizes, body,
                         source)
    in_strides = contiguous_strides(in_sp)
    k_strides = contiguous_strides(sizes)

    def fn(idx):
        k = best.load(idx)
        sub = dict(zip(iv, idx))
        flat = None
        for a in range(d):
            ra = op("remainder", op("truediv_floor", k, _size_value(k_strides[a], I64)),
                    _size_value(sizes[a], I64))
            pos = op("add", L.Index(sympy.sympify(bounds[a][0]).subs(sub, simultaneous=True),
                                    I64), ra)
            term = op("mul", pos, _size_value(in_strides[a], I64))
            flat = term if flat is None else op("add", flat, term)
        return flat

    return pointwise(I64, node.type.shape, fn, best)


# -- convolution -------------------------------------------------------------------------------
def _unflatten(flat, sizes):
    """Row-major digits of a flat index over `sizes`."""
    out = []
    strides = contiguous_strides(sizes)
    for a in range(len(sizes)):
        q = FloorDiv(flat, strides[a]) if strides[a] != 1 else flat
        out.append(ModIdx(q, sizes[a]) if a else q)
    return out


def _contiguous(ctx: LowerCtx, x: Lazy, name: str, src) -> Lazy:
    if x.view is None or x.view.offset != 0 or tuple(x.view.strides) != \
            contiguous_strides(x.shape):
        return ctx.realize(name, x, src)
    return x


def lower_conv(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """out[n, g, oc, o] = sum over (ic, k) of W[g, oc, (ic, k)] * cols[n, g, (ic, k), o]:
    one batched GEMM over (batch, group). `cols` is the im2col matrix, realised with one loop
    per (channel, kernel offset, output position) dim so no index is divided or reduced
    modulo; 1x1 stride-1 convolutions read the input as it is."""
    x, w = args
    stride, padding = node.attr("stride"), node.attr("padding")
    dilation, g = node.attr("dilation"), node.attr("groups")
    dt = node.type.dtype
    if not dt.is_float:
        raise UnsupportedError(f"convolution of dtype {dt} (node {node.name})")
    if node.attr("transposed"):
        return _lower_conv_transposed(ctx, node, x, w)
    n, c = x.shape[:2]
    out_sp, ksz = node.type.shape[2:], w.shape[2:]
    src = (node.source or node.name,)
    cg, og = c // g, node.type.shape[1] // g
    ckk = cg * product(ksz)
    npix = product(out_sp)
    if all(k == 1 for k in ksz) and all(s == 1 for s in stride) and not any(padding):
        x = _contiguous(ctx, x, node.name + "_input", src)
        cols = ctx.buffer_lazy(x.view.buf, dt, (n, g, cg, npix))
    else:
        full = ctx.realize(node.name + "_im2col", _im2col(
            x, (n, g, cg, *ksz, *out_sp), cg, stride, padding, dilation), src)
        cols = ctx.buffer_lazy(full.view.buf, dt, (n, g, ckk, npix))
    w = _contiguous(ctx, w, node.name + "_weight", src)
    wmat = from_view(dt, (n, g, og, ckk), View(w.view.buf, w.view.offset, (
        sympy.Integer(0), og * ckk, ckk, sympy.Integer(1))))
    out = gemm(ctx, node.name, wmat, cols, (n, g), src, dt)
    return from_view(dt, node.type.shape, View(out.view.buf, sympy.Integer(0),
                                               contiguous_strides(node.type.shape)))


def _im2col(x: Lazy, shape, cg, stride, padding, dilation) -> Lazy:
    """cols[n, g, ci, *k, *o] = x[n, g * cg + ci, o * stride + k * dilation - padding] (0 in
    the padding)."""
    dt = x.dtype
    d = len(stride)

    def fn(idx):
        b, g, ci = idx[:3]
        ks, os_ = idx[3:3 + d], idx[3 + d:]
        pos, conds = [], []
        for a in range(d):
            p = os_[a] * stride[a] + ks[a] * dilation[a] - padding[a]
            if padding[a]:
                conds += [_cmp("ge", p, 0), _cmp("lt", p, x.shape[2 + a])]
                p = _clamp(p, x.shape[2 + a])
            pos.append(p)
        v = x.load((b, g * cg + ci, *pos))
        cond = _all(conds)
        return v if cond is None else op("where", cond, v, const(0, dt))

    return Lazy(dt, tuple(shape), fn, None, 6)


def _lower_conv_transposed(ctx: LowerCtx, node: Node, x: Lazy, w: Lazy) -> Lazy:
    """Transposed convolution without wasted FLOPs: a batched GEMM multiplies every input
    pixel by the whole kernel, cols[n, g, (oc, k), i] = sum_ci w[g * cg + ci, oc, k] *
    x[n, g * cg + ci, i], then each output element gathers its contributions (col2im as a
    reduction over k): out[n, g * og + oc, o] = sum over k of cols[n, g, (oc, k), i] where
    i * stride = o + padding - k * dilation has a solution inside the input."""
    stride, padding = node.attr("stride"), node.attr("padding")
    dilation, g = node.attr("dilation"), node.attr("groups")
    dt = node.type.dtype
    src = (node.source or node.name,)
    n, c = x.shape[:2]
    in_sp, ksz = x.shape[2:], w.shape[2:]
    d = len(ksz)
    cg, og = c // g, w.shape[1]
    kk = product(ksz)
    npix = product(in_sp)
    x = _contiguous(ctx, x, node.name + "_input", src)
    w = _contiguous(ctx, w, node.name + "_weight", src)
    xmat = ctx.buffer_lazy(x.view.buf, dt, (n, g, cg, npix))
    # w [g * cg, og, *k] read as [g, (og, k), cg]: a transposed operand, no copy
    wmat = from_view(dt, (n, g, og * kk, cg), View(w.view.buf, w.view.offset, (
        sympy.Integer(0), cg * og * kk, sympy.Integer(1), og * kk)))
    cols = gemm(ctx, node.name + "_cols", wmat, xmat, (n, g), src, dt)
    cols = ctx.buffer_lazy(cols.view.buf, dt, (n, g, og, *ksz, *in_sp))
    iv, rv = ivars(d + 2), rvars(d)
    b, ch, os_ = iv[0], iv[1], iv[2:]
    pos, conds = [], []
    for a in range(d):
        # shifted by `shift` strides so the dividend is never negative
        shift = ((ksz[a] - 1) * dilation[a]) // stride[a] + 1
        t = os_[a] + padding[a] + shift * stride[a] - rv[a] * dilation[a]
        if stride[a] != 1:
            conds.append(_cmp("eq", ModIdx(t, stride[a]), 0))
        i = FloorDiv(t, stride[a]) - shift
        conds += [_cmp("ge", i, 0), _cmp("lt", i, in_sp[a])]
        pos.append(_clamp(i, in_sp[a]))
    body = cols.load((b, FloorDiv(ch, og), ModIdx(ch, og), *rv, *pos))
    body = op("where", _all(conds), body, const(0, dt))
    return ctx.reduction(node.name, dt, node.type.shape, "sum", tuple(ksz), body, src)


# -- upsampling --------------------------------------------------------------------------------
# One dim of an upsampling is a list of taps (source index, weight): the output element is the
# sum over every combination of one tap per dim of the product of their weights times the
# input there. A source index is a sympy expression when it is affine in the output index (no
# copy, vectorisable) and else a Loop IR int64 value (an indirect load). Source coordinates are
# computed in the same precision as eager (float32 for nearest; the op's float type for linear
# and cubic), so the indices agree with eager bit for bit.

CUBIC_A = -0.75


def _np(dt):
    return np.float32 if dt == dtypes.float32 else np.float64


def _index_value(o) -> L.Expr:
    return o if isinstance(o, L.Op) else L.Index(sympy.sympify(o), I64)


def _float_of(v, dt) -> L.Expr:
    return cast(_index_value(v), dt)


def _ratio(num, den, dt) -> L.Expr:
    """num / den in dt, rounded like C++ (folded when both are static)."""
    num, den = sympy.sympify(num), sympy.sympify(den)
    if num.is_Integer and den.is_Integer:
        t = _np(dt)
        return const(float(t(int(num)) / t(int(den))), dt)
    return op("div", _float_of(num, dt), _float_of(den, dt))


def _scale(size, out, align: bool, given, dt) -> L.Expr:
    """Source coordinate per output step (eager's area_pixel_compute_scale)."""
    if align:
        out = sympy.sympify(out)
        if out.is_Integer:
            return _ratio(size - 1, out - 1, dt) if int(out) > 1 else const(0, dt)
        return op("where", _cmp("gt", out, 1), _ratio(size - 1, out - 1, dt), const(0, dt))
    if given is not None and given > 0:
        return const(float(_np(dt)(1.0 / given)), dt)
    return _ratio(size, out, dt)


def _source_coord(scale: L.Expr, o, align: bool, clamp_low: bool, dt) -> L.Expr:
    """Eager's area_pixel_compute_source_index."""
    of = _float_of(o, dt)
    if align:
        return op("mul", scale, of)
    src = op("sub", op("mul", scale, op("add", of, const(0.5, dt))), const(0.5, dt))
    return op("maximum", src, const(0, dt)) if clamp_low else src


def _to_index(v: L.Expr) -> L.Expr:
    return cast(op("floor", v), I64)


def _imin(a: L.Expr, b) -> L.Expr:
    return op("minimum", a, _index_value(b))


def _imax(a: L.Expr, b) -> L.Expr:
    return op("maximum", a, _index_value(b))


def _nearest_taps(o, size, out, given, exact: bool):
    out, size = sympy.sympify(out), sympy.sympify(size)
    if not exact and (given is None or given == 1.0) and sympy.expand(out - size) == 0:
        return [(o, None)]
    if not exact and given is None and sympy.expand(out - 2 * size) == 0:
        return [(FloorDiv(o, 2), None)]
    f32 = dtypes.float32
    scale = _scale(size, out, False, given, f32)
    of = _float_of(o, f32)
    if exact:
        of = op("add", of, const(0.5, f32))
    return [(_imin(_to_index(op("mul", of, scale)), size - 1), None)]


def _linear_taps(o, size, out, given, align: bool, dt):
    if sympy.expand(sympy.sympify(out) - size) == 0 and (given is None or given == 1.0):
        return [(o, None)]
    real = _source_coord(_scale(size, out, align, given, dt), o, align, True, dt)
    i0 = _imin(_to_index(real), size - 1)
    lam = op("minimum", op("maximum", op("sub", real, cast(i0, dt)), const(0, dt)),
             const(1, dt))
    i1 = op("add", i0, cast(op("lt", i0, _index_value(size - 1), dtype=BOOL), I64))
    return [(i0, op("sub", const(1, dt), lam)), (i1, lam)]


def _cubic_taps(o, size, out, given, align: bool, dt):
    real = _source_coord(_scale(size, out, align, given, dt), o, align, False, dt)
    fl = op("floor", real)
    t = op("sub", real, fl)
    base = cast(fl, I64)
    a = const(CUBIC_A, dt)

    def near(x):  # |x| <= 1: ((A + 2) x - (A + 3)) x x + 1
        return op("add", op("mul", op("mul", op("sub", op("mul", const(CUBIC_A + 2, dt), x),
                                                   const(CUBIC_A + 3, dt)), x), x),
                  const(1, dt))

    def far(x):  # 1 < |x| < 2: ((A x - 5A) x + 8A) x - 4A
        return op("sub", op("mul", op("add", op("mul", op("sub", op("mul", a, x),
                                                             const(5 * CUBIC_A, dt)), x),
                                             const(8 * CUBIC_A, dt)), x),
                  const(4 * CUBIC_A, dt))

    one = const(1, dt)
    weights = [far(op("add", t, one)), near(t), near(op("sub", one, t)),
               far(op("sub", const(2, dt), t))]
    taps = []
    for j, w in enumerate(weights):
        i = _imin(_imax(op("add", base, const(j - 1, I64)), 0), size - 1)
        taps.append((i, w))
    return taps


def _gather(ctx: LowerCtx, x: Lazy, name: str, src) -> L.Expr:
    """x at `src`, whose entries are sympy index expressions or Loop IR int64 values."""
    data = {d: v for d, v in enumerate(src) if isinstance(v, L.Expr)}
    if not data:
        return x.load(tuple(src))
    plain = [None if d in data else v for d, v in enumerate(src)]
    return indirect_load(ctx, x, plain, data, wrap=False)


def _combine(ctx, x: Lazy, lead_idx, per_dim, dt) -> L.Expr:
    total = None
    for combo in _product(per_dim):
        w = None
        for _i, wt in combo:
            if wt is not None:
                w = wt if w is None else op("mul", w, wt)
        v = cast(_gather(ctx, x, "", [*lead_idx, *(i for i, _ in combo)]), dt)
        term = v if w is None else op("mul", w, v)
        total = term if total is None else op("add", total, term)
    return total


def _product(lists):
    out = [[]]
    for taps in lists:
        out = [c + [t] for c in out for t in taps]
    return out


def lower_upsample(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    mode, align = node.attr("mode"), node.attr("align_corners")
    scales = node.attr("scales")
    d = len(scales)
    lead = x.rank - d
    dt = node.type.dtype
    if mode != "nearest" and mode != "nearest_exact" and not dt.is_float:
        raise UnsupportedError(f"{mode} upsampling of dtype {dt} (node {node.name})")
    if x.view is None:
        x = ctx.realize(node.name + "_src", x, (node.source or node.name,))
    in_sp, out_sp = x.shape[lead:], node.type.shape[lead:]

    def fn(idx):
        per_dim = []
        for a in range(d):
            o, size, out, given = idx[lead + a], in_sp[a], out_sp[a], scales[a]
            if mode in ("nearest", "nearest_exact"):
                per_dim.append(_nearest_taps(o, size, out, given, mode == "nearest_exact"))
            elif mode == "linear":
                per_dim.append(_linear_taps(o, size, out, given, align, dt))
            else:
                per_dim.append(_cubic_taps(o, size, out, given, align, dt))
        return _combine(ctx, x, idx[:lead], per_dim, dt)

    return pointwise(dt, node.type.shape, fn, x)


# -- grid sampling -----------------------------------------------------------------------------
def _reflect(c: L.Expr, low2: int | sympy.Expr, high2, dt) -> L.Expr:
    """Reflect c into [low2 / 2, high2 / 2] (eager's reflect_coordinates)."""
    lo = _ratio(low2, 2, dt) if not isinstance(low2, L.Expr) else low2
    span = _ratio(sympy.sympify(high2) - low2, 2, dt)
    c = op("abs", op("sub", c, lo))
    extra = op("fmod", c, span)
    flips = op("floor", op("div", c, span))
    even = op("eq", op("fmod", flips, const(2, dt)), const(0, dt), dtype=BOOL)
    return op("where", even, op("add", extra, lo), op("add", op("sub", span, extra), lo))


def _grid_coord(g: L.Expr, size, padding: str, align: bool, dt) -> L.Expr:
    """Grid value in [-1, 1] -> source coordinate (eager's grid_sampler_compute_source_index)."""
    one, two = const(1, dt), const(2, dt)
    sz = _float_of(size, dt)
    if align:
        c = op("mul", op("div", op("add", g, one), two), op("sub", sz, one))
    else:
        c = op("div", op("sub", op("mul", op("add", g, one), sz), one), two)
    if padding == "zeros":
        return c
    if padding == "reflection":
        degenerate = sympy.sympify(size) == 1 if align else False
        if degenerate:
            c = const(0, dt)
        elif align:
            c = _reflect(c, 0, 2 * (sympy.sympify(size) - 1), dt)
        else:
            c = _reflect(c, -1, 2 * sympy.sympify(size) - 1, dt)
    return op("minimum", op("maximum", c, const(0, dt)), op("sub", sz, one))


def lower_grid_sample(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """out[n, c, y, x] samples input[n, c] at grid[n, y, x] = (gx, gy) in [-1, 1]."""
    x, grid = args
    dt = node.type.dtype
    if not dt.is_float:
        raise UnsupportedError(f"grid sampling of dtype {dt} (node {node.name})")
    mode, padding, align = node.attr("mode"), node.attr("padding"), node.attr("align_corners")
    if x.view is None:
        x = ctx.realize(node.name + "_src", x, (node.source or node.name,))
    h, w = x.shape[2], x.shape[3]

    def fn(idx):
        n, c, oy, ox = idx
        cx = _grid_coord(cast(grid.load((n, oy, ox, sympy.Integer(0))), dt), w, padding,
                         align, dt)
        cy = _grid_coord(cast(grid.load((n, oy, ox, sympy.Integer(1))), dt), h, padding,
                         align, dt)
        if mode == "nearest":
            taps = [[(op("round", cy), None)], [(op("round", cx), None)]]
        else:
            fy, fx = op("floor", cy), op("floor", cx)
            ty, tx = op("sub", cy, fy), op("sub", cx, fx)
            one = const(1, dt)
            taps = [[(fy, op("sub", one, ty)), (op("add", fy, one), ty)],
                    [(fx, op("sub", one, tx)), (op("add", fx, one), tx)]]
        total = None
        for (py, wy), (px, wx) in _product(taps):
            conds, pos = [], []
            for p, size in ((py, h), (px, w)):
                # out-of-range taps read 0 (every padding mode; border and reflection
                # coordinates are already inside, except for the +1 tap's zero weight)
                ok = op("logical_and", op("ge", p, const(0, dt), dtype=BOOL),
                        op("le", p, _float_of(size - 1, dt), dtype=BOOL),
                        dtype=BOOL)
                conds.append(ok)
                pos.append(_imin(_imax(cast(_nan_to_zero(p), I64), 0), size - 1))
            v = cast(_gather(ctx, x, "", [n, c, *pos]), dt)
            v = op("where", _all(conds), v, const(0, dt))
            weight = None if wy is None else op("mul", wy, wx)
            term = v if weight is None else op("mul", weight, v)
            total = term if total is None else op("add", total, term)
        return total

    return pointwise(dt, node.type.shape, fn, x, grid)


def _nan_to_zero(p: L.Expr) -> L.Expr:
    """A NaN coordinate converts to an arbitrary integer in C++: read element 0 instead (the
    tap is masked anyway: NaN fails the range test)."""
    return op("where", op("isnan", p, dtype=BOOL), const(0, p.dtype), p)
