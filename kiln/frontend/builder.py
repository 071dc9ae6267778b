"""The state the converters of `torch.export` nodes share (`Builder`: kiln nodes so far, FX name
-> kiln value, types, symbols) and torch dtype -> kiln dtype. `export.py` drives the walk and
hands the builder its node converter, so region converters (control.py) convert their
subgraphs' nodes without importing the driver."""

from __future__ import annotations

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.symbols import SymbolTable
from kiln.frontend.sym_values import sym_value
from kiln.ir import dtypes, sym
from kiln.ir.graph import Node, TensorType


def torch_dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


# dtypes kiln refuses with a reason beyond "not yet"
_WHY = {"float8_e8m0fnu": "eager on the CPU computes little on it (conversions and mul; no add); "
                          "kiln stores float8_e4m3fn, float8_e5m2 and their fnuz variants: "
                          "convert the tensor to one of those (or to float16) outside the program"}


def to_dtype(dt: torch.dtype) -> dtypes.DType:
    try:
        return dtypes.from_torch(dt)
    except KeyError:
        name = torch_dtype_name(dt)
        why = f" ({_WHY[name]})" if name in _WHY else ""
        raise UnsupportedError(f"dtype {name} is not supported{why}; supported: "
                               f"{', '.join(sorted(dtypes.DTYPES))}") from None


class Builder:
    """Collects kiln nodes while the converters walk the FX graph."""

    def __init__(self, syms: SymbolTable, convert_node) -> None:
        self.syms = syms
        #: converts one FX node into this builder (export.convert_node); control-flow
        #: converters call it for their regions' nodes
        self.convert_node = convert_node
        self.nodes: list[Node] = []
        self.env: dict[str, str] = {}
        self.multi: dict[str, list[str]] = {}  # multi-result ops: node -> one value per result
        self.constant_inputs: list[dict] = []  # scalars export specialised to their value
        # ATen ops a converter declined for the target, with its reason (the manifest's
        # `requires.aten_fallback_why`)
        self.fallback_why: dict[str, str] = {}
        self.types: dict[str, TensorType] = {}
        self.counter = 0
        self.ranges: dict = {}  # torch symbol -> value range (ep.range_constraints)
        # attention masks of the program evaluated as keeping every key or not (FX node ->
        # bool; aten_high._noop_mask): one evaluation per mask, which every layer reads
        self.noop_masks: dict = {}
        self.aten_fallback = False  # unknown ops call ATen (frontend/fallback.py)
        # the target links kiln's CPU library routines (kiln_lib.h); without them the ops
        # kiln lowers to one call ATen instead (frontend/export.py: convert_node)
        self.library_routines = True
        # the target runs attention as one fused step (aten_high._sdpa emits `attention`)
        self.fused_attention = False
        self.rng: str | None = None  # the random-number state input, once a random op needs it
        self.streams = 0
        # size relations ops assume and the export did not guard: (lhs, rhs, equal, what)
        self.relations: list[tuple] = []
        # FX nodes holding Python ints as run-time values (0-d int64 tensors): ints carried by
        # while_loop and the int arithmetic on them (frontend/control.py `convert_int_value`)
        self.value_ints: set[str] = set()

    # -- looking at FX values ------------------------------------------------------------------
    @staticmethod
    def val(x):
        v = x.meta.get("val") if isinstance(x, torch.fx.Node) else x
        return v[0] if isinstance(v, (tuple, list)) else v

    def meta_dtype(self, x) -> torch.dtype:
        v = self.val(x)
        if isinstance(v, torch.Tensor):
            return v.dtype
        if isinstance(v, torch.SymFloat):
            return torch.float64
        if isinstance(v, torch.SymBool):
            return torch.bool
        return torch.tensor(v).dtype if not isinstance(v, torch.SymInt) else torch.int64

    def rank(self, x) -> int:
        return self.val(x).dim()

    def shape(self, x) -> tuple[sympy.Expr, ...]:
        return self.syms.shape(self.val(x).shape)

    def numel_nonzero(self, x) -> bool:
        return all(d != 0 for d in self.shape(x))

    def int_or_sym(self, v):
        if isinstance(v, torch.fx.Node):
            v = v.meta["val"]
        return self.syms.convert(v) if isinstance(v, torch.SymInt) else v

    def type_of(self, x) -> TensorType:
        v = self.val(x)
        return TensorType(to_dtype(v.dtype), self.syms.shape(v.shape))

    # -- making kiln values ---------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}_{self.counter}"

    def emit(self, op, inputs, node, like=None, shape_of=None, shape=None, dtype=None,
             result=None, **attrs):
        ref = node if node is not None else like
        name = node.name if node is not None else self.fresh(f"{ref.name}_{op}")
        t = self.type_of(ref)
        if result is not None:  # one result of a multi-result op
            v = ref.meta["val"][result]
            t = TensorType(to_dtype(v.dtype), self.syms.shape(v.shape))
            name = f"{ref.name}_{result}"
            if name in self.types:  # several nodes build one result: only the first is named
                name = self.fresh(name)
        if shape_of is not None:
            t = TensorType(t.dtype, self.shape(shape_of))
        if shape is not None:  # ints, sizes (SymInt) or FX nodes computing sizes
            t = TensorType(t.dtype, tuple(sympy.sympify(self.int_or_sym(s)) for s in shape))
        if dtype is not None:
            t = TensorType(dtype, t.shape)
        source = ref.name if ref is not None else ""
        self.nodes.append(Node(name, op, tuple(inputs), t, tuple(attrs.items()), source))
        self.types[name] = t
        return name

    def scalar(self, value, dt: torch.dtype) -> str:
        name = self.fresh("scalar")
        t = TensorType(to_dtype(dt), ())
        self.nodes.append(Node(name, "full", (), t, (("value", value),), "constant"))
        self.types[name] = t
        return name

    def tensor(self, x) -> str:
        if isinstance(x, torch.fx.Node):
            if x.name in self.env:
                return self.env[x.name]
            if isinstance(x.meta.get("val"), torch.SymInt):  # a size (or int input) as a value
                try:
                    return self.size_value(x, torch.int64)
                except UnsupportedError:
                    return sym_value(self, x)  # arithmetic kiln's sizes do not model
            if isinstance(x.meta.get("val"), (torch.SymFloat, torch.SymBool)):
                return sym_value(self, x)  # size arithmetic as a float / bool value
            raise UnsupportedError(f"value {x.name} ({x.target}) has no kiln equivalent")
        if isinstance(x, (bool, int, float)):
            return self.scalar(x, torch.tensor(x).dtype)
        raise UnsupportedError(f"operand {x!r} of type {type(x).__name__} is not a tensor")

    def size_value(self, x: torch.fx.Node, dt: torch.dtype) -> str:
        """A 0-d value holding the size expression of `x` (a SymInt: a dim, an int input or
        arithmetic on them), computed from the run's bound size symbols."""
        name = self.fresh(f"{x.name}_value")
        t = TensorType(to_dtype(dt), ())
        value = self.syms.convert(x.meta["val"])
        self.nodes.append(Node(name, "full", (), t, (("value", value),), x.name))
        self.types[name] = t
        return name

    def check_same_numel(self, n: torch.fx.Node, src, dst) -> None:
        """A reshape from `src` to `dst` sizes: at run time the element counts must agree and
        no size divisor may be 0 (int inputs make both possible, export guards neither)."""
        a, c = sympy.Mul(*src), sympy.Mul(*dst)
        if not (a.free_symbols | c.free_symbols):
            return
        what = f"{n.target} (node {n.name})"
        for f in sorted(c.atoms(sym.FloorDiv, sym.ModIdx), key=str):
            if not f.args[1].is_Integer:
                self.relations.append((f.args[1], sympy.Integer(0), False, what))
        if sympy.expand(a - c) != 0:
            self.relations.append((a, c, True, what))

    def cast_to(self, name: str, dt: torch.dtype, like) -> str:
        if self.types[name].dtype == to_dtype(dt):
            return name
        t = TensorType(to_dtype(dt), self.types[name].shape)
        new = self.fresh(f"{name}_cast")
        self.nodes.append(Node(new, "cast", (name,), t, (), like.name))
        self.types[new] = t
        return new

    def promoted_operands(self, n, a, b) -> tuple[str, str]:
        out_dt = self.meta_dtype(n)
        op = str(n.target).split(".")[1]
        if op.startswith("logical_"):
            return self.tensor(a), self.tensor(b)
        va, vb = self.val(a), self.val(b)
        compute = torch.result_type(va, vb) if out_dt == torch.bool else out_dt
        names = []
        for x in (a, b):
            if isinstance(x, torch.fx.Node) and x.name not in self.env and isinstance(
                    x.meta.get("val"), torch.SymInt):
                try:
                    names.append(self.size_value(x, compute))
                except UnsupportedError:
                    names.append(self.cast_to(sym_value(self, x), compute, n))
            elif isinstance(x, torch.fx.Node):
                names.append(self.cast_to(self.tensor(x), compute, n))
            else:
                names.append(self.scalar(x, compute))
        return names[0], names[1]

    def alias(self, node, name: str) -> str:
        return name

    def rng_state(self) -> str:
        """The int64 [2] state input (seed, run counter) that random nodes read."""
        if self.rng is None:
            self.rng = RNG_STATE
            self.types[self.rng] = TensorType(dtypes.int64, (sympy.Integer(2),))
        return self.rng

    def rng_stream(self) -> int:
        """A fresh stream number: each random node draws from its own Philox counter range."""
        self.streams += 1
        return self.streams


RNG_STATE = "kiln_rng_state"
RNG_FQN = "<rng state>"
