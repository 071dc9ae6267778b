"""Converters for ops that lower to kiln runtime routines (`lowering/library.py`): sort,
argsort, topk, kthvalue, median, scans, scatters, index_put, masked_scatter and embedding_bag.
They register into `aten_table.TABLE`. A multi-result op becomes one graph node per result,
each with attribute `part` (which output of the call it reads); lowering emits the call once.

index_add, index_copy and index_fill are not converted here: core ATen decomposes them into
index_put, which is."""

from __future__ import annotations

import math
import operator

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_table import TABLE, register
from kiln.ir import dtypes, sym
from kiln.ir.graph import Node, TensorType

# Graph IR ops these converters emit that lower to kiln_lib.h routines, which are CPU code: a
# target without them (import_program's `library_routines`, off for CUDA) calls ATen for the
# aten op instead (frontend/export.py: convert_node), unless `cpu_only` finds a Triton kernel
CPU_ONLY_OPS = frozenset({"sort", "topk", "scan", "scan_extreme", "scatter", "index_put",
                          "masked_scatter", "embedding_bag"})
# ops with a data-dependent result size that kiln computes itself where the target has its
# library routines (else ATen does, as for every other data-dependent op: frontend/export.py)
DATA_DEPENDENT_NATIVE = frozenset({"aten.nonzero.default", "aten.masked_select.default",
                                   "aten.index.Tensor", "aten._unique2.default",
                                   "aten.unique_consecutive.default", "aten.unique_dim.default"})


# dtypes whose accumulating index_put / scatter (sum, product, mean, amax, amin) CUDA builds
# print as Triton kernels (targets/cuda/put_reduce.py); masked_scatter's too
# (targets/cuda/bag_mask.py)
ACC_PUT_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32",
                            "int16", "int8", "uint8", "bool"})
# embedding_bag weights CUDA builds print a Triton kernel for (targets/cuda/bag_mask.py)
BAG_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16"})


def cpu_only(node, types) -> bool:
    """Whether Graph IR `node` lowers to a routine only the CPU library has. index_put and
    scatter through integer indices are the `put` routine, which CUDA builds print as Triton
    kernels: setting (targets/cuda/put.py: a KV cache updated in place), accumulating and
    reducing (targets/cuda/put_reduce.py, the dtypes of ACC_PUT_DTYPES), complex products
    (targets/cuda/scan.py); so are scans of real values (targets/cuda/scan.py), and
    masked_scatter (x[mask] = v too) and embedding_bag (targets/cuda/bag_mask.py, the dtypes
    of ACC_PUT_DTYPES and BAG_DTYPES); `types`: the builder's value types, by name."""
    if node.op == "masked_scatter" or (node.op == "index_put" and any(
            types[i].dtype.name == "bool" for i in node.inputs[2:])):
        # (x[mask] = v: a pointwise select or a masked_scatter, lowering/library.py)
        return node.type.dtype.name not in ACC_PUT_DTYPES or (
            node.op == "index_put" and not node.attr("counted", False))
    if node.op == "embedding_bag":
        return node.type.dtype.name not in BAG_DTYPES
    if node.op == "index_put":
        return bool(node.attr("accumulate")) and node.type.dtype.name not in ACC_PUT_DTYPES
    if node.op in ("scan", "scan_extreme"):  # real scans: Triton kernels (targets/cuda/scan.py)
        return node.type.dtype.is_complex or types[node.inputs[0]].dtype.is_complex
    if node.op == "scatter":
        if node.type.dtype.is_complex:  # complex scatter products: a Triton kernel too
            return node.attr("mode") != "prod"
        return node.attr("mode") != "set" and node.type.dtype.name not in ACC_PUT_DTYPES
    if node.op in ("sort", "topk"):  # every dtype of SORT_DTYPES: targets/cuda/sort.py
        return node.attr("row_max") is None
    return node.op in CPU_ONLY_OPS


def _arg(n, pos: int, name: str, default=None):
    if len(n.args) > pos:
        return n.args[pos]
    return n.kwargs.get(name, default)


def _dim(b, n, d) -> int:
    return d % max(b.rank(n.args[0]), 1)


def _used(n, k: int) -> bool:
    return any(u.target is operator.getitem and u.args[1] == k and u.users for u in n.users)


# what CUDA's sort kernels take (targets/cuda/sort.py): rows of up to SORT_MAX_ROW elements
# (the bound known at build time) in one tile, longer or unbounded ones through its merge sort
SORT_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                         "bfloat16", "float32", "float64"})
SORT_MAX_ROW = 4096


def _upper(b, e) -> int | None:
    """The largest value of size expression `e` over the export's Dim ranges; None when a
    symbol has no bound or `e` is not built from sums, products with positive constants and
    floor divisions by positive constants (forms that grow with every symbol)."""
    theirs = {ours: t for t, ours in b.syms.rename.items()}

    def up(e):
        if e.is_Integer:
            return int(e)
        if e.is_Symbol:
            vr = getattr(b, "ranges", {}).get(theirs.get(e))
            try:
                return int(vr.upper)
            except (TypeError, ValueError, OverflowError, AttributeError):
                return None
        if e.is_Add:
            parts = [int(a) if a.is_Integer else up(a) for a in e.args]
            return None if None in parts else sum(parts)
        if e.is_Mul:
            coeff, rest = e.as_coeff_Mul()
            parts = [up(a) for a in (rest.args if rest.is_Mul else (rest,))]
            if not coeff.is_Integer or coeff < 0 or None in parts:
                return None
            return int(coeff) * math.prod(parts)
        if isinstance(e, sym.FloorDiv) and e.args[1].is_Integer and e.args[1] > 0:
            top = up(e.args[0])
            return None if top is None else top // int(e.args[1])
        return None
    return up(sympy.sympify(e))


def _row_max(b, n, x, dim: int) -> dict:
    """Attributes of a sort / topk node of FX node `n` where the target has no library
    routines (CUDA): `row_max`, the sorted dim's largest length (0: no bound), and `merge`
    where that is over SORT_MAX_ROW or unbounded (CUDA's merge sort, with scratch buffers:
    lowering/library.py); a dtype its kernels do not sort is an UnsupportedError saying why
    (ATen sorts it where the fallback is on). On the CPU: no attribute."""
    if b.library_routines:
        return {}
    dt = b.types[x].dtype.name
    if dt not in SORT_DTYPES:
        raise UnsupportedError(f"{n.target} (node {n.name}) on CUDA: {dt} values (the sort "
                               f"kernels take {', '.join(sorted(SORT_DTYPES))})")
    shape = b.types[x].shape
    hi = _upper(b, shape[dim]) if shape else 1
    if hi is not None and hi <= SORT_MAX_ROW:
        return {"row_max": max(hi, 1)}
    return {"row_max": hi or 0, "merge": True}


@register("aten.sort.default", "aten.sort.stable")
def _sort(b, n):
    stable = str(n.target).endswith("stable")
    dim = _dim(b, n, n.kwargs.get("dim", n.args[1] if len(n.args) > 1 and not stable else -1))
    desc = bool(n.kwargs.get("descending", n.args[2] if len(n.args) > 2 and not stable
                             else False))
    x = b.tensor(n.args[0])
    stable = stable and bool(n.kwargs.get("stable", False))
    return [b.emit("sort", [x], None, like=n, result=k, part=k, dim=dim, descending=desc,
                   stable=stable, **_row_max(b, n, x, dim)) for k in range(2)]


@register("aten.topk.default")
def _topk(b, n):
    k = int(_arg(n, 1, "k"))
    dim = _dim(b, n, _arg(n, 2, "dim", -1))
    largest = bool(_arg(n, 3, "largest", True))
    is_sorted = bool(_arg(n, 4, "sorted", True))
    x = b.tensor(n.args[0])
    return [b.emit("topk", [x], None, like=n, result=r, part=r, k=k, dim=dim, largest=largest,
                   sorted=is_sorted, **_row_max(b, n, x, dim)) for r in range(2)]


def _order_statistic(b, n, x: str, shape, dim: int, k, keepdim: bool, nan: bool = False):
    """(values, indices) of the k-th smallest (0-based) along `dim`: a sort, then a select.
    `nan` (median of floats): a row with a NaN gives NaN and the index of its first NaN, as
    eager's median (CPU; CUDA's: the index of some NaN): the row's max and argmax (both NaN's
    where there is one, argmax the first) replace the pick where the max is NaN."""
    out = []
    row = _row_max(b, n, x, dim)
    for r in range(2):
        s = b.emit("sort", [x], None, like=n, result=r, shape=shape, part=r, dim=dim,
                   descending=False, stable=True, **row)
        picked = b.emit("select", [s], None, like=n, result=r, dim=dim, index=k,
                        shape=shape[:dim] + shape[dim + 1:])
        if keepdim:
            picked = b.emit("view", [picked], None, like=n, result=r)
        out.append(picked)
    if nan and b.types[x].dtype.is_float:
        mx = b.emit("reduce", [x], None, like=n, result=0, kind="max", dims=(dim,),
                    keepdim=keepdim)
        am = b.emit("reduce", [x], None, like=n, result=1, kind="argmax", dims=(dim,),
                    keepdim=keepdim)
        has = b.emit("isnan", [mx], None, like=n, result=0, dtype=dtypes.bool_)
        out = [b.emit("where", [has, mx, out[0]], None, like=n, result=0),
               b.emit("where", [has, am, out[1]], None, like=n, result=1)]
    return out


@register("aten.kthvalue.default")
def _kthvalue(b, n):
    x = n.args[0]
    dim = _dim(b, n, _arg(n, 2, "dim", -1))
    keep = bool(_arg(n, 3, "keepdim", False))
    shape = tuple(b.shape(x)) or (1,)
    xs = b.tensor(x) if b.rank(x) else b.emit("view", [b.tensor(x)], None, like=n, result=0,
                                              shape=(1,))
    return _order_statistic(b, n, xs, shape, dim, int(_arg(n, 1, "k")) - 1, keep)


def _lower_middle(size):
    """(size - 1) // 2, the lower middle position, as kiln's FloorDiv where size is symbolic
    (sympy's own floor has no Triton or C++ spelling)."""
    size = sympy.sympify(size)
    return (size - 1) // 2 if size.is_Integer else sym.FloorDiv(size - 1, 2)


@register("aten.median.dim")
def _median_dim(b, n):
    x = n.args[0]
    dim = _dim(b, n, _arg(n, 1, "dim"))
    keep = bool(_arg(n, 2, "keepdim", False))
    shape = tuple(b.shape(x)) or (1,)
    xs = b.tensor(x) if b.rank(x) else b.emit("view", [b.tensor(x)], None, like=n, result=0,
                                              shape=(1,))
    return _order_statistic(b, n, xs, shape, dim, _lower_middle(shape[dim]), keep, nan=True)


@register("aten.median.default")
def _median(b, n):
    x = n.args[0]
    numel = 1
    for d in b.shape(x):
        numel = numel * d
    flat = b.emit("view", [b.tensor(x)], None, like=n, shape=(numel,))
    s = b.emit("sort", [flat], None, like=n, shape=(numel,), part=0, dim=0, descending=False,
               stable=True, **_row_max(b, n, flat, 0))
    # (nodes named afresh, not after `n`: a median.dim before it named its results
    # `<its name>_0` / `_1`, which may be this node's name)
    picked = b.emit("select", [s], None, like=n, dim=0, index=_lower_middle(numel))
    if not b.types[flat].dtype.is_float:
        return picked
    mx = b.emit("reduce", [flat], None, like=n, kind="max", dims=(0,), keepdim=False)
    has = b.emit("isnan", [mx], None, like=n, dtype=dtypes.bool_)
    return b.emit("where", [has, mx, picked], None, like=n)  # NaN where there is one


_SCANS = {"cumsum": "sum", "cumprod": "prod", "logcumsumexp": "logsumexp"}


@register(*(f"aten.{name}.default" for name in _SCANS))
def _scan(b, n):
    """Output dtype as torch (the node's): cumsum of an int or bool is int64, or `dtype`."""
    kind = _SCANS[str(n.target).split(".")[1]]
    return b.emit("scan", [b.tensor(n.args[0])], n, kind=kind, dim=_dim(b, n, n.args[1]))


@register("aten.cummax.default", "aten.cummin.default")
def _cum_extreme(b, n):
    kind = "max" if "cummax" in str(n.target) else "min"
    x = b.tensor(n.args[0])
    return [b.emit("scan_extreme", [x], None, like=n, result=r, part=r, kind=kind,
                   dim=_dim(b, n, n.args[1])) for r in range(2)]


_REDUCE = {"add": "sum", "multiply": "prod", "sum": "sum", "prod": "prod", "mean": "mean",
           "amax": "amax", "amin": "amin"}


@register("aten.scatter.src", "aten.scatter.value", "aten.scatter.reduce",
          "aten.scatter.value_reduce", "aten.scatter_add.default", "aten.scatter_reduce.two")
def _scatter(b, n):
    target = str(n.target)
    x, dim, index, src = n.args[:4]
    dt = b.meta_dtype(n)
    if isinstance(src, (bool, int, float)):  # scatter.value: the value at every index
        src = b.emit("expand", [b.scalar(src, dt)], None, like=n, shape=b.shape(index))
    else:
        src = b.tensor(src)
    mode, include_self = "set", True
    if target == "aten.scatter_add.default":
        mode = "sum"
    elif target == "aten.scatter_reduce.two":
        mode = _REDUCE[n.args[4]]
        include_self = bool(_arg(n, 5, "include_self", True))
    elif "reduce" in target:
        reduce = _arg(n, 4, "reduce")
        if reduce not in ("add", "multiply"):
            raise UnsupportedError(f"scatter with reduce={reduce!r} (node {n.name})")
        mode = _REDUCE[reduce]
    return b.emit("scatter", [b.tensor(x), b.tensor(index), src], n, dim=_dim(b, n, dim),
                  mode=mode, include_self=include_self)


@register("aten.index_put.default")
def _index_put(b, n):
    x, indices, values = n.args[:3]
    accumulate = bool(_arg(n, 3, "accumulate", False))
    present = tuple(i for i, t in enumerate(indices) if t is not None)
    if not present:
        raise UnsupportedError(f"index_put without index tensors (node {n.name})")
    if len(present) > 1 and any(_is_mask(indices[i]) for i in present):
        positions, names = _mask_coordinates(b, n, indices)
        return b.emit("index_put", [b.tensor(x), b.tensor(values), *names], n,
                      positions=positions, accumulate=accumulate)
    counted = {}
    if not b.library_routines and any(indices[i].meta["val"].dtype == torch.bool
                                      for i in present):
        counted = {"counted": True}  # (x[mask] = v on CUDA: see `_masked_scatter`)
    return b.emit("index_put", [b.tensor(x), b.tensor(values)] +
                  [b.tensor(indices[i]) for i in present], n, positions=present,
                  accumulate=accumulate, **counted)


def _is_mask(t) -> bool:
    return t is not None and t.meta["val"].dtype in (torch.bool, torch.uint8)


def _mask_coordinates(b, n, indices) -> tuple[tuple[int, ...], list[str]]:
    """x[mask, idx] = v (a bool mask beside index tensors): torch replaces the mask of rank m
    by the m coordinate columns of its true elements (nonzero), which then broadcast with the
    other index tensors. Their count k is data-dependent; when the other indices' broadcast
    ends in a size L > 1, k must be L or 1, checked at run time (a `read_size` of the count,
    whose error names it), and a count of 1 reads coordinate row 0 for every position. Returns
    the x dims indexed and the int64 index tensors, one per dim."""
    masks = [t for t in indices if _is_mask(t)]
    others = [t for t in indices if t is not None and not _is_mask(t)]
    if len(masks) > 1:
        raise UnsupportedError(f"index_put with {len(masks)} boolean masks among its indices "
                               f"(node {n.name}): at most one is supported beside index "
                               "tensors")
    if masks[0].meta["val"].dim() == 0:
        raise UnsupportedError(f"index_put with a 0-d boolean mask beside index tensors (node "
                               f"{n.name})")
    shape = torch.broadcast_shapes(*(tuple(t.meta["val"].shape) for t in others))
    last = shape[-1] if shape else 1
    if not isinstance(last, int):
        raise UnsupportedError(f"index_put with a boolean mask beside index tensors whose "
                               f"broadcast size {last} is known only at run time (node "
                               f"{n.name})")
    i64 = dtypes.int64
    positions, names, d = [], [], 0
    for t in indices:
        if t is None:
            d += 1
            continue
        if not _is_mask(t):
            positions.append(d)
            names.append(b.tensor(t))
            d += 1
            continue
        mask = b.tensor(t)
        if b.types[mask].dtype != dtypes.bool_:  # (a uint8 mask, which torch still takes)
            mask = b.emit("ne", [mask, b.scalar(0, torch.uint8)], None, like=n,
                          shape=b.types[mask].shape, dtype=dtypes.bool_)
        mshape = tuple(b.types[mask].shape)
        numel = sympy.Mul(*mshape)
        rows = b.syms.add_unbacked(sympy.Symbol(b.fresh(f"{n.name}_mask_rows")), numel)
        counted = true_count(b, n, mask)
        coords = nonzero_of_mask(b, n, mask, rows.name, rows=rows, counted=counted)
        pick = None
        if last != 1:  # row j of the coordinates, or row 0 for every j when k is 1
            pick = _broadcast_rows(b, n, counted[1], last)
        for c in range(len(mshape)):
            col = b.emit("select", [coords], None, like=n, shape=(rows,), dtype=i64, dim=1,
                         index=c)
            if pick is not None:
                col = b.emit("index", [col, pick], None, like=n, shape=(last,), dtype=i64,
                             positions=(0,), select=True)
            positions.append(d + c)
            names.append(col)
        d += len(mshape)
    return tuple(positions), names


def _broadcast_rows(b, n, count: str, last: int) -> str:
    """[last] int64: which coordinate row of a mask's true elements (`count` of them) each of
    `last` broadcast positions reads: j when the mask has `last` true elements, 0 when it has
    one; any other count fails at run time, naming the count and the size it had to be."""
    i64 = dtypes.int64
    one = b.emit("eq", [count, b.scalar(1, torch.int64)], None, like=n, shape=(),
                 dtype=dtypes.bool_)
    # the checked value: the count, with a count of 1 (which broadcasts) standing for `last`
    value = b.emit("where", [one, b.scalar(last, torch.int64), count], None, like=n, shape=(),
                   dtype=i64)
    name = b.fresh(f"{n.name}_mask_true_count")
    symbol = b.syms.add_unbacked(sympy.Symbol(name), sympy.Integer(last)).name
    t = TensorType(i64, ())
    b.nodes.append(Node(name, "read_size", (value,), t,
                        (("binds", ((0, symbol, sympy.Integer(last)),)), ("lo", last)), n.name))
    b.types[name] = t
    j = b.emit("iota", [], None, like=n, shape=(last,), dtype=i64, start=0, step=1)
    # min(j, count - 1): j, or 0 for a count of 1; plus (checked - last), which is 0, so that
    # no coordinate is read before the check has passed
    lim = b.emit("sub", [count, b.scalar(1, torch.int64)], None, like=n, shape=(), dtype=i64)
    j = b.emit("minimum", [j, lim], None, like=n, shape=(last,), dtype=i64)
    zero = b.emit("sub", [name, b.scalar(last, torch.int64)], None, like=n, shape=(),
                  dtype=i64)
    return b.emit("add", [j, zero], None, like=n, shape=(last,), dtype=i64)


@register("aten.masked_scatter.default")
def _masked_scatter(b, n):
    """Attribute `counted` (CUDA): lowering also scans the mask, whose inclusive count of true
    elements before each one gives its source element (targets/cuda/bag_mask.py)."""
    counted = {} if b.library_routines else {"counted": True}
    x, mask, source = (b.tensor(a) for a in n.args[:3])
    if counted and b.types[x].dtype.is_complex:
        return _complex_masked_scatter(b, n, x, mask, source)
    return b.emit("masked_scatter", [x, mask, source], n, **counted)


def _complex_masked_scatter(b, n, x: str, mask: str, source: str) -> str:
    """Complex masked_scatter on CUDA: the real masked_scatter of x's parts viewed as
    [..., 2] with the mask (broadcast to x's shape) repeated for both parts, from the
    source's parts viewed so too: the true places come in (real, imaginary) pairs in
    row-major order, as the source's parts do, so each part is copied from its own."""
    t = b.types[x]
    part = dtypes.complex_part(t.dtype)
    shape, two = tuple(t.shape), (sympy.Integer(2),)
    mshape = tuple(b.types[mask].shape)
    if mshape != shape:  # (broadcast to x's shape, as eager's masked_scatter)
        mask = b.emit("view", [mask], None, like=n, shape=(1,) * (len(shape) - len(mshape)) +
                      mshape, dtype=dtypes.bool_)
        mask = b.emit("expand", [mask], None, like=n, shape=shape, dtype=dtypes.bool_)
    mask = b.emit("view", [mask], None, like=n, shape=shape + (1,), dtype=dtypes.bool_)
    mask = b.emit("expand", [mask], None, like=n, shape=shape + two, dtype=dtypes.bool_)
    parts = [b.emit("view_as_real", [v], None, like=n, shape=tuple(b.types[v].shape) + two,
                    dtype=part) for v in (x, source)]
    out = b.emit("masked_scatter", [parts[0], mask, parts[1]], None, like=n,
                 shape=shape + two, dtype=part, counted=True)
    re, im = (b.emit("select", [out], None, like=n, shape=shape, dtype=part, dim=len(shape),
                     index=k) for k in (0, 1))
    return b.emit("complex", [re, im], n)


@register("aten._embedding_bag_forward_only.default", "aten._embedding_bag.default",
          "aten.embedding_bag.padding_idx", "aten.embedding_bag.default")
def _embedding_bag(b, n):
    """Result 0 (the bags) only; offset2bag, bag_size and max_indices are not produced."""
    weight, indices, offsets = n.args[:3]
    # scale_grad_by_freq and sparse only concern the gradient
    mode = {0: "sum", 1: "mean", 2: "max"}[int(_arg(n, 4, "mode", 0))]
    psw = _arg(n, 6, "per_sample_weights")
    include_last = bool(_arg(n, 7, "include_last_offset", False))
    padding_idx = _arg(n, 8, "padding_idx", -1)
    padding_idx = -1 if padding_idx is None else int(padding_idx)
    if padding_idx < -1:
        padding_idx %= b.shape(weight)[0]
    for k in (1, 2, 3):
        if _used(n, k):
            raise UnsupportedError(f"result {k} of {n.target} (node {n.name}): only the bags "
                                   "(result 0) are supported")
    ins = [b.tensor(weight), b.tensor(indices), b.tensor(offsets)]
    if psw is not None:
        ins.append(b.tensor(psw))
    out = b.emit("embedding_bag", ins, None, like=n, result=0, mode=mode,
                 include_last_offset=include_last, padding_idx=padding_idx)
    return [out, None, None, None]


def nonzero_rows(b, n, dim: int = 0, bound=None) -> str:
    """Claims the data-dependent row count of aten.nonzero node `n` (torch's unbacked symbol:
    at most the input's element count) as a kiln size symbol; call before emitting any node
    like `n`. "" when torch gave it the row count of an earlier nonzero (of the same input:
    torch's memo). The CPU runs kiln_lib.h's `nonzero`, CUDA a Triton kernel
    (targets/cuda/scan.py)."""
    size = n.meta["val"].shape[dim]
    s = size.node.expr if isinstance(size, torch.SymInt) else None
    if s is not None and s.is_Symbol and s in b.syms.rename and \
            b.syms.rename[s].name in b.syms.unbacked:
        return ""  # torch's: the row count of an earlier nonzero of the same input
    if s is None or not s.is_Symbol or s in b.syms.rename:
        raise UnsupportedError(f"nonzero (node {n.name}) whose row count is not a new "
                               f"data-dependent size ({size})")
    return b.syms.add_unbacked(s, sympy.Mul(*b.shape(n.args[0])) if bound is None
                               else bound).name


def true_count(b, n, mask: str) -> tuple[str, str]:
    """For node `n`: bool value `mask` as a flat int64 vector, and the count of its true
    elements (a sum of it)."""
    shape = tuple(b.types[mask].shape)
    numel = sympy.Mul(*shape)
    i64 = dtypes.int64
    flat = b.emit("view", [b.emit("cast", [mask], None, like=n, shape=shape, dtype=i64)], None,
                  like=n, shape=(numel,), dtype=i64)
    count = b.emit("reduce", [flat], None, like=n, shape=(), dtype=i64, kind="sum", dims=(0,),
                   keepdim=False)
    return flat, count


def nonzero_of_mask(b, n, mask: str, rows_symbol: str, rows=None, counted=None) -> str:
    """aten.nonzero of node `n` from kiln bool value `mask` (x != 0; complex: either part):
    the count of true elements (`true_count`, or `counted` where the caller has it), bound at
    run time to the result's row count `rows_symbol` (`nonzero_rows`; a `read_size` node, as
    `x.item()` used as a size), then kiln_lib.h's `nonzero` writes the coordinates in row-major
    order."""
    shape = tuple(b.types[mask].shape)
    numel = sympy.Mul(*shape)
    i64 = dtypes.int64
    flat, count = counted or true_count(b, n, mask)
    # CUDA: the inclusive count before each element (a scan, multi-block when long) places
    # every true element at once (targets/cuda/scan.py `print_nonzero_kernel`)
    extra = [] if b.library_routines else [
        b.emit("scan", [flat], None, like=n, shape=(numel,), dtype=i64, kind="sum", dim=0)]
    out = {} if rows is None else {"shape": (rows, len(shape)), "dtype": i64}
    node = n if rows is None else None  # (an intermediate of `n`: [rows, rank of the mask])
    if not rows_symbol:  # a size bound before (`nonzero_rows`): the count is its value
        return b.emit("nonzero", [mask, count, *extra], node, like=n, **out)
    read = b.fresh(f"{n.name}_rows")
    t = TensorType(i64, ())
    binds = ((0, rows_symbol, b.syms.unbacked[rows_symbol]),)
    b.nodes.append(Node(read, "read_size", (count,), t, (("binds", binds), ("lo", 0)), n.name))
    b.types[read] = t
    return b.emit("nonzero", [mask, read, *extra], node, like=n, **out)


@register("aten.nonzero.default")
def _nonzero(b, n):
    rows = nonzero_rows(b, n)
    x = b.tensor(n.args[0])
    t = b.types[x]
    mask = x if t.dtype == dtypes.bool_ else b.emit(
        "ne", [x, b.scalar(0, t.dtype.torch)], None, like=n, shape=t.shape, dtype=dtypes.bool_)
    return nonzero_of_mask(b, n, mask, rows)


def _selected(b, n, x: str, mask: str, p: int, rows_symbol: str) -> str:
    """x[(:,) * p + (mask,)] for node `n` (x's dims p .. p + m - 1 selected by bool `mask`,
    m its rank): nonzero(mask) gives the selected positions in row-major order, as flat
    indices into those dims, which index x viewed with them merged into one dim."""
    mshape = tuple(b.types[mask].shape)
    xshape = tuple(b.types[x].shape)
    m = len(mshape)
    numel = sympy.Mul(*mshape)
    rows = b.shape(n)[p]
    i64 = dtypes.int64
    coords = nonzero_of_mask(b, n, mask, rows_symbol, rows=rows)
    flat, stride = None, sympy.Integer(1)
    for d in reversed(range(m)):  # row-major flat index over the mask's dims
        c = b.emit("select", [coords], None, like=n, shape=(rows,), dtype=i64, dim=1, index=d)
        if stride != 1:
            c = b.emit("mul", [c, b.scalar(int(stride), torch.int64)], None, like=n,
                       shape=(rows,), dtype=i64)
        flat = c if flat is None else b.emit("add", [flat, c], None, like=n, shape=(rows,),
                                             dtype=i64)
        stride = stride * mshape[d]
    if flat is None:  # a 0-d mask: one position, selected or not
        flat = b.emit("expand", [b.scalar(0, torch.int64)], None, like=n, shape=(rows,),
                      dtype=i64)
    merged = xshape[:p] + (numel,) + xshape[p + m:]
    xv = b.emit("view", [x], None, like=n, shape=merged, dtype=b.types[x].dtype)
    return b.emit("index", [xv, flat], n, positions=(p,), select=True)


@register("aten.masked_select.default")
def _masked_select(b, n):
    """masked_select(x, mask): x and mask broadcast to one shape, the selected elements in
    row-major order (kiln's nonzero, then a gather: no ATen)."""
    x, mask = b.tensor(n.args[0]), b.tensor(n.args[1])
    sx, sm = b.shape(n.args[0]), b.shape(n.args[1])
    r = max(len(sx), len(sm))
    sx, sm = (1,) * (r - len(sx)) + tuple(sx), (1,) * (r - len(sm)) + tuple(sm)
    shape = tuple(a if b_ == 1 else b_ for a, b_ in zip(sx, sm))
    rows_symbol = nonzero_rows(b, n, 0, sympy.Mul(*shape))  # (before any node like n)
    for v, s_ in ((0, sx), (1, sm)):
        val = (x, mask)[v]
        if tuple(s_) != tuple(b.types[val].shape):
            val = b.emit("view", [val], None, like=n, shape=s_, dtype=b.types[val].dtype)
        if tuple(s_) != shape:
            val = b.emit("expand", [val], None, like=n, shape=shape, dtype=b.types[val].dtype)
        if v == 0:
            x = val
        else:
            mask = val
    if b.types[mask].dtype != dtypes.bool_:
        raise UnsupportedError(f"masked_select with a {b.types[mask].dtype.name} mask (node "
                               f"{n.name})")
    if not shape:  # 0-d: select from one element
        x = b.emit("view", [x], None, like=n, shape=(1,), dtype=b.types[x].dtype)
        mask = b.emit("view", [mask], None, like=n, shape=(1,), dtype=dtypes.bool_)
    return _selected(b, n, x, mask, 0, rows_symbol)


_INDEX = TABLE["aten.index.Tensor"]  # integer indices (aten_table.py)


@register("aten.index.Tensor")
def _index(b, n):
    """x[mask] / x[:, mask] (one bool index and no other): kiln's nonzero, then a gather;
    other forms: aten_table's converter."""
    picked = bool_index(b, n)
    if picked is None and any(isinstance(t, torch.fx.Node) and b.meta_dtype(t) == torch.bool
                              for t in n.args[1]):
        raise UnsupportedError(f"a bool index among other indices (node {n.name})")
    return _INDEX(b, n) if picked is None else picked


def bool_index(b, n):
    """aten.index.Tensor with one bool index and no other (x[mask], x[:, mask]): None when
    the node has another form."""
    idx = n.args[1]
    present = [i for i, t in enumerate(idx) if t is not None]
    if len(present) != 1:
        return None
    p = present[0]
    t = idx[p]
    if not isinstance(t, torch.fx.Node) or b.meta_dtype(t) != torch.bool or not b.rank(t) or \
            b.rank(n.args[0]) < p + b.rank(t):
        return None
    rows_symbol = nonzero_rows(b, n, p, sympy.Mul(*b.shape(t)))
    return _selected(b, n, b.tensor(n.args[0]), b.tensor(t), p, rows_symbol)
