"""Differential tests of elementwise ops: unary math and activations, binary arithmetic with
broadcasting and scalars, comparisons, logical ops, where / masked_fill, casts and promotion.
Models return a dict {op name: result}, so a failure names the op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftest import (SHAPES, STRIDED, Cases, Checker, Fn, Layout, case_name, dim, gen,
                      layout_shape, rand)

F32, F64, I64, I32, BOOL = torch.float32, torch.float64, torch.int64, torch.int32, torch.bool


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("ops_pointwise"))


def _ids(v) -> str:
    if isinstance(v, tuple) and not all(isinstance(d, int) for d in v):
        return "-".join(map(_ids, v))
    return str(v).replace(" ", "").removeprefix("torch.")


def check_cases(check: Checker, cases: dict, **kw) -> None:
    """`cases`: name -> (module, args); all checked as one difftest.Cases program (one package,
    each case its own static shapes, kernels and per-dtype tolerance; outputs named
    "<name>__<output>"); `kw` as for Checker.__call__."""
    mods = {case_name(k): (m, len(a)) for k, (m, a) in cases.items()}
    assert len(mods) == len(cases), list(cases)
    check(Cases(mods), [x for _, a in cases.values() for x in a], **kw)


# -- unary -------------------------------------------------------------------------------------
def unary(x):
    a = 3 * x
    r = 4 * x
    return {
        "exp": torch.exp(x), "log": torch.log(x.abs() + 0.1), "sqrt": torch.sqrt(x.abs()),
        "rsqrt": torch.rsqrt(x.abs() + 0.1), "tanh": torch.tanh(a), "sigmoid": torch.sigmoid(r),
        "erf": torch.erf(2 * x), "sin": torch.sin(a), "cos": torch.cos(a),
        "log1p": torch.log1p(x.abs()), "expm1": torch.expm1(x),
        "relu": torch.relu(a), "gelu": F.gelu(a), "gelu_tanh": F.gelu(a, approximate="tanh"),
        "silu": F.silu(a), "leaky_relu": F.leaky_relu(a), "leaky_relu_0.2": F.leaky_relu(a, 0.2),
        "hardswish": F.hardswish(a), "hardsigmoid": F.hardsigmoid(a), "mish": F.mish(a),
        "softplus": F.softplus(a), "softplus_b2_t5": F.softplus(a, beta=2.0, threshold=5.0),
        "hardtanh": F.hardtanh(a), "relu6": F.relu6(a), "clamp": a.clamp(-0.5, 2.0),
        "clamp_min": a.clamp(min=0.25), "clamp_max": a.clamp(max=-0.25),
        "neg": -r, "abs": r.abs(), "floor": torch.floor(r), "ceil": torch.ceil(r),
        "round": torch.round(r), "sign": torch.sign(r), "trunc": torch.trunc(r),
        "reciprocal": torch.reciprocal(r), "square": torch.square(r),
    }


UNARY_CASES = ([(s, "contig", F32) for s in SHAPES] + [(s, k, F32) for s, k in STRIDED]
               + [((7, 13), "contig", F64), ((130, 97), "t", F64)])


def test_unary(check):
    """`unary` at each (shape, layout, dtype) of UNARY_CASES, in one program (check_cases)."""
    check_cases(check, {_ids(c): (Layout(Fn(unary), c[1]), (
        rand(layout_shape(c[0], c[1]), c[2], gen("unary", *c)),)) for c in UNARY_CASES})


def test_unary_special_values(check):
    x = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -0.0, 0.0, 1e-30, -1e-30, 100.0,
                      -100.0, 88.0, -88.0, 1e6, float("inf"), float("-inf"), float("nan")])

    def specials(x):
        return {"round": torch.round(x), "sign": torch.sign(x), "relu": torch.relu(x),
                "abs": x.abs(), "exp": torch.exp(x), "tanh": torch.tanh(x),
                "sigmoid": torch.sigmoid(x), "erf": torch.erf(x), "floor": torch.floor(x),
                "clamp": x.clamp(-1, 1), "isnan": torch.isnan(x), "isinf": torch.isinf(x),
                "gelu": F.gelu(x), "silu": F.silu(x), "softplus": F.softplus(x)}

    # float64 math rounded to float32 at the extremes of the range: only rounding-level
    # differences. Not float32 eager: on AVX-512 CPUs (Zen 4) eager's float32 gelu(+inf) is nan
    # where float64 math (and kiln) give inf.
    check(Fn(specials), (x,), ref="f64r", tol={"rtol": 1e-5, "atol": 1e-6})
    check(Fn(specials), (x.double(),))


def int_unary(i):
    return {"abs": i.abs(), "neg": -i, "sign": i.sign(), "exp": i.exp(), "sqrt": i.abs().sqrt(),
            "sigmoid": i.sigmoid(), "tanh": torch.tanh(i), "relu": i.relu(),
            "clamp": i.clamp(-3, 4), "clamp_min": i.clamp(min=-3), "floor": i.floor(),
            "round": i.round(), "square": i.square(), "reciprocal": i.reciprocal(),
            "log1p": i.abs().log1p(), "erf": i.erf(), "isnan": i.isnan()}


def test_unary_integer_inputs(check):
    g = gen("int-unary")
    args = [rand((7, 13), dt, g, 0 if dt == torch.uint8 else -10, 10)
            for dt in (I64, I32, torch.int8, torch.uint8)]
    b = rand((5, 6), BOOL, g)

    def fn(a, c, d, e, b):
        out = {f"{k}_{t}": v for t, x in zip(("i64", "i32", "i8", "u8"), (a, c, d, e))
               for k, v in int_unary(x).items()}
        return {**out, "bool_add": b + b, "bool_mul": b * b, "bool_max": torch.maximum(b, ~b),
                "bool_float": b.float() * 2, "bool_neg_long": -(b.long())}

    check(Fn(fn), (*args, b))


# -- binary arithmetic -------------------------------------------------------------------------
def arith(a, b):
    return {"add": a + b, "sub": a - b, "mul": a * b, "add_alpha": torch.add(a, b, alpha=2),
            "sub_alpha": torch.sub(a, b, alpha=3), "maximum": torch.maximum(a, b),
            "minimum": torch.minimum(a, b)}


def rounded_div(a, b):
    return {"div_floor": torch.div(a, b, rounding_mode="floor"),
            "div_trunc": torch.div(a, b, rounding_mode="trunc"), "floordiv": a // b,
            "remainder": torch.remainder(a, b), "fmod": torch.fmod(a, b)}


def float_arith(a, b):
    # floor/trunc of a quotient is discontinuous: integer-valued operands keep float32 and
    # the float64 reference on the same side of every integer
    qa, qb = torch.round(a * 8), _nonzero(torch.round(b * 4))
    return {**arith(a, b), "div": a / b, "pow": torch.pow(a.abs() + 0.5, b),
            "atan2": torch.atan2(a, b), **rounded_div(qa, qb),
            "remainder_frac": torch.remainder(a, qb), "fmod_frac": torch.fmod(a, qb)}


def int_arith(a, b):
    return {**arith(a, b), **rounded_div(a, b), "truediv": a / b,
            "pow": torch.pow(a, b.abs() % 4), "and": a & b, "or": a | b, "xor": a ^ b,
            "not": ~a}


BROADCAST = [((7, 13), (7, 13)), ((7, 13), (13,)), ((7, 13), (7, 1)), ((1, 13), (7, 1)),
             ((7, 13), ()), ((130, 97), (97,)), ((2, 1, 5), (3, 1))]  # + (1,) in dtypes


def _nonzero(b):
    return torch.where(b == 0, torch.ones_like(b), b)


def test_binary_float32_broadcast(check):
    """`float_arith` at each pair of BROADCAST shapes, in one program."""
    cases = {}
    for sa, sb in BROADCAST:
        g = gen("bin", sa, sb)
        cases[str((sa, sb))] = (Fn(float_arith), (rand(sa, F32, g), rand(sb, F32, g)))
    check_cases(check, cases)


def test_binary_float_division_semantics(check):
    # torch's floor division of floats is computed from fmod (1.0 // 0.1 == 9, not 10)
    a = torch.tensor([1.0, -1.0, 1.0, 7.5, -7.5, 0.3, 5.0, -5.0, 0.0, -0.0, 1.0, 2.0])
    b = torch.tensor([0.1, 0.1, -0.1, 2.0, 2.0, 0.1, -3.0, 3.0, 2.0, 2.0, 0.0, float("inf")])
    fn = Fn(lambda a, b: {"div": a / b, **rounded_div(a, b)})
    check(fn, (a, b), ref="same", tol={"rtol": 0, "atol": 0})
    check(fn, (a.double(), b.double()), ref="same", tol={"rtol": 0, "atol": 0})


BINARY_DTYPES = [
    (F64, (7, 13), (13,), "contig"), (F64, (6, 11), (11,), "neg"),
    (I64, (7, 13), (7, 13), "contig"), (I64, (4, 7, 13), (7, 1), "contig"),
    (I32, (7, 13), (13,), "contig"), (I32, (1,), (1,), "contig"),
    (torch.int16, (5, 6), (6,), "contig"), (torch.int8, (3, 4), (3, 1), "contig"),
    (torch.uint8, (3, 4), (4,), "contig")]


def test_binary_dtypes(check):
    """Each (dtype, shapes, layout) of BINARY_DTYPES, in one program."""
    cases = {}
    for dtype, sa, sb, layout in BINARY_DTYPES:
        g = gen("bin", dtype, sa, sb)
        name = _ids((dtype, sa, sb, layout))
        if dtype.is_floating_point:
            a = rand(layout_shape(sa, layout), dtype, g)
            b = rand(layout_shape(sb, layout), dtype, g)
            cases[name] = (Layout(Fn(float_arith), layout), (a, b))
            continue
        lo, hi = (0, 12) if dtype == torch.uint8 else (-12, 12)
        a, b = rand(sa, dtype, g, lo, hi), _nonzero(rand(sb, dtype, g, lo, hi))
        fn = int_arith if dtype != torch.uint8 else \
            lambda a, b: {**arith(a, b), "floordiv": a // b, "mod": a % b}
        cases[name] = (Fn(fn), (a, b))
    check_cases(check, cases)


def test_strided_binary_operands(check):
    g = gen("strided-binary")
    a, b = rand((13, 7), F32, g), rand((7, 26), F32, g)
    check(Fn(lambda a, b: {"t_mul_step": a.t() * b[:, ::2],
                           "neg_slices": a.t()[1:-1, -5:] - b[1:-1, -10::2],
                           "max_offset_step": torch.maximum(a.t(), b[:, 1::2])}), (a, b))


def test_scalars_both_positions(check):
    g = gen("scalars")
    x, i = rand((7, 13), F32, g), rand((7, 13), I64, g)
    check(Fn(lambda x, i: {
        "x+2.5": x + 2.5, "2.5+x": 2.5 + x, "x-1.5": x - 1.5, "1.5-x": 1.5 - x, "3*x": 3.0 * x,
        "x*-2": x * -2, "x/4": x / 4, "3/x": 3 / x, "x**2": x ** 2, "x**3": x ** 3,
        "|x|**0.5": x.abs() ** 0.5, "2**x": 2 ** x, "|x|**-1.5": x.abs() ** -1.5,
        "-x**2": -x ** 2, "x**0": torch.pow(x, 0), "i+3": i + 3, "3-i": 3 - i, "i*2": i * 2,
        "i*2.5": i * 2.5, "i/2": i / 2, "7//i": 7 // _nonzero(i), "i//3": i // 3, "i%5": i % 5,
        "-7%i": -7 % _nonzero(i), "i**2": i ** 2, "2**i": 2 ** (i.abs() % 10),
        "i+True": i + True, "i>2.5": i > 2.5, "x+i": x + i}), (x, i))


def test_nan_propagation(check):
    g = gen("nan")
    a, b = rand((9, 11), F32, g), rand((9, 11), F32, g)
    a[a > 1.0] = float("nan")
    b[b < -1.0] = float("nan")
    check(Fn(lambda a, b: {
        "maximum": torch.maximum(a, b), "minimum": torch.minimum(a, b), "add": a + b,
        "clamp": a.clamp(-1, 1), "relu": torch.relu(a), "hardtanh": F.hardtanh(b),
        "gt": a > b, "eq_self": a == a, "ne": a != b, "isnan": b.isnan()}), (a, b))


# -- comparisons, logical ops, where -----------------------------------------------------------
def compare_ops(a, b):
    return {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b,
            "gt_0": a > 0, "1_lt": 1 < a, "eq_2": a == 2, "2_ge": 2 >= a}


def logical_ops(a, b):
    return {"and": torch.logical_and(a, b), "or": torch.logical_or(a, b),
            "xor": torch.logical_xor(a, b), "not": torch.logical_not(a),
            "not_and": torch.logical_not(b).logical_and(a)}


def test_comparisons_and_logical(check):
    """float32, float64, int64, int32 and bool, in one program."""
    cases = {}
    for dtype in (F32, F64, I64, I32, BOOL):
        g = gen("cmp", dtype)
        a, b = rand((7, 13), dtype, g, -3, 3), rand((13,), dtype, g, -3, 3)
        if dtype.is_floating_point:  # round so that ties (a == b) occur
            a, b = torch.round(a * 2), torch.round(b * 2)
        fn = (lambda a, b: {**compare_ops(a, b), **logical_ops(a, b)}) if dtype != BOOL else \
            (lambda a, b: {**logical_ops(a, b), "&": a & b, "|": a | b, "^": a ^ b, "~": ~a,
                           "eq": a == b, "lt": a < b})
        cases[_ids(dtype)] = (Fn(fn), (a, b))
    check_cases(check, cases)


def test_where_and_masked_fill(check):
    g = gen("where")
    x, y = rand((7, 13), F32, g), rand((13,), F32, g)
    c, i = rand((7, 1), BOOL, g), rand((7, 13), I64, g)
    check(Fn(lambda x, y, c, i: {
        "where": torch.where(c, x, y), "where_scalar_other": torch.where(x > 0, x, 0.0),
        "where_scalar_self": torch.where(x > 0, 1.0, y), "where_scalars": torch.where(c, 2, 3.5),
        "where_int": torch.where(i > 0, i, -i), "where_promote": torch.where(c, i, x),
        "masked_fill": x.masked_fill(c, -1e9),
        "masked_fill_inf": x.masked_fill(x < 0, float("-inf")),
        "masked_fill_int": i.masked_fill(i > 3, 7), "masked_fill_row": x.masked_fill(y > 0, 0.5),
        "masked_fill_0d": y.masked_fill(torch.tensor(True), 2.0)}), (x, y, c, i))


# -- casts and promotion ----------------------------------------------------------------------
def casts(x):
    x = x.float()
    big = x * 50
    return {"f32->i64": big.to(torch.int64), "f32->i32": big.to(torch.int32),
            "f32->i16": big.to(torch.int16), "f32->i8": (big % 100).to(torch.int8),
            "f32->u8": big.abs().to(torch.uint8), "f32->bool": x.to(torch.bool),
            "bool->f32": (x > 0).to(torch.float32), "bool->i64": (x > 0).long(),
            "i64->f32": big.to(torch.int64).to(torch.float32), "f32->f64": x.to(F64) * 3,
            "i32->bool": big.to(torch.int32).to(torch.bool), "f64->f32": x.double().float(),
            "i64->i32->f64": (x * 1e4).to(torch.int64).to(torch.int32).to(F64),
            "u8->i64": big.abs().to(torch.uint8).long() - 300, "i8->f32": (big % 100).to(
                torch.int8).float()}


CASTS = [((7, 13), "contig", F32), ((130, 97), "t", F32), ((1,), "contig", F32),
         ((7, 13), "step", F64)]


def test_casts(check):
    """`casts` at each (shape, layout, dtype) of CASTS, in one program."""
    check_cases(check, {_ids(c): (Layout(Fn(casts), c[1]), (
        rand(layout_shape(c[0], c[1]), c[2], gen("casts", c[0], c[2])),)) for c in CASTS},
        ref="same")  # casts to integers truncate


def test_type_promotion(check):
    g = gen("promotion")
    x, i = rand((7, 13), F32, g), rand((7, 13), I64, g)
    j, b = rand((13,), I32, g), rand((7, 1), BOOL, g)
    check(Fn(lambda x, i, j, b: {
        "f32+i64": x + i, "i64+i32": i + j, "i64*1.5": i * 1.5, "i32/i64": j / i.clamp(min=1),
        "bool+i64": b + i, "bool&bool": b & (i > 0), "f32*bool": x * b, "i32+bool": j + b,
        "f64+f32": x.double() + x, "where_i64_i32": torch.where(b, i, j), "i64+0.5": i + 0.5}),
        (x, i, j, b))


# -- dynamic shapes ---------------------------------------------------------------------------
def test_dynamic_unary_chain(check):
    n = dim("n", 1, 1 << 14)
    fn = Fn(lambda x: {"chain": F.gelu(x) * torch.sigmoid(x) + torch.exp(-x.abs()),
                       "clamp_t": x.clamp(-1, 1).t()})
    xs = [rand((k, 13), F32, gen("dyn-unary", k)) for k in (5, 1, 300, 4096)]
    check(fn, (xs[0],), more=[(x,) for x in xs[1:]], dynamic_shapes=({0: n},))


def test_dynamic_binary_broadcast(check):
    n, m = dim("n"), dim("m")
    fn = Fn(lambda a, b, c: {"mul_add": a * b + c, "max_sub": torch.maximum(a, c) - b,
                             "cmp_div": (a > b).float() / c})
    args = [(rand((k, 1, j), F32, gen("a", k, j)), rand((j,), F32, gen("b", k, j)),
             rand((k, 4, j), F32, gen("c", k, j))) for k, j in [(3, 5), (7, 13), (2, 2), (64, 3)]]
    check(fn, args[0], more=args[1:], dynamic_shapes=({0: n, 2: m}, {0: m}, {0: n, 2: m}))


def test_dynamic_strided_integer(check):
    n = dim("n", 2, 512)
    fn = Fn(lambda i: {"t_floordiv": i.t() // 3, "step": i[:, ::2] * 2 - 1,
                       "count": (i % 4 == 0).sum(0)})
    args = [(rand((k, 6), I64, gen("dyn-int", k)),) for k in (4, 2, 77, 512)]
    check(fn, args[0], more=args[1:], dynamic_shapes=({0: n},))


def test_int64_minimum_literal(tmp_path):
    """The int64 minimum as a constant compiles and compares like eager."""
    import kiln

    class Floor(torch.nn.Module):
        def forward(self, i):
            return torch.maximum(i, torch.full((3,), -2**63, dtype=torch.int64))

    i = torch.tensor([5, -3, 7])
    runner = kiln.compile(Floor(), (i,)).load(tmp_path / "m.kiln")
    torch.testing.assert_close(runner(i), Floor()(i))


# -- more pointwise: special functions, sign handling, compositions, tensor clamp, shifts ----
def more_math(x, y):
    p = x.sigmoid()
    return {
        "log10": torch.log10(x.abs() + 0.01), "i0": torch.i0(x), "signbit": torch.signbit(x),
        "hypot": torch.hypot(x, 3 * y), "copysign": torch.copysign(x, y),
        "copysign_scalar": torch.copysign(x, -1.0), "nextafter": torch.nextafter(x, y),
        "xlogy": torch.xlogy(x, y.abs()), "logit": torch.logit(p), "logit_eps": torch.logit(p, 0.1),
        "frac": torch.frac(4 * x), "lerp": torch.lerp(x, y, 0.3), "lerp_t": torch.lerp(x, y, p),
        "addcmul": torch.addcmul(x, y, p, value=0.5),
        "addcdiv": torch.addcdiv(x, y, p + 1, value=2),
        "heaviside": torch.heaviside(torch.round(x), y), "sinc": torch.sinc(x),
        "nan_to_num": torch.nan_to_num(torch.log(x), nan=1.0, neginf=-5.0),
        "elu": F.elu(x), "selu": F.selu(x), "celu": F.celu(x, 0.5),
        "clamp_t": torch.clamp(x, y, y + 1), "clamp_t_min": torch.clamp(x, min=y),
        "clamp_t_max": torch.clamp(x, max=y[..., :1]), "clamp_min_t": torch.clamp_min(x, y),
        "clamp_max_t": torch.clamp_max(x, y),
    }


MORE_MATH = [((7, 13), "contig", F32), ((1,), "contig", F32), ((130, 97), "contig", F32),
             ((6, 11), "neg", F32), ((7, 13), "t", F64), ((3, 1, 5), "contig", F64)]


def test_more_math(check):
    """`more_math` at each (shape, layout, dtype) of MORE_MATH, in one program."""
    cases = {}
    for shape, layout, dtype in MORE_MATH:
        g = gen("more-math", shape, layout, dtype)
        x = rand(layout_shape(shape, layout), dtype, g)
        y = rand(layout_shape(shape, layout), dtype, g)
        cases[_ids((shape, layout, dtype))] = (Layout(Fn(more_math), layout), (x, y))
    check_cases(check, cases)


def test_round_decimals_and_special_values(check):
    """Rounding is discontinuous: compared with eager in the same dtype."""
    g = gen("round-dec")
    x = torch.cat([rand((200,), F32, g) * 50, torch.tensor(
        [0.125, -0.125, 2.5, float("inf"), float("-inf"), float("nan"), -0.0])])
    check(Fn(lambda x: {
        "round_2": torch.round(x, decimals=2), "round_1": torch.round(x, decimals=1),
        "round_neg": torch.round(x, decimals=-1), "round_0": torch.round(x, decimals=0),
        "signbit": torch.signbit(x), "copysign": torch.copysign(x.abs(), x),
        "nan_to_num": torch.nan_to_num(x), "log10": torch.log10(x.abs()),
        "hypot_inf": torch.hypot(x, x), "i0": torch.i0(x)}), (x,), ref="same")


def test_integer_shifts_and_clamp(check):
    """int64 and int32, in one program."""
    check_cases(check, {_ids(dt): shifts_case(dt) for dt in (I64, I32)})


def shifts_case(dtype):
    g = gen("shifts", dtype)
    bits = torch.iinfo(dtype).bits
    x = rand((9, 11), dtype, g, low=-1000, high=1000)
    s = rand((9, 11), dtype, g, low=0, high=bits)
    return (Fn(lambda x, s: {
        "shl": x << s, "shr": x >> s, "shl_scalar": x << 3, "shr_scalar": x >> 2,
        "bitwise_left_shift": torch.bitwise_left_shift(x, s % 7),
        "signbit": torch.signbit(x), "clamp_t": torch.clamp(x, s - 5, s * 10),
        "log10": torch.log10(x.abs() + 1), "copysign": torch.copysign(x, s - 3)}), (x, s))
