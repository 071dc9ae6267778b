"""Size arithmetic used as tensor data: `x / torch.sym_float(x.shape[0])`,
`x * x.shape[0] ** 0.5`, `x * (x.shape[0] >= 5)`.

torch.export records such values as FX nodes whose value is a SymFloat or SymBool computed
from sizes by Python operators (`operator.pow`, `operator.ge`, ...) and `torch.sym_float`.
kiln computes each as a 0-d value at run time: a size as an int64 value (Builder.size_value),
then one kiln op per operator, in Python's types (int and int stay int64, true division and
anything with a float give float64, comparisons bool), so the consumer sees the number eager
passes it (a Python float is a double, rounded to the tensor's type by the consumer)."""

from __future__ import annotations

import math
import operator

import torch

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir.graph import Node, TensorType

_BINARY = {operator.add: "add", operator.sub: "sub", operator.mul: "mul",
           operator.truediv: "div", operator.pow: "pow", operator.floordiv: "floor_divide",
           operator.mod: "remainder", operator.ge: "ge", operator.gt: "gt", operator.le: "le",
           operator.lt: "lt", operator.eq: "eq", operator.ne: "ne", operator.and_: "logical_and",
           operator.or_: "logical_or"}
_COMPARE = {"ge", "gt", "le", "lt", "eq", "ne", "logical_and", "logical_or"}


def _kind(v) -> dtypes.DType:
    if isinstance(v, (torch.SymBool, bool)):
        return dtypes.bool_
    if isinstance(v, (torch.SymFloat, float)):
        return dtypes.float64
    return dtypes.int64


def is_sym_value(x) -> bool:
    """Whether FX node `x` is a number computed from sizes (not a tensor)."""
    return isinstance(x, torch.fx.Node) and isinstance(
        x.meta.get("val"), (torch.SymFloat, torch.SymBool, torch.SymInt))


def sym_value(b, x) -> str:
    """The kiln 0-d value of FX node (or Python number) `x`."""
    if not isinstance(x, torch.fx.Node):
        return b.scalar(x, _kind(x).torch)
    if x.name in b.env:
        return b.env[x.name]
    v = x.meta.get("val")
    if isinstance(v, torch.SymInt):
        try:
            return b.size_value(x, torch.int64)
        except UnsupportedError:
            pass  # an expression kiln's sizes do not model: built from its operator below
    t = x.target
    out_dt = _kind(v)
    if str(t) == "aten._local_scalar_dense.default":  # `y.item()`: y's one element
        src = b.tensor(x.args[0])
        if b.types[src].shape:
            src = b.emit("view", [src], None, like=x.args[0], shape=())
        return _cast(b, x, src, out_dt)
    if t in (torch.sym_float, float):
        return _cast(b, x, sym_value(b, x.args[0]), dtypes.float64)
    if t is torch.sym_not:
        return _emit(b, x, "logical_not", [sym_value(b, x.args[0])], dtypes.bool_)
    if t is operator.neg:
        return _emit(b, x, "neg", [sym_value(b, x.args[0])], out_dt)
    if t in (math.sqrt, getattr(torch, "_sym_sqrt", None)):
        arg = _cast(b, x, sym_value(b, x.args[0]), dtypes.float64)
        return _emit(b, x, "sqrt", [arg], dtypes.float64)
    op = _BINARY.get(t)
    if op is None:
        raise UnsupportedError(f"size arithmetic {t} (node {x.name}) used as a value is not "
                               "supported")
    args = [sym_value(b, a) for a in x.args[:2]]
    compute = dtypes.bool_ if op in ("logical_and", "logical_or") else \
        max((b.types[a].dtype for a in args), key=lambda d: (d.is_float, d.itemsize))
    if op == "div" or (op == "pow" and out_dt.is_float):
        compute = dtypes.float64
    args = [_cast(b, x, a, compute) for a in args]
    return _emit(b, x, op, args, dtypes.bool_ if op in _COMPARE else out_dt)


def _emit(b, x, op: str, inputs: list[str], dt: dtypes.DType) -> str:
    """A 0-d kiln node for FX node `x` (whose value is a number, not a tensor)."""
    name = b.fresh(f"{x.name}_{op}")
    t = TensorType(dt, ())
    b.nodes.append(Node(name, op, tuple(inputs), t, (), x.name))
    b.types[name] = t
    return name


def _cast(b, x, name: str, dt: dtypes.DType) -> str:
    return b.cast_to(name, dt.torch, x)
