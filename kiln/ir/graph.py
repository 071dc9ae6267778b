"""Graph IR: an SSA graph of tensor operators, typed by dtype and symbolic shape.

A `Graph` is immutable. Its `inputs` are user inputs and weights (parameters, buffers, lifted
constants); `nodes` are in topological order and each names its operands by value name; `outputs`
name the flat user outputs. Op names and their attributes are those of `frontend/aten_table.py`
(pointwise ops: the rows of `ops/table.py`).

Invariants (checked by `verify_graph`): every operand is defined before use, names are unique,
every output is defined, shapes are tuples of sympy integer expressions whose free symbols are
declared in `symbols`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy

from kiln.ir.dtypes import DType


@dataclass(frozen=True)
class TensorType:
    dtype: DType
    shape: tuple[sympy.Expr, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.name}[{', '.join(str(s) for s in self.shape)}]"


@dataclass(frozen=True)
class SymbolRange:
    """A dynamic dim: its sympy symbol name, inclusive range and the value seen at export."""

    name: str
    min: int
    max: int
    example: int


@dataclass(frozen=True)
class Input:
    name: str
    type: TensorType
    kind: str  # "user", "weight", or "state" (a buffer the program updates: see meta mutations)
    fqn: str = ""  # weight: the module attribute path (e.g. "fc1.weight")
    # a user input that is a Python int marked dynamic: its value binds this size symbol; it
    # travels as a 0-d int64 host tensor and only the wrapper reads it
    symbol: str = ""
    # a frozen weight (passes/freeze.py): stored as the FQN's tensor permuted by these dims
    permuted: tuple[int, ...] = ()


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    inputs: tuple[str, ...]
    type: TensorType
    attrs: tuple[tuple[str, Any], ...] = ()
    source: str = ""  # the torch.export node it came from

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default


@dataclass(frozen=True)
class Graph:
    inputs: tuple[Input, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    symbols: tuple[SymbolRange, ...] = ()
    # relations between dims that are not plain symbols, e.g. ("s1", "2*s0")
    in_spec: str = ""
    out_spec: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def types(self) -> dict[str, TensorType]:
        out = {i.name: i.type for i in self.inputs}
        out.update({n.name: n.type for n in self.nodes})
        return out

    def users(self) -> dict[str, int]:
        count: dict[str, int] = {}
        for n in self.nodes:
            for x in n.inputs:
                count[x] = count.get(x, 0) + 1
        for o in self.outputs:
            count[o] = count.get(o, 0) + 1
        return count

    @property
    def user_inputs(self) -> tuple[Input, ...]:
        return tuple(i for i in self.inputs if i.kind == "user")

    @property
    def weights(self) -> tuple[Input, ...]:
        """Weights and state buffers: everything shipped in weights.safetensors."""
        return tuple(i for i in self.inputs if i.kind in ("weight", "state"))

    @property
    def mutations(self) -> tuple[tuple[str, str], ...]:
        """(state input, value) pairs: after a run, the state holds the value."""
        return tuple(self.meta.get("mutations", ()))


def fresh_name(base: str, names: set[str]) -> str:
    """`base`, or `base_2`, `base_3`... the first not in `names`; added to `names`."""
    name, j = base, 1
    while name in names:
        j += 1
        name = f"{base}_{j}"
    names.add(name)
    return name


def _fmt_attr(v: Any) -> str:
    if isinstance(v, Graph):
        return f"<region: {len(v.inputs)} inputs, {len(v.nodes)} nodes>"
    if isinstance(v, tuple):
        return "(" + ", ".join(_fmt_attr(x) for x in v) + ")"
    return str(v)


def print_graph(g: Graph) -> str:
    lines = ["graph("]
    for s in g.symbols:
        lines.append(f"  sym {s.name} in [{s.min}, {s.max}]  # example {s.example}")
    for i in g.inputs:
        extra = f"  # {i.fqn}" if i.fqn else ""
        lines.append(f"  {i.kind} %{i.name}: {i.type}{extra}")
    lines.append(") {")
    for n in g.nodes:
        args = ", ".join(f"%{x}" for x in n.inputs)
        attrs = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in n.attrs)
        sep = "; " if args and attrs else ""
        lines.append(f"  %{n.name}: {n.type} = {n.op}({args}{sep}{attrs})")
        for k, v in n.attrs:  # control-flow regions (frontend/control.py), indented
            if isinstance(v, Graph):
                lines += [f"    {k}: " + x if j == 0 else "    " + x
                          for j, x in enumerate(print_graph(v).splitlines())]
    lines.append("  return " + ", ".join(f"%{o}" for o in g.outputs))
    lines.append("}")
    return "\n".join(lines)


class GraphError(ValueError):
    pass


def verify_graph(g: Graph) -> None:
    """Raise GraphError with the offending node when an invariant does not hold."""
    defined: set[str] = set()
    declared = {s.name for s in g.symbols}

    def check_type(name: str, t: TensorType) -> None:
        for d in t.shape:
            extra = {s.name for s in sympy.sympify(d).free_symbols} - declared
            if extra:
                raise GraphError(f"{name}: shape {t} uses undeclared symbols {sorted(extra)}")

    for i in g.inputs:
        if i.name in defined:
            raise GraphError(f"input {i.name} defined twice")
        check_type(i.name, i.type)
        defined.add(i.name)
    for n in g.nodes:
        for x in n.inputs:
            if x not in defined:
                raise GraphError(f"node {n.name} ({n.op}) uses {x} before it is defined")
        if n.name in defined:
            raise GraphError(f"node {n.name} defined twice")
        declared |= {name for _, name, _ in n.attr("binds", ())}  # data-dependent sizes
        check_type(n.name, n.type)
        defined.add(n.name)
        for k, v in n.attrs:  # a control-flow region: a graph of its own, same symbols
            if isinstance(v, Graph):
                try:
                    verify_graph(Graph(v.inputs, v.nodes, v.outputs, g.symbols))
                except GraphError as e:
                    raise GraphError(f"node {n.name} ({n.op}), region {k}: {e}") from None
    for o in g.outputs:
        if o not in defined:
            raise GraphError(f"output {o} is not defined")
