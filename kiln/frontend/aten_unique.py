"""unique (aten._unique2: sorted, return_inverse, return_counts), unique_consecutive, and both
over a dim (aten.unique_dim, unique_consecutive(dim=k): `_unique_dim`, rows of at most
DIM_MAX_COLUMNS elements) as kiln ops, on both targets: no new kernel, no ATen. The result's
length is data-dependent (torch's unbacked symbol, at most the input's element count), bound
at run time as nonzero's row count is (frontend/aten_library.py `nonzero_of_mask`).

For x flattened to s (n elements; unique sorts it first, a stable sort, so s[i] came from
x.flatten()[perm[i]]):
- first[i] = i == 0 or s[i] != s[i - 1] (a NaN differs from every value, itself included: each
  NaN is its own unique value, as in eager's CPU and CUDA kernels; -0.0 equals +0.0, and the
  run keeps its first element's bits, which the stable sort makes the first in x's order);
- starts = nonzero(first): the k run starts (k = the true count, bound to the result's length);
- values = s[starts];
- inverse (when asked) = cumsum(first) - 1, scattered to x's order through perm for unique;
- counts (when asked) = starts[j + 1] (n for the last run) - starts[j].

The sort orders values as kiln's sort kernels do (frontend/aten_library.py `_sort`; every NaN
above +inf, either sign). Eager's CPU unique orders them so; its CUDA kernel radix-sorts the
bits, which puts NaNs with the sign bit set before -inf (the CUDA target's sort is given
`nan_bits=True` for that: targets/cuda/sort.py)."""

from __future__ import annotations

import operator

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_library import _arg, _row_max, _used, nonzero_of_mask, true_count
from kiln.frontend.aten_table import register
from kiln.ir import dtypes
from kiln.ir.graph import Node, TensorType

# what eager's unique takes (its CPU and CUDA kernels: every real dtype and bool; complex and
# float8 values are refused by eager too)
#: unique_consecutive of these on CUDA stays ATen's (`_unique`)
CUDA_CONSECUTIVE_ATEN = frozenset({"float16", "bfloat16", "float32", "float64"})
UNIQUE_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                           "bfloat16", "float32", "float64"})


def _result_rows(b, n, at: int = 0, bound=None) -> tuple[sympy.Expr, str]:
    """The data-dependent length of node `n`'s results (torch's unbacked symbol, dim `at` of
    result 0; at most `bound`, default the input's element count) as a kiln size symbol, and
    that symbol's name when this node binds it ("" when an earlier unique of the same input
    bound it: torch's memo, the same count)."""
    size = n.meta["val"][0].shape[at]
    s = size.node.expr if isinstance(size, torch.SymInt) else None
    if s is None or not s.is_Symbol:
        raise UnsupportedError(f"{n.target} (node {n.name}) whose result length is not a "
                               f"data-dependent size ({size})")
    if s in b.syms.rename:
        ours = b.syms.rename[s]
        if ours.name in b.syms.unbacked:
            return ours, ""
        raise UnsupportedError(f"{n.target} (node {n.name}) whose result length {size} is "
                               "not a new data-dependent size")
    numel = sympy.Mul(*b.shape(n.args[0])) if bound is None else bound
    rows = b.syms.add_unbacked(s, numel)
    return rows, rows.name


def _check_index_results(b, n) -> None:
    """Results 1 and 2 (inverse, counts) are int64 whatever the export says: torch 2.11's
    export records them with the input's dtype (frontend/fallback.py `RESULT_DTYPES`). kiln
    returns int64, as eager; an op of the program that reads such a result was traced with the
    wrong dtype, so that program is refused."""
    for g in n.users:
        k = g.args[1] if g.target is operator.getitem else None
        if k not in (1, 2):
            continue
        got = n.meta["val"][k].dtype
        if got != torch.int64 and any(u.op != "output" for u in g.users):
            raise UnsupportedError(
                f"{n.target} (node {n.name}): the exported program says result {k} is {got}, "
                f"but the op returns torch.int64, and node {next(iter(g.users)).name} reads it "
                f"as {got}; this torch version ({torch.__version__}) records wrong metadata "
                "for unique (torch 2.11 does). Export with a newer torch")


def _flags(b, n, s: str, numel) -> str:
    """[numel] bool: element i of `s` starts a run (i == 0 or s[i] != s[i - 1])."""
    i64, bool_ = dtypes.int64, dtypes.bool_
    i = b.emit("iota", [], None, like=n, shape=(numel,), dtype=i64, start=0, step=1)
    prev = b.emit("sub", [i, b.scalar(1, torch.int64)], None, like=n, shape=(numel,), dtype=i64)
    prev = b.emit("maximum", [prev, b.scalar(0, torch.int64)], None, like=n, shape=(numel,),
                  dtype=i64)
    dt = b.types[s].dtype
    before = b.emit("index", [s, prev], None, like=n, shape=(numel,), dtype=dt, positions=(0,),
                    select=True)
    differs = b.emit("ne", [s, before], None, like=n, shape=(numel,), dtype=bool_)
    first = b.emit("eq", [i, b.scalar(0, torch.int64)], None, like=n, shape=(numel,),
                   dtype=bool_)
    return b.emit("logical_or", [first, differs], None, like=n, shape=(numel,), dtype=bool_)


def _counts(b, n, starts: str, count: str, rows, numel) -> str:
    """[rows] int64: the length of each run, from its start and the next one's (`numel` after
    the last; `count`: the number of runs, a 0-d int64)."""
    i64, bool_ = dtypes.int64, dtypes.bool_
    j = b.emit("iota", [], None, like=n, shape=(rows,), dtype=i64, start=0, step=1)
    j1 = b.emit("add", [j, b.scalar(1, torch.int64)], None, like=n, shape=(rows,), dtype=i64)
    last = b.emit("sub", [count, b.scalar(1, torch.int64)], None, like=n, shape=(), dtype=i64)
    at = b.emit("minimum", [j1, last], None, like=n, shape=(rows,), dtype=i64)
    at = b.emit("maximum", [at, b.scalar(0, torch.int64)], None, like=n, shape=(rows,),
                dtype=i64)
    nxt = b.emit("index", [starts, at], None, like=n, shape=(rows,), dtype=i64, positions=(0,),
                 select=True)
    inside = b.emit("lt", [j1, count], None, like=n, shape=(rows,), dtype=bool_)
    end = b.emit("where", [inside, nxt, _size(b, n, numel)], None, like=n, shape=(rows,),
                 dtype=i64)
    return b.emit("sub", [end, starts], None, like=n, result=2, dtype=i64)


def _size(b, n, e) -> str:
    """A 0-d int64 value holding size expression `e`."""
    name = b.fresh(f"{n.name}_numel")
    t = TensorType(dtypes.int64, ())
    b.nodes.append(Node(name, "full", (), t, (("value", sympy.sympify(e)),), n.name))
    b.types[name] = t
    return name


def _empty(b, n, k: int) -> str:
    """Result `k` of node `n` where it was not asked for: eager's empty int64 tensor."""
    shape = tuple(n.meta["val"][k].shape)
    if shape != (0,):
        raise UnsupportedError(f"result {k} of {n.target} (node {n.name}), not asked for, has "
                               f"shape {list(shape)}; expected [0]")
    return b.emit("expand", [b.scalar(0, torch.int64)], None, like=n, result=k,
                  dtype=dtypes.int64)


@register("aten._unique2.default", "aten.unique_consecutive.default",
          "aten.unique_dim.default")
def _unique(b, n):
    consecutive = "consecutive" in str(n.target)
    dim = None
    if consecutive:
        inverse, counts = bool(_arg(n, 1, "return_inverse")), bool(_arg(n, 2, "return_counts"))
        dim = _arg(n, 3, "dim")
    elif str(n.target) == "aten.unique_dim.default":
        dim = _arg(n, 1, "dim")
        inverse, counts = bool(_arg(n, 3, "return_inverse")), bool(_arg(n, 4, "return_counts"))
    else:
        inverse, counts = bool(_arg(n, 2, "return_inverse")), bool(_arg(n, 3, "return_counts"))
    if dim is not None:
        return _unique_dim(b, n, int(dim), consecutive, inverse, counts)
    x = b.tensor(n.args[0])
    t = b.types[x]
    if t.dtype.name not in UNIQUE_DTYPES:
        raise UnsupportedError(f"{n.target} (node {n.name}) of {t.dtype.name} values (kiln's "
                               f"unique takes {', '.join(sorted(UNIQUE_DTYPES))})")
    if consecutive and not b.library_routines and t.dtype.name in CUDA_CONSECUTIVE_ATEN:
        raise UnsupportedError(
            f"{n.target} (node {n.name}) of {t.dtype.name} values on CUDA: on an H100, eager's "
            "CUDA kernel kept other bits than kiln's first element for some run of equal "
            "values (session 18, not yet explained); ATen's kernel runs it")
    _check_index_results(b, n)
    rows, rows_symbol = _result_rows(b, n)  # (before any node like n)
    numel = sympy.Mul(*t.shape)
    i64 = dtypes.int64
    s = b.emit("view", [x], None, like=n, shape=(numel,), dtype=t.dtype)
    perm = None
    if not consecutive:  # a stable sort: each run keeps its elements in x's order
        order = {} if b.library_routines else {"nan_bits": True}
        sort = dict(dim=0, descending=False, stable=True, **_row_max(b, n, s, 0), **order)
        flat = s
        s = b.emit("sort", [flat], None, like=n, shape=(numel,), dtype=t.dtype, part=0, **sort)
        if inverse and _used(n, 1):
            perm = b.emit("sort", [flat], None, like=n, shape=(numel,), dtype=i64, part=1,
                          **sort)
    first = _flags(b, n, s, numel)
    counted = true_count(b, n, first)
    coords = nonzero_of_mask(b, n, first, rows_symbol, rows=rows, counted=counted)
    starts = b.emit("select", [coords], None, like=n, shape=(rows,), dtype=i64, dim=1, index=0)
    values = b.emit("index", [s, starts], None, like=n, result=0, positions=(0,), select=True)
    return _results(b, n, values, starts, counted, perm, rows, numel, inverse, counts)


def _results(b, n, values, starts, counted, perm, rows, length, inverse: bool, counts: bool):
    """[values, inverse, counts] of unique over `length` elements (or rows): the inverse (when
    asked) is the run of each sorted element, cumsum(first) - 1, scattered back to x's order
    through the sort's `perm` (None: unsorted, unique_consecutive); the counts from the run
    `starts`; an unasked result empty."""
    i64 = dtypes.int64
    out = [values, None, None]
    if _used(n, 1):
        if not inverse:
            out[1] = _empty(b, n, 1)
        else:
            run = b.emit("scan", [counted[0]], None, like=n, shape=(length,), dtype=i64,
                         kind="sum", dim=0)
            run = b.emit("sub", [run, b.scalar(1, torch.int64)], None, like=n, shape=(length,),
                         dtype=i64)
            if perm is not None:
                zero = b.emit("expand", [b.scalar(0, torch.int64)], None, like=n,
                              shape=(length,), dtype=i64)
                run = b.emit("scatter", [zero, perm, run], None, like=n, shape=(length,),
                             dtype=i64, dim=0, mode="set", include_self=True)
            out[1] = b.emit("view", [run], None, like=n, result=1, dtype=i64)
    if _used(n, 2):
        out[2] = _counts(b, n, starts, counted[1], rows, length) if counts else _empty(b, n, 2)
    return out


# unique over a dim sorts rows by each column in turn (a least-significant-column-first
# sequence of stable sorts): at most this many columns (elements of a row)
DIM_MAX_COLUMNS = 16


def _lower(b, e) -> int | None:
    """The smallest value of size `e` over the export's Dim ranges (None: unknown)."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return int(e)
    theirs = {ours: t for t, ours in b.syms.rename.items()}
    vr = getattr(b, "ranges", {}).get(theirs.get(e)) if e.is_Symbol else None
    try:
        return int(vr.lower)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _unique_dim(b, n, dim: int, consecutive: bool, inverse: bool, counts: bool):
    """unique / unique_consecutive over dim `dim`: the slices along it as rows [N, M] (M: the
    other dims' element count, static, at most DIM_MAX_COLUMNS); unique orders the rows
    lexicographically by M stable sorts, last column first; a row starts a run where any
    element differs from the row before (!=: a row with a NaN is a value of its own); the
    first row of each run, the inverse and the counts as for dim None. Eager orders rows with
    `<` element by element, which gives NaNs no place: with NaNs in x its row order is its
    own (kiln puts a NaN after every number, as its sort does)."""
    x = b.tensor(n.args[0])
    t = b.types[x]
    if t.dtype.name not in UNIQUE_DTYPES:
        raise UnsupportedError(f"{n.target} (node {n.name}) of {t.dtype.name} values (kiln's "
                               f"unique takes {', '.join(sorted(UNIQUE_DTYPES))})")
    shape = tuple(t.shape)
    if not shape:
        raise UnsupportedError(f"{n.target} over dim {dim} of a 0-d tensor (node {n.name})")
    dim %= len(shape)
    others = [sympy.sympify(e) for k, e in enumerate(shape) if k != dim]
    m = sympy.Mul(*others)
    if not m.is_Integer or not 1 <= int(m) <= DIM_MAX_COLUMNS:
        raise UnsupportedError(
            f"{n.target} over dim {dim} (node {n.name}) with rows of {m} elements: kiln sorts "
            f"rows of 1 to {DIM_MAX_COLUMNS} elements, known when compiling")
    big = shape[dim]
    low = _lower(b, big)
    if low is None or low < 1:  # (eager returns a 1-d empty tensor for an empty dim)
        raise UnsupportedError(f"{n.target} over dim {dim} (node {n.name}) whose length {big} "
                               "may be 0: kiln takes dims of at least one element")
    got = tuple(n.meta["val"][0].shape)
    if len(got) != len(shape) or any(
            k != dim and b.syms.convert(g) != sympy.sympify(e)
            for k, (g, e) in enumerate(zip(got, shape))):
        raise UnsupportedError(  # (torch's meta of unique_consecutive with a negative dim)
            f"{n.target} over dim {dim} (node {n.name}): the exported program says result 0 "
            f"has shape {list(got)}, which is not the input's shape {list(shape)} with one "
            "data-dependent length; this torch version records wrong metadata for it")
    _check_index_results(b, n)
    rows, rows_symbol = _result_rows(b, n, dim, big)  # (before any node like n)
    m = int(m)
    i64, bool_ = dtypes.int64, dtypes.bool_
    perm_dims = (dim,) + tuple(k for k in range(len(shape)) if k != dim)
    xt = b.emit("permute", [x], None, like=n, shape=tuple(shape[k] for k in perm_dims),
                dtype=t.dtype, dims=perm_dims)
    x2 = b.emit("view", [xt], None, like=n, shape=(big, m), dtype=t.dtype)
    perm = None
    if not consecutive:  # rows sorted by column m - 1, then (stably) m - 2, ..., then 0
        sort = dict(dim=0, descending=False, stable=True, **_row_max(b, n, x, dim))
        for j in reversed(range(m)):
            col = b.emit("select", [x2], None, like=n, shape=(big,), dtype=t.dtype, dim=1,
                         index=j)
            if perm is not None:
                col = b.emit("index", [col, perm], None, like=n, shape=(big,), dtype=t.dtype,
                             positions=(0,), select=True)
            step = b.emit("sort", [col], None, like=n, shape=(big,), dtype=i64, part=1,
                          **sort)
            perm = step if perm is None else b.emit(
                "index", [perm, step], None, like=n, shape=(big,), dtype=i64, positions=(0,),
                select=True)
        s2 = b.emit("index", [x2, perm], None, like=n, shape=(big, m), dtype=t.dtype,
                    positions=(0,), select=True)
    else:
        s2 = x2
    i = b.emit("iota", [], None, like=n, shape=(big,), dtype=i64, start=0, step=1)
    prev = b.emit("sub", [i, b.scalar(1, torch.int64)], None, like=n, shape=(big,), dtype=i64)
    prev = b.emit("maximum", [prev, b.scalar(0, torch.int64)], None, like=n, shape=(big,),
                  dtype=i64)
    before = b.emit("index", [s2, prev], None, like=n, shape=(big, m), dtype=t.dtype,
                    positions=(0,), select=True)
    differs = b.emit("ne", [s2, before], None, like=n, shape=(big, m), dtype=bool_)
    differs = b.emit("reduce", [differs], None, like=n, shape=(big,), dtype=bool_, kind="any",
                     dims=(1,), keepdim=False)
    first = b.emit("eq", [i, b.scalar(0, torch.int64)], None, like=n, shape=(big,),
                   dtype=bool_)
    first = b.emit("logical_or", [first, differs], None, like=n, shape=(big,), dtype=bool_)
    counted = true_count(b, n, first)
    coords = nonzero_of_mask(b, n, first, rows_symbol, rows=rows, counted=counted)
    starts = b.emit("select", [coords], None, like=n, shape=(rows,), dtype=i64, dim=1, index=0)
    pick = starts if perm is None else b.emit("index", [perm, starts], None, like=n,
                                              shape=(rows,), dtype=i64, positions=(0,),
                                              select=True)
    values = b.emit("index", [x, pick], None, like=n, result=0, positions=(dim,), select=True)
    return _results(b, n, values, starts, counted, perm, rows, big, inverse, counts)
