"""Complex products as real GEMMs (the matmul family: mm, bmm, matmul, mv, dot, vdot, linear,
addmm, baddbmm: one real GEMM per product on the interleaved parts), prod / cumsum / cumprod
/ logcumsumexp (torch.fft: frontend/aten_complex_fft.py): aten op on complex operands -> kiln
Graph IR nodes. Split from frontend/aten_complex.py,
whose registry, part views (`_Parts`) and elementwise formulas these converters build on;
importing this module registers them (frontend/export.py imports it)."""

from __future__ import annotations

import math

import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_complex import _arg, _Parts, _scaled, _start, register
from kiln.frontend.aten_high import Fallback
from kiln.ir import dtypes
from kiln.ir.sym import product
# -- the matmul family: one real GEMM on the parts ----------------------------------------------

def _gemm(p: _Parts, x: str, y: str) -> tuple[str, str]:
    """(real, imaginary) of x @ y (complex or real; shapes (..., M, K) and (..., K, N), equal
    batch dims) as ONE real GEMM of the part dtype: x's own layout read as the real
    (..., M, 2K) matrix of interleaved parts, times the real (..., 2K, 2N) matrix whose 2 x 2
    block (k, n) is [[c, d], [-d, c]] (y[k, n] = c + di), gives (..., M, 2N): x @ y's
    interleaved parts. Each part is a sum of 2K real products, accumulated by kiln's GEMM
    backend, as a complex GEMM (eager's cgemm / zgemm) sums ac - bd: 4 real products per
    complex one, not Gauss's 3 (whose (a + b)(c + d) - ac - bd cancels: its error in the
    imaginary part grows with |a||d| + |b||c| over |ad + bc|, beyond eager's)."""
    b = p.b
    cdt = dtypes.complex_of(p.rdt)
    x, y = (b.cast_to(v, cdt.torch, p.n) for v in (x, y))
    xs, ys = b.types[x].shape, b.types[y].shape
    *batch, m, k = xs
    n_ = ys[-1]
    r = len(batch)
    xr = p.view(p.pairs(x), (*batch, m, 2 * k))
    c, d = p.parts_of(y)
    blk = (*batch, k, 1, n_, 1)
    c4, d4, nd4 = (p.view(v, blk) for v in (c, d, p.e("neg", d)))

    def cat(parts, dim, shape):
        return b.emit("cat", parts, None, like=p.n, shape=shape, dtype=p.rdt, dim=dim)

    rows = [cat([u, v], r + 3, (*batch, k, 1, n_, 2)) for u, v in ((c4, d4), (nd4, c4))]
    yr = p.view(cat(rows, r + 1, (*batch, k, 2, n_, 2)), (*batch, 2 * k, 2 * n_))
    out = b.emit("matmul", [xr, yr], None, like=p.n, shape=(*batch, m, 2 * n_), dtype=p.rdt)
    out = p.view(out, (*batch, m, n_, 2))
    re, im = (b.emit("select", [out], None, like=p.n, shape=(*batch, m, n_), dtype=p.rdt,
                     dim=r + 2, index=j) for j in (0, 1))
    return re, im


@register("aten.mm.default", "aten.bmm.default")
def _mm(b, n):
    p = _start(b, n)
    return p.join(*_gemm(p, b.tensor(n.args[0]), b.tensor(n.args[1])))


@register("aten.matmul.default")
def _matmul(b, n):
    """2-D @ 2-D and batched @ batched of equal batch shape; other forms (vectors,
    broadcasting) decompose to mm / bmm / mv, as for real operands."""
    x, y = n.args[0], n.args[1]
    xs, ys = tuple(b.shape(x)), tuple(b.shape(y))
    if len(xs) < 2 or len(ys) < 2 or len(xs) != len(ys) or xs[:-2] != ys[:-2]:
        raise Fallback("complex matmul with broadcasting or vectors")
    return _mm(b, n)


@register("aten.mv.default", "aten.dot.default", "aten.vdot.default")
def _mv(b, n):
    """Matrix @ vector, vector . vector (vdot: the first one conjugated) as a GEMM with a
    column (and a row)."""
    p = _start(b, n)
    x, y = b.tensor(n.args[0]), b.tensor(n.args[1])
    if "vdot" in str(n.target):
        xr, xi = p.parts_of(x)
        x = p.join_as(xr, p.e("neg", xi), b.types[x].shape, dtypes.complex_of(p.rdt))
    if len(b.types[x].shape) == 1:
        x = p.view(x, (1,) + tuple(b.types[x].shape))
    y = p.view(y, tuple(b.types[y].shape) + (1,))
    re, im = _gemm(p, x, y)
    return p.join(*(p.view(v, b.shape(n)) for v in (re, im)))


@register("aten.linear.default")
def _linear(b, n):
    p = _start(b, n)
    x, w = b.tensor(n.args[0]), b.tensor(n.args[1])
    bias = _arg(n, 2, "bias")
    xs, ws = b.types[x].shape, b.types[w].shape
    rows = product(xs[:-1])
    flat = p.view(x, (rows, xs[-1]))
    wt = b.emit("permute", [w], None, like=n, shape=(ws[1], ws[0]), dims=(1, 0),
                dtype=b.types[w].dtype)
    re, im = _gemm(p, flat, wt)
    if bias is not None:
        br, bi = p.parts(bias)
        re, im = p.e("add", re, br), p.e("add", im, bi)
    return p.join(*(p.view(v, b.shape(n)) for v in (re, im)))


@register("aten.addmm.default", "aten.baddbmm.default")
def _addmm(b, n):
    """beta * input + alpha * (x @ y); beta == 0 ignores input (NaN included), as eager."""
    p = _start(b, n)
    re, im = _scaled(p, n.kwargs.get("alpha", 1), *_gemm(p, b.tensor(n.args[1]),
                                                          b.tensor(n.args[2])))
    beta = n.kwargs.get("beta", 1)
    if beta != 0:
        cr, ci = _scaled(p, beta, *p.parts(n.args[0]))
        re, im = p.e("add", re, cr), p.e("add", im, ci)
    return p.join(re, im)


# -- products and scans --------------------------------------------------------------------------

def _halves(p: _Parts, re: str, im: str, dim: int) -> tuple[str, str]:
    """The product along static `dim` by a pairwise tree: (first half) * (second half) until
    one element is left (an odd element carried to the next level)."""
    b = p.b
    while True:
        shape = list(b.types[re].shape)
        size = shape[dim]
        if not size.is_Integer:
            raise UnsupportedError("complex prod / cumprod over a dynamic size")
        size = int(size)
        if size <= 1:
            return re, im
        h = size // 2

        def cut(x, lo, hi):
            return b.emit("slice", [x], None, like=p.n, shape=(*shape[:dim], hi - lo,
                          *shape[dim + 1:]), dtype=p.rdt, dim=dim, start=lo, end=hi, step=1)

        r2, i2 = p.mul(cut(re, 0, h), cut(im, 0, h), cut(re, h, 2 * h), cut(im, h, 2 * h))
        if size % 2:
            out = (*shape[:dim], h + 1, *shape[dim + 1:])
            r2, i2 = (b.emit("cat", [x, cut(y, size - 1, size)], None, like=p.n, shape=out,
                             dtype=p.rdt, dim=dim) for x, y in ((r2, re), (i2, im)))
        re, im = r2, i2


def _last_product(p: _Parts, x: str, dim: int) -> tuple[str, str]:
    """The product along dynamic `dim` of kiln value x: its prefix products by doubling, one
    1 + 0i put before them (pad), the element at the size (the empty product is 1)."""
    b, n = p.b, p.n
    shape = tuple(b.types[x].shape)
    rank = len(shape)
    bound = _size_bound(b, n.args[0], dim) if tuple(b.shape(n.args[0])) == shape else \
        2 ** SCAN_MAX_LEVELS  # (all dims flattened: no bound of the product kept)
    re, im = _doubling(p, *p.parts_of(x), shape, dim, bound, p.mul, 1.0)
    pad = [0] * (2 * (rank - dim))
    pad[-2:] = [1, 0]
    longer = tuple(s + 1 if d == dim else s for d, s in enumerate(shape))
    re, im = (b.emit("pad", [v], None, like=n, shape=longer, dtype=p.rdt, pad=tuple(pad),
                     value=c) for v, c in ((re, 1.0), (im, 0.0)))
    out = tuple(s for d, s in enumerate(shape) if d != dim)
    return tuple(b.emit("select", [v], None, like=n, shape=out, dtype=p.rdt, dim=dim,
                        index=shape[dim]) for v in (re, im))


def _library_scan(b, n, x: str) -> bool:
    """Whether complex kiln value x (of node n's complex type) takes kiln's CPU library scan
    (kiln_lib.h `scan_complex`: complex64 / complex128 rows, sequential like eager's loops)."""
    dt = b.types[x].dtype
    return b.library_routines and dt in (dtypes.complex64, dtypes.complex128) and \
        b.meta_dtype(n) == dt.torch


def _sequential_product(p: _Parts, x: str, dim: int) -> tuple[str, str]:
    """The product along `dim` of complex kiln value x, left to right in its own precision:
    the last element of kiln's CPU library scan of kind prod_own (eager's prod reduction
    loop: from 1 + 0i, textbook products, so infinities give eager's NaN pattern; eager's
    vectorised loop for rows of 4 vectors or more multiplies in another order). A 1 + 0i put
    before the scan (pad) makes the empty product 1, at static and dynamic sizes."""
    b, n = p.b, p.n
    shape = tuple(b.types[x].shape)
    rank = len(shape)
    scan = b.emit("scan", [x], None, like=n, shape=shape, dtype=b.types[x].dtype,
                  kind="prod_own", dim=dim)
    pad = [0] * (2 * (rank - dim))
    pad[-2:] = [1, 0]
    longer = tuple(s + 1 if d == dim else s for d, s in enumerate(shape))
    out = tuple(s for d, s in enumerate(shape) if d != dim)
    return tuple(
        b.emit("select", [b.emit("pad", [v], None, like=n, shape=longer, dtype=p.rdt,
                                 pad=tuple(pad), value=c)],
               None, like=n, shape=out, dtype=p.rdt, dim=dim, index=shape[dim])
        for v, c in zip(p.parts_of(scan), (1.0, 0.0)))


@register("aten.prod.default", "aten.prod.dim_int")
def _prod(b, n):
    """The product of complex values along one dimension (or all). CPU: left to right
    (`_sequential_product`, eager's loop); CUDA: a pairwise tree of complex products (log2 n
    levels of pointwise ops; eager's GPU reduction has its own order too)."""
    p = _start(b, n)
    if n.kwargs.get("dtype") is not None and not n.kwargs["dtype"].is_complex:
        raise UnsupportedError("complex prod to a real dtype")
    x = b.tensor(n.args[0])
    shape = b.types[x].shape
    if "dim_int" in str(n.target):
        dim = n.args[1] % max(len(shape), 1)  # (keepdim: the final view's shape)
    else:
        x = p.view(x, (product(shape),))
        dim = 0
    if len(b.types[x].shape) == 0:
        return p.join(*p.parts_of(x))
    if _library_scan(b, n, x):
        return p.join(*(p.view(v, b.shape(n)) for v in _sequential_product(p, x, dim)))
    size = b.types[x].shape[dim]
    if not size.is_Integer:  # a dynamic size: the last prefix product (1 when empty)
        return p.join(*(p.view(v, b.shape(n)) for v in _last_product(p, x, dim)))
    re, im = _halves(p, *p.parts_of(x), dim)
    return p.join(*(p.view(v, b.shape(n)) for v in (re, im)))


SCAN_MAX_LEVELS = 40  # a dynamic size without an upper bound: 2^40 elements along the dim


def _size_bound(b, x, dim: int) -> int:
    """An upper bound of dim `dim` of FX node x's size: its value when static, else the size
    expression at the export range's upper bounds of its symbols (2^SCAN_MAX_LEVELS when one
    is unbounded)."""
    size = x.meta["val"].shape[dim]
    if isinstance(size, int):
        return size
    e = size.node.expr
    cap = 2 ** SCAN_MAX_LEVELS
    try:
        ups = {s: int(b.ranges[s].upper) for s in e.free_symbols}
        value = int(e.xreplace(ups))
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
        return cap
    return min(max(value, 1), cap)


def _doubling(p: _Parts, re: str, im: str, shape, dim: int, bound: int, combine,
              identity: float) -> tuple[str, str]:
    """The inclusive scan of (re, im) along `dim` by doubling (Hillis-Steele): level k
    combines each element with the partial result 2^k before it, where there is one (a
    mask on the position: the first elements keep their value exactly; no identity
    element is combined with the others). The first element is combine(identity + 0i, x_0),
    as eager's loop starts from the identity (1 * (inf + 0i) is inf + NaN i there).
    log2(bound) levels of pointwise ops (static or dynamic size: the shift is a pad, a level
    past the size is a no-op), so both targets compute it; eager combines left to right
    (other rounding, same terms)."""
    b, n = p.b, p.n
    shape = tuple(shape)
    rank = len(shape)
    re, im = (x if tuple(b.types[x].shape) == shape else
              b.emit("expand", [x], None, like=n, shape=shape, dtype=p.rdt) for x in (re, im))
    i64 = dtypes.int64
    pos = b.emit("iota", [], None, like=n, shape=(shape[dim],), dtype=i64, start=0, step=1)
    pos = b.emit("view", [pos], None, like=n, dtype=i64,
                 shape=tuple(shape[d] if d == dim else 1 for d in range(rank)))
    first = b.emit("eq", [pos, b.scalar(0, torch.int64)], None, like=n,
                   shape=b.types[pos].shape, dtype=dtypes.bool_)
    r0, i0 = combine(p.const(identity), p.const(0.0), re, im)
    re, im = p.e("where", first, r0, re), p.e("where", first, i0, im)
    k = 1
    while k < bound:
        pad = [0] * (2 * (rank - dim))
        pad[-2:] = [k, -k]  # (torch's order: the last dim's pair first, `dim`'s last)
        sr, si = (b.emit("pad", [x], None, like=n, shape=shape, dtype=p.rdt, pad=tuple(pad),
                         value=0.0) for x in (re, im))
        nr, ni = combine(sr, si, re, im)
        keep = b.emit("ge", [pos, b.scalar(k, torch.int64)], None, like=n,
                      shape=b.types[pos].shape, dtype=dtypes.bool_)
        re, im = p.e("where", keep, nr, re), p.e("where", keep, ni, im)
        k *= 2
    return re, im


def _add_parts(p: _Parts):
    return lambda a, b_, c, d: (p.e("add", a, c), p.e("add", b_, d))


@register("aten.cumsum.default")
def _cumsum(b, n):
    """A real scan of each part: kiln's CPU library scan (as for real cumsum, accumulating in
    float64 as eager's CPU loop); where the target has no library (CUDA) by doubling."""
    p = _start(b, n)
    if n.kwargs.get("dtype") is not None and not n.kwargs["dtype"].is_complex:
        raise UnsupportedError("complex cumsum to a real dtype")
    dim = n.args[1] % max(b.rank(n.args[0]), 1)
    if b.rank(n.args[0]) == 0:
        return p.join(*p.parts(n.args[0]))
    if not b.library_routines:
        return p.join(*_doubling(p, *p.parts(n.args[0]), b.shape(n), dim,
                                 _size_bound(b, n.args[0], dim), _add_parts(p), 0.0))
    re, im = (b.emit("scan", [x], None, like=n, dtype=p.rdt, kind="sum", dim=dim)
              for x in p.parts(n.args[0]))
    return p.join(re, im)


def _log_add_exp_parts(p: _Parts):
    """combine(s, v) = log(exp(v) + exp(s)) on parts, as ATen's _log_add_exp_helper(v, s)
    (kiln_lib.h `log_add_exp`): NaN anywhere gives NaN + NaN i; max: the operand with the
    larger real part (ties: v), min the other; two equal infinite real parts: -inf gives min,
    +inf log(exp(min) + exp(max)); else max + log1p(exp(min - max)), log1p(w) as
    (log1p(wr (2 + wr) + wi^2) / 2, atan2(wi, 1 + wr))."""
    e, c = p.e, p.const

    def combine(sr, si, vr, vi):
        nan = e("logical_or", e("logical_or", e("isnan", sr), e("isnan", si)),
                e("logical_or", e("isnan", vr), e("isnan", vi)))
        v_max = e("logical_not", e("lt", vr, sr))
        mxr, mxi = e("where", v_max, vr, sr), e("where", v_max, vi, si)
        mnr, mni = e("where", v_max, sr, vr), e("where", v_max, si, vi)
        # general: max + log1p(exp(min - max))
        scale = e("exp", e("sub", mnr, mxr))
        di = e("sub", mni, mxi)
        wr, wi = e("mul", scale, e("cos", di)), e("mul", scale, e("sin", di))
        q = e("add", e("mul", wr, e("add", c(2.0), wr)), e("mul", wi, wi))
        gr = e("add", mxr, e("mul", c(0.5), e("log1p", q)))
        gi = e("add", mxi, e("atan2", wi, e("add", c(1.0), wr)))
        # both real parts +inf: log(exp(min) + exp(max)), exp(inf + i t) = inf (cos t, sin t)
        # (t = 0: inf + 0i, C99)
        def ex(r, t):
            zero = e("eq", t, c(0.0))
            return (e("where", zero, r, e("mul", r, e("cos", t))),
                    e("where", zero, t, e("mul", r, e("sin", t))))
        ar, ai = ex(mnr, mni)
        br, bi = ex(mxr, mxi)
        tr, ti = e("add", ar, br), e("add", ai, bi)
        hr = e("log", e("sqrt", e("add", e("mul", tr, tr), e("mul", ti, ti))))
        hi = e("atan2", ti, tr)
        both_inf = e("logical_and", e("isinf", mnr), e("eq", mnr, mxr))
        pos = e("logical_and", both_inf, e("lt", c(0.0), mnr))
        neg = e("logical_and", both_inf, e("lt", mnr, c(0.0)))
        rr = e("where", pos, hr, e("where", neg, mnr, gr))
        ri = e("where", pos, hi, e("where", neg, mni, gi))
        return e("where", nan, c(math.nan), rr), e("where", nan, c(math.nan), ri)
    return combine


@register("aten.logcumsumexp.default")
def _logcumsumexp(b, n):
    """CPU: kiln's library scan on the complex values themselves (kiln_lib.h `scan_complex`):
    eager's sequential loop in complex128, so the imaginary part keeps eager's branch (each
    step adds to the larger-real-part operand's angle: the result depends on the order).
    Targets without the library (CUDA): by doubling (`_doubling`, from -inf + 0i as eager's
    loop) with `_log_add_exp_parts`: the real part as eager's, the imaginary part equal modulo
    2 pi (another order of combination; eager's CUDA scan has its own order too)."""
    p = _start(b, n)
    dim = n.args[1] % max(b.rank(n.args[0]), 1)
    if b.library_routines or not b.rank(n.args[0]):
        x = b.tensor(n.args[0])
        return b.emit("scan", [x], n, kind="logsumexp", dim=dim)
    return p.join(*_doubling(p, *p.parts(n.args[0]), b.shape(n), dim,
                             _size_bound(b, n.args[0], dim), _log_add_exp_parts(p),
                             -math.inf))


@register("aten.cumprod.default")
def _cumprod(b, n):
    """Prefix products. CPU: kiln's library scan (kiln_lib.h `scan_complex`, eager's loop in
    complex128, so special values give eager's NaN pattern); CUDA: by doubling (`_doubling`,
    static or dynamic size; infinities may give another NaN pattern than eager's loop)."""
    p = _start(b, n)
    if n.kwargs.get("dtype") is not None and not n.kwargs["dtype"].is_complex:
        raise UnsupportedError("complex cumprod to a real dtype")
    shape = tuple(b.shape(n))
    if shape and isinstance(n.args[0], torch.fx.Node) and \
            _library_scan(b, n, b.tensor(n.args[0])):
        return b.emit("scan", [b.tensor(n.args[0])], n, kind="prod", dim=n.args[1] % len(shape))
    re, im = p.parts(n.args[0])
    if not shape:
        return p.join(re, im)
    dim = n.args[1] % len(shape)
    return p.join(*_doubling(p, re, im, shape, dim, _size_bound(b, n.args[0], dim), p.mul,
                             1.0))
