"""Complex arithmetic as real arithmetic on the parts: aten op on complex32 / complex64 /
complex128 -> kiln Graph IR nodes.

A complex operand is read as its two real parts (`view_as_real` then `select` of part 0 / 1:
index maps, no copy), the op's formula is written with kiln's real pointwise ops and
reductions in the part dtype (float32 / float64), and the result joined by `complex`
(lowering/complex.py). Fused like any pointwise chain, printed by both targets. This module
is the one home of each complex formula:

- add / sub / mul: the textbook formulas (eager's: no C99 Annex G recovery of infinities);
  a real operand is (x, +0), a Python number its two parts;
- div and reciprocal: Smith's algorithm as c10::complex's scalar division (numpy's too):
  scaled by the larger of |c|, |d|; x / 0 gives (a / 0, b / 0);
- exp: exp(a) (cos b, sin b), with C99's special values: exp(a + 0i) = exp(a) + 0i
  exactly (eager's vectorised loop gives NaN for exp(inf + 0i)), exp(+-inf + i b) for an
  infinite or NaN b = (+inf, NaN) / (0, 0);
- log: (log |z|, atan2(b, a)), log |z| without rounding |z| of subnormal parts; abs: hypot
  (no overflow); angle: atan2; sgn: z / |z|, 0 at 0;
- sqrt: C99's csqrt (principal root, special values as C99), without overflow, tiny
  parts scaled by a power of two;
- conj / conj_physical / resolve_conj / resolve_neg, neg, polar, complex, view_as_complex,
  where, casts (complex -> real keeps the real part, -> bool tests both parts, real ->
  complex has imaginary part +0), sum / mean (of each part);
- the matmul family (mm, bmm, matmul, mv, dot, vdot, linear, addmm, baddbmm): one real GEMM
  per product (`_gemm`);
- pow (eager's special cases by a Scalar, else exp(y log x) with C99's product, as glibc's
  cpow), rsqrt, square, sigmoid; exp2 / log2 / log10 / log1p / expm1 as c10's formulas;
  sinh / cosh / tanh with C99's special values as glibc, sin / cos / tan through them;
  asin / acos / asinh / acosh (Hull, Fairgrieve and Tang), atanh / atan (Kahan);
  isnan / isinf / isfinite; add / sub / rsub with alpha; prod (pairwise tree), cumsum (real
  scans), cumprod (doubling);
- torch.fft's _fft_c2c / _fft_r2c / _fft_c2r on static sizes up to FFT_MAX: a DFT as one
  GEMM with twiddles computed in float64.

complex32 (torch.chalf) computes in complex64, each part rounded to float16 once (eager's math
type and rounding). Ops or forms not here (longer ffts, logcumsumexp, ...) go to the ATen
fallback: a converter that declines raises UnsupportedError, which the
importer turns into a fallback call (frontend/export.py: convert_node)."""

from __future__ import annotations

import functools
import math

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_high import Fallback
from kiln.frontend.builder import to_dtype
from kiln.ir import dtypes

Converter = object
COMPLEX: dict[str, Converter] = {}
_NATIVE = ("complex32", "complex64", "complex128")


def register(*names: str):
    def deco(fn):
        for name in names:
            COMPLEX[name] = fn
        return fn
    return deco


def _broadcast(*shapes) -> tuple[sympy.Expr, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        big = [d for d in dims if d != 1]
        out.append(big[0] if big else sympy.Integer(1))
    return tuple(out)


class _Parts:
    """Emits the real nodes of one complex op `n`, computing in part dtype `rdt`."""

    BOOL = {"eq", "ne", "lt", "le", "gt", "ge", "isinf", "isnan", "logical_and",
            "logical_or", "logical_not"}

    def __init__(self, b, n, rdt: dtypes.DType):
        self.b, self.n, self.rdt = b, n, rdt

    def shape(self, name: str):
        return self.b.types[name].shape

    def e(self, op: str, *args: str, **attrs) -> str:
        shape = _broadcast(*(self.shape(a) for a in args))
        dt = dtypes.bool_ if op in self.BOOL else (
            self.b.types[args[1]].dtype if op == "where" else self.rdt)
        return self.b.emit(op, list(args), None, like=self.n, shape=shape, dtype=dt, **attrs)

    def const(self, v: float) -> str:
        return self.b.scalar(v, self.rdt.torch)

    def real(self, name: str) -> str:
        return self.b.cast_to(name, self.rdt.torch, self.n)

    def parts(self, x) -> tuple[str, str]:
        """(real, imaginary) of operand `x` (an FX node or a Python number) in `rdt`."""
        b = self.b
        if not isinstance(x, torch.fx.Node):
            if not isinstance(x, (bool, int, float, complex)):
                raise UnsupportedError(f"operand {x!r} of a complex op")
            v = complex(x)
            return self.const(v.real), self.const(v.imag)
        return self.parts_of(b.tensor(x))

    def parts_of(self, name: str) -> tuple[str, str]:
        """(real, imaginary) of the kiln value `name` in `rdt`."""
        b = self.b
        t = b.types[name]
        if not t.dtype.is_complex:
            return self.real(name), self.const(0.0)
        _check(t.dtype)
        pd = dtypes.complex_part(t.dtype)
        pairs = self.pairs(name)
        re, im = (b.emit("select", [pairs], None, like=self.n, shape=t.shape, dtype=pd,
                         dim=len(t.shape), index=k) for k in (0, 1))
        return self.real(re), self.real(im)

    def pairs(self, name: str) -> str:
        """The complex value `name` of shape S as the real S + [2] of its parts (no copy)."""
        t = self.b.types[name]
        return self.b.emit("view_as_real", [name], None, like=self.n, shape=t.shape + (2,),
                           dtype=dtypes.complex_part(t.dtype))

    def out_real(self, x: str) -> str:
        """A real result x (in `rdt`) as the node's value (complex32's: rounded to float16)."""
        if self.b.types[x].dtype == to_dtype(self.b.meta_dtype(self.n)):
            return x
        return self.b.emit("cast", [x], self.n)

    def join(self, re: str, im: str) -> str:
        return self.b.emit("complex", [re, im], self.n)

    def join_as(self, re: str, im: str, shape, cdt: dtypes.DType) -> str:
        """An intermediate complex value of `shape` and type `cdt` made of re, im."""
        return self.b.emit("complex", [re, im], None, like=self.n, shape=shape, dtype=cdt)

    def view(self, name: str, shape) -> str:
        return self.b.emit("view", [name], None, like=self.n, shape=tuple(shape),
                           dtype=self.b.types[name].dtype)

    def mul(self, a, b_, c, d) -> tuple[str, str]:
        """(a + bi)(c + di), the textbook formula (eager's)."""
        e = self.e
        return (e("sub", e("mul", a, c), e("mul", b_, d)),
                e("add", e("mul", a, d), e("mul", b_, c)))

    def mul_c99(self, a, b_, c, d) -> tuple[str, str]:
        """(a + bi)(c + di) as C99 Annex G's product (libgcc's __muldc3, which C++'s
        std::complex product and so eager's std::pow use): the textbook formula, then, where
        both parts are NaN, infinities recovered (an infinite operand boxed to +-1 / +-0
        parts, NaN parts of the other one to +-0, or every NaN part to +-0 after an
        overflowing product), the product recomputed and scaled by inf."""
        e, zero, one = self.e, self.const(0.0), self.const(1.0)
        ac, bd, ad, bc = e("mul", a, c), e("mul", b_, d), e("mul", a, d), e("mul", b_, c)
        x, y = e("sub", ac, bd), e("add", ad, bc)
        both = e("logical_and", e("isnan", x), e("isnan", y))

        def box(v):  # an infinite part -> +-1, else +-0
            return e("copysign", e("where", e("isinf", v), one, zero), v)

        def unnan(v, cond):
            return e("where", e("logical_and", cond, e("isnan", v)), e("copysign", zero, v), v)

        def any_inf(*vs):
            return functools.reduce(lambda u, v: e("logical_or", u, v),
                                    [e("isinf", v) for v in vs])

        z_inf, w_inf = any_inf(a, b_), any_inf(c, d)
        a1, b1 = (e("where", z_inf, box(v), v) for v in (a, b_))
        c1, d1 = unnan(c, z_inf), unnan(d, z_inf)
        c1, d1 = (e("where", w_inf, box(v), v) for v in (c1, d1))
        a1, b1 = unnan(a1, w_inf), unnan(b1, w_inf)
        over = e("logical_and", e("logical_not", e("logical_or", z_inf, w_inf)),
                 any_inf(ac, bd, ad, bc))
        a1, b1, c1, d1 = (unnan(v, over) for v in (a1, b1, c1, d1))
        redo = e("logical_and", both, e("logical_or", e("logical_or", z_inf, w_inf), over))
        inf = self.const(math.inf)
        x1 = e("mul", inf, e("sub", e("mul", a1, c1), e("mul", b1, d1)))
        y1 = e("mul", inf, e("add", e("mul", a1, d1), e("mul", b1, c1)))
        return e("where", redo, x1, x), e("where", redo, y1, y)

    # -- formulas shared by several ops ----------------------------------------------------
    def div(self, a, b_, c, d) -> tuple[str, str]:
        """(a + bi) / (c + di), Smith's algorithm as c10::complex's operator/."""
        e = self.e
        ac, ad = e("abs", c), e("abs", d)
        c_big = e("ge", ac, ad)
        zero = e("logical_and", e("eq", ac, self.const(0.0)), e("eq", ad, self.const(0.0)))
        # |c| >= |d|: rat = d / c, scl = 1 / (c + d rat)
        rat1 = e("div", d, c)
        scl1 = e("reciprocal", e("add", c, e("mul", d, rat1)))
        re1 = e("mul", e("add", a, e("mul", b_, rat1)), scl1)
        im1 = e("mul", e("sub", b_, e("mul", a, rat1)), scl1)
        # |c| < |d| (or NaN): rat = c / d, scl = 1 / (d + c rat)
        rat2 = e("div", c, d)
        scl2 = e("reciprocal", e("add", d, e("mul", c, rat2)))
        re2 = e("mul", e("add", e("mul", a, rat2), b_), scl2)
        im2 = e("mul", e("sub", e("mul", b_, rat2), a), scl2)
        re = e("where", c_big, e("where", zero, e("div", a, ac), re1), re2)
        im = e("where", c_big, e("where", zero, e("div", b_, ad), im1), im2)
        return re, im

    def hypot(self, a, b_) -> str:
        return self.e("hypot", a, b_)

    def finite(self, x: str) -> str:
        e = self.e
        return e("logical_not", e("logical_or", e("isinf", x), e("isnan", x)))


def _check(dt: dtypes.DType) -> None:
    if dt.name not in _NATIVE:
        raise UnsupportedError(f"{dt.name} arithmetic is left to ATen")


def _start(b, n) -> _Parts:
    """The emitter for complex op `n`, computing in the part dtype of its complex type (its
    result's, else its first complex operand's)."""
    dts = [b.meta_dtype(n)] + [b.meta_dtype(a) for a in n.all_input_nodes]
    cdts = [d for d in dts if d.is_complex]
    for d in cdts:
        _check(to_dtype(d))
    cdt = cdts[0] if dts[0].is_complex else functools.reduce(torch.promote_types, cdts)
    if cdt == torch.complex32:  # in complex64, the result's parts rounded once (eager's
        cdt = torch.complex64   # math type for complex32)
    return _Parts(b, n, dtypes.complex_part(to_dtype(cdt)))


def _arg(n, k: int, name: str, default=None):
    return n.args[k] if len(n.args) > k else n.kwargs.get(name, default)


@register(*(f"aten.{op}.{ov}" for op in ("add", "sub") for ov in ("Tensor", "Scalar")))
def _add(b, n):
    """x + alpha y: alpha y as eager's product of the complex scalar alpha (a real alpha:
    (alpha, +0)) and y, the textbook formula."""
    p = _start(b, n)
    (a, bi), (c, d) = p.parts(n.args[0]), p.parts(n.args[1])
    alpha = _arg(n, 2, "alpha", 1)
    if alpha != 1:
        c, d = _scaled(p, alpha, c, d)
    op = "add" if ".add." in str(n.target) else "sub"
    return p.join(p.e(op, a, c), p.e(op, bi, d))


@register("aten.rsub.Scalar", "aten.rsub.Tensor")
def _rsub(b, n):
    """other - alpha x."""
    p = _start(b, n)
    (a, bi), (c, d) = p.parts(n.args[0]), p.parts(n.args[1])
    alpha = _arg(n, 2, "alpha", 1)
    if alpha != 1:
        a, bi = _scaled(p, alpha, a, bi)
    return p.join(p.e("sub", c, a), p.e("sub", d, bi))


@register("aten.mul.Tensor", "aten.mul.Scalar")
def _mul(b, n):
    p = _start(b, n)
    x, y = n.args[0], n.args[1]
    (a, bi), (c, d) = p.parts(x), p.parts(y)
    e = p.e
    return p.join(e("sub", e("mul", a, c), e("mul", bi, d)),
                  e("add", e("mul", a, d), e("mul", bi, c)))


@register("aten.div.Tensor", "aten.div.Scalar")
def _div(b, n):
    p = _start(b, n)
    (a, bi), (c, d) = p.parts(n.args[0]), p.parts(n.args[1])
    return p.join(*p.div(a, bi, c, d))


@register("aten.reciprocal.default")
def _reciprocal(b, n):
    p = _start(b, n)
    c, d = p.parts(n.args[0])
    return p.join(*p.div(p.const(1.0), p.const(0.0), c, d))


@register("aten.neg.default")
def _neg(b, n):
    p = _start(b, n)
    a, bi = p.parts(n.args[0])
    return p.join(p.e("neg", a), p.e("neg", bi))


@register("aten._conj.default", "aten.conj_physical.default", "aten._conj_physical.default",
          "aten.conj.default", "aten.resolve_conj.default", "aten.resolve_neg.default",
          "aten._conj_copy.default")
def _conj(b, n):
    p = _start(b, n)
    a, bi = p.parts(n.args[0])
    if "resolve" in str(n.target):  # a functional graph holds no conjugate / negative bits
        return p.join(a, bi)
    return p.join(a, p.e("neg", bi))


@register("aten.abs.default")
def _abs(b, n):
    p = _start(b, n)
    return p.out_real(p.hypot(*p.parts(n.args[0])))


@register("aten.angle.default")
def _angle(b, n):
    p = _start(b, n)
    a, bi = p.parts(n.args[0])
    return p.out_real(p.e("atan2", bi, a))


@register("aten.sgn.default")
def _sgn(b, n):
    p = _start(b, n)
    a, bi = p.parts(n.args[0])
    h = p.hypot(a, bi)
    zero = p.e("eq", h, p.const(0.0))
    return p.join(p.e("where", zero, p.const(0.0), p.e("div", a, h)),
                  p.e("where", zero, p.const(0.0), p.e("div", bi, h)))


def _unary(formula):
    """A converter of a one-operand complex op from `formula(p, a, b) -> (re, im)`."""
    def conv(b, n):
        p = _start(b, n)
        return p.join(*formula(p, *p.parts(n.args[0])))
    return conv


def _exp_parts(p: _Parts, a: str, bi: str) -> tuple[str, str]:
    e = p.e
    m = e("exp", a)
    re, im = e("mul", m, e("cos", bi)), e("mul", m, e("sin", bi))
    # exp(a) beyond the dtype's range: exp(a / 2) twice, so a part whose sine or cosine is
    # small stays finite (glibc's cexp scales likewise)
    big = e("gt", a, p.const(88.0 if p.rdt == dtypes.float32 else 709.0))
    h = e("exp", e("mul", a, p.const(0.5)))
    re = e("where", big, e("mul", e("mul", h, e("cos", bi)), h), re)
    im = e("where", big, e("mul", e("mul", h, e("sin", bi)), h), im)
    # C99's infinities: exp(+-inf + i b), b infinite or NaN, is (+inf, NaN) / (0, 0)
    edge = e("logical_and", e("isinf", a), e("logical_or", e("isinf", bi), e("isnan", bi)))
    pos = e("gt", a, p.const(0.0))
    re = e("where", edge, e("where", pos, p.const(math.inf), p.const(0.0)), re)
    im = e("where", edge, e("where", pos, p.const(math.nan), p.const(0.0)), im)
    return re, e("where", e("eq", bi, p.const(0.0)), bi, im)


def _log_parts(p: _Parts, a: str, bi: str) -> tuple[str, str]:
    e = p.e
    # log |z| = log m + log1p((s / m)^2) / 2 (m, s: the larger and smaller |part|): |z| of
    # subnormal parts would be rounded to the subnormal grid first; 0, inf, NaN: log |z|
    h = p.hypot(a, bi)
    aa, ab = e("abs", a), e("abs", bi)
    m, q = e("maximum", aa, ab), e("div", e("minimum", aa, ab), e("maximum", aa, ab))
    fine = e("add", e("log", m), e("mul", p.const(0.5), e("log1p", e("mul", q, q))))
    ok = e("logical_and", e("gt", h, p.const(0.0)), e("logical_not", e("isinf", h)))
    return e("where", ok, fine, e("log", h)), e("atan2", bi, a)


def _sqrt_parts(p: _Parts, a0: str, b0: str) -> tuple[str, str]:
    """C99 csqrt: t = sqrt((|a| + |z|) / 2); a >= 0: (t, b / 2t), else (|b| / 2t, t sign b);
    0 -> (+0, b); an infinite b -> (inf, b)."""
    e, half = p.e, p.const(0.5)
    # parts below 2^-k (subnormal territory) scaled by 2^2k first, the root by 2^-k after
    # (powers of two: exact), so |z| is not rounded to the subnormal grid
    k = 50 if p.rdt == dtypes.float32 else 500
    tiny = e("lt", e("maximum", e("abs", a0), e("abs", b0)), p.const(2.0 ** -k))
    up = e("where", tiny, p.const(2.0 ** (2 * k)), p.const(1.0))
    down = e("where", tiny, p.const(2.0 ** -k), p.const(1.0))
    a, bi = e("mul", a0, up), e("mul", b0, up)
    t = e("sqrt", e("add", e("mul", half, e("abs", a)), e("mul", half, p.hypot(a, bi))))
    two_t = e("add", t, t)
    pos = e("ge", a, p.const(0.0))
    re = e("mul", e("where", pos, t, e("div", e("abs", bi), two_t)), down)
    im = e("mul", e("where", pos, e("div", bi, two_t), e("copysign", t, bi)), down)
    a, bi = a0, b0
    zero = e("logical_and", e("eq", a, p.const(0.0)), e("eq", bi, p.const(0.0)))
    inf = p.const(float("inf"))
    big = e("isinf", bi)
    re = e("where", big, inf, e("where", zero, p.const(0.0), re))
    im = e("where", e("logical_or", big, zero), bi, im)
    return re, im


register("aten.exp.default")(_unary(_exp_parts))
register("aten.log.default")(_unary(_log_parts))
register("aten.sqrt.default")(_unary(_sqrt_parts))


@register("aten.polar.default")
def _polar(b, n):
    p = _start(b, n)
    r, th = p.real(b.tensor(n.args[0])), p.real(b.tensor(n.args[1]))
    return p.join(p.e("mul", r, p.e("cos", th)), p.e("mul", r, p.e("sin", th)))


@register("aten.complex.default")
def _complex(b, n):
    p = _start(b, n)
    return p.join(p.real(b.tensor(n.args[0])), p.real(b.tensor(n.args[1])))


@register("aten.view_as_complex.default")
def _view_as_complex(b, n):
    p = _start(b, n)
    x = b.tensor(n.args[0])
    shape = b.types[x].shape
    re, im = (p.real(b.emit("select", [x], None, like=n, shape=shape[:-1],
                            dtype=b.types[x].dtype, dim=len(shape) - 1, index=k))
              for k in (0, 1))
    return p.join(re, im)


@register("aten.view_as_real.default")
def _view_as_real(b, n):
    x = b.tensor(n.args[0])
    _check(b.types[x].dtype)
    return b.emit("view_as_real", [x], n)


@register("aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther",
          "aten.where.Scalar")
def _where(b, n):
    p = _start(b, n)
    cond = b.tensor(n.args[0])
    (a, bi), (c, d) = p.parts(n.args[1]), p.parts(n.args[2])
    return p.join(p.e("where", cond, a, c), p.e("where", cond, bi, d))


@register("aten.eq.Tensor", "aten.eq.Scalar", "aten.ne.Tensor", "aten.ne.Scalar")
def _eq(b, n):
    p = _start(b, n)
    (a, bi), (c, d) = p.parts(n.args[0]), p.parts(n.args[1])
    if ".eq." in str(n.target):
        return b.emit("logical_and", [p.e("eq", a, c), p.e("eq", bi, d)], n)
    return b.emit("logical_or", [p.e("ne", a, c), p.e("ne", bi, d)], n)


@register("aten._to_copy.default")
def _to_copy(b, n):
    if set(n.kwargs) - {"dtype", "layout", "device", "memory_format"}:
        raise UnsupportedError("complex _to_copy with other arguments")
    src = n.args[0]
    out = b.meta_dtype(n)
    if out == b.meta_dtype(src):
        return b.alias(n, b.tensor(src))
    if not out.is_complex:  # eager's rule: the real part (bool: either part nonzero)
        p = _start(b, n)
        a, bi = p.parts(src)
        if out == torch.bool:
            return b.emit("logical_or", [p.e("ne", a, p.const(0.0)),
                                         p.e("ne", bi, p.const(0.0))], n)
        return b.emit("cast", [a], n)
    p = _start(b, n)
    return p.join(*p.parts(src))


def _reduce(kind: str):
    def conv(b, n):
        p = _start(b, n)
        if n.kwargs.get("dtype") is not None and not n.kwargs["dtype"].is_complex:
            raise UnsupportedError("complex reduction to a real dtype")
        rank = b.rank(n.args[0])
        dims = _arg(n, 1, "dim")
        dims = tuple(range(rank)) if dims in (None, []) else (
            (dims,) if isinstance(dims, int) else tuple(dims))
        dims = tuple(sorted(d % max(rank, 1) for d in dims))
        keep = bool(_arg(n, 2, "keepdim", False))
        shape = b.shape(n)
        re, im = (b.emit("reduce", [x], None, like=n, shape=shape, dtype=p.rdt, kind=kind,
                         dims=dims, keepdim=keep) for x in p.parts(n.args[0]))
        return p.join(re, im)
    return conv


for _kind in ("sum", "mean"):
    for _ov in ("default", "dim_IntList", "dim"):
        register(f"aten.{_kind}.{_ov}")(_reduce(_kind))


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


def _scaled(p: _Parts, s, re: str, im: str) -> tuple[str, str]:
    """The Python number s times (re, im), as eager's complex scalar product (1: as it is)."""
    if s == 1:
        return re, im
    v = complex(s)
    return p.mul(p.const(v.real), p.const(v.imag), re, im)


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
    rows = functools.reduce(lambda u, v: u * v, xs[:-1], sympy.Integer(1))
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


# -- powers ------------------------------------------------------------------------------------

def _pow_parts(p: _Parts, a, bi, c, d) -> tuple[str, str]:
    """(a + bi) ** (c + di) = exp((c + di) log(a + bi)), as eager's std::pow (glibc's cpow,
    the product C99's; a real exponent is (c, +0) there too: 2.5 * (inf + i pi/2) is
    inf + NaN i): 0 ** y is exp(y * (-inf + 0i)): 0 for Re y > 0, inf + NaN i for Re y < 0,
    NaN for y == 0 (numpy gives 1 there)."""
    return _exp_parts(p, *p.mul_c99(c, d, *_log_parts(p, a, bi)))


def _int_pow(p: _Parts, a, bi, k: int) -> tuple[str, str]:
    """z ** k for k in (2, 3, -2) as eager's pow by a Scalar: z * z, z * z * z, 1 / (z * z)."""
    re, im = p.mul(a, bi, a, bi)
    if k == 3:
        re, im = p.mul(re, im, a, bi)
    if k == -2:
        re, im = p.div(p.const(1.0), p.const(0.0), re, im)
    return re, im


@register("aten.pow.Tensor_Scalar")
def _pow_scalar(b, n):
    """z ** s for a Python number s, as eager's pow by a Scalar: s == 0 -> 1, 1 -> z,
    0.5 -> sqrt, -0.5 -> 1 / sqrt, -1 -> reciprocal, 2 / 3 / -2 -> products, else
    exp(s log z)."""
    p = _start(b, n)
    a, bi = p.parts(n.args[0])
    s = complex(n.args[1])
    zero = p.e("mul", a, p.const(0.0))  # a value of the result's shape
    if s == 0:
        return p.join(p.e("add", zero, p.const(1.0)), p.e("add", zero, p.const(0.0)))
    if s == 1:
        return p.join(a, bi)
    if s in (0.5, -0.5):
        a, bi = _sqrt_parts(p, a, bi)
        if s == 0.5:
            return p.join(a, bi)
        return p.join(*p.div(p.const(1.0), p.const(0.0), a, bi))
    if s == -1:
        return p.join(*p.div(p.const(1.0), p.const(0.0), a, bi))
    if s in (2, 3, -2):
        return p.join(*_int_pow(p, a, bi, int(s.real)))
    return p.join(*_pow_parts(p, a, bi, p.const(s.real), p.const(s.imag)))


@register("aten.pow.Tensor_Tensor", "aten.pow.Scalar")
def _pow(b, n):
    """x ** y (either complex, the other real or complex; pow.Scalar: a number base, 1 ** y
    is 1 as in eager)."""
    p = _start(b, n)
    x, y = n.args[0], n.args[1]
    (a, bi), (c, d) = p.parts(x), p.parts(y)
    if not isinstance(x, torch.fx.Node) and complex(x) == 1:
        zero = p.e("mul", c, p.const(0.0))
        return p.join(p.e("add", zero, p.const(1.0)), p.e("add", zero, p.const(0.0)))
    return p.join(*_pow_parts(p, a, bi, c, d))


@register("aten.rsqrt.default")
def _rsqrt(b, n):
    p = _start(b, n)
    return p.join(*p.div(p.const(1.0), p.const(0.0), *_sqrt_parts(p, *p.parts(n.args[0]))))


@register("aten.square.default")
def _square(b, n):
    p = _start(b, n)
    return p.join(*_int_pow(p, *p.parts(n.args[0]), 2))


@register("aten.sigmoid.default")
def _sigmoid(b, n):
    """1 / (1 + exp(-z)), as eager."""
    p = _start(b, n)
    a, bi = p.parts(n.args[0])
    er, ei = _exp_parts(p, p.e("neg", a), p.e("neg", bi))
    return p.join(*p.div(p.const(1.0), p.const(0.0), p.e("add", er, p.const(1.0)), ei))


# -- exp / log relatives (c10/util/complex_math.h's formulas) -----------------------------------

def _scale_parts(p: _Parts, s: float, re: str, im: str, op: str = "mul") -> tuple[str, str]:
    """A real constant s times (or `op` div: over) both parts, as c10's real * complex."""
    return p.e(op, re, p.const(s)), p.e(op, im, p.const(s))


def _exp2(p, a, bi):
    """2 ** z = exp(ln 2 * z), c10's exp2 (ln 2 times each part)."""
    return _exp_parts(p, *_scale_parts(p, math.log(2.0), a, bi))


def _log2(p, a, bi):
    """log(z) / ln 2, each part (eager's vectorised loop; log10 likewise)."""
    return _scale_parts(p, math.log(2.0), *_log_parts(p, a, bi), op="div")


def _log10(p, a, bi):
    return _scale_parts(p, math.log(10.0), *_log_parts(p, a, bi), op="div")


def _log1p(p, a, bi):
    """c10's log1p: theta = atan2(b, a + 1); |z| < 0.5: (log1p(a (2 + a) + b^2) / 2, theta)
    ((a, theta) when that sum is 0); else (log(hypot(a + 1, b)), theta)."""
    e = p.e
    one = p.const(1.0)
    a1 = e("add", a, one)
    theta = e("atan2", bi, a1)
    r = e("add", e("mul", a, e("add", p.const(2.0), a)), e("mul", bi, bi))
    small_re = e("where", e("eq", r, p.const(0.0)), a, e("mul", p.const(0.5), e("log1p", r)))
    big_re = e("log", p.hypot(a1, bi))
    return e("where", e("lt", p.hypot(a, bi), p.const(0.5)), small_re, big_re), theta


def _expm1(p, a, bi):
    """c10's expm1: (expm1(a) cos b - 2 sin(b / 2)^2, exp(a) sin b)."""
    e = p.e
    s = e("sin", e("mul", bi, p.const(0.5)))
    re = e("sub", e("mul", e("expm1", a), e("cos", bi)), e("mul", p.const(2.0), e("mul", s, s)))
    return re, e("mul", e("exp", a), e("sin", bi))


# -- hyperbolic and trigonometric functions (C99 Annex G's special values, as glibc) ------------

def _sinh(p, a, bi):
    """(sinh a cos b, cosh a sin b); b == 0 -> imaginary part b; a == 0 with b infinite or
    NaN -> (a, NaN); a infinite with b infinite or NaN -> (+inf, NaN) (glibc's sign)."""
    e = p.e
    re = e("mul", e("sinh", a), e("cos", bi))
    im = e("mul", e("cosh", a), e("sin", bi))
    im = e("where", e("eq", bi, p.const(0.0)), bi, im)
    wild = e("logical_not", p.finite(bi))
    odd = e("logical_and", e("logical_or", e("eq", a, p.const(0.0)), e("isinf", a)), wild)
    re = e("where", e("logical_and", e("isinf", a), wild), p.const(math.inf), re)
    return e("where", e("logical_and", e("eq", a, p.const(0.0)), wild), a, re), e(
        "where", odd, p.const(math.nan), im)


def _cosh(p, a, bi):
    """(cosh a cos b, sinh a sin b); b == 0 -> imaginary part b sign(a); a == 0 with b
    infinite or NaN -> (NaN, 0); a infinite with b infinite or NaN -> (inf, NaN)."""
    e = p.e
    re = e("mul", e("cosh", a), e("cos", bi))
    im = e("mul", e("sinh", a), e("sin", bi))
    im = e("where", e("eq", bi, p.const(0.0)),
           e("where", e("isnan", a), bi, e("mul", bi, e("copysign", p.const(1.0), a))), im)
    wild = e("logical_not", p.finite(bi))
    zero = e("logical_and", e("eq", a, p.const(0.0)), wild)
    big = e("logical_and", e("isinf", a), wild)
    re = e("where", big, p.const(math.inf), re)
    im = e("where", big, p.const(math.nan), e("where", zero, p.const(0.0), im))
    return re, im


def _tanh(p, a, bi):
    """Kahan's formula (FreeBSD's ctanh): t = tan b, beta = 1 + t^2, s = sinh a,
    rho = sqrt(1 + s^2): (beta rho s, t) / (1 + beta s^2); |a| large: (sign a, 4 sin b cos b
    exp(-2|a|)); a infinite: (sign a, +-0); a NaN: (NaN, b == 0 ? b : NaN); a == 0 with b
    infinite or NaN: (a, NaN); else b infinite or NaN: (NaN, NaN)."""
    e, one = p.e, p.const(1.0)
    big_at = 11.0 if p.rdt == dtypes.float32 else 22.0
    aa = e("abs", a)
    small = e("lt", aa, p.const(big_at))
    a_s = e("where", small, a, p.const(0.0))  # no overflow in the branch not taken
    t = e("tan", bi)
    beta = e("add", one, e("mul", t, t))
    s = e("sinh", a_s)
    ss = e("mul", s, s)
    rho = e("sqrt", e("add", one, ss))
    den = e("add", one, e("mul", beta, ss))
    re_k = e("div", e("mul", e("mul", beta, rho), s), den)
    im_k = e("div", t, den)
    sgn = e("copysign", one, a)
    em = e("exp", e("neg", aa))
    im_b = e("mul", e("mul", p.const(4.0), e("mul", e("sin", bi), e("cos", bi))),
             e("mul", em, em))
    re = e("where", small, re_k, sgn)
    im = e("where", small, im_k, im_b)
    # a infinite: (sign a, 0 with the sign of sin(2b); b infinite or NaN: +-0 as b)
    wild = e("logical_not", p.finite(bi))
    ainf = e("isinf", a)
    im_inf = e("where", wild, e("copysign", p.const(0.0), bi),
               e("copysign", p.const(0.0), e("mul", e("sin", bi), e("cos", bi))))
    im = e("where", ainf, im_inf, im)
    # a NaN: (NaN, b == 0 ? b : NaN); a finite with b infinite or NaN: (a == 0 ? a : NaN, NaN)
    anan = e("isnan", a)
    nan = p.const(math.nan)
    im = e("where", anan, e("where", e("eq", bi, p.const(0.0)), bi, nan), im)
    re = e("where", anan, nan, re)
    fin_wild = e("logical_and", p.finite(a), wild)
    re = e("where", fin_wild, e("where", e("eq", a, p.const(0.0)), a, nan), re)
    im = e("where", fin_wild, nan, im)
    return re, im


def _rotated(fn, back: bool = True):
    """f(z) = -i g(iz) (sin, tan from sinh, tanh) or g(iz) (cos from cosh): iz = (-b, a)."""
    def formula(p, a, bi):
        u, v = fn(p, p.e("neg", bi), a)
        return (v, p.e("neg", u)) if back else (u, v)
    return formula


def _sin(p, a, bi):
    """-i sinh(iz); an infinite b with a infinite or NaN: (NaN, +inf), glibc's sign."""
    re, im = _rotated(_sinh)(p, a, bi)
    e = p.e
    odd = e("logical_and", e("isinf", bi), e("logical_not", p.finite(a)))
    return re, e("where", odd, p.const(math.inf), im)


_UNARY = {"exp2": _exp2, "log2": _log2, "log10": _log10, "log1p": _log1p, "expm1": _expm1,
          "sinh": _sinh, "cosh": _cosh, "tanh": _tanh, "sin": _sin,
          "cos": _rotated(_cosh, back=False), "tan": _rotated(_tanh)}
for _name, _f in _UNARY.items():
    register(f"aten.{_name}.default")(_unary(_f))


@register("aten.isnan.default", "aten.isinf.default", "aten.isfinite.default")
def _isnan(b, n):
    """isnan / isinf: either part; isfinite: both parts finite."""
    p = _start(b, n)
    a, bi = p.parts(n.args[0])
    kind = str(n.target).split(".")[1]
    if kind == "isfinite":
        return b.emit("logical_and", [p.finite(a), p.finite(bi)], n)
    return b.emit("logical_or", [p.e(kind, a), p.e(kind, bi)], n)


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


@register("aten.prod.default", "aten.prod.dim_int")
def _prod(b, n):
    """The product of complex values along one dimension (or all) as a pairwise tree of complex
    products (log2 n levels of pointwise ops); eager multiplies in its own reduction order."""
    p = _start(b, n)
    if n.kwargs.get("dtype") is not None and not n.kwargs["dtype"].is_complex:
        raise UnsupportedError("complex prod to a real dtype")
    x = b.tensor(n.args[0])
    shape = b.types[x].shape
    if "dim_int" in str(n.target):
        dim = n.args[1] % max(len(shape), 1)  # (keepdim: the final view's shape)
    else:
        x = p.view(x, (functools.reduce(lambda u, v: u * v, shape, sympy.Integer(1)),))
        dim = 0
    if len(b.types[x].shape) == 0:
        return p.join(*p.parts_of(x))
    re, im = _halves(p, *p.parts_of(x), dim)
    return p.join(*(p.view(v, b.shape(n)) for v in (re, im)))


@register("aten.cumsum.default")
def _cumsum(b, n):
    """A real scan of each part (kiln's CPU library scan, as for real cumsum)."""
    p = _start(b, n)
    if n.kwargs.get("dtype") is not None and not n.kwargs["dtype"].is_complex:
        raise UnsupportedError("complex cumsum to a real dtype")
    dim = n.args[1] % max(b.rank(n.args[0]), 1)
    re, im = (b.emit("scan", [x], None, like=n, dtype=p.rdt, kind="sum", dim=dim)
              for x in p.parts(n.args[0]))
    return p.join(re, im)


@register("aten.cumprod.default")
def _cumprod(b, n):
    """Prefix products by doubling (Hillis-Steele: log2 n levels, each one multiplying every
    element by the one 2^k before it, 1 before the start): pointwise ops only, so both
    targets compute it; eager multiplies left to right (other rounding, same products)."""
    p = _start(b, n)
    if n.kwargs.get("dtype") is not None and not n.kwargs["dtype"].is_complex:
        raise UnsupportedError("complex cumprod to a real dtype")
    re, im = p.parts(n.args[0])
    shape = tuple(b.shape(n))
    if not shape:
        return p.join(re, im)
    dim = n.args[1] % len(shape)
    size = shape[dim]
    if not size.is_Integer:
        raise UnsupportedError("complex cumprod over a dynamic size")
    size, k = int(size), 1
    while k < size:
        def shifted(x, fill):
            head = b.emit("expand", [p.const(fill)], None, like=n,
                          shape=(*shape[:dim], k, *shape[dim + 1:]), dtype=p.rdt)
            body = b.emit("slice", [x], None, like=n, shape=(*shape[:dim], size - k,
                          *shape[dim + 1:]), dtype=p.rdt, dim=dim, start=0, end=size - k,
                          step=1)
            return b.emit("cat", [head, body], None, like=n, shape=shape, dtype=p.rdt, dim=dim)
        re, im = p.mul(re, im, shifted(re, 1.0), shifted(im, 0.0))
        k *= 2
    return p.join(re, im)


# -- inverse trigonometric and hyperbolic functions (Hull, Fairgrieve and Tang's algorithm) ------

def _arc_core(p: _Parts, P: str, Q: str) -> tuple[str, str]:
    """For P, Q >= 0 (asinh(P + iQ) = (L, atan2(Q, D))): L = log(A + sqrt(A^2 - 1)) and
    D = sqrt(A^2 - Q^2), A = (hypot(P, Q + 1) + hypot(P, Q - 1)) / 2, each without
    cancellation (Hull, Fairgrieve and Tang, ACM TOMS 1997: A - 1 and A - Q from their
    parts) or overflow (log(2A) for large A, products of square roots). asin / acos / asinh /
    acosh are these two numbers with signs and roles (C99's special values included)."""
    e, one, half = p.e, p.const(1.0), p.const(0.5)
    f32 = p.rdt == dtypes.float32
    R = p.hypot(P, e("add", Q, one))
    S = p.hypot(P, e("sub", Q, one))
    A = e("mul", half, e("add", R, S))
    r_part = e("mul", P, e("div", P, e("add", e("add", R, Q), one)))  # R - (Q + 1)
    below = e("lt", Q, one)
    s_small = e("mul", P, e("div", P, e("add", S, e("sub", one, Q))))  # S - (1 - Q), Q < 1
    am1 = e("mul", half, e("add", r_part, e("where", below, s_small,
                                             e("add", S, e("sub", Q, one)))))
    l_small = e("log1p", e("add", am1, e("sqrt", e("mul", am1, e("add", A, one)))))
    l_mid = e("log", e("add", A, e("sqrt", e("mul", e("sub", A, one), e("add", A, one)))))
    l_big = e("add", e("log", A), p.const(math.log(2.0)))
    tiny = e("logical_and", e("lt", P, p.const(1e-18 if f32 else 1e-150)), below)
    l_tiny = e("div", P, e("sqrt", e("mul", e("sub", one, Q), e("add", one, Q))))
    L = e("where", tiny, l_tiny, e("where", e("le", A, p.const(1.5)), l_small, e(
        "where", e("gt", A, p.const(1e4 if f32 else 1e8)), l_big, l_mid)))
    # D = sqrt((A + Q)(A - Q)); A - Q = (R - (Q + 1) + S + 1 - Q) / 2
    d_low = e("mul", e("sqrt", e("mul", half, e("add", A, Q))),
              e("sqrt", e("add", r_part, e("add", S, e("sub", one, Q)))))
    d_high = e("mul", P, e("sqrt", e("mul", e("mul", half, e("add", A, Q)), e(
        "add", e("reciprocal", e("add", e("add", R, Q), one)),
        e("reciprocal", e("add", S, e("sub", Q, one)))))))
    D = e("where", e("le", Q, one), d_low, d_high)
    # infinities and NaN (C99's casinh): an infinite part -> L = inf; D: P infinite -> inf,
    # Q infinite -> 1 (NaN if P is), P NaN with Q == 0 -> 1
    p_inf, q_inf, p_nan = e("isinf", P), e("isinf", Q), e("isnan", P)
    L = e("where", e("logical_or", p_inf, q_inf), p.const(math.inf), L)
    D = e("where", p_inf, p.const(math.inf), e("where", q_inf, e("where", p_nan, p.const(
        math.nan), one), e("where", e("logical_and", p_nan, e("eq", Q, p.const(0.0))),
                           one, D)))
    return L, D


def _asinh(p, a, bi):
    e = p.e
    L, D = _arc_core(p, e("abs", a), e("abs", bi))
    return e("copysign", L, a), e("copysign", e("atan2", e("abs", bi), D), bi)


def _asin(p, a, bi):
    e = p.e
    L, D = _arc_core(p, e("abs", bi), e("abs", a))
    return e("copysign", e("atan2", e("abs", a), D), a), e("copysign", L, bi)


def _acos(p, a, bi):
    e = p.e
    L, D = _arc_core(p, e("abs", bi), e("abs", a))
    return e("atan2", D, a), e("neg", e("copysign", L, bi))


def _acosh(p, a, bi):
    """i acos(z) or -i acos(z), whichever has a nonnegative real part: (L, +-Re acos z)."""
    e = p.e
    L, D = _arc_core(p, e("abs", bi), e("abs", a))
    return L, e("copysign", e("atan2", D, a), bi)


def _atanh(p, a, bi):
    """Kahan's formulas on |a|, |b| (atanh is odd and commutes with conj): (log1p(4X / ((1 -
    X)^2 + Y^2)) / 4, atan2(2Y, (1 - X)(1 + X) - Y^2) / 2); z near 1: the log of that
    quotient from its parts; |z| huge: (X / |z| / |z|, pi/2);
    C99's special values (an infinite part: (+0, pi/2); NaN with an infinite part: (+0,
    NaN) / (0, pi/2))."""
    e, one = p.e, p.const(1.0)
    X, Y = e("abs", a), e("abs", bi)
    omx = e("sub", one, X)
    re = e("mul", p.const(0.25), e("log1p", e("div", e("mul", p.const(4.0), X), e(
        "add", e("mul", omx, omx), e("mul", Y, Y)))))
    im = e("mul", p.const(0.5), e("atan2", e("add", Y, Y), e(
        "sub", e("mul", omx, e("add", one, X)), e("mul", Y, Y))))
    # z near 1 (h = |1 - z| tiny, Y^2 may underflow): log1p(4X / h^2) = log(4X) - 2 log h
    h1 = p.hypot(omx, Y)
    near = e("lt", h1, p.const(1e-4 if p.rdt == dtypes.float32 else 1e-8))
    re = e("where", near, e("mul", p.const(0.5), e("sub", e("mul", p.const(0.5), e(
        "log", e("mul", p.const(4.0), X))), e("log", h1))), re)
    h = p.hypot(X, Y)
    big = e("gt", h, p.const(1e18 if p.rdt == dtypes.float32 else 1e150))
    re = e("where", big, e("div", e("div", X, h), h), re)
    im = e("where", big, p.const(math.pi / 2), im)
    x_inf, y_inf, y_nan = e("isinf", X), e("isinf", Y), e("isnan", Y)
    # an infinite part: (0, pi/2), or (0, NaN) when the other is NaN and X is infinite
    re = e("where", e("logical_or", x_inf, y_inf), p.const(0.0), re)
    im = e("where", y_inf, p.const(math.pi / 2), e("where", x_inf, e(
        "where", y_nan, p.const(math.nan), p.const(math.pi / 2)), im))
    # NaN real part with an infinite imaginary one: (+-0, pi/2) (above); X == 0 and Y NaN:
    # (+0, NaN) (the formula's re is log1p(0 / NaN): NaN)
    re = e("where", e("logical_and", e("eq", X, p.const(0.0)), y_nan), X, re)
    return e("copysign", re, a), e("copysign", im, bi)


def _atan(p, a, bi):
    """-i atanh(iz)."""
    u, v = _atanh(p, p.e("neg", bi), a)
    return v, p.e("neg", u)


for _name, _f in {"asinh": _asinh, "asin": _asin, "acos": _acos, "acosh": _acosh,
                  "atanh": _atanh, "atan": _atan}.items():
    register(f"aten.{_name}.default")(_unary(_f))


# -- torch.fft on small static sizes: a DFT as a GEMM with twiddles from float64 ------------------

FFT_MAX = 512  # the longest transformed dim kiln computes (a DFT costs N^2 per row)


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


def _dft(p: _Parts, x: str, dim: int, forward: bool, cols: int | None = None) -> str:
    """The DFT of complex (or real) value x along static `dim` (cols: the first outputs
    only, rfft's onesided half) as a GEMM of x (dim moved last, rows flattened) with the
    N x cols twiddle matrix; a complex value of x's shape with `dim` of size cols."""
    b = p.b
    shape = list(b.types[x].shape)
    n = shape[dim]
    if not n.is_Integer or int(n) > FFT_MAX:
        raise UnsupportedError(f"fft over a dim of size {n} computes on complex values in a "
                               f"way kiln leaves to ATen (kiln's DFT takes static sizes up to "
                               f"{FFT_MAX}): enable aten_fallback")
    n = int(n)
    cols = n if cols is None else cols
    cdt = dtypes.complex_of(p.rdt)
    x = b.cast_to(x, cdt.torch, p.n)
    r = len(shape)
    order = [d for d in range(r) if d != dim] + [dim]
    moved = [shape[d] for d in order]
    if dim != r - 1:
        x = b.emit("permute", [x], None, like=p.n, shape=moved, dims=tuple(order), dtype=cdt)
    rows = functools.reduce(lambda u, v: u * v, moved[:-1], sympy.Integer(1))
    x2 = p.view(x, (rows, n))
    w = p.join_as(*_twiddles(p, n, cols, -1.0 if forward else 1.0), (n, cols), cdt)
    re, im = _gemm(p, x2, w)
    out = p.view(p.join_as(re, im, (rows, cols), cdt), (*moved[:-1], cols))
    if dim != r - 1:
        back = [order.index(d) for d in range(r)]
        out = b.emit("permute", [out], None, like=p.n, shape=[(*moved[:-1], cols)[k]
                                                               for k in back],
                     dims=tuple(back), dtype=cdt)
    return out


def _fft_scale(p: _Parts, x: str, dims, norm: int, sizes) -> tuple[str, str]:
    """The parts of x scaled as ATen's fft_norm_mode: 0 none, 1 1 / sqrt(n), 2 1 / n (n: the
    product of the transformed sizes, the signal's)."""
    re, im = p.parts_of(x)
    total = math.prod(sizes)
    if norm == 0 or total == 1:
        return re, im
    s = 1.0 / math.sqrt(total) if norm == 1 else 1.0 / total
    return _scale_parts(p, s, re, im)


@register("aten._fft_c2c.default")
def _fft_c2c(b, n):
    p = _start(b, n)
    x = b.tensor(n.args[0])
    rank = len(b.types[x].shape)
    dims = [d % rank for d in n.args[1]]
    norm, forward = int(n.args[2]), bool(n.args[3])
    sizes = [int(b.types[x].shape[d]) if b.types[x].shape[d].is_Integer else 0 for d in dims]
    for d in dims:
        x = _dft(p, x, d, forward)
    return p.join(*_fft_scale(p, x, dims, norm, sizes))


@register("aten._fft_r2c.default")
def _fft_r2c(b, n):
    """rfft (onesided: the last dim's first N // 2 + 1 outputs) then c2c over the others."""
    p = _start(b, n)
    x = b.tensor(n.args[0])
    rank = len(b.types[x].shape)
    dims = [d % rank for d in n.args[1]]
    norm, onesided = int(n.args[2]), bool(n.args[3])
    sizes = [int(b.types[x].shape[d]) if b.types[x].shape[d].is_Integer else 0 for d in dims]
    last = dims[-1]
    size = b.types[x].shape[last]
    cols = int(size) // 2 + 1 if onesided and size.is_Integer else None
    x = _dft(p, x, last, True, cols)
    for d in dims[:-1]:
        x = _dft(p, x, d, True)
    return p.join(*_fft_scale(p, x, dims, norm, sizes))


@register("aten._fft_c2r.default")
def _fft_c2r(b, n):
    """irfft: c2c (inverse) over all but the last dim, then the real signal of length
    last_dim_size from the first n // 2 + 1 entries of the last: x_j = sum_k w_k (Re X_k
    cos - Im X_k sin)(2 pi jk / n), w_0 = w_(n/2) = 1, else 2, the imaginary parts of X_0
    and X_(n/2) ignored (as pocketfft / MKL): one real GEMM of the interleaved parts."""
    p = _start(b, n)
    x = b.tensor(n.args[0])
    shape = b.types[x].shape
    rank = len(shape)
    dims = [d % rank for d in n.args[1]]
    norm, size = int(n.args[2]), b.int_or_sym(n.args[3])
    if not isinstance(size, int) or size > FFT_MAX:
        raise UnsupportedError(f"irfft to a size {size} computes on complex values in a way "
                               f"kiln leaves to ATen (kiln's DFT takes static sizes up to "
                               f"{FFT_MAX}): enable aten_fallback")
    sizes = [int(shape[d]) if shape[d].is_Integer else 0 for d in dims[:-1]] + [size]
    for d in dims[:-1]:
        x = _dft(p, x, d, False)
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
        x = b.emit("permute", [x], None, like=n, shape=moved, dims=tuple(order), dtype=cdt)
    rows = functools.reduce(lambda u, v: u * v, moved[:-1], sympy.Integer(1))
    xr = p.view(p.pairs(p.view(x, (rows, m))), (rows, 2 * m))
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
    out = b.emit("matmul", [xr, p.view(wmat, (2 * m, size))], None, like=n,
                 shape=(rows, size), dtype=p.rdt)
    out = p.view(out, (*moved[:-1], size))
    if last != rank - 1:
        back = [order.index(d) for d in range(rank)]
        out = b.emit("permute", [out], None, like=n, shape=[(*moved[:-1], size)[k]
                                                             for k in back],
                     dims=tuple(back), dtype=p.rdt)
    total = math.prod(sizes)
    if norm and total > 1:
        out = p.e("mul", out, p.const(1.0 / math.sqrt(total) if norm == 1 else 1.0 / total))
    return p.out_real(out)
