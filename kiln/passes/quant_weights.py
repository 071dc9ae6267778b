"""CPU builds: GEMMs whose B operand is a constant weight read it from a quantised (or
bf16-packed) copy stored in the package, through kiln_qgemm.h's dequantising kernels.

A `matmul(x, B)` node (2-D, static sizes) whose B is a weight [K, N], or `permute(W, (1, 0))`
of a weight W [N, K] (nn.Linear), becomes

    qgemm(x, q, s[, wsum][, bias])    attrs: mode, k, n, group[, bias]

with q, s (and wsum) new weights in ir/quant.py's panel layout:
  `weight_quant` "int8"  float32 GEMMs: int8 per output channel (symmetric, fp32 scale per
                         column of B); `kernel` "vnni" also quantises each activation row
                         (per row, symmetric int8) and multiplies integers (vpdpbusd where the
                         CPU has AVX-512 VNNI): the node's mode is then "int8_vnni"
  `weight_quant` "int4"  float32 GEMMs: int4 group-wise along K (`group` values a scale),
                         two values a byte; `kernel` "vnni": the activation rows quantised
                         too, integer products per group (mode "int4_vnni")
  `bf16`                 bfloat16 GEMMs (x, B and the result bfloat16), whatever
                         weight_quant says: B repacked, not rounded (vdpbf16ps where the CPU
                         has avx512_bf16); products summed in fp32, the result rounded once

A bias add that is the GEMM's only reader (nn.Linear's `add(mm, bias)`, bias a weight [N])
is folded in: the node takes the add's name and the bias is added to the fp32 sum.

The stored tensors are named `<weight>_q8` / `_q4` / `_bf16` (values), `_s` (scales) and
`_wsum`; their FQN is `<quantised MODE of FQN>`, which update_weights refuses (runtime/
weights.py). A weight with other readers stays stored for them too. A pure pass: returns a
new graph and weight table (dead permutes and weights dropped by passes/dce.py)."""

from __future__ import annotations

from dataclasses import replace

import sympy
import torch

from kiln.ir import dtypes
from kiln.ir import quant as Q
from kiln.ir.graph import Graph, Input, Node, TensorType, fresh_name
from kiln.passes.dce import dce

SUFFIX = {"int8": "q8", "int8_vnni": "q8", "int4": "q4", "int4_vnni": "q4", "bf16": "bf16"}


def _static(*dims) -> bool:
    return all(isinstance(sympy.sympify(d), sympy.Integer) and int(d) > 0 for d in dims)


def quantisable_weights(g: Graph) -> dict[str, Input]:
    """The weights a GEMM may read quantised, by name: the graph's weight inputs, but those
    stored permuted (their tensor is not the value the graph reads)."""
    return {i.name: i for i in g.inputs if i.kind == "weight" and not i.permuted}


def weight_b(n: Node, types, nodes: dict, weights_in: dict) -> tuple[str, bool] | None:
    """(weight name, transposed) when `n` is a 2-D matmul `x @ B` (x 2-D) whose B is a
    weight of `weights_in` (`quantisable_weights`) [K, N] or the (1, 0) permute of one
    [N, K] (nn.Linear); else None. The GEMMs a weight-only quantisation may rewrite, on
    every target (the CPU's here; the CUDA target's targets/cuda/quant.py)."""
    if n.op != "matmul" or len(n.type.shape) != 2 or len(types[n.inputs[0]].shape) != 2:
        return None
    b = n.inputs[1]
    if b in weights_in:
        return (b, False) if len(weights_in[b].type.shape) == 2 else None
    p = nodes.get(b)
    if (p is not None and p.op == "permute" and tuple(p.attr("dims")) == (1, 0)
            and p.inputs[0] in weights_in):
        return p.inputs[0], True
    return None


def quantised_inputs(wname: str, mode: str, suffix: str, parts: dict[str, torch.Tensor],
                     weights_in: dict, names: set[str]) -> list[tuple[Input, torch.Tensor]]:
    """The weight inputs that store weight `wname` quantised as `mode`, one a part of `parts`
    ({"q": values, "s": scales, ...}): named `<weight>_<suffix>` (the values) or
    `<weight>_<part>`, with `_2`, `_3`... where the name is taken (`names` gets the new
    ones); FQN `<quantised MODE of FQN>`, which update_weights refuses."""
    fqn = f"<quantised {mode} of {weights_in[wname].fqn or wname}>"
    out = []
    for part, t in parts.items():
        name = fresh_name(f"{wname}_{suffix if part == 'q' else part}", names)
        dt = dtypes.DTYPES[str(t.dtype).removeprefix("torch.")]
        out.append((Input(name, TensorType(dt, tuple(sympy.Integer(d) for d in t.shape)),
                          "weight", fqn), t))
    return out


def quantize_weights(g: Graph, weights: dict[str, torch.Tensor], weight_quant: str,
                     group: int, kernel: str = "dequant", bf16: bool = True
                     ) -> tuple[Graph, dict[str, torch.Tensor]]:
    if weight_quant == "none" and not bf16:
        return g, weights
    types = g.types()
    nodes = {n.name: n for n in g.nodes}
    weights_in = quantisable_weights(g)
    names = set(types)
    new_weights = dict(weights)
    added: list[Input] = []
    done: dict[tuple[str, bool, str], tuple[str, ...]] = {}  # (weight, transposed, mode) -> ins
    users: dict[str, list[Node]] = {}
    for n in g.nodes:
        for x in n.inputs:
            users.setdefault(x, []).append(n)
    fused: set[str] = set()  # bias adds folded into their qgemm
    out_nodes = []
    for n in g.nodes:
        if n.name in fused:
            continue
        wb = weight_b(n, types, nodes, weights_in)
        mode = _mode(n, types, weight_quant, kernel, bf16) if wb else None
        if mode is None:
            out_nodes.append(n)
            continue
        wname, transposed = wb
        k, nn_ = (int(d) for d in types[n.inputs[0]].shape[-1:] + n.type.shape[-1:])
        key = (wname, transposed, mode)
        if key not in done:
            w = weights[wname].t() if transposed else weights[wname]
            if mode == "bf16":
                parts = Q.pack_bf16(w)
            elif mode in ("int4", "int4_vnni"):
                parts = Q.quantize_int4(w, group)
            else:
                parts = Q.quantize_int8(w)
                if mode == "int8":
                    parts.pop("wsum")
            new = quantised_inputs(wname, mode, SUFFIX[mode], parts, weights_in, names)
            added += [i for i, _ in new]
            new_weights.update((i.name, t) for i, t in new)
            done[key] = tuple(i.name for i, _ in new)
        attrs = (("mode", Q.MODES[mode]), ("k", k), ("n", nn_),
                 ("group", group if mode.startswith("int4") else 0))
        add = _bias_add(n, users, weights_in, g)
        if add is None:
            out_nodes.append(Node(n.name, "qgemm", (n.inputs[0], *done[key]), n.type, attrs,
                                  n.source))
            continue
        fused.add(add.name)
        out_nodes.append(Node(add.name, "qgemm", (n.inputs[0], *done[key], add.inputs[1]),
                              add.type, attrs + (("bias", 1),), add.source or n.source))
    if not done:
        return g, weights
    out = dce(replace(g, inputs=g.inputs + tuple(added), nodes=tuple(out_nodes)))
    live = {i.name for i in out.inputs}
    return out, {k: v for k, v in new_weights.items() if k in live}


def _bias_add(n: Node, users: dict, weights_in: dict, g: Graph) -> Node | None:
    """The `add(n, bias)` that is matmul `n`'s only reader, bias a weight [N] of n's dtype
    (nn.Linear's bias): folded into the qgemm (added to the fp32 sum, so a bf16 result is
    rounded once, as eager's addmm)."""
    us = users.get(n.name, [])
    if len(us) != 1 or n.name in g.outputs:
        return None
    add = us[0]
    if add.op != "add" or len(add.inputs) != 2 or add.inputs[0] != n.name:
        return None
    b = weights_in.get(add.inputs[1])
    if (b is None or b.type.dtype != n.type.dtype or len(b.type.shape) != 1
            or sympy.sympify(b.type.shape[0]) != sympy.sympify(n.type.shape[-1])
            or add.type != n.type):
        return None
    return add


def _mode(n: Node, types, weight_quant: str, kernel: str, bf16: bool) -> str | None:
    """The qgemm mode for 2-D matmul `n` (`weight_b`), or None when it stays a matmul."""
    if not _static(*types[n.inputs[1]].shape):  # K and N static; M may be a size symbol
        return None
    dt, xt, bt = n.type.dtype, types[n.inputs[0]].dtype, types[n.inputs[1]].dtype
    if dt == xt == bt == dtypes.bfloat16 and bf16:
        return "bf16"
    if dt == xt == bt == dtypes.float32 and weight_quant in ("int8", "int4"):
        return f"{weight_quant}_vnni" if kernel == "vnni" else weight_quant
    return None
