"""Generator families for the ops with weights or index inputs: linear/matmul, conv2d and
pooling, softmax and layer norm, embedding / index_select / gather / advanced indexing,
scaled_dot_product_attention with masks that may leave a query row no key.
Each takes the `_Gen` of `kiln.fuzz.generator` and appends at most a few ops (or nothing when
no value fits). Index inputs are int64 graph inputs with a "high", so fresh inputs stay in
range."""

from __future__ import annotations

from kiln.fuzz.program import V


def _float(g, i: int) -> int:
    return g.as_float(i)


def op_linear(g) -> None:
    i = g.pick(lambda v: len(v.shape) >= 1 and v.shape[-1] != "B" and v.dtype != "bool")
    if i is None:
        return
    i = _float(g, i)
    v, r = g.vals[i], g.r
    k, n = v.shape[-1], r.choice([1, 3, 4, 8, 16])
    if v.dtype == "float64" or r.random() < 0.4:
        w = g.param((n, k) if r.random() < 0.5 else (k, n))
        t = g.spec["params"][w]["shape"][0] == n
        if v.dtype == "float64":
            i = g.emit("cast", [i], {"dtype": "float32"}, V(v.shape, "float32", v.exact))
        g.emit("mm_w", [i], {"w": w, "t": t}, V(v.shape[:-1] + (n,), "float32", False))
        return
    b = g.param((n,)) if r.random() < 0.6 else None
    g.emit("linear", [i], {"w": g.param((n, k)), "b": b},
           V(v.shape[:-1] + (n,), "float32", False))


def op_matmul(g) -> None:
    i = g.pick(lambda v: len(v.shape) >= 2 and v.dtype.startswith("float")
               and v.shape[-1] != "B")
    if i is None:
        return
    v, r = g.vals[i], g.r
    if r.random() < 0.4:
        s = v.shape[:-1] + (v.shape[-2],)
        g.emit("self_mm", [i], {}, V(s, v.dtype, False))
        return
    n = r.choice([1, 2, 5, 8])
    shape = list(v.shape[:-2]) + [v.shape[-1], n]
    if shape and shape[0] == "B" and len(shape) > 2 and r.random() < 0.3:
        shape = shape[1:]  # broadcast batch
    transposed = r.random() < 0.4 and "B" not in shape[-2:]
    if transposed:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    if "B" in shape[1:]:
        return
    j = g.new_input(shape, v.dtype)
    if transposed:
        ts = list(shape)
        ts[-1], ts[-2] = ts[-2], ts[-1]
        j = g.emit("transpose", [j], {"d0": len(ts) - 1, "d1": len(ts) - 2},
                   V(tuple(ts), v.dtype, True))
    g.emit("matmul", [i, j], {}, V(v.shape[:-1] + (n,), v.dtype, False))


def op_conv(g) -> None:
    i = g.pick(lambda v: len(v.shape) in (3, 4) and "B" not in v.shape[len(v.shape) - 3:]
               and v.dtype != "bool")
    if i is None:
        return
    i = _float(g, i)
    v, r = g.vals[i], g.r
    if v.dtype == "float64":
        i = g.emit("cast", [i], {"dtype": "float32"}, V(v.shape, "float32", v.exact))
    if len(v.shape) == 3:
        i = g.emit("unsqueeze", [i], {"dim": 0}, V((1,) + v.shape, "float32", v.exact))
        v = g.vals[i]
    _n, c, h, w = v.shape
    if r.random() < 0.3:
        k, s, pad = r.choice([1, 2]), r.choice([1, 2]), 0
        if h < k or w < k:
            return
        g.emit("pool", [i], {"max": r.random() < 0.5, "k": k, "s": s, "pad": pad},
               V((_n, c, (h - k) // s + 1, (w - k) // s + 1), "float32", False))
        return
    groups = r.choice([d for d in (1, 1, 2, c) if c % d == 0])
    cout = groups * r.choice([1, 2, 3])
    kh, kw = r.choice([1, 2, 3]), r.choice([1, 3])
    stride, dil = r.choice([1, 1, 2]), r.choice([1, 1, 2])
    pad = r.choice([0, 1])
    oh = (h + 2 * pad - dil * (kh - 1) - 1) // stride + 1
    ow = (w + 2 * pad - dil * (kw - 1) - 1) // stride + 1
    if oh < 1 or ow < 1:
        return
    wname = g.param((cout, c // groups, kh, kw))
    b = g.param((cout,)) if r.random() < 0.5 else None
    g.emit("conv2d", [i], {"w": wname, "b": b, "stride": stride, "padding": pad,
                           "dilation": dil, "groups": groups},
           V((_n, cout, oh, ow), "float32", False))


def op_norm(g) -> None:
    i = g.pick(lambda v: len(v.shape) >= 1 and v.dtype.startswith("float"))
    if i is None:
        return
    v, r = g.vals[i], g.r
    if r.random() < 0.5:
        d = r.randrange(len(v.shape))
        g.emit("softmax", [i], {"dim": d, "log": r.random() < 0.3}, V(v.shape, v.dtype, False))
        return
    rank = 1
    while rank < len(v.shape) and v.shape[-rank - 1] != "B" and r.random() < 0.3:
        rank += 1
    if "B" in v.shape[-rank:]:
        return
    shape = list(v.shape[-rank:])
    attrs = {"rank": rank, "w": None, "b": None}
    if v.dtype == "float32" and r.random() < 0.7:
        attrs["w"] = g.param(shape, "ln")
        attrs["b"] = g.param(shape) if r.random() < 0.7 else None
    g.emit("layer_norm", [i], attrs, V(v.shape, v.dtype, False))


def op_index(g) -> None:
    r = g.r
    kind = r.choice(["embedding", "index_select", "gather", "adv_index"])
    if kind == "embedding":
        num, dim = r.choice([3, 10, 17]), r.choice([1, 4, 6])
        ishape = g.rand_shape(r.choice([1, 2]))
        j = g.new_input(ishape, "int64", high=num)
        g.emit("embedding", [j], {"w": g.param((num, dim), "ln")},
               V(ishape + (dim,), "float32", False))
        return
    i = g.pick(lambda v: len(v.shape) >= 1 and any(s != "B" for s in v.shape))
    if i is None:
        return
    v = g.vals[i]
    d = r.choice(g.static_dims(v))
    size = v.shape[d]
    if kind == "index_select":
        k = r.randint(1, 6)
        j = g.new_input((k,), "int64", high=size)
        s = list(v.shape)
        s[d] = k
        g.emit("index_select", [i, j], {"dim": d}, V(tuple(s), v.dtype, v.exact))
    elif kind == "gather":
        s = list(v.shape)
        s[d] = r.randint(1, 5)
        s = [x if x == "B" or dd == d else r.randint(1, x) for dd, x in enumerate(s)]
        if "B" in s[1:]:
            return
        j = g.new_input(s, "int64", high=size)
        g.emit("gather", [i, j], {"dim": d}, V(tuple(s), v.dtype, v.exact))
    else:
        ishape = (r.randint(1, 5),) if r.random() < 0.7 else (2, r.randint(1, 3))
        j = g.new_input(ishape, "int64", high=size)
        s = v.shape[:d] + ishape + v.shape[d + 1:]
        g.emit("adv_index", [i, j], {"dim": d}, V(tuple(s), v.dtype, v.exact))


def op_attention(g) -> None:
    """scaled_dot_product_attention on q (a rank-4 float value, or a new input), new k and v
    inputs and a bool mask input (kept where true) or its float form (0 / -inf, or 0 / the
    dtype's lowest finite value as Hugging Face builds masks), or causal.
    Few keys (S in 1..5) so that random masks often leave a query row no key at all, and with
    `empty_row` the program itself masks every key of query row 0: eager gives zeros there,
    which kiln must match."""
    r = g.r

    def fits(v):
        return len(v.shape) == 4 and v.dtype == "float32" and "B" not in v.shape[1:]

    i = g.pick(fits) if any(fits(v) for v in g.vals) and r.random() < 0.6 else None
    if i is None:
        n, h = ("B" if g.dynamic and r.random() < 0.7 else r.choice([1, 2])), r.choice([1, 2])
        i = g.new_input((n, h, r.choice([1, 3, 4, 7]), r.choice([1, 4, 8])), "float32")
    q = g.vals[i]
    n, h, lq, e = q.shape
    s, ev = r.choice([1, 2, 3, 5]), r.choice([1, 4, 8])
    k = g.new_input((n, h, s, e), "float32")
    v = g.new_input((n, h, s, ev), "float32")
    kind = r.choice(["bool", "bool", "float", "finfo", "none", "causal"])
    args, attrs = [i, k, v], {"mask": "none" if kind == "causal" else kind,
                              "causal": kind == "causal", "empty_row": r.random() < 0.5}
    if kind in ("bool", "float", "finfo"):
        shape = (lq, s) if r.random() < 0.5 else (n, 1, lq, s)
        args.append(g.new_input(shape, "bool"))
    g.emit("attention", args, attrs, V((n, h, lq, ev), "float32", False))


FAMILIES = [(op_linear, 2), (op_matmul, 2), (op_conv, 2), (op_norm, 2), (op_index, 2),
            (op_attention, 1)]
