"""torch.cond and while_loop -> Graph IR control nodes.

torch.export keeps `torch.cond(pred, true_fn, false_fn, operands)` as
`higher_order.cond(pred, true_graph, false_graph, operands)` and `while_loop` as
`higher_order.while_loop(cond_graph, body_graph, carried, additional)`, the subgraphs being
attributes of the exported module. Each subgraph becomes a nested `Graph` (a region) whose
inputs are its placeholders, in order; the outer-scope tensors a subgraph needs (weights,
buffers, closure captures) are operands (cond) or additional inputs (while_loop), so they reach
the region as ordinary inputs. Size operands (SymInts) are dropped: shapes come from metadata.
Python ints carried by a while_loop (a counter) are values, not sizes: they travel as 0-d
int64 tensors, and the int arithmetic and comparisons on them (`i + 1`, `i < n`) become
pointwise nodes (`convert_int_value`); the loop's int results are such values too, returned
as Python ints when they are outputs. Using one as a shape is refused (the size would change
per iteration).

A control node is one Graph IR node (op "cond" or "while_loop", its own type a 0-d bool token)
plus one "ctl_result" node per result (attr `index`), so every result is an ordinary value.
Attributes: cond -- `then`, `else` (Graphs), `pred_expr` (None when the first input is the 0-d
predicate tensor, else a sympy condition over size symbols); while_loop -- `cond`, `body`,
`n_carried` (inputs are the carried values then the additional ones); both -- `results`
(the result node names)."""

from __future__ import annotations

import operator

import sympy
import torch
from torch.utils import _pytree as pytree

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.frontend.builder import Builder, to_dtype
from kiln.ir.graph import Graph, Input, Node, TensorType


# Python int operators on int values -> kiln pointwise ops (Python's floor division and modulo
# are torch's floor_divide and remainder on int64)
INT_OPS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul",
           operator.floordiv: "floor_divide", operator.mod: "remainder", operator.lt: "lt",
           operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.eq: "eq",
           operator.ne: "ne"}


def convert_int_value(b, n: torch.fx.Node) -> bool:
    """Int arithmetic or a comparison that reads an int held as a value (`b.value_ints`): emits
    the pointwise node on 0-d int64 tensors and returns True; False for anything else (size
    arithmetic stays symbolic)."""
    if n.op != "call_function" or isinstance(n.meta.get("val"), torch.Tensor) or not any(
            isinstance(a, torch.fx.Node) and a.name in b.value_ints for a in n.args):
        return False
    op = INT_OPS.get(n.target)
    if op is None or n.kwargs or len(n.args) != 2:
        raise UnsupportedError(f"{n.target} (node {n.name}) on an int carried by a "
                               "while_loop is not supported (carry a 0-d tensor instead)")
    ins = [b.tensor(a) if isinstance(a, torch.fx.Node) else b.scalar(a, torch.int64)
           for a in n.args]
    ins = [b.cast_to(x, torch.int64, n) for x in ins]
    t = TensorType(dtypes.bool_ if op in ("lt", "le", "gt", "ge", "eq", "ne") else
                   dtypes.int64, ())
    name = b.fresh(n.name)
    b.nodes.append(Node(name, op, tuple(ins), t, (), n.name))
    b.types[name] = t
    b.env[n.name] = name
    if t.dtype == dtypes.int64:
        b.value_ints.add(n.name)
    return True


def _region(b, gm: torch.fx.GraphModule, what: str, ints: frozenset[int] = frozenset()
            ) -> tuple[Graph, list[int]]:
    """`gm` as a region Graph, and the positions of its tensor placeholders (and of the int
    placeholders at positions `ints`, values carried as 0-d int64 tensors)."""
    sub = Builder(b.syms, b.convert_node)
    sub.ranges = b.ranges
    sub.aten_fallback = b.aten_fallback
    sub.library_routines = b.library_routines
    sub.fused_attention = b.fused_attention
    sub.relations = b.relations  # size relations a region's reshapes need: checked up front
    inputs: list[Input] = []
    kept: list[int] = []
    for k, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        v = ph.meta.get("val")
        if isinstance(v, torch.Tensor) or k in ints:
            t = TensorType(to_dtype(v.dtype), b.syms.shape(v.shape)) if k not in ints else \
                TensorType(dtypes.int64, ())
            inputs.append(Input(ph.name, t, "user"))
            sub.env[ph.name], sub.types[ph.name] = ph.name, t
            kept.append(k)
            if k in ints:
                sub.value_ints.add(ph.name)
        elif not isinstance(v, (torch.SymInt, int)):
            raise UnsupportedError(f"{what}: operand {ph.name} is a {type(v).__name__}; only "
                                   "tensors and sizes are supported")
    for n in gm.graph.nodes:
        if n.op == "call_function":
            sub.convert_node(sub, n, gm)
        elif n.op == "output":
            outs = []
            for x in pytree.tree_leaves(n.args[0]):
                if isinstance(x, int) and not isinstance(x, bool) and ints:
                    outs.append(sub.scalar(x, torch.int64))  # a carried int set to a constant
                    continue
                # kiln values (int values and comparisons on them included) or tensors
                if not isinstance(x, torch.fx.Node) or not (
                        x.name in sub.env or isinstance(x.meta.get("val"), torch.Tensor)):
                    raise UnsupportedError(f"{what}: result {x} is not a tensor")
                outs.append(sub.tensor(x))
    return Graph(tuple(inputs), tuple(sub.nodes), tuple(outs)), kept


def size_condition(syms, e) -> sympy.Basic:
    """A torch size predicate (sympy relational / boolean over torch's symbols) in kiln's
    symbols."""
    if e in (sympy.true, sympy.false):
        return e
    if isinstance(e, sympy.core.relational.Relational):
        return type(e)(syms.convert(e.lhs), syms.convert(e.rhs))
    if isinstance(e, (sympy.And, sympy.Or, sympy.Not)):
        return type(e)(*(size_condition(syms, a) for a in e.args))
    raise UnsupportedError(f"cannot translate size predicate {e} ({type(e).__name__})")


def _results(b, n: torch.fx.Node, op: str, inputs: list[str], attrs: list) -> list[str]:
    vals = pytree.tree_leaves(n.meta["val"])
    names = []
    for k, v in enumerate(vals):
        name = f"{n.name}_out{k}"
        names.append(b.fresh(name) if name in b.types else name)
    token = TensorType(dtypes.bool_, ())
    b.nodes.append(Node(n.name, op, tuple(inputs), token,
                        tuple(attrs) + (("results", tuple(names)),), n.name))
    b.types[n.name] = token
    for k, (name, v) in enumerate(zip(names, vals)):
        t = TensorType(dtypes.int64, ()) if isinstance(v, (torch.SymInt, int)) else \
            TensorType(to_dtype(v.dtype), b.syms.shape(v.shape))
        b.nodes.append(Node(name, "ctl_result", (n.name,), t, (("index", k),), n.name))
        b.types[name] = t
    return names


def types_match(ta: list[TensorType], tb: list[TensorType]) -> bool:
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and len(x.shape) == len(y.shape) and all(
            sympy.expand(p - q) == 0 for p, q in zip(x.shape, y.shape)) for x, y in zip(ta, tb))


def _same_types(a: Graph, b: Graph, what: str) -> None:
    ta = [a.types()[o] for o in a.outputs]
    tb = [b.types()[o] for o in b.outputs]
    if not types_match(ta, tb):
        raise UnsupportedError(f"{what}: the two branches return different types "
                               f"({', '.join(map(str, ta))} vs {', '.join(map(str, tb))})")


def convert_cond(b, n: torch.fx.Node, gm: torch.fx.GraphModule) -> list[str]:
    pred, true_g, false_g, operands = n.args[:4]
    what = f"torch.cond (node {n.name})"
    then, keep = _region(b, getattr(gm, true_g.target), what)
    orelse, keep_else = _region(b, getattr(gm, false_g.target), what)
    if keep != keep_else:
        raise UnsupportedError(f"{what}: the branches take different operands")
    _same_types(then, orelse, what)
    v = pred.meta.get("val") if isinstance(pred, torch.fx.Node) else pred
    inputs: list[str] = []
    expr = None
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype != torch.bool:
            raise UnsupportedError(f"{what}: the predicate is {v.dtype}[{v.numel()}], not one "
                                   "bool")
        inputs.append(b.tensor(pred))
    elif isinstance(v, torch.SymBool):
        expr = size_condition(b.syms, v.node.expr)
    elif isinstance(v, bool):
        expr = sympy.true if v else sympy.false
    else:
        raise UnsupportedError(f"{what}: predicate {pred} of type {type(v).__name__}")
    inputs += [b.tensor(operands[k]) for k in keep]
    return _results(b, n, "cond", inputs,
                    [("then", then), ("else", orelse), ("pred_expr", expr)])


def convert_while(b, n: torch.fx.Node, gm: torch.fx.GraphModule) -> list[str]:
    cond_g, body_g, carried, additional = n.args[:4]
    what = f"while_loop (node {n.name})"
    ints = set()
    for k, x in enumerate(carried):
        v = x.meta.get("val") if isinstance(x, torch.fx.Node) else x
        if isinstance(v, (torch.SymInt, int)) and not isinstance(v, bool):
            ints.add(k)  # a Python int: carried as a 0-d int64 value
        elif not isinstance(v, torch.Tensor):
            raise UnsupportedError(f"{what}: carried value {x} is a {type(v).__name__}; "
                                   "tensors and ints can be carried")
    cond, keep = _region(b, getattr(gm, cond_g.target), what, frozenset(ints))
    body, keep_body = _region(b, getattr(gm, body_g.target), what, frozenset(ints))
    ops = list(carried) + list(additional)
    if keep != keep_body or keep[:len(carried)] != list(range(len(carried))):
        raise UnsupportedError(f"{what}: cond and body take different operands")
    out = cond.types()[cond.outputs[0]] if len(cond.outputs) == 1 else None
    if out is None or out.dtype != dtypes.bool_ or any(sympy.sympify(d) != 1 for d in out.shape):
        raise UnsupportedError(f"{what}: cond_fn must return one 0-d bool tensor")
    carried_types = [body.types()[i.name] for i in body.inputs[:len(carried)]]
    body_types = [body.types()[o] for o in body.outputs]
    if not types_match(carried_types, body_types):
        raise UnsupportedError(f"{what}: body_fn returns {', '.join(map(str, body_types))} "
                               f"for carried {', '.join(map(str, carried_types))}")
    inputs = [b.tensor(ops[k]) for k in keep]
    return _results(b, n, "while_loop", inputs,
                    [("cond", cond), ("body", body), ("n_carried", len(carried))])


CONTROL = {torch.ops.higher_order.cond: convert_cond,
           torch.ops.higher_order.while_loop: convert_while}
