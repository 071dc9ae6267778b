"""Merged projections: GEMMs that share their A operand and read constant weights as B become
one GEMM on the weights concatenated at compile time.

A transformer layer written with separate q, k and v Linears (Hugging Face's Llama, BERT, ...)
runs three GEMMs on the same normalised input, and a gated MLP two (gate and up). Each is
`matmul(x, permute(W_i))` with W_i [N_i, K] a weight. They become

    W = cat(W_1, ..., W_n)            [sum N_i, K]   (a compile-time fold)
    y = matmul(x, permute(W))          [M, sum N_i]
    y_i = slice(y, dim 1, off_i, off_i + N_i)

so one launch reads x once and streams all the weights; the slices are views (free), read by
what read the separate products. At M = 1 (single-token decode) this removes launches that cost
more than their arithmetic.

Applies to products of at most MAX_ROWS rows (M's upper bound; decode and small batches), where
launches dominate: on larger products each separate GEMM keeps its own fused epilogue (bias,
activation, residual in a CUTLASS visitor tree or the Triton template), which the merged GEMM,
read through slices, cannot carry. Applies where each W_i is a static 2-D weight read only by
that permute, and each permute only
by its matmul (no weight is stored twice). In a package of several entry points where one
merges (decode) and another does not (prefill of more than MAX_ROWS rows), the separate
weights are stored as views into the merged one (package/entries.py), not twice. The merged
weight is a fold of the model's tensors
(FQN `<folded ...>`), so the pass runs only with `Options.fold_constants`, and
`update_weights` refuses such packages as it refuses other folds. A pure pass: returns a new
graph and weight table."""

from __future__ import annotations

from dataclasses import replace

import sympy
import torch

from kiln.ir.graph import Graph, Input, Node, TensorType


MAX_ROWS = 64


def _rows_bound(g: Graph, rows) -> int | None:
    """The largest value `rows` (a sympy size) takes over the graph's symbol ranges."""
    rows = sympy.sympify(rows)
    if rows.is_Integer:
        return int(rows)
    ranges = {s.name: s.max for s in g.symbols}
    if not all(str(f) in ranges for f in rows.free_symbols):
        return None
    try:  # sizes are increasing in their symbols: the bound at every symbol's maximum
        return int(rows.subs({f: ranges[str(f)] for f in rows.free_symbols}))
    except TypeError:
        return None


def merge_gemms(g: Graph, weights: dict[str, torch.Tensor]
                ) -> tuple[Graph, dict[str, torch.Tensor]]:
    readers = g.users()
    nodes = {n.name: n for n in g.nodes}
    wins = {i.name: i for i in g.inputs if i.kind == "weight" and not i.permuted}
    groups: dict[tuple, list[tuple[Node, Node, Input]]] = {}
    for n in g.nodes:
        if n.op != "matmul" or len(n.inputs) != 2 or len(n.type.shape) != 2:
            continue
        bound = _rows_bound(g, n.type.shape[0])
        if bound is None or bound > MAX_ROWS:
            continue
        x, p = n.inputs
        pn = nodes.get(p)
        if pn is None or pn.op != "permute" or tuple(pn.attr("dims")) != (1, 0):
            continue
        w = wins.get(pn.inputs[0])
        if w is None or len(w.type.shape) != 2 or not all(d.is_Integer for d in w.type.shape) \
                or readers.get(p) != 1 or readers.get(w.name) != 1:
            continue
        groups.setdefault((_same_value(x, nodes), w.type.dtype, w.type.shape[1]), []).append(
            (n, pn, w))
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return g, weights

    new_weights = dict(weights)
    new_inputs: list[Input] = []
    drop: set[str] = set()  # old weights and permutes
    merged_at: dict[str, list[Node]] = {}  # first matmul of a group -> nodes placed before it
    as_slice: dict[str, Node] = {}  # each matmul of a group -> its slice of the merged one
    for (_, dtype, k), members in groups.items():
        first = members[0][0]
        x = first.inputs[0]  # defined before the group's first GEMM, where the merged one goes
        widths = [int(w.type.shape[0]) for _, _, w in members]
        total = sympy.Integer(sum(widths))
        wname = f"{first.name}_merged_weight"
        fqns = ", ".join(w.fqn or w.name for _, _, w in members)
        new_inputs.append(Input(wname, TensorType(dtype, (total, k)), "weight",
                                f"<folded {fqns}: concatenated for one GEMM>"))
        new_weights[wname] = torch.cat([weights[w.name] for _, _, w in members], 0)
        perm = Node(f"{first.name}_merged_t", "permute", (wname,),
                    TensorType(dtype, (k, total)), (("dims", (1, 0)),), first.source)
        mm = Node(f"{first.name}_merged", "matmul", (x, perm.name),
                  TensorType(first.type.dtype, (first.type.shape[0], total)), first.attrs,
                  first.source)
        merged_at[first.name] = [perm, mm]
        off = 0
        for (n, pn, w), width in zip(members, widths):
            as_slice[n.name] = Node(n.name, "slice", (mm.name,), n.type,
                                    (("dim", 1), ("start", off), ("end", off + width),
                                     ("step", 1)), n.source)
            off += width
            drop.update((pn.name, w.name))
    out_nodes: list[Node] = []
    for n in g.nodes:
        if n.name in drop:
            continue
        out_nodes.extend(merged_at.get(n.name, ()))
        out_nodes.append(as_slice.get(n.name, n))
    inputs = tuple(i for i in g.inputs if i.name not in drop) + tuple(new_inputs)
    for name in drop:
        new_weights.pop(name, None)
    return replace(g, inputs=inputs, nodes=tuple(out_nodes)), new_weights


def _same_value(x: str, nodes: dict[str, Node]) -> tuple:
    """A key equal for names of the same value: the export flattens the input of each Linear
    with its own `view` node (view(h), view_3(h), ... of one h)."""
    n = nodes.get(x)
    if n is not None and n.op == "view":
        return ("view", _same_value(n.inputs[0], nodes), n.type.shape)
    return (x,)
