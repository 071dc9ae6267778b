"""Inverted residual blocks (MobileNetV2) of the CPU direct convolution as one node: after
passes/conv_nchwc.py, a chain of three `conv_nchwc` nodes

    expand   dense 1x1, stride 1, no padding, no residual, NCHWc input
    -> depthwise (any kernel, stride, padding, dilation; no residual)
    -> project dense 1x1, stride 1, no padding (with or without a residual)

where the expand's and the depthwise's outputs are read by the next node only (not a graph
output, not converted back to NCHW) becomes one `conv_block_nchwc` node under the project's
name, operands (x, expand w, b, depthwise w, b, project w, b[, residual]), attributes the
depthwise's geometry and the three stages' epilogues. A depthwise -> project pair outside
such a chain (MobileNetV2's first block, expand ratio 1: its 112x112 depthwise output is
never stored whole either) becomes a `conv_block_nchwc` of operands (x, depthwise w, b,
project w, b[, residual]), stage 1's epilogue "none" (kiln_conv.h's overloads of 5 and 6
views). kiln_conv.h's conv2d_block_nchwc
computes it in bands of output rows: the expanded tensor (expand ratio x the block's input,
6x in MobileNetV2) is never stored whole, its rows live in a per-thread buffer in L2.

kiln_conv.h splits the bands over threads by rows, or, where the rows do not split evenly
(the 7x7 blocks on 2 threads), by groups of hidden channels (expand and depthwise) and then of
output channels (project), one barrier between: one parallel region instead of three.
A pure pass over the rewritten graph."""

from __future__ import annotations

from dataclasses import replace

from kiln.ir.graph import Graph, Node

def _pointwise_1x1(n: Node, weights_shape) -> bool:
    """A dense 1x1 conv_nchwc with stride 1 and no padding."""
    return (n.op == "conv_nchwc" and not n.attr("depthwise") and tuple(n.attr("stride")) == (1, 1)
            and tuple(n.attr("padding")) == (0, 0) and tuple(weights_shape[2:4]) == (1, 1))


def _stage(n: Node) -> tuple:
    return (n.attr("act"), float(n.attr("lo")), float(n.attr("hi")))


def conv_block(g: Graph, bare: bool = True) -> Graph:
    """Fuse the inverted residual chains of `g` (see the module docstring); `bare`: also the
    depthwise -> project pairs without an expand."""
    types = dict(g.types())
    users: dict[str, list[Node]] = {}
    for n in g.nodes:
        for x in dict.fromkeys(n.inputs):
            users.setdefault(x, []).append(n)
    outputs = set(g.outputs)

    def sole_user(name: str) -> Node | None:
        us = users.get(name, [])
        return us[0] if len(us) == 1 and name not in outputs else None

    fused: dict[str, tuple[Node, Node]] = {}  # project name -> (expand, depthwise)
    gone: set[str] = set()
    for e in g.nodes:
        if e.name in gone or len(e.inputs) != 3 or types[e.inputs[0]].rank != 5 or \
                not _pointwise_1x1(e, types[e.inputs[1]].shape):
            continue
        d = sole_user(e.name)
        if d is None or d.op != "conv_nchwc" or not d.attr("depthwise") or len(d.inputs) != 3 \
                or d.inputs[0] != e.name:
            continue
        p = sole_user(d.name)
        # (the depthwise may end the chain: its sole user a from_nchwc with one input)
        if p is None or p.op != "conv_nchwc" or len(p.inputs) < 3 or p.inputs[0] != d.name \
                or not _pointwise_1x1(p, types[p.inputs[1]].shape):
            continue
        if p.name in gone or (len(p.inputs) > 3 and p.inputs[3] in (e.name, d.name)):
            continue
        fused[p.name] = (e, d)
        gone.update((e.name, d.name))
    # blocks without an expand (MobileNetV2's first, expand ratio 1): depthwise -> project
    no_expand: dict[str, Node] = {}  # project name -> depthwise
    for d in g.nodes if bare else ():
        if d.name in gone or d.op != "conv_nchwc" or not d.attr("depthwise") or \
                len(d.inputs) != 3 or types[d.inputs[0]].rank != 5:
            continue
        p = sole_user(d.name)
        if p is None or p.name in gone or p.name in fused or p.op != "conv_nchwc" or \
                len(p.inputs) < 3 or p.inputs[0] != d.name or \
                not _pointwise_1x1(p, types[p.inputs[1]].shape) or \
                (len(p.inputs) > 3 and p.inputs[3] == d.name):
            continue
        no_expand[p.name] = d
        gone.add(d.name)
    if not fused and not no_expand:
        return g
    nodes = []
    for n in g.nodes:
        if n.name in gone:
            continue
        if n.name not in fused and n.name not in no_expand:
            nodes.append(n)
            continue
        e, d = fused[n.name] if n.name in fused else (None, no_expand[n.name])
        (a1, l1, h1) = _stage(e) if e is not None else ("none", 0.0, 0.0)
        (a2, l2, h2), (a3, l3, h3) = _stage(d), _stage(n)
        attrs = (("stride", tuple(d.attr("stride"))), ("padding", tuple(d.attr("padding"))),
                 ("dilation", tuple(d.attr("dilation"))),
                 ("acts", (a1, a2, a3)), ("los", (l1, l2, l3)), ("his", (h1, h2, h3)),
                 ("channels", n.attr("channels")), ("block", n.attr("block")),
                 ("threads", n.attr("threads")),
                 ("fused", (tuple(e.attr("fused")) if e is not None else ())
                  + tuple(d.attr("fused")) + tuple(n.attr("fused"))),
                 ("epilogue", (f"expand {e.name}: {e.attr('epilogue')}; " if e is not None
                               else "") + f"depthwise {d.name}: {d.attr('epilogue')}; "
                              f"project: {n.attr('epilogue')}"))
        head = (e.inputs[0], e.inputs[1], e.inputs[2]) if e is not None else (d.inputs[0],)
        ins = head + (d.inputs[1], d.inputs[2], n.inputs[1], n.inputs[2]) + tuple(n.inputs[3:])
        nodes.append(Node(n.name, "conv_block_nchwc", ins, n.type, attrs,
                          (e if e is not None else d).source))
    return replace(g, nodes=tuple(nodes))
