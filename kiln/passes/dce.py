"""Dead code elimination on Graph IR: drops nodes no output depends on, and weights nothing
reads (so they are not shipped). User inputs are kept even when unused: they are part of the
calling convention."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import sympy

from kiln.ir.graph import Graph


def _attr_symbols(v) -> set[str]:
    if isinstance(v, sympy.Basic):
        return {s.name for s in v.free_symbols}
    if isinstance(v, (tuple, list)):
        return {name for x in v for name in _attr_symbols(x)}
    if is_dataclass(v) and not isinstance(v, type):  # an ATen argument (`AtenInt` of u0), a
        # user Triton kernel's spec (its grid and int arguments)
        return {name for f in fields(v) for name in _attr_symbols(getattr(v, f.name))}
    return set()


def dce(g: Graph) -> Graph:
    live = set(g.outputs) | {value for _, value in g.mutations} | {s for s, _ in g.mutations}
    types = g.types()
    sizes = {s.name for o in g.outputs for d in types[o].shape
             for s in sympy.sympify(d).free_symbols}  # symbols live nodes' sizes use
    kept = []
    for n in reversed(g.nodes):
        binds = {name for _, name, _ in n.attr("binds", ())}
        if n.name in live or binds & sizes:  # a node that defines a size in use stays
            kept.append(n)
            live.update(n.inputs)
            sizes |= {s.name for d in n.type.shape for s in sympy.sympify(d).free_symbols}
            sizes |= _attr_symbols(n.attrs)  # a size used as a value (`full` of u0, ...)
    inputs = tuple(i for i in g.inputs if i.kind in ("user", "state") or i.name in live)
    return replace(g, nodes=tuple(reversed(kept)), inputs=inputs)
