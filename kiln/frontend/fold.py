"""Constant folding at import: call nodes that depend only on weights (not on user inputs, not
on buffers the program mutates) are evaluated once, at compile time, with torch. The values
that non-folded nodes consume become new weights ("folded constants"); everything behind them
disappears from the program.

Never folded: views (a view of a weight is free and folding it would copy the weight), ops that
grow their data in bytes (a folded expand or repeat would make the package bigger, and so would
a folded widening convert: an int8 weight converted to float16, or dequantised by a float16
scale, would ship at twice its bytes; the convert stays in the program, where a mixed-dtype GEMM
reads the int8 weight), random ops, and nodes with symbolic sizes."""

from __future__ import annotations

import operator

import torch

_MAX_GROWTH = 1.0  # a folded output's bytes may not exceed its largest input's


def _is_view(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _mutates(target) -> bool:
    """An in-place op (`add_`, a running-stat update): evaluating it here would change the
    weight it reads (a program imported as exported still holds them)."""
    return any(a.alias_info is not None and a.alias_info.is_write
               for a in target._schema.arguments)


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _foldable(n, values) -> bool:
    if n.op != "call_function":
        return False
    if n.target is not operator.getitem and not isinstance(n.target, torch._ops.OpOverload):
        return False
    if isinstance(n.target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in n.target.tags or _mutates(n.target)):
        return False
    deps = n.all_input_nodes
    if not deps or any(d.name not in values for d in deps):
        return False
    val = n.meta.get("val")
    outs = _tensors(val)
    if not outs or any(not isinstance(s, int) for t in outs for s in t.shape):
        return False
    return True


def fold_constants(ep, weights: dict[str, torch.Tensor], mutated: set[str]
                   ) -> dict[str, torch.Tensor]:
    """FX node name -> folded value, for the folded nodes that unfolded nodes consume."""
    values: dict[str, object] = {k: v for k, v in weights.items() if k not in mutated}
    folded: set[str] = set()
    for n in ep.graph.nodes:
        if not _foldable(n, values):
            continue
        args = torch.fx.node.map_arg(n.args, lambda a: values[a.name])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: values[a.name])
        with torch.no_grad():
            out = n.target(*args, **kwargs)
        biggest = max((_nbytes(t) for a in n.all_input_nodes for t in _tensors(values[a.name])),
                      default=0)
        if any(_nbytes(t) > _MAX_GROWTH * max(biggest, 1) for t in _tensors(out)):
            continue
        values[n.name] = out
        folded.add(n.name)
    # the frontier: folded nodes used by unfolded nodes; views there stay unfolded
    changed = True
    while changed:
        changed = False
        for n in ep.graph.nodes:
            if n.name not in folded:
                continue
            used_outside = any(u.name not in folded for u in n.users)
            if used_outside and (_is_view(n.target) or n.target is operator.getitem
                                 or not isinstance(values[n.name], torch.Tensor)):
                folded.discard(n.name)
                changed = True
    frontier = {}
    for n in ep.graph.nodes:
        if n.name in folded and any(u.name not in folded for u in n.users):
            frontier[n.name] = values[n.name].detach().contiguous()
    return {"__folded__": folded, **frontier}
