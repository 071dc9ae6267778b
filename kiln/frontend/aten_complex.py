"""Complex arithmetic as real arithmetic on the parts: aten op on complex32 / complex64 /
complex128 -> kiln Graph IR nodes.

A complex operand is read as its two real parts (`view_as_real` then `select` of part 0 / 1:
index maps, no copy), the op's formula is written with kiln's real pointwise ops and
reductions in the part dtype (float32 / float64), and the result joined by `complex`
(lowering/complex.py). Fused like any pointwise chain, printed by both targets. This module,
with frontend/aten_complex_math.py (pow, the exp / log relatives, the trigonometric and
hyperbolic functions and their inverses, isnan / isinf / isfinite),
frontend/aten_complex_linalg.py (the matmul family, prod / cumsum / cumprod / logcumsumexp) and
frontend/aten_complex_fft.py (torch.fft), which register into its table, is the one home of
each complex formula:

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
  complex has imaginary part +0), sum / mean / var (of each part), logical_not / and / or /
  xor and any (either part nonzero), constant pad, scatter / scatter_add / scatter_reduce
  (set, sum, mean) and index_put (x[mask] = v too; the same op on each part);
- the matmul family (mm, bmm, matmul, mv, dot, vdot, linear, addmm, baddbmm): one real GEMM
  per product (`_gemm`);
- pow (eager's special cases by a Scalar, else exp(y log x) with C99's product, as glibc's
  cpow), rsqrt, square, sigmoid; exp2 / log2 / log10 / log1p / expm1 as c10's formulas;
  sinh / cosh / tanh with C99's special values as glibc, sin / cos / tan through them;
  asin / acos / asinh / acosh (Hull, Fairgrieve and Tang), atanh / atan (Kahan);
  isnan / isinf / isfinite; add / sub / rsub with alpha; prod (pairwise tree; a dynamic
  size: the last prefix product), cumsum (real scans; CUDA: doubling), cumprod (doubling, static
  or dynamic sizes), logcumsumexp (CPU: kiln's library scan, eager's loop);
- torch.fft's _fft_c2c / _fft_r2c / _fft_c2r: a DFT as one GEMM with twiddles computed in
  float64 up to FFT_MAX points, four-step factorisations and Bluestein's chirp-z beyond, and
  on dynamic sizes with an upper bound.

complex32 (torch.chalf) computes in complex64, each part rounded to float16 once (eager's math
type and rounding). Ops or forms not here (scatter products, ffts over unbounded dynamic
sizes, logcumsumexp on CUDA, ...) go to the ATen fallback: a converter that declines raises
UnsupportedError, which the importer turns into a fallback call (frontend/export.py:
convert_node)."""

from __future__ import annotations

import functools
import math

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_library import _is_mask, _mask_coordinates, nonzero_of_mask, nonzero_rows
from kiln.frontend.aten_table import _dims
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


def _scaled(p: _Parts, s, re: str, im: str) -> tuple[str, str]:
    """The Python number s times (re, im), as eager's complex scalar product (1: as it is)."""
    if s == 1:
        return re, im
    v = complex(s)
    return p.mul(p.const(v.real), p.const(v.imag), re, im)


def _scale_parts(p: _Parts, s: float, re: str, im: str, op: str = "mul") -> tuple[str, str]:
    """A real constant s times (or `op` div: over) both parts, as c10's real * complex."""
    return p.e(op, re, p.const(s)), p.e(op, im, p.const(s))


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
        dims = _dims(b, n, 1)
        keep = bool(_arg(n, 2, "keepdim", False))
        shape = b.shape(n)
        re, im = (b.emit("reduce", [x], None, like=n, shape=shape, dtype=p.rdt, kind=kind,
                         dims=dims, keepdim=keep) for x in p.parts(n.args[0]))
        return p.join(re, im)
    return conv


for _kind in ("sum", "mean"):
    for _ov in ("default", "dim_IntList", "dim"):
        register(f"aten.{_kind}.{_ov}")(_reduce(_kind))


def _nonzero(p: _Parts, x) -> str:
    """Whether complex (or real) operand x is nonzero: either part (NaN counts as nonzero)."""
    a, bi = p.parts(x)
    return p.e("logical_or", p.e("ne", a, p.const(0.0)), p.e("ne", bi, p.const(0.0)))


@register("aten.nonzero.default")
def _nonzero_coords(b, n):
    """The coordinates of the nonzero complex values (either part nonzero, NaN included):
    kiln's nonzero of that mask (aten_library.nonzero_of_mask)."""
    rows = nonzero_rows(b, n)
    return nonzero_of_mask(b, n, _nonzero(_start(b, n), n.args[0]), rows)


@register("aten.logical_not.default", "aten.logical_and.default", "aten.logical_or.default",
          "aten.logical_xor.default")
def _logical(b, n):
    """Eager's truth of a complex value: either part nonzero; the result is bool."""
    p = _start(b, n)
    op = str(n.target).split(".")[1]
    x = _nonzero(p, n.args[0])
    if op == "logical_not":
        return b.emit("logical_not", [x], n)
    y = _nonzero(p, n.args[1])
    return b.emit("ne" if op == "logical_xor" else op, [x, y], n)


@register("aten.var.correction", "aten.var.dim")
def _var(b, n):
    """var of complex values = var(real part) + var(imaginary part) (eager's rule: the squared
    modulus of the deviation splits into the parts'), each kiln's real var; a real result."""
    p = _start(b, n)
    dims = _dims(b, n, 1)
    corr = n.kwargs.get("correction", 1)
    if str(n.target).endswith("dim"):
        corr = 1 if _arg(n, 2, "unbiased", True) else 0
    corr = 1 if corr is None else corr
    if float(corr) != int(corr):
        raise UnsupportedError(f"complex var with fractional correction {corr}")
    keep = bool(n.kwargs.get("keepdim", n.args[3] if len(n.args) > 3 else False))
    re, im = (b.emit("var", [x], None, like=n, shape=b.shape(n), dtype=p.rdt, dims=dims,
                     correction=int(corr), keepdim=keep) for x in p.parts(n.args[0]))
    return p.out_real(p.e("add", re, im))


@register("aten.constant_pad_nd.default", "aten.pad.default")
def _pad(b, n):
    """Constant padding: each part padded with the value's part (a complex value: its own);
    other modes (reflect, replicate, circular) are moves torch's decomposition writes."""
    mode = _arg(n, 2, "mode", "constant") if "pad.default" in str(n.target) else "constant"
    if mode != "constant":
        raise UnsupportedError(f"complex pad mode {mode!r}")
    value = _arg(n, 3 if "pad.default" in str(n.target) else 2, "value", 0)
    v = complex(0 if value is None else value)
    p = _start(b, n)
    pad = tuple(n.args[1])
    shape = b.shape(n)
    re, im = (b.emit("pad", [x], None, like=n, shape=shape, dtype=p.rdt, pad=pad, value=c)
              for x, c in zip(p.parts(n.args[0]), (v.real, v.imag)))
    return p.join(re, im)


@register("aten.any.default", "aten.any.dim", "aten.any.dims")
def _any(b, n):
    """Whether any complex value is nonzero (either part), over dims or all."""
    p = _start(b, n)
    dims = _dims(b, n, 1)
    return b.emit("reduce", [_nonzero(p, n.args[0])], n, kind="any", dims=dims,
                  keepdim=bool(_arg(n, 2, "keepdim", False)))


_SCATTER_MODES = {"add": "sum", "sum": "sum", "mean": "mean"}


@register("aten.scatter.src", "aten.scatter.value", "aten.scatter.reduce",
          "aten.scatter.value_reduce", "aten.scatter_add.default", "aten.scatter_reduce.two")
def _scatter(b, n):
    """Scatters that set, sum or average: the same scatter of each part (set and sum act on
    the parts independently); products: `_scatter_product`."""
    target = str(n.target)
    x, dim, index, src = n.args[:4]
    mode, include_self = "set", True
    if target == "aten.scatter_add.default":
        mode = "sum"
    elif target == "aten.scatter_reduce.two":
        mode = _SCATTER_MODES.get(n.args[4])
        include_self = bool(_arg(n, 5, "include_self", True))
    elif "reduce" in target:
        mode = _SCATTER_MODES.get(_arg(n, 4, "reduce"))
    p = _start(b, n)
    shape = b.shape(n)
    idx = b.tensor(index)
    if mode is None:
        return _scatter_product(b, n, p, x, dim, idx, src, include_self)
    if isinstance(src, torch.fx.Node):
        sparts = p.parts(src)
    else:
        sparts = tuple(b.emit("expand", [c], None, like=n, shape=b.shape(index), dtype=p.rdt)
                       for c in p.parts(src))
    re, im = (b.emit("scatter", [xp, idx, sp], None, like=n, shape=shape, dtype=p.rdt,
                     dim=dim % max(len(shape), 1), mode=mode, include_self=include_self)
              for xp, sp in zip(p.parts(x), sparts))
    return p.join(re, im)


def _scatter_product(b, n, p: _Parts, x, dim: int, idx: str, src, include_self: bool) -> str:
    """scatter(reduce="multiply") / scatter_reduce("prod") of complex values: kiln's CPU put
    routine on the complex values themselves (kiln_lib.h `cput_combine`: eager's in-order
    products, with eager's fmas); CUDA: a Triton kernel with the same order and arithmetic
    (targets/cuda/scan.py `print_cput_kernel`)."""
    reduce = n.args[4] if str(n.target) == "aten.scatter_reduce.two" else _arg(n, 4, "reduce")
    cdt = b.meta_dtype(n)
    if reduce not in ("multiply", "prod") or cdt not in (torch.complex64, torch.complex128):
        raise UnsupportedError(f"a complex scatter with reduce={reduce!r} (node {n.name}) "
                               "computes in a way kiln leaves to ATen: enable aten_fallback")
    if isinstance(src, torch.fx.Node):
        s = b.tensor(src)
    else:  # a Python number: the value at every index
        ishape = b.types[idx].shape
        s = p.join_as(*(b.emit("expand", [c], None, like=n, shape=ishape, dtype=p.rdt)
                        for c in p.parts(src)), ishape, to_dtype(cdt))
    xs = b.tensor(x)
    if b.types[xs].dtype != to_dtype(cdt) or b.types[s].dtype != to_dtype(cdt):
        raise UnsupportedError(f"a complex scatter product (node {n.name}) of mixed dtypes")
    return b.emit("scatter", [xs, idx, s], n, dim=dim % max(len(b.shape(n)), 1), mode="prod",
                  include_self=include_self)


@register("aten.index_put.default")
def _index_put(b, n):
    """x[indices] = values (or += with accumulate): the same index_put of each part."""
    x, indices, values = n.args[:3]
    accumulate = bool(_arg(n, 3, "accumulate", False))
    present = tuple(i for i, t in enumerate(indices) if t is not None)
    if not present:
        raise UnsupportedError(f"complex index_put without index tensors (node {n.name})")
    p = _start(b, n)
    extra = {}
    if len(present) > 1 and any(_is_mask(indices[i]) for i in present):
        present, idx = _mask_coordinates(b, n, indices)  # x[mask, idx] = v
    else:
        idx = [b.tensor(indices[i]) for i in present]
        if not b.library_routines and any(_is_mask(indices[i]) for i in present):
            if accumulate:  # ATen's: see the message
                raise UnsupportedError(
                    f"complex x[mask] += v on CUDA (node {n.name}): on an H100 its NaN parts "
                    "differed from eager's CUDA kernel (session 18, not yet explained)")
            extra = {"counted": True}  # x[mask] = v on CUDA (aten_library.py `_index_put`)
    vshape = b.shape(values) if isinstance(values, torch.fx.Node) else ()
    vparts = [v if tuple(b.types[v].shape) == tuple(vshape) else
              b.emit("expand", [v], None, like=n, shape=vshape, dtype=p.rdt)
              for v in p.parts(values)]
    re, im = (b.emit("index_put", [xp, vp] + idx, None, like=n, shape=b.shape(n),
                     dtype=p.rdt, positions=present, accumulate=accumulate, **extra)
              for xp, vp in zip(p.parts(x), vparts))
    return p.join(re, im)

