"""Complex transcendental functions as real arithmetic on the parts: pow, rsqrt, square,
sigmoid, exp2 / log2 / log10 / log1p / expm1 (c10's formulas), sinh / cosh / tanh and sin / cos
/ tan through them (C99 Annex G's special values, as glibc), asin / acos / asinh / acosh (Hull,
Fairgrieve and Tang), atanh / atan (Kahan), isnan / isinf / isfinite: aten op on complex
operands -> kiln Graph IR nodes. Split from frontend/aten_complex.py, whose registry, part
views (`_Parts`) and elementwise formulas (exp, log, sqrt) these build on; importing this
module registers them (frontend/export.py imports it)."""

from __future__ import annotations

import math

import torch

from kiln.frontend.aten_complex import (_exp_parts, _log_parts, _Parts, _scale_parts,
                                        _sqrt_parts, _start, _unary, register)
from kiln.ir import dtypes
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
