"""unique (aten._unique2: sorted, return_inverse, return_counts) and unique_consecutive (dim
None) as kiln ops, on both targets: no new kernel, no ATen. The result's length is
data-dependent (torch's unbacked symbol, at most the input's element count), bound at run time
as nonzero's row count is (frontend/aten_library.py `nonzero_of_mask`).

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
UNIQUE_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                           "bfloat16", "float32", "float64"})


def _result_rows(b, n) -> tuple[sympy.Expr, str]:
    """The data-dependent length of node `n`'s results (torch's unbacked symbol) as a kiln
    size symbol, and that symbol's name when this node binds it ("" when an earlier unique of
    the same input bound it: torch's memo, the same count)."""
    size = n.meta["val"][0].shape[0]
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
    numel = sympy.Mul(*b.shape(n.args[0]))
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


@register("aten._unique2.default", "aten.unique_consecutive.default")
def _unique(b, n):
    consecutive = "consecutive" in str(n.target)
    if consecutive:
        inverse, counts = bool(_arg(n, 1, "return_inverse")), bool(_arg(n, 2, "return_counts"))
        if _arg(n, 3, "dim") is not None:
            raise UnsupportedError(f"unique_consecutive over a dim (node {n.name}): kiln "
                                   "computes it over the flattened input (dim=None) only")
    else:
        inverse, counts = bool(_arg(n, 2, "return_inverse")), bool(_arg(n, 3, "return_counts"))
    x = b.tensor(n.args[0])
    t = b.types[x]
    if t.dtype.name not in UNIQUE_DTYPES:
        raise UnsupportedError(f"{n.target} (node {n.name}) of {t.dtype.name} values (kiln's "
                               f"unique takes {', '.join(sorted(UNIQUE_DTYPES))})")
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
    out = [values, None, None]
    if _used(n, 1):
        if not inverse:
            out[1] = _empty(b, n, 1)
        else:  # the run of each sorted element, scattered back to x's order
            run = b.emit("scan", [counted[0]], None, like=n, shape=(numel,), dtype=i64,
                         kind="sum", dim=0)
            run = b.emit("sub", [run, b.scalar(1, torch.int64)], None, like=n, shape=(numel,),
                         dtype=i64)
            if perm is not None:
                zero = b.emit("expand", [b.scalar(0, torch.int64)], None, like=n,
                              shape=(numel,), dtype=i64)
                run = b.emit("scatter", [zero, perm, run], None, like=n, shape=(numel,),
                             dtype=i64, dim=0, mode="set", include_self=True)
            out[1] = b.emit("view", [run], None, like=n, result=1, dtype=i64)
    if _used(n, 2):
        out[2] = _counts(b, n, starts, counted[1], rows, numel) if counts else _empty(b, n, 2)
    return out
