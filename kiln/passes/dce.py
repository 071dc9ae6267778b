"""Dead code elimination on Graph IR: drops nodes no output depends on, and weights nothing
reads (so they are not shipped). User inputs are kept even when unused: they are part of the
calling convention."""

from __future__ import annotations

from dataclasses import replace

from kiln.ir.graph import Graph


def dce(g: Graph) -> Graph:
    live = set(g.outputs) | {value for _, value in g.mutations} | {s for s, _ in g.mutations}
    kept = []
    for n in reversed(g.nodes):
        if n.name in live:
            kept.append(n)
            live.update(n.inputs)
    inputs = tuple(i for i in g.inputs if i.kind in ("user", "state") or i.name in live)
    return replace(g, nodes=tuple(reversed(kept)), inputs=inputs)
