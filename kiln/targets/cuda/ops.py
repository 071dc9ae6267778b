"""Per-op Triton spellings for Loop IR operators (one table), the reduction table, the
printers of index expressions (`to_tl`) and constants (`literal`), and the helper functions
every generated Triton module starts with (`PRELUDE`).

Input: an operator name from `kiln.ir.loop.OPS` and whether its operands are floating point.
Output: a format string over the argument expressions `{0}`, `{1}`, `{2}` (and `{T}`, the
Triton dtype of the result). Invariants: every spelling computes what the C++ spelling of
`kiln/targets/cpu/ops.py` computes (`kiln_kernels.h` semantics: integer division by zero
gives 0, `maximum`/`minimum` propagate NaN, `floordiv`/`remainder` follow Python's sign rules);
helpers named `_kl_*` are `@triton.jit` functions defined in `PRELUDE`."""

from __future__ import annotations

import struct

import sympy

from kiln.gemm.int4_tc import MMA_CONSTRAINTS, MMA_PTX
from kiln.ir import dtypes
from kiln.ir.dtypes import DType
from kiln.ir.sym import FloorDiv, ModIdx
from kiln.errors import UnsupportedError

# Triton's spellings of each dtype: its `tl.` type, and its signature spelling as a pointer's
# element (bool tensors are bytes: *i1)
TL_DTYPE = {dtypes.float32: "tl.float32", dtypes.float64: "tl.float64",
            dtypes.float16: "tl.float16", dtypes.bfloat16: "tl.bfloat16",
            dtypes.int64: "tl.int64", dtypes.int32: "tl.int32", dtypes.int16: "tl.int16",
            dtypes.int8: "tl.int8", dtypes.uint8: "tl.uint8", dtypes.bool_: "tl.int1",
            dtypes.float8_e4m3fn: "tl.float8e4nv", dtypes.float8_e5m2: "tl.float8e5",
            # fnuz float8: Triton's fp8e4b8 / fp8e5b16 are AMD's only; stored as bytes here,
            # converted by the `_kl_*fnuz*` helpers (bit arithmetic, eager's rules)
            dtypes.float8_e4m3fnuz: "tl.uint8", dtypes.float8_e5m2fnuz: "tl.uint8"}
SIG_PTR = {dtypes.float32: "*fp32", dtypes.float64: "*fp64", dtypes.float16: "*fp16",
           dtypes.bfloat16: "*bf16", dtypes.int64: "*i64", dtypes.int32: "*i32",
           dtypes.int16: "*i16", dtypes.int8: "*i8", dtypes.uint8: "*u8", dtypes.bool_: "*i1",
           dtypes.float8_e4m3fn: "*fp8e4nv", dtypes.float8_e5m2: "*fp8e5",
           dtypes.float8_e4m3fnuz: "*u8", dtypes.float8_e5m2fnuz: "*u8",
           # complex: pairs of parts (real, imaginary), moved as their bit patterns
           dtypes.complex32: "*i16", dtypes.complex64: "*i32", dtypes.complex128: "*i64"}
# complex dtype -> the Triton type of one part's bits (kernels move parts as bits and compute
# on them as floats: `real` / `imag` / `complex` in FLOAT_OPS)
COMPLEX_PART = {"complex32": ("tl.int16", "<e", "<h"), "complex64": ("tl.int32", "<f", "<i"),
                "complex128": ("tl.int64", "<d", "<q")}
# The type values of each dtype are held in while computing: 16-bit floats are loaded into
# float32, every operator and accumulator works in float32, and a value is rounded to 16 bits
# only where it is stored or explicitly cast (as eager's CUDA kernels do per operator).
# 8-bit floats likewise, rounded by the `_kl_f8*` helpers (eager's overflow rules:
# kiln/targets/float8.py picks the helper of the compiling torch).
COMPUTE = {"float16": "float32", "bfloat16": "float32", "float8_e4m3fn": "float32",
           "float8_e5m2": "float32", "float8_e4m3fnuz": "float32", "float8_e5m2fnuz": "float32"}
ROUND8 = frozenset({"float8_e4m3fn", "float8_e5m2"})
# fnuz dtype -> (decoding helper: byte -> float32, encoding helper: float32 -> byte)
FNUZ = {"float8_e4m3fnuz": ("_kl_e4m3fnuz_f32", "_kl_f32_e4m3fnuz"),
        "float8_e5m2fnuz": ("_kl_e5m2fnuz_f32", "_kl_f32_e5m2fnuz")}


def tl_compute(name: str) -> str:
    """The Triton dtype values of dtype `name` are computed in."""
    return TL_DTYPE[dtypes.dtype(COMPUTE.get(name, name))]

LD = "libdevice"
_SHARED = {
    "neg": "(-{0})", "abs": "tl.abs({0})", "square": "({0} * {0})",
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})",
    "logical_not": "({0} == 0)", "to_bool": "({0} != 0)",
    "logical_and": "(({0} != 0) & ({1} != 0))", "logical_or": "(({0} != 0) | ({1} != 0))",
    "logical_xor": "(({0} != 0) ^ ({1} != 0))",
    "bitwise_and": "({0} & {1})", "bitwise_or": "({0} | {1})", "bitwise_xor": "({0} ^ {1})",
    "bitwise_not": "(~{0})", "where": "tl.where({0}, {1}, {2})",
    "relu": "tl.where({0} < 0, 0, {0}).to({T})",
    "sign": "(({0} > 0).to({T}) - ({0} < 0).to({T}))",
    "philox": "_kl_philox({0}, {1}, {2}, {3}, {4})",
}

FLOAT_OPS: dict[str, str] = {
    **_SHARED,
    "exp": "tl.exp({0})", "log": "tl.log({0})", "sqrt": "tl.sqrt_rn({0})",
    "rsqrt": "tl.rsqrt({0})", "tanh": f"{LD}.tanh({{0}})", "sigmoid": "tl.sigmoid({0})",
    "sin": "tl.sin({0})", "cos": "tl.cos({0})", "tan": f"{LD}.tan({{0}})",
    "atan": f"{LD}.atan({{0}})", "asin": f"{LD}.asin({{0}})", "acos": f"{LD}.acos({{0}})",
    "sinh": f"{LD}.sinh({{0}})", "cosh": f"{LD}.cosh({{0}})", "asinh": f"{LD}.asinh({{0}})",
    "acosh": f"{LD}.acosh({{0}})", "atanh": f"{LD}.atanh({{0}})", "erf": "tl.erf({0})",
    "erfc": f"{LD}.erfc({{0}})", "reciprocal": "(1 / {0})", "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})", "round": f"{LD}.nearbyint({{0}})", "trunc": f"{LD}.trunc({{0}})",
    "log1p": f"{LD}.log1p({{0}})", "expm1": f"{LD}.expm1({{0}})", "exp2": "tl.exp2({0})",
    "log2": "tl.log2({0})", "isnan": "({0} != {0})", "isinf": "(tl.abs({0}) == float('inf'))",
    "div": "({0} / {1})", "truediv_floor": "_kl_floordiv_f({0}, {1})",
    "truediv_trunc": f"{LD}.trunc({{0}} / {{1}})", "pow": f"{LD}.pow({{0}}, {{1}})",
    "maximum": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "remainder": "_kl_remainder_f({0}, {1})", "fmod": f"{LD}.fmod({{0}}, {{1}})",
    "atan2": f"{LD}.atan2({{0}}, {{1}})",
    "log10": f"{LD}.log10({{0}})", "i0": f"{LD}.cyl_bessel_i0({{0}})",
    "signbit": f"({LD}.signbit({{0}}) != 0)", "hypot": f"{LD}.hypot({{0}}, {{1}})",
    "copysign": f"{LD}.copysign({{0}}, {{1}})", "nextafter": f"{LD}.nextafter({{0}}, {{1}})",
    "shift_left": f"({{0}} * {LD}.exp2({{1}}))", "shift_right": f"({{0}} / {LD}.exp2({{1}}))",
    # complex values as their parts' bits (kernel.py `part`): a part of a complex element
    # read as a float ({0}: the part's bits), and part k of a complex element made of two
    # floats stored as bits ({0}: operand k, {T}: the part's integer type)
    "real": "{0}.to({T}, bitcast=True)", "imag": "{0}.to({T}, bitcast=True)",
    "complex": "{0}.to({T}, bitcast=True)",
}

INT_OPS: dict[str, str] = {
    **_SHARED,
    "isnan": "({0} != {0})", "isinf": "({0} != {0})",
    "div": "_kl_div_i({0}, {1})", "truediv_trunc": "_kl_div_i({0}, {1})",
    "truediv_floor": "_kl_floordiv_i({0}, {1})",
    "maximum": "tl.maximum({0}, {1})", "minimum": "tl.minimum({0}, {1})",
    "remainder": "_kl_remainder_i({0}, {1})", "fmod": "_kl_fmod_i({0}, {1})",
    "pow": f"{LD}.pow({{0}}.to(tl.float64), {{1}}.to(tl.float64)).to({{T}})",
    "signbit": "({0} < 0)", "shift_left": "_kl_shl({0}, {1})", "shift_right": "_kl_shr({0}, {1})",
}

# kind -> (identity for floats, identity for ints, per-tile combine, final cross-lane reduce).
# {acc} is the [XBLOCK, RBLOCK] accumulator, {x} the masked tile (identity where masked).
REDUCTIONS: dict[str, tuple[str, str, str, str]] = {
    "sum": ("0", "0", "{acc} + {x}", "tl.sum({acc}, 1, keep_dims=True)"),
    "prod": ("1", "1", "{acc} * {x}", "tl.reduce({acc}, 1, _kl_mul, keep_dims=True)"),
    "max": ("float('-inf')", "{lo}", "{maximum}", "tl.reduce({acc}, 1, _kl_max, keep_dims=True)"),
    "min": ("float('inf')", "{hi}", "{minimum}", "tl.reduce({acc}, 1, _kl_min, keep_dims=True)"),
    "any": ("0", "0", "tl.maximum({acc}, {x})", "tl.max({acc}, 1, keep_dims=True) != 0"),
    "all": ("1", "1", "tl.minimum({acc}, {x})", "tl.min({acc}, 1, keep_dims=True) != 0"),
}

# by dtype name: the range of each integer and bool dtype
INT_LIMITS = {d.name: d.int_range for d in dtypes.DTYPES.values() if d.int_range is not None}


# float64 spellings where FLOAT_OPS's take float32 only (`tl.sqrt_rn`; float64 `tl.sqrt` is
# sqrt.rn.f64, correctly rounded)
FLOAT64_OPS = {"sqrt": "tl.sqrt({0})"}


def op_spelling(op: str, arg_dtype: DType) -> str:
    if arg_dtype.name == "float64" and op in FLOAT64_OPS:
        return FLOAT64_OPS[op]
    table = FLOAT_OPS if arg_dtype.is_float else INT_OPS
    try:
        return table[op]
    except KeyError:
        raise UnsupportedError(f"operator {op!r} on {arg_dtype.name} has no Triton spelling "
                               "(kiln/targets/cuda/ops.py)") from None


def to_tl(e, names: dict[str, str] | None = None) -> str:
    """A size or index expression as Triton/Python integer arithmetic (operands of // and %
    are non-negative in index expressions, where C and Python semantics agree)."""
    e = sympy.sympify(e)
    names = names or {}
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return names.get(e.name, e.name)
    if isinstance(e, FloorDiv):
        return f"({to_tl(e.args[0], names)} // {to_tl(e.args[1], names)})"
    if isinstance(e, ModIdx):
        return f"({to_tl(e.args[0], names)} % {to_tl(e.args[1], names)})"
    if e.is_Add:
        return "(" + " + ".join(to_tl(a, names) for a in
                                sorted(e.args, key=sympy.default_sort_key)) + ")"
    if e.is_Mul:
        return "(" + " * ".join(to_tl(a, names) for a in
                                sorted(e.args, key=sympy.default_sort_key)) + ")"
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        return "(" + " * ".join([to_tl(e.base, names)] * int(e.exp)) + ")"
    if isinstance(e, (sympy.Max, sympy.Min)):
        fn = "tl.maximum" if isinstance(e, sympy.Max) else "tl.minimum"
        out = to_tl(e.args[0], names)
        for a in e.args[1:]:
            out = f"{fn}({out}, {to_tl(a, names)})"
        return out
    raise ValueError(f"cannot print index expression {e!r} for Triton")


def canon(e) -> sympy.Expr:
    """A size expression (int, string or sympy) in its expanded form: what the kernel printers
    compare and print."""
    return sympy.expand(sympy.sympify(e))


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= n, at least `least` (tile sizes: Triton's blocks are
    powers of two)."""
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def size_names(exprs) -> list[str]:
    """The size symbols of `exprs`, sorted by name: a kernel's size parameters."""
    return sorted({str(s) for x in exprs for s in sympy.sympify(x).free_symbols})


def part_literal(value, dt, part: int) -> str:
    """The bits of part `part` (0 real, 1 imaginary) of complex constant `value` of dtype
    `dt`, as an integer literal."""
    _, f, i = COMPLEX_PART[dt.name]
    v = complex(value)
    return str(struct.unpack(i, struct.pack(f, v.imag if part else v.real))[0])


def literal(value, dt) -> str:
    if dt.name == "bool":
        return "1" if value else "0"
    if dt.is_float:
        v = float(value)
        if v != v:
            return "float('nan')"
        if v in (float("inf"), float("-inf")):
            return "float('inf')" if v > 0 else "float('-inf')"
        return repr(v)
    return str(int(value))


PRELUDE = '''\
# Generated by kiln: fused kernels as Triton, compiled ahead of time to cubin.
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.random import philox as _tl_philox
import os as _os


if _os.environ.get("TRITON_INTERPRET") == "1":  # (numpy has no grid dependency control)
    @triton.jit
    def _kl_pdl():
        pass
else:
    @triton.jit
    def _kl_pdl():
        # programmatic dependent launch (sm_90+): wait until the previous kernel has finished
        # and its writes are visible (nothing in a launch without programmatic stream
        # serialisation). No early trigger: the next kernel launches as this one's programs
        # exit (bench/pdl_decode_ab.py: triggering at entry made a decode step 15% slower)
        tl.extra.cuda.gdc_wait()


@triton.jit
def _kl_f8e4m3(x):
    # eager's float -> float8_e4m3fn: nearest-even; finite overflow and +-inf saturate to
    # +-448 (clamped first, so the hardware's saturation mode never matters); NaN stays NaN
    x = x.to(tl.float32)
    x = tl.where(tl.abs(x) > 448.0, tl.where(x > 0, 448.0, -448.0), x)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _kl_f8e4m3_nan(x):
    # torch < 2.12's float -> float8_e4m3fn: nearest-even; magnitudes past 464 (which would
    # round to 480) and +-inf become NaN; 464 itself rounds to 448
    x = x.to(tl.float32)
    x = tl.where(tl.abs(x) > 464.0, float("nan"), x)
    x = tl.where(tl.abs(x) > 448.0, tl.where(x > 0, 448.0, -448.0), x)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _kl_f8e5m2(x):
    # eager's float -> float8_e5m2: nearest-even; magnitudes from 61440 (halfway past the
    # largest finite value, 57344) become +-inf, whatever the hardware conversion saturates to
    x = x.to(tl.float32)
    y = x.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    inf = tl.where(x < 0, 0xFC, 0x7C).to(tl.uint8)
    y = tl.where(tl.abs(x) >= 61440.0, inf, y)
    return y.to(tl.float8e5, bitcast=True)


@triton.jit
def _kl_fnuz_f32(b, MB: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr):
    # a fnuz float8 byte (MB mantissa bits, exponent bias BIAS; SUB = 2^(1 - BIAS - MB), the
    # smallest subnormal) -> float32, exactly; 0x80 is the one NaN (eager's payload 0x7f800001)
    b = b.to(tl.int32) & 0xFF
    e = (b & 0x7F) >> MB
    m = b & ((1 << MB) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MB))).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * SUB, normal)
    v = tl.where(b >= 0x80, -v, v)
    nan = (b * 0 + 0x7F800001).to(tl.float32, bitcast=True)
    return tl.where(b == 0x80, nan, v)


@triton.jit
def _kl_f32_fnuz(x, MB: tl.constexpr, BIAS: tl.constexpr, OVF: tl.constexpr,
                 INV_SUB: tl.constexpr):
    # float32 -> fnuz float8 byte as eager's CPU cast: nearest-even; magnitudes from OVF
    # (halfway past the largest finite value), +-inf and NaN -> 0x80; no negative zero
    x = x.to(tl.float32)
    u = x.to(tl.int32, bitcast=True)
    a = u & 0x7FFFFFFF
    # normal targets: round the float32 bits to MB mantissa bits, rebias the exponent
    half = (1 << (22 - MB)) - 1
    r = (a + half + ((a >> (23 - MB)) & 1)) >> (23 - MB)
    normal = r - ((127 - BIAS) << MB)
    # subnormal targets (|x| < 2^(1 - BIAS)): |x| / 2^(1 - BIAS - MB) rounded to an integer
    # by the float32 adder (exact scaling; 2^23 forces the rounding to nearest-even)
    y = tl.where(a < ((128 - BIAS) << 23), a, 0).to(tl.float32, bitcast=True) * INV_SUB
    sub = ((y + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(a < ((128 - BIAS) << 23), sub, normal)  # (normal is garbage there: unused)
    out = tl.where(mag == 0, 0, mag | tl.where(u < 0, 0x80, 0))
    bad = (a > 0x7F800000) | (a.to(tl.float32, bitcast=True) >= OVF)
    return tl.where(bad, 0x80, out).to(tl.uint8)


@triton.jit
def _kl_e4m3fnuz_f32(b):
    return _kl_fnuz_f32(b, 3, 8, 0.0009765625)


@triton.jit
def _kl_f32_e4m3fnuz(x):
    return _kl_f32_fnuz(x, 3, 8, 248.0, 1024.0)


@triton.jit
def _kl_e5m2fnuz_f32(b):
    return _kl_fnuz_f32(b, 2, 16, 7.62939453125e-06)


@triton.jit
def _kl_f32_e5m2fnuz(x):
    return _kl_f32_fnuz(x, 2, 16, 61440.0, 131072.0)


@triton.jit
def _kl_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _kl_min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _kl_mul(a, b):
    return a * b


@triton.jit
def _kl_add(a, b):
    return a + b


@triton.jit
def _kl_lse(a, b):
    # ATen's _log_add_exp_helper (logcumsumexp): NaN from either side; equal infinities kept
    mx = tl.maximum(a, b)
    mn = tl.minimum(a, b)
    r = mx + libdevice.log1p(tl.exp(mn - mx))
    r = tl.where((mn == mx) & ((mn - mn) != 0), a, r)
    return tl.where((a != a) | (b != b), a + b, r)


@triton.jit
def _kl_cummax(v1, i1, v2, i2):
    # scans (targets/cuda/scan.py): the later element on ties and on NaN (eager's
    # binary_op_update), the earlier one after a NaN
    t = (v2 != v2) | ((v1 == v1) & (v2 >= v1))
    return tl.where(t, v2, v1), tl.where(t, i2, i1)


@triton.jit
def _kl_cummin(v1, i1, v2, i2):
    t = (v2 != v2) | ((v1 == v1) & (v2 <= v1))
    return tl.where(t, v2, v1), tl.where(t, i2, i1)


@triton.jit
def _kl_argmax(v1, i1, v2, i2):
    n1 = v1 != v1
    n2 = v2 != v2
    eq = (v1 == v2) | (n1 & n2)
    t = (v1 > v2) | (n1 & (n2 == 0)) | (eq & (i1 < i2))
    return tl.where(t, v1, v2), tl.where(t, i1, i2)


@triton.jit
def _kl_argmin(v1, i1, v2, i2):
    n1 = v1 != v1
    n2 = v2 != v2
    eq = (v1 == v2) | (n1 & n2)
    t = (v1 < v2) | (n1 & (n2 == 0)) | (eq & (i1 < i2))
    return tl.where(t, v1, v2), tl.where(t, i1, i2)


@triton.jit
def _kl_div_i(a, b):
    return tl.where(b == 0, 0, a // tl.where(b == 0, 1, b))


@triton.jit
def _kl_fmod_i(a, b):
    return tl.where(b == 0, 0, a % tl.where(b == 0, 1, b))


@triton.jit
def _kl_floordiv_i(a, b):
    bb = tl.where(b == 0, 1, b)
    q = a // bb
    q = tl.where((a % bb != 0) & ((a < 0) != (bb < 0)), q - 1, q)
    return tl.where(b == 0, 0, q)


@triton.jit
def _kl_remainder_i(a, b):
    bb = tl.where(b == 0, 1, b)
    r = a % bb
    r = tl.where((r != 0) & ((r < 0) != (bb < 0)), r + bb, r)
    return tl.where(b == 0, 0, r)


@triton.jit
def _kl_remainder_f(a, b):
    r = libdevice.fmod(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _kl_floordiv_f(a, b):
    mod = libdevice.fmod(a, b)
    q = (a - mod) / b
    q = tl.where((mod != 0) & ((b < 0) != (mod < 0)), q - 1, q)
    fq = tl.floor(q)
    q2 = tl.where(q - fq > 0.5, fq + 1, fq)
    q2 = tl.where(q == 0, libdevice.copysign(q * 0, a / b), q2)
    return tl.where(b == 0, a / b, q2)


@triton.jit
def _kl_shl(a, b):
    bits = a.dtype.primitive_bitwidth
    ok = (b >= 0) & (b < bits)
    return tl.where(ok, a << tl.where(ok, b, 0).to(a.dtype), 0)


@triton.jit
def _kl_shr(a, b):
    bits = a.dtype.primitive_bitwidth
    ok = (b >= 0) & (b < bits)
    return tl.where(ok, a >> tl.where(ok, b, 0).to(a.dtype), tl.where(a < 0, -1, 0))


@triton.jit
def _kl_bf16_bits(x):
    # the bfloat16 bits (in the low half of an int32) of float32 x, rounded to nearest even
    # as c10::BFloat16's round_to_nearest_even (NaN: 0x7FC0)
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r & 0xFFFF)


@triton.jit
def _kl_philox(seed, run, stream, index, lane):
    # same words as kr::philox: key = seed, counter = (index lo, index hi, stream, run)
    c0 = (index & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((index >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = (index * 0 + stream).to(tl.uint32)
    c3 = (index * 0 + run).to(tl.uint32)
    r0, r1, r2, r3 = _tl_philox(seed, c0, c1, c2, c3)
    r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return r.to(tl.int64)
'''
#: the tensor-core int4 GEMV's word-pair product (kiln/gemm/int4_tc.py `mma_pair`; printed by
#: targets/cuda/gemv_template.py): `_kl_i4mma(wa, wb, x0..x7)` -> the float32 sums of the
#: 8 nibbles (less 8) of words wa / wb times x0..x7 (bf16, x at nibble i), summed over a
#: quad of lanes on the tensor cores and returned in one lane of it (0 in the others); in
#: Triton's interpreter (no inline PTX) each element's own sums, which sum to the same tile
PRELUDE += f"""

_KL_I4MMA_PTX = tl.constexpr({MMA_PTX!r})


if _os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def _kl_i4nib(w, i: tl.constexpr):
        return (((w >> (4 * i)) & 15) - 8).to(tl.float32)

    @triton.jit
    def _kl_i4mma(wa, wb, x0, x1, x2, x3, x4, x5, x6, x7):
        ra = _kl_i4nib(wa, 0) * x0 + _kl_i4nib(wa, 1) * x1 + _kl_i4nib(wa, 2) * x2 + \\
            _kl_i4nib(wa, 3) * x3 + _kl_i4nib(wa, 4) * x4 + _kl_i4nib(wa, 5) * x5 + \\
            _kl_i4nib(wa, 6) * x6 + _kl_i4nib(wa, 7) * x7
        rb = _kl_i4nib(wb, 0) * x0 + _kl_i4nib(wb, 1) * x1 + _kl_i4nib(wb, 2) * x2 + \\
            _kl_i4nib(wb, 3) * x3 + _kl_i4nib(wb, 4) * x4 + _kl_i4nib(wb, 5) * x5 + \\
            _kl_i4nib(wb, 6) * x6 + _kl_i4nib(wb, 7) * x7
        return ra, rb
else:
    @triton.jit
    def _kl_i4mma(wa, wb, x0, x1, x2, x3, x4, x5, x6, x7):
        return tl.inline_asm_elementwise(
            _KL_I4MMA_PTX, {MMA_CONSTRAINTS!r}, [wa, wb, x0, x1, x2, x3, x4, x5, x6, x7],
            dtype=(tl.float32, tl.float32), is_pure=False, pack=1)
"""



def unravel(var: str, shape) -> list[str]:
    """Triton expressions of the row-major coordinates of flat index `var` over `shape`
    (size-1 dims: "0"; sizes are expressions over size symbols)."""
    out, inner = [], sympy.Integer(1)
    for n in reversed(shape):
        n = sympy.expand(sympy.sympify(n))
        if n == 1:
            out.append("0")
        else:
            q = var if inner == 1 else f"({var} // {to_tl(inner)})"
            out.append(f"({q} % {to_tl(n)})")
        inner = inner * n
    return out[::-1]
