"""CPU 1-D convolution as one GEMM over a channels-last copy of its input, with no im2col
buffer (Options.cpu_conv == "direct", fold_constants).

A 1-D convolution out[n, o, t] = sum over (k, c) of W[o, c, k] * x[n, c, t * s + k - p] reads,
for each output position t, the K input rows t * s - p .. t * s - p + K - 1 of x laid out
channels-last ([N, T, C]); in that layout those K rows are K * C consecutive floats. So with
xp = x channels-last, zero-padded by p rows before (and as many after as the last window
needs), the im2col matrix is a view of xp: cols[n, t, k * C + c] = xp[n, t * s + k, c], rows
s * C floats apart and K * C long (rows overlap where K > s). The convolution is then
    out[n, :, :] = (cols[n] @ Wt).T     Wt[k * C + c, o] = W[o, c, k]
one GEMM of M = T_out, N = OC, K = K * C per batch element, reading cols in place: the
matmul node carries `rows_overlap` so lowering takes the overlapping view as its A operand
(lowering/extern.py) and the GEMM runs on kiln's own kernel, which reads A with any row
stride (gemm/select.py keeps such GEMMs off BLAS and oneDNN, whose operands may not
overlap). Wt is a constant (packed at compile time into the GEMM's panels, pack_weights).
The one copy left is the channels-last pad (C * (T + pads) floats, 1 / K of im2col's), and a
pointwise producer (a previous convolution's GELU) fuses into it.

Rewritten: `conv` nodes with a rank-3 float32 / float64 input, a constant weight, groups 1,
dilation 1, not transposed, static sizes, a result that is not empty. The result keeps the
conv's name and type ([N, OC, T_out], a permute of the GEMM's [N, T_out, OC]), so its readers
are unchanged; a reader that permutes it back to channels-last (Whisper's encoder) reads the
GEMM's result in place. Wt's FQN is `<folded ...>` (update_weights refuses it, as the direct
2-D convolution's packed weights). A pure pass: returns a new graph and weight table."""

from __future__ import annotations

from dataclasses import replace

import sympy
import torch

from kiln.ir import dtypes
from kiln.ir.graph import Graph, Input, Node, TensorType
from kiln.passes.conv_epilogue import per_channel, users_of
from kiln.passes.dce import dce

DTYPES = (dtypes.float32, dtypes.float64)
#: pointwise ops of one operand that may run before the permute back to [N, OC, T]
UNARY = ("gelu", "relu", "silu", "sigmoid", "tanh", "hardswish", "leaky_relu")


def supported(n: Node, types, weights: dict) -> bool:
    """Whether conv node `n` is a 1-D convolution this pass rewrites."""
    if n.op != "conv" or len(n.inputs) != 2 or n.attr("transposed"):
        return False
    x, w = (types[i] for i in n.inputs)
    if x.rank != 3 or w.rank != 3 or n.inputs[1] not in weights:
        return False
    if any(t.dtype not in DTYPES or t.dtype != n.type.dtype for t in (x, w)):
        return False
    if n.attr("groups") != 1 or tuple(n.attr("dilation")) != (1,):
        return False
    if not all(sympy.sympify(d).is_Integer for t in (x, w, n.type) for d in t.shape):
        return False
    return all(int(d) > 0 for d in n.type.shape)  # (an empty result stays im2col's)


def conv1d_gemm(g: Graph, weights: dict[str, torch.Tensor]
                ) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Rewrite the supported 1-D convolutions of `g` (see the module docstring)."""
    types = dict(g.types())
    weights_in = {i.name: i for i in g.inputs if i.kind == "weight" and i.name in weights}
    targets = [n for n in g.nodes if supported(n, types, weights_in)]
    if not targets:
        return g, weights
    users = users_of(g)
    by_name = {n.name: n for n in g.nodes}
    taken: set[str] = set()
    tails = {}  # conv name -> the nodes after it computed channels-last
    for n in targets:
        tails[n.name] = _tail(n, g, users, types, weights_in, by_name, taken)
        taken |= {n.name, *(t.name for t in tails[n.name])}
    new_inputs, new_weights, nodes = list(g.inputs), dict(weights), []
    for node in g.nodes:
        if node.name in taken and node.name not in tails:
            continue
        if node.name not in tails:
            nodes.append(node)
            continue
        wt = _packed_weight(weights[node.inputs[1]])
        fqn = weights_in[node.inputs[1]].fqn or node.inputs[1]
        win = Input(f"{node.name}_wt", TensorType(node.type.dtype, tuple(map(
            sympy.Integer, wt.shape))), "weight",
            f"<folded {fqn}: [K * C, OC] weight of the 1-D convolution {node.name}>")
        new_inputs.append(win)
        new_weights[win.name] = wt
        nodes += _gemm_nodes(node, types[node.inputs[0]], win, tails[node.name])
    out = replace(g, inputs=tuple(new_inputs), nodes=tuple(nodes))
    out = dce(out)
    live = {i.name for i in out.inputs}
    return out, {k: v for k, v in new_weights.items() if k in live}


def _packed_weight(w: torch.Tensor) -> torch.Tensor:
    """Wt[k * C + c, o] = W[o, c, k]."""
    oc, c, k = w.shape
    return w.detach().to("cpu").permute(2, 1, 0).reshape(k * c, oc).contiguous()


def _tail(conv: Node, g: Graph, users, types, weights_in, by_name, taken) -> list[Node]:
    """The single-reader chain after `conv` that is computed on the GEMM's channels-last
    result (a GEMM epilogue, gemm/fuse_cpu.py) instead of after the permute: the bias
    (`add(conv, view(bias [OC]))`), then unary pointwise ops (GELU, ...)."""
    out, last = [], conv
    oc = int(conv.type.shape[1])

    def sole_user(name):
        us = users.get(name, [])
        ok = len(us) == 1 and name not in g.outputs and us[0].name not in taken
        return us[0] if ok and us[0].type == conv.type and us[0].inputs[0] == name else None

    nxt = sole_user(last.name)
    if nxt is not None and nxt.op == "add" and len(nxt.inputs) == 2:
        v = by_name.get(nxt.inputs[1])
        if v is not None and v.op == "view" and v.inputs[0] in weights_in and \
                per_channel(types[v.name].shape, 3, oc) and \
                tuple(int(d) for d in types[v.inputs[0]].shape) == (oc,) and \
                types[v.inputs[0]].dtype == conv.type.dtype:
            out.append(replace(nxt, inputs=(nxt.inputs[0], v.inputs[0])))
            last, nxt = nxt, sole_user(nxt.name)
    while nxt is not None and nxt.op in UNARY and len(nxt.inputs) == 1:
        out.append(nxt)
        last, nxt = nxt, sole_user(nxt.name)
    return out


def _gemm_nodes(conv: Node, xt: TensorType, win: Input, tail: list[Node]) -> list[Node]:
    """permute -> pad -> as_strided -> matmul [-> tail] -> permute, the last under the name
    of the conv (or of the tail's last node)."""
    dt, src, name = conv.type.dtype, conv.source, conv.name
    n, c, t = (int(d) for d in xt.shape)
    oc, to = int(conv.type.shape[1]), int(conv.type.shape[2])
    k = int(win.type.shape[0]) // c
    (s,), (p,) = conv.attr("stride"), conv.attr("padding")
    after = max(0, (to - 1) * s + k - t - p)  # rows past the end the last window reads
    tp = t + p + after
    i = sympy.Integer
    nodes = [Node(f"{name}_cl", "permute", (conv.inputs[0],), TensorType(dt, (i(n), i(t), i(c))),
                  (("dims", (0, 2, 1)),), src)]
    if p or after:
        nodes.append(Node(f"{name}_pad", "pad", (nodes[-1].name,), TensorType(
            dt, (i(n), i(tp), i(c))), (("pad", (0, 0, p, after)), ("value", 0)), src))
    base = nodes[-1].name
    # the im2col matrix as a view: row t at t * s * C, K * C long (rows overlap where K > s)
    cols_shape, cols_strides = (i(to), i(k * c)), (i(s * c), i(1))
    if n > 1:
        cols_shape, cols_strides = (i(n), *cols_shape), (i(tp * c), *cols_strides)
    nodes.append(Node(f"{name}_cols", "as_strided", (base,), TensorType(dt, cols_shape), (
        ("stride", cols_strides), ("offset", i(0)),
        ("src_strides", (i(tp * c), i(c), i(1)))), src))
    wname = win.name
    if n > 1:  # the batch shares the weight (a stride-0 batch dim)
        nodes.append(Node(f"{name}_wt_batch", "expand", (wname,), TensorType(
            dt, (i(n), *win.type.shape)), (), src))
        wname = nodes[-1].name
    mm_shape = (*cols_shape[:-1], i(oc))
    nodes.append(Node(f"{name}_gemm", "matmul", (f"{name}_cols", wname),
                      TensorType(dt, mm_shape), (("rows_overlap", True),), src))
    for t in tail:  # each reads the previous one's channels-last value
        nodes.append(replace(t, name=f"{t.name}_cl", inputs=(nodes[-1].name, *t.inputs[1:]),
                             type=TensorType(dt, mm_shape)))
    if n == 1:
        nodes.append(Node(f"{nodes[-1].name}_3d", "view", (nodes[-1].name,),
                          TensorType(dt, (i(1), i(to), i(oc))), (), src))
    last = tail[-1] if tail else conv
    nodes.append(Node(last.name, "permute", (nodes[-1].name,), conv.type,
                      (("dims", (0, 2, 1)),), last.source))
    return nodes
