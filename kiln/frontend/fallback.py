"""The ATen fallback: an op kiln does not lower becomes an `aten` Graph IR node that calls ATen
at run time (through torch's stable C interface, see runtime/model/kiln_aten.h).

The converter reads the op's schema and encodes every argument in schema order as a
`loop.AtenArg`; tensor arguments are `AtenOperand`s, naming the node's inputs by position. An
op whose arguments or results the stable interface cannot carry (Generator, Device, ...), and
an op that mutates its inputs are refused with an `UnsupportedError` that names the op and the
reason; a Scalar argument raises `scalar_ops.ScalarArgument`, on which the importer rewrites
the op without Scalars (scalar_ops.py) and imports again. One Graph IR node is made per
result. A result size that depends on data
(torch's unbacked symbol, e.g. the row count of `nonzero`) becomes a size symbol `u0, u1, ...`
bound when the call returns; memory is planned for its upper bound (`_bound`), or, when it has
none, the buffers it sizes are allocated at run time once it is known."""

from __future__ import annotations

import torch

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node, TensorType
from kiln.frontend.builder import to_dtype
from kiln.frontend.scalar_ops import ScalarArgument
import sympy

# ops whose data-dependent result sizes never exceed the element count of their first tensor
BOUNDED_BY_NUMEL = {"aten::nonzero", "aten::masked_select", "aten::index", "aten::_unique2",
                    "aten::unique_dim", "aten::unique_consecutive", "aten::unique"}


def _bound(b, n, schema, s, inputs: list[str]):
    """An upper bound, over input sizes, of the unbacked size `s` of node `n`'s results;
    None when there is none (the buffers it sizes are then allocated at run time)."""

    if schema.name in BOUNDED_BY_NUMEL and inputs:
        return sympy.Mul(*b.types[inputs[0]].shape)
    vr = getattr(b, "ranges", {}).get(s)
    upper = getattr(vr, "upper", None)
    try:
        value = int(upper)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
    return None if value >= 2**62 else sympy.Integer(value)  # torch's int_oo: no bound


def _binds(b, n, schema, vals, inputs: list[str]) -> list[list[tuple]]:
    """Per result: (dim, kiln symbol, bound) for each dim that is a new data-dependent size."""
    out = []
    for v in vals:
        binds = []
        for d, size in enumerate(v.shape):
            e = size.node.expr if isinstance(size, torch.SymInt) else None
            if e is not None and e.is_Symbol and e not in b.syms.rename:
                s = b.syms.add_unbacked(e, _bound(b, n, schema, e, inputs))
                binds.append((d, s.name, b.syms.unbacked[s.name]))
        out.append(binds)
    return out


def _encode(b, n, name: str, t, value, inputs: list[str]) -> L.AtenArg:
    kind = t.kind()
    where = f"argument {name} of {n.target} (node {n.name})"
    if kind == "OptionalType":
        if value is None:
            return L.AtenNone()
        return L.AtenOptional(_encode(b, n, name, t.getElementType(), value, inputs))
    if kind == "TensorType":
        if isinstance(value, (bool, int, float)):  # a wrapped number: a 0-d tensor
            inputs.append(b.tensor(value))
            return L.AtenOperand(len(inputs) - 1)
        if isinstance(value, complex):  # the importer rewrites the op (scalar_ops.py)
            raise ScalarArgument(f"{where}: a Python complex number where ATen expects a "
                                 "tensor", n.target)
        if not isinstance(value, torch.fx.Node):
            raise UnsupportedError(f"{where}: a {type(value).__name__} where ATen expects a "
                                   "tensor")
        inputs.append(b.tensor(value))
        return L.AtenOperand(len(inputs) - 1)
    if isinstance(value, torch.dtype):  # a ScalarType argument (its schema type reads int)
        return L.AtenDtype(to_dtype(value))
    if kind in ("IntType", "SymIntType"):
        return L.AtenInt(b.int_or_sym(value))
    if kind == "FloatType":
        return L.AtenFloat(float(value))
    if kind == "BoolType":
        return L.AtenBool(bool(value))
    if kind == "StringType":
        return L.AtenStr(str(value))
    if kind == "ScalarTypeType":
        return L.AtenDtype(to_dtype(value))
    if kind == "ListType":
        el = t.getElementType().kind()
        if el in ("IntType", "SymIntType"):
            return L.AtenInts(tuple(b.int_or_sym(v) for v in value))
        if el == "TensorType" or (el == "OptionalType" and
                                  t.getElementType().getElementType().kind() == "TensorType"):
            return L.AtenTensors(tuple(_encode(b, n, name, t.getElementType(), v, inputs)
                                       for v in value))
    shown = "Scalar" if kind == "NumberType" else str(t)
    message = (f"{where} has type {shown}, which kiln's ATen fallback cannot pass through "
               "torch's stable C interface")
    if kind == "NumberType":  # the importer rewrites the op without Scalars if it can
        raise ScalarArgument(message + " (and kiln has no rewrite of the op without it)",
                             n.target)
    raise UnsupportedError(message)


def read_size(b, n) -> str:
    """`x.item()` that becomes a size (torch's unbacked symbol): a `read_size` node that binds
    it at run time, checked against the range the export assumed (`torch._check`). Without
    an upper bound (no `torch._check(value <= N)`) the buffers it sizes are allocated at run
    time; a negative value is refused at run time."""
    s = n.meta["val"].node.expr
    vr = getattr(b, "ranges", {}).get(s)
    try:
        lo = int(vr.lower)
    except (AttributeError, TypeError, ValueError, OverflowError):
        lo = 0
    try:
        hi = int(vr.upper)
        hi = None if hi >= 2**62 else sympy.Integer(hi)
    except (AttributeError, TypeError, ValueError, OverflowError):
        hi = None
    name = b.syms.add_unbacked(s, hi).name
    bound = b.syms.unbacked[name]
    t = TensorType(dtypes.int64, ())
    attrs = (("binds", ((0, name, bound),)), ("lo", max(lo, 0)))
    b.nodes.append(Node(n.name, "read_size", (b.tensor(n.args[0]),), t, attrs, n.name))
    b.types[n.name] = t
    return n.name

# result index -> dtype that the op always returns, for ops whose exported metadata some torch
# versions get wrong: torch 2.11's export records unique's inverse indices and counts as the
# input's dtype (float32 for a float input) while eager returns int64; kiln trusts the export's
# metadata, so such a program is refused rather than compiled with the wrong output dtypes
RESULT_DTYPES = {"aten::_unique2": {1: torch.int64, 2: torch.int64},
                 "aten::unique_dim": {1: torch.int64, 2: torch.int64},
                 "aten::unique_consecutive": {1: torch.int64, 2: torch.int64}}


def check_result_dtypes(n, schema, vals) -> None:
    """Refuses results whose exported dtype contradicts `RESULT_DTYPES`."""
    for k, want in RESULT_DTYPES.get(schema.name, {}).items():
        got = getattr(vals[k], "dtype", want) if k < len(vals) else want
        if got != want:
            raise UnsupportedError(
                f"{schema.name} (node {n.name}): the exported program says result {k} is "
                f"{got}, but the op returns {want}; this torch version ({torch.__version__}) "
                f"records wrong metadata for it (torch 2.11 does for unique), so the compiled "
                f"program would return the wrong dtype. Export with a newer torch")


def aten_fallback(b, n) -> list[str] | str:
    """Graph IR nodes for FX node `n` (an OpOverload kiln has no converter for)."""
    op = n.target
    schema = getattr(op, "_schema", None)
    if schema is None or not str(op).startswith("aten."):
        raise UnsupportedError(f"operator {op} (node {n.name}) is not supported and is not an "
                               "ATen op that could fall back")
    if any(a.name == "storage_offset" for a in schema.arguments):
        # as_strided & co address their input's storage, which a compiled program does not
        # have (it sees each input as its own contiguous tensor): eager could read elements
        # outside the input, so calling ATen here could give a different answer
        raise UnsupportedError(f"operator {op} (node {n.name}) addresses its input's storage "
                               "by strides; kiln handles it only as a view of a whole buffer")
    if schema.is_mutable:
        raise UnsupportedError(f"operator {op} (node {n.name}) mutates its inputs; the ATen "
                               "fallback only calls functional ops")
    for r in schema.returns:
        if r.type.kind() != "TensorType":
            raise UnsupportedError(f"operator {op} (node {n.name}) returns {r.type}; the ATen "
                                   "fallback handles tensor results only")
    inputs: list[str] = []
    args = []
    for k, arg in enumerate(schema.arguments):
        if k < len(n.args) and not arg.kwarg_only:
            value = n.args[k]
        elif arg.name in n.kwargs:
            value = n.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            raise UnsupportedError(f"argument {arg.name} of {op} (node {n.name}) is missing")
        args.append(_encode(b, n, arg.name, arg.type, value, inputs))
    vals = n.meta["val"]
    vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    check_result_dtypes(n, schema, vals)
    binds = _binds(b, n, schema, vals, inputs)
    keywords = tuple(a.name for a in schema.arguments if a.kwarg_only)
    attrs = dict(aten_op=schema.name, overload=schema.overload_name, args=tuple(args),
                 keywords=keywords, n_results=len(vals))
    if len(vals) == 1:
        return b.emit("aten", inputs, n, result=0 if isinstance(n.meta["val"], (tuple, list))
                      else None, index=0, binds=tuple(binds[0]), **attrs)
    return [b.emit("aten", inputs, n, result=k, index=k, binds=tuple(binds[k]), **attrs)
            for k in range(len(vals))]
