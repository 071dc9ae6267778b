"""The epilogue chain of a convolution: the single-use nodes after a `conv` that a layout pass
folds into its store (passes/conv_nchwc.py on the CPU, passes/conv_nhwc.py on CUDA).

Input: a Graph IR graph, its value types, the users of each value, its weight inputs, and the
`conv` nodes a pass supports. Output: one `Fused` per convolution (`chains`): the conv, the
nodes absorbed after it and what they compute, and the chain in words (`describe`, the node's
`epilogue` attribute shown in graph dumps and kernel comments).

The chain after a convolution is absorbed in this order, as far as it matches:
    add of the bias (the frontend's `add(conv, view(bias))`, bias a weight [OC])
    batch_norm with constant statistics (eval mode)
    add of a residual of the output's type (not `x + x`)
    relu | clamp (relu6, hardtanh) | silu
and the fused result is out = act(bn(W * x + bias) [+ residual]). Batch norm folds into a
per-channel scale and shift (`scale_shift`, in float64): y = (z + bias - mean) *
gamma / sqrt(var + eps) + beta.

Invariants: every absorbed node but the last has the chain's next node as its only reader
and is not a graph output; a node is in one chain at most (the conv of a later chain may not
take a node an earlier chain absorbed); nothing here changes the graph (the passes rewrite
it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kiln.ir.graph import Graph, Node


@dataclass(frozen=True)
class Fused:
    """One convolution and the chain folded into it."""

    conv: Node
    last: str  # the chain's last node (its value is the fused result)
    absorbed: tuple[str, ...]  # every node of the chain, conv first
    bias: str | None = None  # weight input of the bias
    bn: Node | None = None
    residual: str | None = None
    act: str = "none"
    lo: float = 0.0
    hi: float = 0.0


def users_of(g: Graph) -> dict[str, list[Node]]:
    """Value name -> the nodes that read it (each once, in graph order)."""
    users: dict[str, list[Node]] = {}
    for n in g.nodes:
        for x in dict.fromkeys(n.inputs):
            users.setdefault(x, []).append(n)
    return users


def chains(g: Graph, types, users, weights_in, by_name, supported) -> dict[str, Fused]:
    """{last node: chain} of every conv node that `supported(n, types, weights_in)` accepts
    and no earlier chain absorbed, in graph order."""
    fused: dict[str, Fused] = {}
    absorbed: set[str] = set()
    for n in g.nodes:
        if n.name in absorbed or not supported(n, types, weights_in):
            continue
        f = chain(n, g, users, types, weights_in, by_name, absorbed)
        fused[f.last] = f
        absorbed.update(f.absorbed)
    return fused


def _ints(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def per_channel(shape, rank: int, oc: int) -> bool:
    """Whether a value of `shape` added to a [N, OC, ...] result of `rank` dims varies along
    the channels only (a bias [OC] viewed [OC, 1, 1] or [1, OC, 1, 1]; not one viewed along
    the last dim, which only broadcasts when that dim happens to be OC long)."""
    dims = (1,) * (rank - len(shape)) + tuple(int(d) for d in shape)
    return len(dims) == rank and dims[1] == oc and all(d == 1 for k, d in enumerate(dims)
                                                       if k != 1)


def chain(conv: Node, g: Graph, users, types, weights_in, by_name, taken) -> Fused:
    """The longest chain after `conv` that its epilogue computes (`taken`: nodes already in
    another chain)."""
    f = Fused(conv, conv.name, (conv.name,))
    outputs = set(g.outputs)
    oc = int(conv.type.shape[1])

    def sole_user(name):
        us = users.get(name, [])
        if len(us) != 1 or name in outputs or us[0].name in taken:
            return None
        return us[0]

    def const(name) -> bool:
        return name in weights_in

    nxt = sole_user(f.last)
    # the bias: add(conv, view(bias [OC] -> [OC, 1, 1]))
    if nxt is not None and nxt.op == "add" and nxt.type == conv.type and nxt.inputs[0] == f.last:
        v = by_name.get(nxt.inputs[1])
        if v is not None and v.op == "view" and const(v.inputs[0]) and \
                _ints(types[v.inputs[0]].shape) == (oc,) and \
                per_channel(types[v.name].shape, conv.type.rank, oc):
            f = replace(f, last=nxt.name, absorbed=f.absorbed + (nxt.name,), bias=v.inputs[0])
            nxt = sole_user(f.last)
    if nxt is not None and nxt.op == "batch_norm" and nxt.inputs[0] == f.last and \
            all(const(i) for i in nxt.inputs[1:]) and nxt.type == conv.type:
        f = replace(f, last=nxt.name, absorbed=f.absorbed + (nxt.name,), bn=nxt)
        nxt = sole_user(f.last)
    if nxt is not None and nxt.op == "add" and nxt.type == conv.type and f.last in nxt.inputs \
            and nxt.inputs[0] != nxt.inputs[1]:  # (x + x is not a residual)
        other = nxt.inputs[1] if nxt.inputs[0] == f.last else nxt.inputs[0]
        if types[other] == conv.type:
            f = replace(f, last=nxt.name, absorbed=f.absorbed + (nxt.name,), residual=other)
            nxt = sole_user(f.last)
    if nxt is not None and nxt.inputs[:1] == (f.last,) and nxt.type == conv.type:
        if nxt.op in ("relu", "silu"):
            f = replace(f, last=nxt.name, absorbed=f.absorbed + (nxt.name,), act=nxt.op)
        elif nxt.op == "clamp" and (nxt.attr("min") is not None or nxt.attr("max") is not None):
            lo, hi = nxt.attr("min"), nxt.attr("max")
            f = replace(f, last=nxt.name, absorbed=f.absorbed + (nxt.name,), act="clamp",
                        lo=-math.inf if lo is None else float(lo),
                        hi=math.inf if hi is None else float(hi))
    return f


def describe(f: Fused) -> str:
    """The epilogue in words (the node's `epilogue` attribute, shown in graph dumps)."""
    parts = []
    if f.bias:
        parts.append("bias")
    if f.bn is not None:
        parts.append(f"{f.bn.name} folded")
    if f.residual:
        parts.append(f"+ {f.residual}")
    if f.act == "clamp":
        parts.append(f"clamp({f.lo:g}, {f.hi:g})")
    elif f.act != "none":
        parts.append(f.act)
    return ", ".join(parts) or "none"


def folded_fqns(f: Fused, weights_in) -> str:
    """The FQNs of the model weights a fused convolution's packed weights are made from
    (its weight, bias and batch-norm tensors), for the packed inputs' `<folded ...>` FQN."""
    srcs = [f.conv.inputs[1]] + ([f.bias] if f.bias else []) + (
        list(f.bn.inputs[1:]) if f.bn is not None else [])
    return ", ".join(weights_in[s].fqn or s for s in srcs)


def scale_shift(f: Fused, bias, bn_tensors, oc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 per-channel (scale, shift) on the CPU of the chain's bias and batch norm:
    (1, bias) without batch norm, else (gamma / sqrt(var + eps), (bias - mean) * scale + beta);
    `bias`: the bias tensor or None, `bn_tensors`: the batch norm's constant inputs."""
    b = torch.zeros(oc, dtype=torch.float64) if bias is None else \
        bias.detach().to("cpu", torch.float64).reshape(oc)
    scale = torch.ones(oc, dtype=torch.float64)
    if f.bn is not None:  # y = (z + b - mean) * rsqrt(var + eps) * gamma + beta
        mean, var, *rest = (t.detach().to("cpu", torch.float64).reshape(oc) for t in bn_tensors)
        gamma = rest.pop(0) if f.bn.attr("has_weight") else torch.ones(oc, dtype=torch.float64)
        beta = rest.pop(0) if f.bn.attr("has_bias") else torch.zeros(oc, dtype=torch.float64)
        scale = gamma / torch.sqrt(var + f.bn.attr("eps"))
        b = (b - mean) * scale + beta
    return scale, b
