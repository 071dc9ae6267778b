"""Grouped-query attention read in place: the fused `attention` op (CUDA builds) whose keys and
values are `repeat_kv` copies of fewer heads reads the kv heads themselves.

Hugging Face's attention (and most GQA code) repeats each of the Hkv key / value heads G times
before scaled_dot_product_attention when a mask is given:

    x5 = view(x)         [B, Hkv, 1, S, E]     (unsqueeze)
    xe = expand(x5)      [B, Hkv, G, S, E]
    xr = view(xe)        [B, Hkv * G, S, E]    (reshape: not a strided view of x)

so the attention's operand could only be read after a copy G times the size of the (KV cache)
tensor, every step. Query head h reads kv head h // G: this pass rewrites
`attention(q, xr_k, xr_v, mask?)` to `attention(q, x_k, x_v, mask?; group=G)` when both keys
and values are such repeats with the same G; the fused kernel (targets/cuda/attention.py) reads
kv head h // G, and the interpreter's twin (ir/interp.py) repeats the heads. The views stay for
other readers; DCE drops them when the attention was their only one. A pure pass."""

from __future__ import annotations

from dataclasses import replace

import sympy

from kiln.ir.graph import Graph, Node


def _eq(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(_eq(x, y) for x, y in zip(xs, ys))


def repeated_heads(nodes: dict[str, Node], types, name: str) -> tuple[str, int] | None:
    """(x, G) when value `name` is repeat_kv(x, G) as above (G >= 2), else None."""
    r = nodes.get(name)
    if r is None or r.op != "view" or len(r.type.shape) != 4:
        return None
    e = nodes.get(r.inputs[0])
    if e is None or e.op != "expand" or len(e.type.shape) != 5:
        return None
    u = nodes.get(e.inputs[0])
    if u is None or u.op != "view" or len(u.type.shape) != 5:
        return None
    x = types.get(u.inputs[0])
    if x is None or len(x.shape) != 4:
        return None
    b, hkv, s, d = x.shape
    g = e.type.shape[2]
    if not sympy.sympify(g).is_Integer or int(g) < 2:
        return None
    if not (_same(u.type.shape, (b, hkv, 1, s, d)) and _same(e.type.shape, (b, hkv, g, s, d))
            and _same(r.type.shape, (b, hkv * g, s, d))):
        return None
    return u.inputs[0], int(g)


def fold_repeat_kv(g: Graph) -> Graph:
    nodes = {n.name: n for n in g.nodes}
    types = g.types()
    out, changed = [], False
    for n in g.nodes:
        if n.op == "attention" and n.attr("group", 1) == 1:
            k = repeated_heads(nodes, types, n.inputs[1])
            v = repeated_heads(nodes, types, n.inputs[2])
            if k is not None and v is not None and k[1] == v[1]:
                n = replace(n, inputs=(n.inputs[0], k[0], v[0], *n.inputs[3:]),
                            attrs=(*n.attrs, ("group", k[1])))
                changed = True
        out.append(n)
    return replace(g, nodes=tuple(out)) if changed else g
