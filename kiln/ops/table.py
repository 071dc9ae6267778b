"""The op table: one row per kiln pointwise op (`ROWS`), and named forms of rows (`FORMS`).

A row is everything kiln knows about one pointwise op of Graph IR, keyed by its name:

| field      | meaning                                                                    |
| ---------- | -------------------------------------------------------------------------- |
| `name`     | the Graph IR op (the frontend maps aten overloads to it)                   |
| `arity`    | how many tensor operands it takes                                          |
| `dtypes`   | its dtype rule (`DTYPE_RULES`): which operand dtypes it takes and the      |
|            | result dtype torch gives (tests/test_op_table.py checks it against eager)  |
| `operands` | how each operand is converted before the body (`CONVERSIONS`)              |
| `torch`    | its eager twin `torch(*tensors, **attrs)` (references: tests, the CUTLASS  |
|            | profiling child)                                                           |
| `body`     | `body(operands, dt, attrs) -> Loop IR expression`: the element's value     |
|            | from the converted operands (None: the Loop IR operator of the same name)  |
| `attrs`    | the attributes it reads, with their defaults, in order                     |

`Row.expr(operands, dt, attrs)` is the whole element: conversions, then the body, computing
in `dt` (the node's dtype; bool for dtype rule "bool"). Lowering (lowering/pointwise.py)
calls it per element; epilogue fusion matches forms of it (match.py).

A form (`form(name)`) is a row with some attributes fixed and others left open (`PARAM`, whose
values a match reports): every row with its default attributes is the form of its own name;
`FORMS` adds the named others. The table of fused epilogues (gemm/cutlass_evt.py FUNCTORS) is
keyed by form names; the Triton template prints the epilogue's Loop IR itself.

Invariants: every operator a body emits is a Loop IR operator (`kiln.ir.loop.OPS`) spelled by
every target and the interpreter (tests/test_op_table.py); bodies are pure functions of their
arguments; the table is a literal (nothing registers into it)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ops.build import Param, cast, const, op, to_bool

#: dtype rule -> meaning (operands are the frontend's promoted ones)
DTYPE_RULES = {
    "same": "any operands; the result has their dtype",
    "float": "any operands; integer or bool operands give a float result (the default dtype)",
    "float_only": "floating-point operands only; the result has their dtype",
    "integral": "integer or bool operands only; the result has their dtype",
    "bool": "any operands; the result is bool",
    "given": "the result dtype is the node's own (cast)",
}

#: operand conversion -> how an operand becomes a body argument, computing in dt
CONVERSIONS: dict[str, Callable[[L.Expr, dtypes.DType], L.Expr]] = {
    "cast": cast,  # to dt
    "keep": lambda x, dt: x,  # as it is (predicates and comparisons)
    "bool": lambda x, dt: to_bool(x),  # to bool (logical ops, where's condition)
    # binary arithmetic: to dt, but a bool result (bool operands, after the frontend's type
    # promotion) takes them as they are
    "promote": lambda x, dt: x if dt == dtypes.bool_ else cast(x, dt),
    # bitwise_not: to dt, or to bool for a bool result (where it is logical not)
    "bitwise": lambda x, dt: to_bool(x) if dt == dtypes.bool_ else cast(x, dt),
}

Body = Callable[[tuple, dtypes.DType, Mapping], L.Expr]


@dataclass(frozen=True)
class Row:
    name: str
    arity: int
    dtypes: str
    operands: str | tuple[str, ...]  # one conversion for every operand, or one each
    torch: Callable
    body: Body | None = None
    attrs: tuple[tuple[str, object], ...] = ()

    @property
    def conversions(self) -> tuple[str, ...]:
        ops = self.operands
        return (ops,) * self.arity if isinstance(ops, str) else ops

    def default(self, attr: str):
        return dict(self.attrs)[attr]

    def expr(self, xs, dt: dtypes.DType, attrs: Mapping | None = None) -> L.Expr:
        """The element: operands `xs` converted, then the body, computing in `dt` (bool for
        dtype rule "bool"); `attrs` override the row's defaults."""
        dt = dtypes.bool_ if self.dtypes == "bool" else dt
        xs = tuple(CONVERSIONS[c](x, dt) for x, c in zip(xs, self.conversions))
        values = {**dict(self.attrs), **(attrs or {})}
        if self.body is None:
            return L.Op(self.name, xs, dt)
        return self.body(xs, dt, values)


# -- bodies: the decompositions lowering uses -----------------------------------------------

def _gelu(xs, dt, a):
    (x,) = xs
    dt = x.dtype
    half, one = const(0.5, dt), const(1.0, dt)
    if a["approximate"] == "tanh":
        inner = op("mul", const(math.sqrt(2 / math.pi), dt),
                   op("add", x, op("mul", const(0.044715, dt), op("mul", x, op("mul", x, x)))))
        return op("mul", op("mul", half, x), op("add", one, op("tanh", inner)))
    return op("mul", op("mul", half, x),
              op("add", one, op("erf", op("mul", x, const(1 / math.sqrt(2), dt)))))


def _hardsigmoid_of(x):
    dt = x.dtype
    return op("div", op("minimum", op("maximum", op("add", x, const(3, dt)), const(0, dt)),
                        const(6, dt)), const(6, dt))


def _softplus_of(x):
    return op("log1p", op("exp", x))


def _silu(xs, dt, a):
    return op("mul", xs[0], op("sigmoid", xs[0]))


def _hardsigmoid(xs, dt, a):
    return _hardsigmoid_of(xs[0])


def _hardswish(xs, dt, a):
    return op("mul", xs[0], _hardsigmoid_of(xs[0]))


def _mish(xs, dt, a):
    return op("mul", xs[0], op("tanh", _softplus_of(xs[0])))


def _softplus(xs, dt, a):
    return _softplus_of(xs[0])


def _leaky_relu(xs, dt, a):
    (x,) = xs
    return op("where", op("gt", x, const(0, dt), dtype=dtypes.bool_), x,
              op("mul", x, const(a["slope"], dt)))


def _clamp(xs, dt, a):
    (v,) = xs
    if a["min"] is not None:
        v = op("maximum", v, const(a["min"], dt))
    if a["max"] is not None:
        v = op("minimum", v, const(a["max"], dt))
    return v


def _cast(xs, dt, a):
    return xs[0]  # the conversion did it


def _bitwise_not(xs, dt, a):
    if dt == dtypes.bool_:
        return op("logical_not", xs[0], dtype=dtypes.bool_)
    return L.Op("bitwise_not", xs, dt)


_ROUNDING = {"floor": "truediv_floor", "trunc": "truediv_trunc"}


def _div(xs, dt, a):
    return L.Op(_ROUNDING.get(a["rounding_mode"], "div"), xs, dt)


def _floor_divide(xs, dt, a):
    return L.Op("truediv_floor", xs, dt)


# -- the table ------------------------------------------------------------------------------

_ROWS = (
    # unary: Loop IR operators of the same name
    Row("neg", 1, "same", "cast", torch.neg),
    Row("abs", 1, "same", "cast", torch.abs),
    Row("relu", 1, "same", "cast", torch.relu),
    Row("sign", 1, "same", "cast", torch.sign),
    Row("floor", 1, "same", "cast", torch.floor),
    Row("ceil", 1, "same", "cast", torch.ceil),
    Row("round", 1, "same", "cast", torch.round),
    Row("trunc", 1, "same", "cast", torch.trunc),
    Row("exp", 1, "float", "cast", torch.exp),
    Row("exp2", 1, "float", "cast", torch.exp2),
    Row("expm1", 1, "float", "cast", torch.expm1),
    Row("log", 1, "float", "cast", torch.log),
    Row("log2", 1, "float", "cast", torch.log2),
    Row("log10", 1, "float", "cast", torch.log10),
    Row("log1p", 1, "float", "cast", torch.log1p),
    Row("sqrt", 1, "float", "cast", torch.sqrt),
    Row("rsqrt", 1, "float", "cast", torch.rsqrt),
    Row("reciprocal", 1, "float", "cast", torch.reciprocal),
    Row("sigmoid", 1, "float", "cast", torch.sigmoid),
    Row("tanh", 1, "float", "cast", torch.tanh),
    Row("sin", 1, "float", "cast", torch.sin),
    Row("cos", 1, "float", "cast", torch.cos),
    Row("tan", 1, "float", "cast", torch.tan),
    Row("asin", 1, "float", "cast", torch.asin),
    Row("acos", 1, "float", "cast", torch.acos),
    Row("atan", 1, "float", "cast", torch.atan),
    Row("sinh", 1, "float", "cast", torch.sinh),
    Row("cosh", 1, "float", "cast", torch.cosh),
    Row("asinh", 1, "float", "cast", torch.asinh),
    Row("acosh", 1, "float", "cast", torch.acosh),
    Row("atanh", 1, "float", "cast", torch.atanh),
    Row("erf", 1, "float", "cast", torch.erf),
    Row("erfc", 1, "float", "cast", torch.erfc),
    Row("i0", 1, "float", "cast", torch.i0),
    Row("isnan", 1, "bool", "keep", torch.isnan),
    Row("isinf", 1, "bool", "keep", torch.isinf),
    Row("signbit", 1, "bool", "keep", torch.signbit),
    Row("logical_not", 1, "bool", "bool", torch.logical_not),
    # unary with a body of their own
    Row("bitwise_not", 1, "integral", "bitwise", torch.bitwise_not, _bitwise_not),
    Row("cast", 1, "given", "cast", lambda x, dtype: x.to(dtype), _cast),
    Row("silu", 1, "float_only", "cast", F.silu, _silu),
    Row("hardsigmoid", 1, "float_only", "cast", F.hardsigmoid, _hardsigmoid),
    Row("hardswish", 1, "float_only", "cast", F.hardswish, _hardswish),
    Row("mish", 1, "float_only", "cast", F.mish, _mish),
    Row("softplus", 1, "float_only", "cast", F.softplus, _softplus),
    Row("gelu", 1, "float_only", "cast",
        lambda x, approximate="none": F.gelu(x, approximate=approximate), _gelu,
        (("approximate", "none"),)),
    Row("leaky_relu", 1, "float_only", "cast",
        lambda x, slope=0.01: F.leaky_relu(x, slope), _leaky_relu, (("slope", 0.01),)),
    Row("clamp", 1, "same", "cast", lambda x, min=None, max=None: torch.clamp(x, min, max),
        _clamp, (("min", None), ("max", None))),
    # binary
    Row("add", 2, "same", "promote", torch.add),
    Row("sub", 2, "same", "promote", torch.sub),
    Row("mul", 2, "same", "promote", torch.mul),
    Row("div", 2, "float", "promote",
        lambda a, b, rounding_mode=None: torch.div(a, b, rounding_mode=rounding_mode), _div,
        (("rounding_mode", None),)),
    Row("floor_divide", 2, "same", "promote", torch.floor_divide, _floor_divide),
    Row("remainder", 2, "same", "promote", torch.remainder),
    Row("fmod", 2, "same", "promote", torch.fmod),
    Row("pow", 2, "same", "promote", torch.pow),
    Row("maximum", 2, "same", "promote", torch.maximum),
    Row("minimum", 2, "same", "promote", torch.minimum),
    Row("atan2", 2, "float", "promote", torch.atan2),
    Row("copysign", 2, "float", "promote", torch.copysign),
    Row("hypot", 2, "float_only", "promote", torch.hypot),
    Row("nextafter", 2, "float_only", "promote", torch.nextafter),
    Row("shift_left", 2, "integral", "promote", torch.bitwise_left_shift),
    Row("shift_right", 2, "integral", "promote", torch.bitwise_right_shift),
    Row("bitwise_and", 2, "integral", "cast", torch.bitwise_and),
    Row("bitwise_or", 2, "integral", "cast", torch.bitwise_or),
    Row("bitwise_xor", 2, "integral", "cast", torch.bitwise_xor),
    Row("eq", 2, "bool", "keep", torch.eq),
    Row("ne", 2, "bool", "keep", torch.ne),
    Row("lt", 2, "bool", "keep", torch.lt),
    Row("le", 2, "bool", "keep", torch.le),
    Row("gt", 2, "bool", "keep", torch.gt),
    Row("ge", 2, "bool", "keep", torch.ge),
    Row("logical_and", 2, "bool", "bool", torch.logical_and),
    Row("logical_or", 2, "bool", "bool", torch.logical_or),
    Row("logical_xor", 2, "bool", "bool", torch.logical_xor),
    # ternary: the condition to bool, the values to the result dtype
    Row("where", 3, "same", ("bool", "cast", "cast"), torch.where),
)
ROWS: dict[str, Row] = {r.name: r for r in _ROWS}

#: the attribute value a form leaves open (any float constant; the match reports it)
PARAM = object()


@dataclass(frozen=True)
class Form:
    """Row `row` with attributes `attrs` (the others at their defaults; a value `PARAM` is
    left open, in the row's attribute order)."""

    row: str
    attrs: tuple[tuple[str, object], ...] = ()

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.attrs if v is PARAM)

    def values(self, params=()) -> dict:
        """The attribute values of this form with its open ones set to `params`."""
        given = dict(zip(self.params, params))
        return {k: given[k] if v is PARAM else v for k, v in self.attrs}

    def pattern_attrs(self) -> dict:
        return {k: Param(k) if v is PARAM else v for k, v in self.attrs}


FORMS: dict[str, Form] = {
    "gelu_tanh": Form("gelu", (("approximate", "tanh"),)),
    "clamp": Form("clamp", (("min", PARAM), ("max", PARAM))),  # both bounds
    "relu6": Form("clamp", (("min", 0.0), ("max", 6.0))),
}


def form(name: str) -> Form:
    """The form called `name`: a named one of `FORMS`, else row `name` with its defaults."""
    if name in FORMS:
        return FORMS[name]
    if name not in ROWS:
        raise KeyError(f"no kiln op or form {name!r} (kiln/ops/table.py)")
    return Form(name)
