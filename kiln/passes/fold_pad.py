"""Zero pads folded away on Graph IR (a pure pass): models written for TensorFlow-style "same"
padding (Hugging Face's MobileNetV2, EfficientNet-like stems) pad every convolution's input with
an explicit `F.pad` and convolve with padding 0. Run as written, each pad is a copy of the whole
activation (HF MobileNetV2 on the CPU: 52 pad kernels, a third of its run).

- A pad whose amounts are all zero is the identity: its users read its input instead.
- A pad of +0.0 that is the input of convolutions, symmetric in each spatial dim and zero in the
  batch and channel dims, becomes those convolutions' own padding (added to theirs): the
  convolution reads zeros outside its input either way. Users of the pad that are not
  convolutions keep it.

Asymmetric pads (TensorFlow's "same" at stride 2 pads one more at the bottom / right) stay
pads on Graph IR, whose `conv` has one padding per dim; the CPU direct convolution folds them
(passes/conv_nchwc.py, through `edge_pad` below): its `conv_nchwc` node takes the pad's input,
the top / left amounts as its padding and the output size of the padded input, and
kiln_conv.h's kernels read zeros past the bottom / right edge of the input (their index math
tests every window row and column against the input, not against the padding)."""

from __future__ import annotations

import math
from dataclasses import replace

from kiln.ir.graph import Graph, Node


def _zero_value(v) -> bool:
    """+0 (an exact zero that is not -0.0: a -0.0 pad could change the sign of a zero sum)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return False
    return f == 0.0 and math.copysign(1.0, f) > 0


def _amounts(n: Node) -> tuple[int, ...] | None:
    pad = n.attr("pad")
    if not isinstance(pad, (tuple, list)) or not all(isinstance(p, int) for p in pad):
        return None
    return tuple(pad)


def _conv_padding(n: Node, rank: int) -> tuple[int, ...] | None:
    """The extra padding per spatial dim (first spatial dim first) that pad node `n` of an
    input of `rank` dims can give a convolution of `rank - 2` spatial dims, else None."""
    pad = _amounts(n)
    if pad is None or not _zero_value(n.attr("value", 0)) or any(p < 0 for p in pad):
        return None
    d = rank - 2
    if len(pad) > 2 * d and any(pad[2 * d:]):
        return None  # batch or channels padded
    pairs = [(pad[2 * j], pad[2 * j + 1]) if 2 * j + 1 < len(pad) else (0, 0) for j in range(d)]
    if any(lo != hi for lo, hi in pairs):
        return None
    return tuple(lo for lo, _ in reversed(pairs))  # torch's pad lists the last dim first


def edge_pad(n: Node, rank: int) -> tuple[int, ...] | None:
    """For a pad node `n` of a value of `rank` dims that a convolution of `rank - 2` spatial
    dims can read through as padding (+0, amounts >= 0, batch and channels unpadded, symmetric
    or not): the top / left amounts per spatial dim (first spatial dim first), which with the
    convolution's output size (that of the padded input) say everything; else None."""
    pad = _amounts(n)
    if pad is None or not _zero_value(n.attr("value", 0)) or any(p < 0 for p in pad):
        return None
    d = rank - 2
    if len(pad) > 2 * d and any(pad[2 * d:]):
        return None
    return tuple(pad[2 * j] if 2 * j < len(pad) else 0 for j in reversed(range(d)))


def fold_pads(g: Graph) -> Graph:
    types = g.types()
    kept = set(g.outputs) | {value for _, value in g.mutations}  # names the caller sees
    rename: dict[str, str] = {}
    pads: dict[str, tuple[str, tuple[int, ...]]] = {}  # pad node -> (its input, conv padding)
    nodes = []
    for n in g.nodes:
        n = replace(n, inputs=tuple(rename.get(x, x) for x in n.inputs))
        if n.op == "pad" and len(n.inputs) == 1:
            amounts = _amounts(n)
            if (amounts is not None and not any(amounts) and n.name not in kept
                    and types[n.inputs[0]] == n.type):
                rename[n.name] = n.inputs[0]  # the identity
                nodes.append(n)  # (dead now: dce drops it)
                continue
            extra = _conv_padding(n, len(n.type.shape))
            if extra is not None and any(extra):
                pads[n.name] = (n.inputs[0], extra)
        if (n.op == "conv" and n.inputs and n.inputs[0] in pads
                and not n.attr("transposed", False)):
            src, extra = pads[n.inputs[0]]
            padding = n.attr("padding")
            if isinstance(padding, tuple) and len(padding) == len(extra) and all(
                    isinstance(p, int) for p in padding):
                attrs = tuple((k, tuple(p + e for p, e in zip(padding, extra)))
                              if k == "padding" else (k, v) for k, v in n.attrs)
                n = replace(n, inputs=(src,) + n.inputs[1:], attrs=attrs)
        nodes.append(n)
    return replace(g, nodes=tuple(nodes))
