"""torch.fft (`_fft_c2c`, `_fft_r2c`, `_fft_c2r`) as GEMMs with twiddles computed in float64:
aten op on complex (or real) operands -> kiln Graph IR nodes. Split from
frontend/aten_complex_linalg.py, whose real GEMM of the parts (`_gemm`) each DFT runs;
importing this module registers the converters (frontend/export.py imports it).

A transform of length N along one dim (moved last, the other dims flattened into rows):
- N <= FFT_MAX: one GEMM with the N x N twiddle matrix (N^2 per row);
- larger N with a divisor: the four-step factorisation N = N1 * N2 (N1 the divisor nearest
  sqrt N): N2 DFTs of length N1, a pointwise product with the twiddles W_N^(j2 k1), N1 DFTs of
  length N2, a transpose (each length again by this rule: N (N1 + N2) per row);
- a prime N > FFT_MAX, or a dynamic N with an upper bound (export's Dim max): Bluestein's
  chirp-z, a circular convolution of static length M (a power of two >= 2 N_max - 1) as two
  forward DFTs and one inverse of length M (four-step), the chirps exp(+-i pi (m^2 mod 2N) / N)
  reduced exactly in int64 and computed in float64 (a dynamic N as a value of the run's size).
A dynamic N without an upper bound is left to ATen (UnsupportedError: the fallback)."""

from __future__ import annotations

import math

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_complex import _Parts, _scale_parts, _start, register
from kiln.frontend.aten_complex_linalg import SCAN_MAX_LEVELS, _gemm, _size_bound
from kiln.ir import dtypes
from kiln.ir.sym import product

FFT_MAX = 512  # the longest length one DFT GEMM computes (N^2 per row); longer: factorised
BLUESTEIN_MAX = 2 ** 22  # the longest convolution length M a Bluestein transform uses


def _twiddles(p: _Parts, n: int, cols: int, sign: float, rows: int | None = None,
              weights=None) -> tuple[str, str]:
    """cos / sign * sin of 2 pi (j k mod n) / n for j < rows (n), k < cols: the angles
    reduced exactly in int64, cos / sin in float64 (times `weights`, a function of the row
    index giving (cos factor, sin factor) node names), rounded once to the part dtype."""
    b, node = p.b, p.n
    i64, f64 = dtypes.int64, dtypes.float64
    rows = n if rows is None else rows

    def iota(size, shape):
        x = b.emit("iota", [], None, like=node, shape=(size,), dtype=i64, start=0, step=1)
        return b.emit("view", [x], None, like=node, shape=shape, dtype=i64)

    shape = (rows, cols)
    j = iota(rows, (rows, 1))
    jk = b.emit("mul", [j, iota(cols, (1, cols))], None, like=node, shape=shape, dtype=i64)
    m = b.emit("remainder", [jk, b.scalar(n, torch.int64)], None, like=node, shape=shape,
               dtype=i64)
    th = b.emit("mul", [b.emit("cast", [m], None, like=node, shape=shape, dtype=f64),
                        b.scalar(2 * math.pi / n, torch.float64)], None, like=node,
                shape=shape, dtype=f64)
    c, s = (b.emit(f, [th], None, like=node, shape=shape, dtype=f64) for f in ("cos", "sin"))
    if sign < 0:
        s = b.emit("neg", [s], None, like=node, shape=shape, dtype=f64)
    # exact at the quarter turns (cos pi is -1, sin pi 0): a real signal's DC and Nyquist
    # outputs are then exactly real, as an FFT's (their angle is 0 or pi, not +-pi at random)
    points = [(n // 2, -1.0, 0.0)] if n % 2 == 0 else []
    if n % 4 == 0:
        points += [(n // 4, 0.0, sign), (3 * n // 4, 0.0, -sign)]
    for k, cv, sv in points:
        at = b.emit("eq", [m, b.scalar(k, torch.int64)], None, like=node, shape=shape,
                    dtype=dtypes.bool_)
        c = b.emit("where", [at, b.scalar(cv, torch.float64), c], None, like=node,
                   shape=shape, dtype=f64)
        s = b.emit("where", [at, b.scalar(sv, torch.float64), s], None, like=node,
                   shape=shape, dtype=f64)
    if weights is not None:
        wc, ws = weights(j)
        c, s = (b.emit("mul", [v, w], None, like=node, shape=shape, dtype=f64)
                for v, w in ((c, wc), (s, ws)))
    return p.real(c), p.real(s)


def _split(n: int) -> int | None:
    """The divisor of n nearest sqrt(n) from below (the four-step's N1); None for a prime."""
    for d in range(math.isqrt(n), 1, -1):
        if n % d == 0:
            return d
    return None


def _permute(p: _Parts, x: str, dims) -> str:
    shape = p.b.types[x].shape
    return p.b.emit("permute", [x], None, like=p.n, shape=tuple(shape[d] for d in dims),
                    dims=tuple(dims), dtype=p.b.types[x].dtype)


def _cmul(p: _Parts, x: str, re: str, im: str) -> str:
    """Complex value x times (re + i im) (broadcast), the textbook product."""
    a, bi = p.parts_of(x)
    r, i = p.mul(a, bi, re, im)
    shape = p.b.types[x].shape
    return p.join_as(r, i, shape, p.b.types[x].dtype)


def _rows_dft(p: _Parts, x: str, n, forward: bool, cols=None, bound: int | None = None) -> str:
    """The DFT of each row of complex value x (rows, n) (the first `cols` outputs): a complex
    value (rows, cols)."""
    b = p.b
    rows = b.types[x].shape[0]
    cdt = b.types[x].dtype
    sign = -1.0 if forward else 1.0
    if n.is_Integer and int(n) <= FFT_MAX:
        n = int(n)
        cols = n if cols is None else int(cols)
        w = p.join_as(*_twiddles(p, n, cols, sign), (n, cols), cdt)
        re, im = _gemm(p, x, w)
        return p.join_as(re, im, (rows, cols), cdt)
    n1 = _split(int(n)) if n.is_Integer else None
    if n1 is not None:
        out = _four_step(p, x, int(n), n1, forward)
    else:
        out = _bluestein(p, x, n, forward, bound)
    if cols is not None and sympy.sympify(cols) != n:
        out = b.emit("slice", [out], None, like=p.n, shape=(rows, cols), dtype=cdt, dim=1,
                     start=0, end=cols, step=1)
    return out


def _four_step(p: _Parts, x: str, n: int, n1: int, forward: bool) -> str:
    """x (rows, n), n = n1 n2, input index j = j1 n2 + j2, output k = k1 + n1 k2:
    X[k1 + n1 k2] = sum_j2 W_n2^(j2 k2) W_n^(j2 k1) sum_j1 W_n1^(j1 k1) x[j1 n2 + j2]."""
    b = p.b
    rows = b.types[x].shape[0]
    n2 = n // n1
    a = _permute(p, p.view(x, (rows, n1, n2)), (0, 2, 1))  # [j2, j1]
    a = p.view(_rows_dft(p, p.view(a, (rows * n2, n1)), sympy.Integer(n1), forward),
               (rows, n2, n1))  # [j2, k1]
    c, s = _twiddles(p, n, n1, -1.0 if forward else 1.0, rows=n2)  # W_n^(j2 k1)
    a = _cmul(p, a, c, s)
    a = _permute(p, a, (0, 2, 1))  # [k1, j2]
    a = p.view(_rows_dft(p, p.view(a, (rows * n1, n2)), sympy.Integer(n2), forward),
               (rows, n1, n2))  # [k1, k2]
    a = _permute(p, a, (0, 2, 1))  # [k2, k1]: k = k1 + n1 k2 row-major
    return p.view(a, (rows, n))


def _chirp(p: _Parts, n, m: str, sign: float) -> tuple[str, str]:
    """cos / sign * sin of pi (m^2 mod 2n) / n for the int64 value m (n: an int or a size
    expression, a value of the run), computed in float64, rounded to the part dtype."""
    b, node = p.b, p.n
    i64, f64 = dtypes.int64, dtypes.float64
    shape = b.types[m].shape
    nv = b.scalar(n, torch.int64)
    e = b.emit("remainder", [b.emit("mul", [m, m], None, like=node, shape=shape, dtype=i64),
                             b.emit("mul", [nv, b.scalar(2, torch.int64)], None, like=node,
                                    shape=(), dtype=i64)], None, like=node, shape=shape,
               dtype=i64)
    th = b.emit("div", [b.emit("mul", [b.emit("cast", [e], None, like=node, shape=shape,
                                              dtype=f64), b.scalar(math.pi, torch.float64)],
                               None, like=node, shape=shape, dtype=f64),
                        b.emit("cast", [nv], None, like=node, shape=(), dtype=f64)],
                None, like=node, shape=shape, dtype=f64)
    c, s = (b.emit(f, [th], None, like=node, shape=shape, dtype=f64) for f in ("cos", "sin"))
    if sign < 0:
        s = b.emit("neg", [s], None, like=node, shape=shape, dtype=f64)
    return p.real(c), p.real(s)


def _bluestein(p: _Parts, x: str, n, forward: bool, bound: int | None) -> str:
    """Bluestein's chirp-z: with a_m = exp(sign i pi m^2 / n), X_k = a_k sum_j (x_j a_j)
    conj(a_(k - j)): a circular convolution of length M >= 2 n_max - 1 (a power of two) by
    DFTs of length M; n static or dynamic (bound: its upper bound)."""
    b = p.b
    rows = b.types[x].shape[0]
    cdt = b.types[x].dtype
    top = int(n) if n.is_Integer else bound
    n = int(n) if n.is_Integer else n
    if top is None or 2 * top - 1 > BLUESTEIN_MAX:
        raise UnsupportedError(f"fft over a dim of size {n} (no upper bound <= "
                               f"{BLUESTEIN_MAX // 2}) computes on complex values in a way kiln "
                               "leaves to ATen: enable aten_fallback")
    big = 1 << (2 * top - 2).bit_length()  # M >= 2 top - 1
    sign = -1.0 if forward else 1.0
    i64 = dtypes.int64

    def iota(size):
        return b.emit("iota", [], None, like=p.n, shape=(size,), dtype=i64, start=0, step=1)

    ac, as_ = _chirp(p, n, iota(n), sign)  # a_j, j < n
    u = _cmul(p, x, ac, as_)
    u = b.emit("pad", [u], None, like=p.n, shape=(rows, big), dtype=cdt, pad=(0, big - n),
               value=0.0)
    # v_q = conj(a_m), m = q for q < n, M - q for q > M - n, else 0
    q = iota(big)
    nv = b.scalar(n, torch.int64)
    low = b.emit("lt", [q, nv], None, like=p.n, shape=(big,), dtype=dtypes.bool_)
    mq = b.emit("sub", [b.scalar(big, torch.int64), q], None, like=p.n, shape=(big,),
                dtype=i64)
    high = b.emit("lt", [mq, nv], None, like=p.n, shape=(big,), dtype=dtypes.bool_)
    m = b.emit("where", [low, q, mq], None, like=p.n, shape=(big,), dtype=i64)
    vc, vs = _chirp(p, n, m, -sign)
    keep = b.emit("logical_or", [low, high], None, like=p.n, shape=(big,), dtype=dtypes.bool_)
    zero = p.const(0.0)
    v = p.join_as(p.e("where", keep, vc, zero), p.e("where", keep, vs, zero), (1, big), cdt)
    big_n = sympy.Integer(big)
    fu = _rows_dft(p, u, big_n, True)
    fv = _rows_dft(p, v, big_n, True)
    fr, fi = p.parts_of(fv)
    conv = _rows_dft(p, _cmul(p, fu, fr, fi), big_n, False)
    cr, ci = _scale_parts(p, 1.0 / big, *p.parts_of(conv))
    conv = p.join_as(cr, ci, (rows, big), cdt)
    conv = b.emit("slice", [conv], None, like=p.n, shape=(rows, n), dtype=cdt, dim=1, start=0,
                  end=n, step=1)
    return _cmul(p, conv, ac, as_)


def _dft(p: _Parts, x: str, dim: int, forward: bool, cols=None, bound: int | None = None) -> str:
    """The DFT of complex (or real) value x along `dim` (cols: the first outputs only, rfft's
    onesided half; bound: an upper bound of a dynamic size) as `_rows_dft` of x (dim moved
    last, the other dims flattened into rows); a complex value of x's shape with `dim` of size
    cols."""
    b = p.b
    shape = list(b.types[x].shape)
    n = shape[dim]
    cols = n if cols is None else sympy.sympify(cols)
    cdt = dtypes.complex_of(p.rdt)
    x = b.cast_to(x, cdt.torch, p.n)
    r = len(shape)
    order = [d for d in range(r) if d != dim] + [dim]
    moved = [shape[d] for d in order]
    if dim != r - 1:
        x = _permute(p, x, order)
    rows = product(moved[:-1])
    out = _rows_dft(p, p.view(x, (rows, n)), n, forward, cols, bound)
    out = p.view(out, (*moved[:-1], cols))
    if dim != r - 1:
        out = _permute(p, out, [order.index(d) for d in range(r)])
    return out


def _bound(b, n, d: int) -> int | None:
    """An upper bound of dim d of node n's input (None: unbounded or unknown)."""
    v = _size_bound(b, n.args[0], d)
    return None if v >= 2 ** SCAN_MAX_LEVELS else v


def _scaled(p: _Parts, norm: int, total, *parts: str) -> tuple[str, ...]:
    """Real parts scaled as ATen's fft_norm_mode: 0 none, 1 1 / sqrt(n), 2 1 / n (n: the
    product of the transformed sizes, the signal's; a size expression when dynamic)."""
    total = sympy.sympify(total)
    if norm == 0 or total == 1:
        return parts
    if total.is_Integer:
        s = 1.0 / math.sqrt(int(total)) if norm == 1 else 1.0 / int(total)
        return tuple(p.e("mul", v, p.const(s)) for v in parts)
    b = p.b
    t = b.emit("cast", [b.scalar(total, torch.int64)], None, like=p.n, shape=(),
               dtype=dtypes.float64)
    if norm == 1:
        t = b.emit("sqrt", [t], None, like=p.n, shape=(), dtype=dtypes.float64)
    return tuple(p.e("div", v, p.real(t)) for v in parts)


def _fft_scale(p: _Parts, x: str, norm: int, total) -> tuple[str, str]:
    return _scaled(p, norm, total, *p.parts_of(x))


def _sizes(b, x: str, dims) -> sympy.Expr:
    return product([b.types[x].shape[d] for d in dims])


@register("aten._fft_c2c.default")
def _fft_c2c(b, n):
    p = _start(b, n)
    x = b.tensor(n.args[0])
    rank = len(b.types[x].shape)
    dims = [d % rank for d in n.args[1]]
    norm, forward = int(n.args[2]), bool(n.args[3])
    total = _sizes(b, x, dims)
    for d in dims:
        x = _dft(p, x, d, forward, bound=_bound(b, n, d))
    return p.join(*_fft_scale(p, x, norm, total))


@register("aten._fft_r2c.default")
def _fft_r2c(b, n):
    """rfft (onesided: the last dim's first N // 2 + 1 outputs) then c2c over the others."""
    p = _start(b, n)
    x = b.tensor(n.args[0])
    rank = len(b.types[x].shape)
    dims = [d % rank for d in n.args[1]]
    norm, onesided = int(n.args[2]), bool(n.args[3])
    total = _sizes(b, x, dims)
    last = dims[-1]
    cols = b.shape(n)[last] if onesided else None
    x = _dft(p, x, last, True, cols, bound=_bound(b, n, last))
    for d in dims[:-1]:
        x = _dft(p, x, d, True, bound=_bound(b, n, d))
    return p.join(*_fft_scale(p, x, norm, total))


@register("aten._fft_c2r.default")
def _fft_c2r(b, n):
    """irfft: c2c (inverse) over all but the last dim, then the real signal of length
    last_dim_size from the first n // 2 + 1 entries of the last: x_j = sum_k w_k (Re X_k
    cos - Im X_k sin)(2 pi jk / n), w_0 = w_(n/2) = 1, else 2, the imaginary parts of X_0
    and X_(n/2) ignored (as pocketfft / MKL): one real GEMM of the interleaved parts. A
    longer signal: the full Hermitian spectrum (those imaginary parts zeroed, X_(n-k) =
    conj X_k) through the inverse c2c transform, its real part."""
    p = _start(b, n)
    x = b.tensor(n.args[0])
    shape = b.types[x].shape
    rank = len(shape)
    dims = [d % rank for d in n.args[1]]
    norm, size = int(n.args[2]), b.int_or_sym(n.args[3])
    if not isinstance(size, int):
        raise UnsupportedError(f"irfft to a dynamic size {size} computes on complex values in "
                               "a way kiln leaves to ATen: enable aten_fallback")
    total = _sizes(b, x, dims[:-1]) * size
    for d in dims[:-1]:
        x = _dft(p, x, d, False, bound=_bound(b, n, d))
    last = dims[-1]
    cdt = dtypes.complex_of(p.rdt)
    x = b.cast_to(x, cdt.torch, p.n)
    shape = list(b.types[x].shape)
    m = size // 2 + 1
    if not shape[last].is_Integer or int(shape[last]) < m:
        raise UnsupportedError("irfft with fewer than n // 2 + 1 inputs")
    if int(shape[last]) != m:
        shape[last] = sympy.Integer(m)
        x = b.emit("slice", [x], None, like=n, shape=tuple(shape), dtype=cdt, dim=last,
                   start=0, end=m, step=1)
    order = [d for d in range(rank) if d != last] + [last]
    moved = [shape[d] for d in order]
    if last != rank - 1:
        x = _permute(p, x, order)
    rows = product(moved[:-1])
    if size <= FFT_MAX:
        out = _c2r_gemm(p, p.view(x, (rows, m)), rows, m, size)
    else:
        out = _c2r_hermitian(p, p.view(x, (rows, m)), rows, m, size)
    out = p.view(out, (*moved[:-1], size))
    if last != rank - 1:
        back = [order.index(d) for d in range(rank)]
        out = b.emit("permute", [out], None, like=n, shape=[(*moved[:-1], size)[k]
                                                             for k in back],
                     dims=tuple(back), dtype=p.rdt)
    return p.out_real(_scaled(p, norm, total, out)[0])


def _c2r_gemm(p: _Parts, x: str, rows, m: int, size: int) -> str:
    """The real (rows, size) signal of the onesided spectrum x (rows, m) as one real GEMM."""
    b, n = p.b, p.n
    xr = p.view(p.pairs(x), (rows, 2 * m))
    f64 = dtypes.float64

    def weights(j):  # (rows, 1) int64 -> cos weights w_k, sin weights (0 at k = 0, n / 2)
        def is_(k):
            return b.emit("eq", [j, b.scalar(k, torch.int64)], None, like=n, shape=(m, 1),
                          dtype=dtypes.bool_)
        edge = is_(0)
        if size % 2 == 0:
            edge = b.emit("logical_or", [edge, is_(size // 2)], None, like=n, shape=(m, 1),
                          dtype=dtypes.bool_)
        one, two, zero = (b.scalar(v, torch.float64) for v in (1.0, 2.0, 0.0))
        wc = b.emit("where", [edge, one, two], None, like=n, shape=(m, 1), dtype=f64)
        ws = b.emit("where", [edge, zero, two], None, like=n, shape=(m, 1), dtype=f64)
        return wc, ws

    c, s = _twiddles(p, size, size, 1.0, rows=m, weights=weights)
    blk = (m, 1, size)
    wmat = b.emit("cat", [p.view(c, blk), p.view(p.e("neg", s), blk)], None, like=n,
                  shape=(m, 2, size), dtype=p.rdt, dim=1)
    return b.emit("matmul", [xr, p.view(wmat, (2 * m, size))], None, like=n,
                  shape=(rows, size), dtype=p.rdt)


def _c2r_hermitian(p: _Parts, x: str, rows, m: int, size: int) -> str:
    """The real part of the inverse DFT of the Hermitian spectrum of length size made of the
    onesided x (rows, m): X_0 (and X_(size/2)) real parts only, X_(size-k) = conj X_k."""
    b, n = p.b, p.n
    cdt = b.types[x].dtype
    re, im = p.parts_of(x)
    k = b.emit("iota", [], None, like=n, shape=(m,), dtype=dtypes.int64, start=0, step=1)
    edge = b.emit("eq", [k, b.scalar(0, torch.int64)], None, like=n, shape=(m,),
                  dtype=dtypes.bool_)
    if size % 2 == 0:
        edge = b.emit("logical_or", [edge, b.emit("eq", [k, b.scalar(size // 2, torch.int64)],
                                                  None, like=n, shape=(m,),
                                                  dtype=dtypes.bool_)],
                      None, like=n, shape=(m,), dtype=dtypes.bool_)
    im = p.e("where", edge, p.const(0.0), im)
    tail = size - m  # X_m .. X_(size-1) = conj X_(size-m) .. conj X_1

    def mirrored(v):
        s = b.emit("slice", [v], None, like=n, shape=(rows, tail), dtype=p.rdt, dim=1, start=1,
                   end=tail + 1, step=1)
        return b.emit("flip", [s], None, like=n, shape=(rows, tail), dtype=p.rdt, dims=(1,))

    full = [b.emit("cat", [v, t], None, like=n, shape=(rows, size), dtype=p.rdt, dim=1)
            for v, t in ((re, mirrored(re)), (im, p.e("neg", mirrored(im))))]
    spec = p.join_as(*full, (rows, size), cdt)
    out = _rows_dft(p, spec, sympy.Integer(size), False)
    return p.parts_of(out)[0]
