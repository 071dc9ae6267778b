"""CPU direct convolution (Options.cpu_conv == "direct"): 2-D float32 convolutions become
`conv_nchwc` nodes that read and write the blocked channel layout NCHWc ([N, C/B, H, W, B],
channels zero-padded to a multiple of B) with weights packed at compile time, and the ops
that follow a convolution are folded into its store (its "epilogue").

For each supported `conv` (2-D, not transposed, float32, static sizes, a constant weight;
groups 1, or depthwise: groups == in channels == out channels) the chain of single-use
nodes after it (bias add, eval batch_norm folded into weight and bias, residual add,
relu | clamp | silu: passes/conv_epilogue.py) is absorbed, and the whole chain
becomes one `conv_nchwc` node named `<last>_nchwc`: out = act(W * x + bias [+ residual]).
Weights are stored packed, in float32 computed from float64:
    dense      [OC/B, IC/B, KH, KW, B, B]   (in-channel, then out-channel innermost)
               [OC/B, 1, KH, KW, IC, B]     when IC < B and the input is a plain NCHW tensor
                                            (a stem convolution reads it unconverted)
    depthwise  [C/B, KH, KW, B]
    bias       [OC/B * B]

A zero pad (amounts >= 0, spatial dims only) that a supported convolution reads is read
through (passes/fold_pad.py's edge_pad): the `conv_nchwc` node takes the pad's input, the
top / left amounts added to its padding, and keeps the output size of the padded input, so
the kernel reads zeros past the bottom / right edge. This is how the asymmetric pads of
TensorFlow's "same" padding at stride 2 (0 before, 1 after) go (the symmetric ones are the
conv's padding already, the fold_pads stage); a pad read by other nodes too stays for them.

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

from dataclasses import replace

import sympy
import torch

from kiln.ir import dtypes
from kiln.ir.graph import Graph, Input, Node, TensorType
from kiln.passes.conv_epilogue import Fused, chains, describe, folded_fqns, scale_shift, users_of
from kiln.passes.dce import dce
from kiln.passes.fold_pad import edge_pad


def _static(shape) -> bool:
    return all(sympy.sympify(d).is_Integer for d in shape)


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


def _padded(c: int, block: int) -> int:
    return -(-c // block) * block


def pack(f: Fused, w: torch.Tensor, bias, bn_tensors, block: int, unblocked_input: bool,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, packed bias) of fused convolution `f` (see the module docstring)."""
    w = w.detach().to("cpu", torch.float64)  # (as scale_shift's: a GPU export's weights)
    oc, icg, kh, kw = w.shape
    scale, b = scale_shift(f, bias, bn_tensors, oc)
    if f.bn is not None:  # batch norm folded into the weights
        w = w * scale.reshape(oc, 1, 1, 1)
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


def conv_nchwc(g: Graph, weights: dict[str, torch.Tensor], block: int, threads: int = 0
               ) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Rewrite the supported convolutions of `g` (see the module docstring); `block`: floats
    per channel block (16 with AVX-512, 8 otherwise); `threads`: Options.num_threads."""
    types = dict(g.types())
    weights_in = {i.name: i for i in g.inputs if i.kind == "weight" and i.name in weights}
    by_name = {n.name: n for n in g.nodes}
    users = users_of(g)
    fused = chains(g, types, users, weights_in, by_name, supported)  # last node -> chain
    if not fused:
        return g, weights
    # zero pads the convolutions read through (passes/fold_pad.py's edge_pad: the asymmetric
    # ones that TensorFlow's "same" padding writes before a strided convolution): pad -> (its
    # input, top / left amounts); the bottom / right ones are the kernel's reads past the edge
    through = {n.name: (n.inputs[0], extra) for n in g.nodes
               if n.op == "pad" and len(n.inputs) == 1 and n.type.rank == 4
               and n.type.dtype == dtypes.float32 and types[n.inputs[0]].rank == 4
               and (extra := edge_pad(n, 4)) is not None}
    chain_of = {a: f for f in fused.values() for a in f.absorbed}
    absorbed = set(chain_of)
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
        x, extra = through.get(conv.inputs[0], (conv.inputs[0], (0, 0)))
        ic = int(types[x].shape[1])
        unblocked = x not in blocked and conv.attr("groups") == 1 and ic < block
        xin = x if unblocked else to_blocked(x)
        res = to_blocked(f.residual) if f.residual else None
        bn_t = [weights[i] for i in f.bn.inputs[1:]] if f.bn is not None else None
        wp, bp = pack(f, weights[conv.inputs[1]], weights[f.bias] if f.bias else None, bn_t,
                      block, unblocked)
        name = f"{f.last}_nchwc"
        fqns = folded_fqns(f, weights_in)
        win = Input(f"{name}_w", TensorType(dtypes.float32, tuple(map(sympy.Integer, wp.shape))),
                    "weight", f"<folded {fqns}: packed for the NCHWc convolution {name}>")
        bin_ = Input(f"{name}_b", TensorType(dtypes.float32, (sympy.Integer(bp.numel()),)),
                     "weight", f"<folded {fqns}: bias of the NCHWc convolution {name}>")
        new_inputs += [win, bin_]
        new_weights[win.name], new_weights[bin_.name] = wp, bp
        out_t = f.conv.type
        nb, oc, oh, ow = out_t.shape
        ocb = _padded(int(oc), block) // block
        padding = tuple(p + e for p, e in zip(conv.attr("padding"), extra))
        attrs = (("stride", tuple(conv.attr("stride"))), ("padding", padding),
                 ("dilation", tuple(conv.attr("dilation"))),
                 ("depthwise", conv.attr("groups") != 1), ("act", f.act), ("lo", f.lo),
                 ("hi", f.hi), ("channels", int(oc)), ("block", block), ("threads", threads),
                 ("fused", f.absorbed), ("epilogue", describe(f)))
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
