"""Differential tests of elementwise ops: unary math and activations, binary arithmetic with
broadcasting and scalars, comparisons, logical ops, where / masked_fill, casts and promotion."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftest import SHAPES, STRIDED, Checker, Fn, Layout, dim, gen, layout_shape, rand

F32, F64, I64, I32, BOOL = torch.float32, torch.float64, torch.int64, torch.int32, torch.bool


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("ops_pointwise"))


# -- unary -------------------------------------------------------------------------------------
def transcendental(x):
    return (torch.exp(x), torch.log(x.abs() + 0.1), torch.sqrt(x.abs()),
            torch.rsqrt(x.abs() + 0.1), torch.tanh(3 * x), torch.sigmoid(4 * x), torch.erf(2 * x),
            torch.sin(3 * x), torch.cos(3 * x), torch.log1p(x.abs()), torch.expm1(x))


def activations(x):
    x = 3 * x
    return (torch.relu(x), F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x),
            F.leaky_relu(x), F.leaky_relu(x, 0.2), F.hardswish(x), F.mish(x), F.softplus(x),
            F.softplus(x, beta=2.0, threshold=5.0), F.hardtanh(x), F.relu6(x),
            x.clamp(-0.5, 2.0), x.clamp(min=0.25), x.clamp(max=-0.25), F.hardsigmoid(x))


def rounding(x):
    x = 4 * x
    return (-x, x.abs(), torch.floor(x), torch.ceil(x), torch.round(x), torch.sign(x),
            torch.trunc(x), torch.reciprocal(x), torch.square(x))


UNARY = [transcendental, activations, rounding]
UNARY_CASES = ([(s, "contig", F32) for s in SHAPES] + [(s, k, F32) for s, k in STRIDED]
               + [((7, 13), "contig", F64), ((130, 97), "t", F64), ((3, 1, 5), "step", F64)])


@pytest.mark.parametrize("fn", UNARY, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("shape", "layout", "dtype"), UNARY_CASES,
                         ids=lambda v: str(v).replace(" ", "").removeprefix("torch."))
def test_unary(check, fn, shape, layout, dtype):
    x = rand(layout_shape(shape, layout), dtype, gen(fn.__name__, shape, layout, dtype))
    check(Layout(Fn(fn), layout), (x,))


def test_round_half_to_even_and_special_values(check):
    x = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -0.0, 0.0, 1e-30, -1e-30, 100.0,
                      -100.0, 88.0, -88.0, 1e6, float("inf"), float("-inf"), float("nan")])
    specials = lambda x: (torch.round(x), torch.sign(x), torch.relu(x), x.abs(), torch.exp(x),
                          torch.tanh(x), torch.sigmoid(x), torch.erf(x), torch.floor(x),
                          x.clamp(-1, 1), torch.isnan(x), torch.isinf(x))
    check(Fn(specials), (x,), ref="same", tol={"rtol": 1e-5, "atol": 1e-6})
    check(Fn(specials), (x.double(),))


# -- binary arithmetic -------------------------------------------------------------------------
def arith(a, b):
    return (a + b, a - b, a * b, torch.add(a, b, alpha=2), torch.sub(a, b, alpha=3),
            torch.maximum(a, b), torch.minimum(a, b))


def float_arith(a, b):
    return arith(a, b) + (a / b, torch.pow(a.abs() + 0.5, b), torch.atan2(a, b),
                          torch.fmod(a, b), torch.remainder(a, b))


def rounded_div(a, b):
    return (torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"),
            a // b)


def int_arith(a, b):
    return arith(a, b) + rounded_div(a, b) + (
        a / b, torch.remainder(a, b), torch.fmod(a, b), torch.pow(a, b.abs() % 4),
        a & b, a | b, a ^ b, ~a)


BROADCAST = [((7, 13), (7, 13)), ((7, 13), (13,)), ((7, 13), (7, 1)), ((4, 7, 13), (13,)),
             ((1, 13), (7, 1)), ((7, 13), ()), ((), (5, 3)), ((1,), (1,)), ((130, 97), (97,)),
             ((2, 1, 5), (3, 1))]


def _nonzero(b):
    return torch.where(b == 0, torch.ones_like(b), b)


@pytest.mark.parametrize(("sa", "sb"), BROADCAST, ids=str)
def test_binary_float32_broadcast(check, sa, sb):
    g = gen("bin", sa, sb)
    a, b = rand(sa, F32, g), rand(sb, F32, g)
    check(Fn(float_arith), (a, b))
    # floor/trunc of a quotient is discontinuous: compare with float32 eager, same operands.
    check(Fn(rounded_div), (a * 8, b), ref="same")


@pytest.mark.parametrize(("dtype", "sa", "sb", "layout"), [
    (F64, (7, 13), (13,), "contig"), (F64, (6, 11), (11,), "neg"),
    (I64, (7, 13), (7, 13), "contig"), (I64, (4, 7, 13), (7, 1), "contig"),
    (I32, (7, 13), (13,), "contig"), (I32, (1,), (1,), "contig"), (torch.int16, (5, 6), (6,),
                                                                  "contig"),
    (torch.int8, (3, 4), (3, 1), "contig"), (torch.uint8, (3, 4), (4,), "contig")])
def test_binary_dtypes(check, dtype, sa, sb, layout):
    g = gen("bin", dtype, sa, sb)
    if dtype.is_floating_point:
        a, b = rand(layout_shape(sa, layout), dtype, g), rand(layout_shape(sb, layout), dtype, g)
        check(Layout(Fn(float_arith), layout), (a, b))
        check(Layout(Fn(rounded_div), layout), (a * 8, b))
        return
    lo, hi = (0, 12) if dtype == torch.uint8 else (-12, 12)
    a, b = rand(sa, dtype, g, lo, hi), _nonzero(rand(sb, dtype, g, lo, hi))
    fn = int_arith if dtype != torch.uint8 else lambda a, b: arith(a, b) + (a // b, a % b)
    check(Fn(fn), (a, b))


def test_strided_binary_operands(check):
    g = gen("strided-binary")
    a, b = rand((13, 7), F32, g), rand((7, 26), F32, g)
    check(Fn(lambda a, b: (a.t() * b[:, ::2], a.t()[1:-1, -5:] - b[2:-1, ::-3],
                           torch.maximum(a.t(), b[:, 1::2]))), (a, b))


def test_scalars_both_positions(check):
    g = gen("scalars")
    x = rand((7, 13), F32, g)
    check(Fn(lambda x: (x + 2.5, 2.5 + x, x - 1.5, 1.5 - x, 3.0 * x, x * -2, x / 4, 3 / x,
                        x ** 2, x ** 3, x.abs() ** 0.5, 2 ** x, x.abs() ** -1.5, -x ** 2,
                        torch.pow(x, 0))), (x,))
    i = rand((7, 13), I64, g)
    check(Fn(lambda i: (i + 3, 3 - i, i * 2, i * 2.5, i / 2, 7 // _nonzero(i), i // 3, i % 5,
                        -7 % _nonzero(i), i ** 2, 2 ** (i.abs() % 10), i + True, i > 2.5)),
          (i,))


def test_nan_propagation(check):
    g = gen("nan")
    a, b = rand((9, 11), F32, g), rand((9, 11), F32, g)
    a[a > 1.0] = float("nan")
    b[b < -1.0] = float("nan")
    check(Fn(lambda a, b: (torch.maximum(a, b), torch.minimum(a, b), a + b, a.clamp(-1, 1),
                           torch.relu(a), F.hardtanh(b), a > b, a == a, a != b, b.isnan())),
          (a, b))


# -- comparisons, logical ops, where -----------------------------------------------------------
def compare_ops(a, b):
    return (a == b, a != b, a < b, a <= b, a > b, a >= b, a > 0, 1 < a, a == 2, 2 >= a)


def logical_ops(a, b):
    return (torch.logical_and(a, b), torch.logical_or(a, b), torch.logical_xor(a, b),
            torch.logical_not(a), torch.logical_not(b).logical_and(a))


@pytest.mark.parametrize("dtype", [F32, F64, I64, I32, BOOL], ids=str)
def test_comparisons_and_logical(check, dtype):
    g = gen("cmp", dtype)
    a, b = rand((7, 13), dtype, g, -3, 3), rand((13,), dtype, g, -3, 3)
    if dtype.is_floating_point:  # round so that ties (a == b) occur
        a, b = torch.round(a * 2), torch.round(b * 2)
    fn = (lambda a, b: compare_ops(a, b) + logical_ops(a, b)) if dtype != BOOL else \
        (lambda a, b: logical_ops(a, b) + (a & b, a | b, a ^ b, ~a, a == b, a < b))
    check(Fn(fn), (a, b), ref="same")


def test_where_and_masked_fill(check):
    g = gen("where")
    x, y = rand((7, 13), F32, g), rand((13,), F32, g)
    c = rand((7, 1), BOOL, g)
    i = rand((7, 13), I64, g)
    check(Fn(lambda x, y, c, i: (
        torch.where(c, x, y), torch.where(x > 0, x, 0.0), torch.where(x > 0, 1.0, y),
        torch.where(c, 2, 3.5), torch.where(i > 0, i, -i), torch.where(c, i, x),
        x.masked_fill(c, -1e9), x.masked_fill(x < 0, float("-inf")), i.masked_fill(i > 3, 7),
        x.masked_fill(y > 0, 0.5), y.masked_fill(torch.tensor(True), 2.0))), (x, y, c, i))


# -- casts and promotion ----------------------------------------------------------------------
def casts(x):
    big = x * 50
    return (big.to(torch.int64), big.to(torch.int32), big.to(torch.int16), (big % 100).to(
        torch.int8), big.abs().to(torch.uint8), x.to(torch.bool), (x > 0).to(torch.float32),
        big.to(torch.int64).to(torch.float32), x.to(torch.float64) * 3, big.to(torch.int32).to(
        torch.bool), (x > 0).long(), x.double().float(), (x * 1e4).to(torch.int64).to(
        torch.int32).to(torch.float64))


def promotion(x, i, j, b):
    return (x + i, i + j, i * 1.5, j / i.clamp(min=1), b + i, b & (i > 0), x * b, j + b,
            x.double() + x, torch.where(b, i, j), i + 0.5)


@pytest.mark.parametrize(("shape", "layout"), [((7, 13), "contig"), ((130, 97), "t"),
                                               ((1,), "contig")], ids=str)
def test_casts(check, shape, layout):
    x = rand(layout_shape(shape, layout), F32, gen("casts", shape))
    check(Layout(Fn(casts), layout), (x,), ref="same")
    check(Layout(Fn(lambda x: casts(x.float())), layout), (x.double(),), ref="same")


def test_type_promotion(check):
    g = gen("promotion")
    x, i = rand((7, 13), F32, g), rand((7, 13), I64, g)
    j, b = rand((13,), I32, g), rand((7, 1), BOOL, g)
    check(Fn(promotion), (x, i, j, b))


# -- dynamic shapes ---------------------------------------------------------------------------
def test_dynamic_unary_chain(check):
    n = dim("n", 1, 1 << 14)
    fn = Fn(lambda x: (F.gelu(x) * torch.sigmoid(x) + torch.exp(-x.abs()), x.clamp(-1, 1).t()))
    sizes = [5, 1, 300, 4096]
    xs = [rand((k, 13), F32, gen("dyn-unary", k)) for k in sizes]
    check(fn, (xs[0],), more=[(x,) for x in xs[1:]], dynamic_shapes=({0: n},))


def test_dynamic_binary_broadcast(check):
    n, m = dim("n"), dim("m")
    fn = Fn(lambda a, b, c: (a * b + c, torch.maximum(a, c) - b, (a > b).float() / c))
    sizes = [(3, 5), (7, 13), (2, 2), (64, 3)]
    args = [(rand((k, 1, j), F32, gen("dyn-bin", k, j)), rand((j,), F32, gen("b", k, j)),
             rand((k, 4, j), F32, gen("c", k, j))) for k, j in sizes]
    check(fn, args[0], more=args[1:], dynamic_shapes=({0: n, 2: m}, {0: m}, {0: n, 2: m}))


def test_dynamic_strided_integer(check):
    n = dim("n", 2, 512)
    fn = Fn(lambda i: (i.t() // 3, i[:, ::2] * 2 - 1, (i % 4 == 0).sum(0)))
    args = [(rand((k, 6), I64, gen("dyn-int", k)),) for k in (4, 2, 77, 512)]
    check(fn, args[0], more=args[1:], dynamic_shapes=({0: n},))

