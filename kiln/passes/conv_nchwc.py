"""CPU direct convolution (Options.cpu_conv == "direct"): 2-D float32 convolutions become
`conv_nchwc` nodes that read and write the blocked channel layout NCHWc ([N, C/B, H, W, B],
channels zero-padded to a multiple of B) with weights packed at compile time, and the ops
that follow a convolution are folded into its store (its "epilogue").

For each supported `conv` (2-D, not transposed, float32, static sizes, a constant weight;
groups 1, or depthwise: groups == in channels == out channels) the chain of single-use
nodes after it is absorbed, in this order, as far as it matches:
    add of the bias (the frontend's `add(conv, view(bias))`)
    batch_norm with constant statistics (eval mode): folded into weight and bias
    add of a residual of the output's shape
    relu | clamp (relu6, hardtanh) | silu
and the whole chain becomes one `conv_nchwc` node named `<last>_nchwc`: out = act(W * x +
bias [+ residual]). Weights are stored packed, in float32 computed from float64:
    dense      [OC/B, IC/B, KH, KW, B, B]   (in-channel, then out-channel innermost)
               [OC/B, 1, KH, KW, IC, B]     when IC < B and the input is a plain NCHW tensor
                                            (a stem convolution reads it unconverted)
    depthwise  [C/B, KH, KW, B]
    bias       [OC/B * B]

Layout regions: a value is converted only where the layout changes. A convolution reads its
input and its residual in NCHWc: the blocked output `<v>_nchwc` of the convolution that made
`v`, or else a `to_nchwc` node named `<v>_nchwc`. Where a convolution's result is also read
by another op (or is a graph output), a `from_nchwc` node under the original name gives the
NCHW value back (a pointwise index map that fuses into its readers), so every other node
keeps its operands.

A 2-D max pooling (values only) of a value already in NCHWc stays in the layout
(`max_pool_nchwc`, named `<pool>_nchwc`): the ResNet stem's conv -> relu -> max pool ->
block chain never leaves NCHWc.

Packed weights are compile-time folds of the model's tensors: their FQN is `<folded ...>`
(naming the source weights), so update_weights(state_dict) refuses them with the message
for folded constants; packages that must take new weights compile with
fold_constants=False, which also turns this pass off (the convolution then stays im2col +
GEMM). A pure pass: returns a new graph and weight table."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import sympy
import torch

from kiln.ir import dtypes
from kiln.ir.graph import Graph, Input, Node, TensorType
from kiln.passes.dce import dce

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


def _static(shape) -> bool:
    return all(sympy.sympify(d).is_Integer for d in shape)


def _ints(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


def supported(n: Node, types, weights_in) -> bool:
    """Whether the direct convolution computes conv node `n`."""
    if n.op != "conv" or len(n.inputs) != 2 or n.attr("transposed"):
        return False
    x, w = (types[i] for i in n.inputs)
    if x.rank != 4 or w.rank != 4 or n.inputs[1] not in weights_in:
        return False
    if any(t.dtype != dtypes.float32 for t in (x, w, n.type)):
        return False
    if not (_static(x.shape) and _static(w.shape) and _static(n.type.shape)):
        return False
    g = n.attr("groups")
    c, oc = int(x.shape[1]), int(n.type.shape[1])
    return g == 1 or (g == c == oc and int(w.shape[1]) == 1)


def _chain(conv: Node, g: Graph, users, types, weights_in, by_name, taken) -> Fused:
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
                _ints(types[v.inputs[0]].shape) == (oc,):
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


def _padded(c: int, block: int) -> int:
    return -(-c // block) * block


def pack(f: Fused, w: torch.Tensor, bias, bn_tensors, block: int, unblocked_input: bool,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, packed bias) of fused convolution `f` (see the module docstring)."""
    w = w.detach().to(torch.float64)
    oc, icg, kh, kw = w.shape
    b = torch.zeros(oc, dtype=torch.float64) if bias is None else \
        bias.detach().to(torch.float64).reshape(oc)
    if f.bn is not None:  # y = (z - mean) * rsqrt(var + eps) * gamma + beta
        mean, var, *rest = (t.detach().to(torch.float64).reshape(oc) for t in bn_tensors)
        gamma = rest.pop(0) if f.bn.attr("has_weight") else torch.ones(oc, dtype=torch.float64)
        beta = rest.pop(0) if f.bn.attr("has_bias") else torch.zeros(oc, dtype=torch.float64)
        scale = gamma / torch.sqrt(var + f.bn.attr("eps"))
        w = w * scale.reshape(oc, 1, 1, 1)
        b = (b - mean) * scale + beta
    ocp = _padded(oc, block)
    bias_p = torch.zeros(ocp, dtype=torch.float64)
    bias_p[:oc] = b
    if f.conv.attr("groups") != 1:  # depthwise: [C/B, KH, KW, B]
        wp = torch.zeros(ocp, kh, kw, dtype=torch.float64)
        wp[:oc] = w[:, 0]
        wp = wp.reshape(ocp // block, block, kh, kw).permute(0, 2, 3, 1)
    else:
        icn = icg if unblocked_input else block
        icp = _padded(icg, icn)
        wp = torch.zeros(ocp, icp, kh, kw, dtype=torch.float64)
        wp[:oc, :icg] = w
        # [OCb, o, ICb, i, KH, KW] -> [OCb, ICb, KH, KW, i, o]
        wp = wp.reshape(ocp // block, block, icp // icn, icn, kh, kw).permute(0, 2, 4, 5, 3, 1)
    return (wp.to(torch.float32).contiguous(), bias_p.to(torch.float32).contiguous())


def _describe(f: Fused) -> str:
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


def conv_nchwc(g: Graph, weights: dict[str, torch.Tensor], block: int, threads: int = 0
               ) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Rewrite the supported convolutions of `g` (see the module docstring); `block`: floats
    per channel block (16 with AVX-512, 8 otherwise); `threads`: Options.num_threads."""
    types = dict(g.types())
    weights_in = {i.name: i for i in g.inputs if i.kind == "weight" and i.name in weights}
    by_name = {n.name: n for n in g.nodes}
    users: dict[str, list[Node]] = {}
    for n in g.nodes:
        for x in dict.fromkeys(n.inputs):
            users.setdefault(x, []).append(n)
    fused: dict[str, Fused] = {}  # last node -> chain
    absorbed: set[str] = set()
    for n in g.nodes:
        if n.name in absorbed or not supported(n, types, weights_in):
            continue
        f = _chain(n, g, users, types, weights_in, by_name, absorbed)
        fused[f.last] = f
        absorbed.update(f.absorbed)
    if not fused:
        return g, weights
    chain_of = {a: f for f in fused.values() for a in f.absorbed}
    outputs = set(g.outputs)

    def needs_nchw(v: str) -> bool:
        """Whether a node other than a fused convolution reading it as its input or
        residual (or the graph's outputs) reads value `v`."""
        return v in outputs or any(
            u.name not in chain_of or v not in (chain_of[u.name].conv.inputs[0],
                                                 chain_of[u.name].residual)
            for u in users.get(v, []))

    new_inputs = list(g.inputs)
    new_weights = dict(weights)
    nodes: list[Node] = []
    blocked: dict[str, str] = {}  # value -> its NCHWc node

    def to_blocked(v: str) -> str:
        if v not in blocked:
            t = types[v]
            n, c, h, w = t.shape
            name = f"{v}_nchwc"
            nodes.append(Node(name, "to_nchwc", (v,), TensorType(t.dtype, (
                n, sympy.Integer(_padded(int(c), block) // block), h, w, sympy.Integer(block))),
                (("block", block),), by_name[v].source if v in by_name else v))
            blocked[v] = name
            types[name] = nodes[-1].type
        return blocked[v]

    for node in g.nodes:
        if node.name in absorbed and node.name not in fused:
            continue
        if _blocked_pool(node, blocked):  # max pooling inside a region stays in NCHWc
            name = f"{node.name}_nchwc"
            x = types[blocked[node.inputs[0]]]
            nodes.append(Node(name, "max_pool_nchwc", (blocked[node.inputs[0]],), TensorType(
                node.type.dtype, (x.shape[0], x.shape[1], *node.type.shape[2:], x.shape[4])),
                (*node.attrs, ("threads", threads)), node.source))
            types[name] = nodes[-1].type
            blocked[node.name] = name
            if needs_nchw(node.name):
                nodes.append(Node(node.name, "from_nchwc", (name,), node.type,
                                  (("block", block),), node.source))
            continue
        if node.name not in fused:
            nodes.append(node)
            continue
        f = fused[node.name]
        conv = f.conv
        x = conv.inputs[0]
        ic = int(types[x].shape[1])
        unblocked = x not in blocked and conv.attr("groups") == 1 and ic < block
        xin = x if unblocked else to_blocked(x)
        res = to_blocked(f.residual) if f.residual else None
        bn_t = [weights[i] for i in f.bn.inputs[1:]] if f.bn is not None else None
        wp, bp = pack(f, weights[conv.inputs[1]], weights[f.bias] if f.bias else None, bn_t,
                      block, unblocked)
        name = f"{f.last}_nchwc"
        srcs = [conv.inputs[1]] + ([f.bias] if f.bias else []) + (
            list(f.bn.inputs[1:]) if f.bn is not None else [])
        fqns = ", ".join(weights_in[s].fqn or s for s in srcs)
        win = Input(f"{name}_w", TensorType(dtypes.float32, tuple(map(sympy.Integer, wp.shape))),
                    "weight", f"<folded {fqns}: packed for the NCHWc convolution {name}>")
        bin_ = Input(f"{name}_b", TensorType(dtypes.float32, (sympy.Integer(bp.numel()),)),
                     "weight", f"<folded {fqns}: bias of the NCHWc convolution {name}>")
        new_inputs += [win, bin_]
        new_weights[win.name], new_weights[bin_.name] = wp, bp
        out_t = f.conv.type
        nb, oc, oh, ow = out_t.shape
        ocb = _padded(int(oc), block) // block
        attrs = (("stride", tuple(conv.attr("stride"))), ("padding", tuple(conv.attr("padding"))),
                 ("dilation", tuple(conv.attr("dilation"))),
                 ("depthwise", conv.attr("groups") != 1), ("act", f.act), ("lo", f.lo),
                 ("hi", f.hi), ("channels", int(oc)), ("block", block), ("threads", threads),
                 ("fused", f.absorbed), ("epilogue", _describe(f)))
        ins = (xin, win.name, bin_.name) + ((res,) if res else ())
        nodes.append(Node(name, "conv_nchwc", ins, TensorType(dtypes.float32, (
            nb, sympy.Integer(ocb), oh, ow, sympy.Integer(block))), attrs, conv.source))
        types[name] = nodes[-1].type
        blocked[f.last] = name
        if needs_nchw(f.last):
            nodes.append(Node(f.last, "from_nchwc", (name,), out_t, (("block", block),),
                              node.source))
    out = replace(g, inputs=tuple(new_inputs), nodes=tuple(nodes))
    out = dce(out)
    names = {i.name for i in out.inputs}
    return out, {k: v for k, v in new_weights.items() if k in names}



def _blocked_pool(n: Node, blocked) -> bool:
    """A 2-D max pooling (values) of a value already in NCHWc."""
    return n.op == "max_pool" and n.attr("want") == "values" and len(n.attr("kernel")) == 2 \
        and n.inputs[0] in blocked and n.type.dtype == dtypes.float32
