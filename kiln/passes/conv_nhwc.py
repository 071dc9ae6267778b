"""CUDA convolution in channels-last (Options.cuda_conv == "implicit"): 2-D convolutions become
`conv_nhwc` nodes that read and write NHWC ([N, H, W, C], channels contiguous), with the ops
that follow a convolution folded into its store (its epilogue), as the CPU direct convolution
(passes/conv_nchwc.py) does: the chain matcher is passes/conv_epilogue.py's.

For each supported `conv` (2-D, not transposed, float32 / float16 / bfloat16, a constant
weight, static channel and kernel sizes; batch and spatial sizes may be dynamic) its epilogue
chain (bias add, eval batch_norm as a per-channel scale and shift, a residual add of its dtype,
relu | clamp | silu) becomes one `conv_nhwc` node named `<last>_nhwc`:
out = act((W * x) * scale + shift [+ residual]).
Weights are stored in the convolution's dtype, as the model has them, repacked:
    dense / grouped   [G, KH * KW * Cg, OCg]  the implicit GEMM's B per group: K ordered
                                              (kh, kw, c) so a K step reads contiguous
                                              channels of one input pixel; OC contiguous
    depthwise         [KH, KW, C]             (groups == C == OC)
    scale, shift      [2 * OC] float32        (batch norm's gamma / sqrt(var + eps), and
                                              (bias - mean) * scale + beta; 1 and the bias
                                              without one), computed in float64
Depthwise: groups == in channels == out channels. The kernels are the CUDA target's
(targets/cuda/conv_template.py); with Options.max_autotune, 1x1 stride-1 unpadded dense
convolutions lower to a plain GEMM on the NHWC matrix [N*H*W, C] (lowering/conv_nhwc.py),
timed like every GEMM.

Split-K (`split_k`, node attribute "split"): a dense convolution whose output tiles cannot fill
the GPU at the example sizes but whose K loop is long (ResNet's last stages at batch 1) has S
programs per output tile, each over 1/S of the K loop, writing float32 partial sums; the
epilogue's pointwise kernel then adds the S partials of its element and applies the epilogue
(lowering/conv_nhwc.py).

Layout regions: a value is converted only where the layout changes. A convolution reads its
input and residual in NHWC: the `<v>_nhwc` output of the convolution (or max pooling) that
made `v`, or else a `to_nhwc` node named `<v>_nhwc` (a materialised transpose, once per
value); a dense convolution with a channel count per group off the 16 grid (an RGB stem,
whose K loop gathers element by element) reads an NCHW value through a `permute` view
instead, with no copy. Where a result is also read by anything else (or is a graph output),
a `from_nhwc` node under the original name gives the NCHW value back (an index map that
fuses into its readers), so every other node keeps its operands. A 2-D max pooling (values
only) of a value already in NHWC stays in the layout (`max_pool_nhwc`): the ResNet stem's
conv -> relu -> max pool -> block chain never leaves NHWC.

Folded weights have FQN `<folded ...>`, so update_weights(state_dict) refuses them; with
fold_constants=False the pass is off (im2col + GEMM). A pure pass: a new graph and weights."""

from __future__ import annotations

from dataclasses import replace

import sympy
import torch

from kiln.ir import dtypes
from kiln.ir.graph import Graph, Input, Node, TensorType
from kiln.ir.sym import evaluate
from kiln.passes.conv_epilogue import Fused, chains, describe, folded_fqns, scale_shift, users_of
from kiln.passes.dce import dce

DTYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)


def _static(*dims) -> bool:
    return all(sympy.sympify(d).is_Integer for d in dims)


def supported(n: Node, types, weights_in) -> bool:
    """Whether the NHWC convolution computes conv node `n`."""
    if n.op != "conv" or len(n.inputs) != 2 or n.attr("transposed"):
        return False
    x, w = (types[i] for i in n.inputs)
    if x.rank != 4 or w.rank != 4 or n.inputs[1] not in weights_in:
        return False
    if n.type.dtype not in DTYPES or any(t.dtype != n.type.dtype for t in (x, w)):
        return False
    if not _static(x.shape[1], *w.shape, n.type.shape[1]):
        return False
    g = n.attr("groups")
    c, oc = int(x.shape[1]), int(n.type.shape[1])
    return c % g == 0 and oc % g == 0 and int(w.shape[1]) == c // g


def depthwise(conv: Node, types) -> bool:
    g = conv.attr("groups")
    return g > 1 and g == int(types[conv.inputs[0]].shape[1]) == int(conv.type.shape[1])


def pack(f: Fused, w: torch.Tensor, bias, bn_tensors, dw: bool, dtype
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight in `dtype`, float32 [scale; shift]) of fused convolution `f` (module
    docstring). Batch norm stays out of the weights: rounding the folded weights to 16 bits
    would add an error eager does not make; its scale multiplies the float32 accumulator."""
    # (a program exported on the GPU holds GPU weights.) The weight is only permuted and
    # rounded once, to `dtype`: in its own type (exact), not through float64 (4 x the bytes
    # moved by the permuting copy: 0.6 s of ResNet-18's compile)
    w = w.detach().to("cpu")
    oc, cg, kh, kw = w.shape
    scale, b = scale_shift(f, bias, bn_tensors, oc)
    if dw:  # [C, 1, KH, KW] -> [KH, KW, C]
        wp = w[:, 0].permute(1, 2, 0)
    else:  # [G * OCg, Cg, KH, KW] -> [G, KH, KW, Cg, OCg] -> [G, KH * KW * Cg, OCg]
        g = f.conv.attr("groups")
        wp = w.reshape(g, oc // g, cg, kh, kw).permute(0, 3, 4, 2, 1).reshape(
            g, kh * kw * cg, oc // g)
    return wp.to(dtype.torch).contiguous(), torch.cat([scale, b]).to(torch.float32)


SMS = 132  # H100 SXM: programs that fill the GPU once


def split_k(conv: Node, types, env: dict[str, int], dw: bool) -> int:
    """How many programs share one output tile's K loop (split-K: partial sums in float32,
    added by a reduction that also applies the epilogue): more than one only for a dense
    convolution whose output tiles (64 x 64 at the example sizes) would leave half the SMs
    idle while its K loop is long (at least 16 steps of 64 channels, 32 for float32: the deep
    3x3 layers of a ResNet at batch 1), at most 8 and at least 8 K steps each."""
    if dw:
        return 1
    x, w = types[conv.inputs[0]], types[conv.inputs[1]]
    g = conv.attr("groups")
    cg, kh, kw = int(w.shape[1]), int(w.shape[2]), int(w.shape[3])
    ocg = int(conv.type.shape[1]) // g
    if cg % 16:
        return 1
    try:
        m = int(evaluate(conv.type.shape[0] * conv.type.shape[2] * conv.type.shape[3], env))
    except Exception:  # noqa: BLE001 - no example size: no split
        return 1
    bk = 32 if x.dtype.itemsize == 4 else 64
    steps = kh * kw * -(-cg // bk)
    tiles = -(-m // 64) * -(-ocg // 64) * g
    if tiles >= SMS // 2 or steps < 16:
        return 1
    return max(1, min(steps // 8, -(-SMS // tiles), 8))


def _nhwc_type(t: TensorType) -> TensorType:
    n, c, h, w = t.shape
    return TensorType(t.dtype, (n, h, w, c))


def conv_nhwc(g: Graph, weights: dict[str, torch.Tensor], gemm_1x1: bool = False
              ) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Rewrite the supported convolutions of `g` (see the module docstring). `gemm_1x1`:
    1x1 stride-1 unpadded dense convolutions lower to plain GEMMs (node attribute "gemm"),
    which the GEMM autotuner gives a backend (Options.max_autotune: cuBLAS, the Triton
    template or CUTLASS, the latter two with the epilogue fused); otherwise they run as the
    NHWC kernel like the others (the epilogue always fused: the GEMM heuristic's cuBLAS would
    leave it a kernel of its own)."""
    types = dict(g.types())
    env = {s.name: s.example for s in g.symbols}
    weights_in = {i.name: i for i in g.inputs if i.kind == "weight" and i.name in weights}
    by_name = {n.name: n for n in g.nodes}
    users = users_of(g)
    fused = chains(g, types, users, weights_in, by_name, supported)  # last node -> chain
    if not fused:
        return g, weights
    chain_of = {a: f for f in fused.values() for a in f.absorbed}
    absorbed = set(chain_of)
    outputs = set(g.outputs)

    def needs_nchw(v: str) -> bool:
        """Whether something other than a fused convolution reading `v` as its input or
        residual, or a max pooling kept in NHWC, reads value `v` (or it is an output)."""
        if v in outputs:
            return True
        for u in users.get(v, []):
            f = chain_of.get(u.name)
            if f is not None and v in (f.conv.inputs[0], f.residual):
                continue
            if _nhwc_pool(u, {v}):
                continue
            return True
        return False

    new_inputs = list(g.inputs)
    new_weights = dict(weights)
    nodes: list[Node] = []
    nhwc: dict[str, str] = {}  # value -> its NHWC node

    def to_nhwc(v: str) -> str:
        if v not in nhwc:
            name = f"{v}_nhwc"
            nodes.append(Node(name, "to_nhwc", (v,), _nhwc_type(types[v]), (),
                              by_name[v].source if v in by_name else v))
            nhwc[v] = name
            types[name] = nodes[-1].type
        return nhwc[v]

    views: dict[str, str] = {}  # value -> an NHWC view of it (a permute, no copy)

    def nhwc_view(v: str) -> str:
        if v in nhwc:
            return nhwc[v]
        if v not in views:
            name = f"{v}_nhwc_view"
            nodes.append(Node(name, "permute", (v,), _nhwc_type(types[v]),
                              (("dims", (0, 2, 3, 1)),), by_name[v].source if v in by_name
                              else v))
            views[v] = name
            types[name] = nodes[-1].type
        return views[v]

    def back(name: str, node: Node, t: TensorType) -> None:
        if needs_nchw(node.name):
            nodes.append(Node(node.name, "from_nhwc", (name,), t, (), node.source))

    for node in g.nodes:
        if node.name in absorbed and node.name not in fused:
            continue
        if _nhwc_pool(node, nhwc):  # max pooling inside a region stays in NHWC
            name = f"{node.name}_nhwc"
            nodes.append(Node(name, "max_pool_nhwc", (nhwc[node.inputs[0]],),
                              _nhwc_type(node.type), node.attrs, node.source))
            types[name] = nodes[-1].type
            nhwc[node.name] = name
            back(name, node, node.type)
            continue
        if node.name not in fused:
            nodes.append(node)
            continue
        f = fused[node.name]
        conv = f.conv
        dt = conv.type.dtype
        # a few input channels (an RGB stem: the K loop gathers element by element anyway)
        # are read through an NHWC view of the NCHW value, with no transposed copy
        few = int(types[conv.inputs[0]].shape[1]) // conv.attr("groups") % 16 != 0 and \
            not depthwise(conv, types)
        xin = nhwc_view(conv.inputs[0]) if few else to_nhwc(conv.inputs[0])
        res = to_nhwc(f.residual) if f.residual else None
        dw = depthwise(conv, types)
        bn_t = [weights[i] for i in f.bn.inputs[1:]] if f.bn is not None else None
        wp, bp = pack(f, weights[conv.inputs[1]], weights[f.bias] if f.bias else None, bn_t,
                      dw, dt)
        name = f"{f.last}_nhwc"
        fqns = folded_fqns(f, weights_in)
        win = Input(f"{name}_w", TensorType(dt, tuple(map(sympy.Integer, wp.shape))),
                    "weight", f"<folded {fqns}: packed for the NHWC convolution {name}>")
        bin_ = Input(f"{name}_b", TensorType(dtypes.float32, (sympy.Integer(bp.numel()),)),
                     "weight", f"<folded {fqns}: scale and shift of the NHWC convolution {name}>")
        new_inputs += [win, bin_]
        new_weights[win.name], new_weights[bin_.name] = wp, bp
        kh, kw = (int(k) for k in types[conv.inputs[1]].shape[2:])
        gemm = gemm_1x1 and not dw and (kh, kw) == (1, 1) and conv.attr("groups") == 1 \
            and set(conv.attr("stride")) == {1} and not any(conv.attr("padding"))
        attrs = (("stride", tuple(conv.attr("stride"))), ("padding", tuple(conv.attr("padding"))),
                 ("dilation", tuple(conv.attr("dilation"))), ("groups", conv.attr("groups")),
                 ("kernel", (kh, kw)), ("depthwise", dw), ("act", f.act), ("lo", f.lo),
                 ("hi", f.hi), ("fused", f.absorbed), ("epilogue", describe(f)),
                 ("gemm", gemm), ("split", 1 if gemm else split_k(conv, types, env, dw)))
        ins = (xin, win.name, bin_.name) + ((res,) if res else ())
        nodes.append(Node(name, "conv_nhwc", ins, _nhwc_type(conv.type), attrs, conv.source))
        types[name] = nodes[-1].type
        nhwc[f.last] = name
        back(name, node, conv.type)
    out = replace(g, inputs=tuple(new_inputs), nodes=tuple(nodes))
    out = dce(out)
    names = {i.name for i in out.inputs}
    return out, {k: v for k, v in new_weights.items() if k in names}


def _nhwc_pool(n: Node, nhwc) -> bool:
    """A 2-D max pooling (values) of a value already in NHWC."""
    return n.op == "max_pool" and n.attr("want") == "values" and len(n.attr("kernel")) == 2 \
        and n.inputs[0] in nhwc and n.type.rank == 4
