"""Freezing (`Options(freeze=True)`): weights stored in the layout their GEMMs read.

`nn.Linear` computes `x @ W.t()`: the GEMM reads W column by column. kiln's BLAS and CPU GEMM
calls take such strided operands without a copy, so by default W ships as the model holds it.
Freezing instead stores `W.t()` contiguous (transposed once, at compile time): the GEMM then
reads its B operand row by row, which the register-blocked CPU GEMM (`gemm_backends` "cpp")
and the Triton GEMM templates load with unit stride. Only a weight whose every reader is a
`permute` feeding a matmul as B is rewritten, so no weight is stored twice.

The package records the permutation per weight (manifest `weights[].permuted`): the Python
`update_weights(state_dict)` applies it to tensors given by FQN, so frozen packages still take
new weights; a safetensors file passed to update_weights holds tensors in the stored layout.
A pure pass: returns a new graph and weight table."""

from __future__ import annotations

from dataclasses import replace

import torch

from kiln.ir.graph import Graph, Input, TensorType

GEMM_OPS = ("matmul",)  # kiln ops whose input 1 is a GEMM's B operand


def freeze(g: Graph, weights: dict[str, torch.Tensor]
           ) -> tuple[Graph, dict[str, torch.Tensor]]:
    readers: dict[str, list] = {}
    for n in g.nodes:
        for k, x in enumerate(n.inputs):
            readers.setdefault(x, []).append((n, k))
    weights_in = {i.name: i for i in g.inputs if i.kind == "weight" and not i.permuted}
    rewrite: dict[str, tuple[Input, str]] = {}  # permute node -> (stored weight, source)
    for name, w in weights_in.items():
        uses = readers.get(name, [])
        if not uses or name in g.outputs or any(
                n.op != "permute" or not _feeds_gemm_b(n.name, readers, g) for n, _ in uses):
            continue
        for n, _ in uses:
            dims = tuple(n.attr("dims"))
            if dims == tuple(range(len(dims))):
                continue
            rewrite[n.name] = (Input(f"{name}_{'_'.join(map(str, dims))}",
                                     TensorType(w.type.dtype, n.type.shape), "weight", w.fqn,
                                     permuted=dims), name)
    if not rewrite:
        return g, weights
    new_weights = dict(weights)
    for inp, src in rewrite.values():
        new_weights[inp.name] = weights[src].permute(inp.permuted).contiguous()
    rename = {node: inp.name for node, (inp, _) in rewrite.items()}
    nodes = tuple(replace(n, inputs=tuple(rename.get(x, x) for x in n.inputs))
                  for n in g.nodes if n.name not in rename)
    added = tuple({i.name: i for i, _ in rewrite.values()}.values())
    out = replace(g, inputs=g.inputs + added, nodes=nodes)
    live = {x for n in out.nodes for x in n.inputs}
    out = replace(out, inputs=tuple(i for i in out.inputs if i.kind != "weight" or i.name in live))
    return out, {k: v for k, v in new_weights.items() if k in {i.name for i in out.inputs}}


def _feeds_gemm_b(node: str, readers: dict, g: Graph) -> bool:
    uses = readers.get(node, [])
    return bool(uses) and node not in g.outputs and all(
        n.op in GEMM_OPS and k == 1 for n, k in uses)
