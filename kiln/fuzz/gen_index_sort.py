"""Generator families for scatters and sorts (issue 16: the ops CUDA builds print as their own
Triton kernels, put.py / put_reduce.py / sort.py, and the CPU runs as library routines).

- `op_scatter`: index_put (set or accumulate), index_add, index_copy, scatter (set),
  scatter_add and scatter_reduce (sum, prod, mean, amax, amin; include_self or not) of a
  float32 / float64 / int64 value along one of its static dims. Accumulating modes take a
  fresh int64 index input (duplicates combine); setting modes take distinct indices, made in
  the program as a stable argsort of a fresh float input cut to k (eager leaves the winner
  of duplicate sets unspecified), so these programs sort too;
- `op_sort`: sort (stable, ascending or descending: values, and indices where the operand is
  exactly known, so the float64 reference orders it alike), argsort, msort, topk, kthvalue,
  median over a dim (values: indices among ties are unspecified), unique (sorted, maybe with
  inverse indices and counts) and unique_consecutive of a value, along any dim, the dynamic
  one too.

These ops are drawn from a random stream of their own after the other families (`apply`),
so the rest of each program stays what it was before them."""

from __future__ import annotations

import random

from kiln.fuzz.gen_coverage import U
from kiln.fuzz.program import V

ACC_MODES = ("index_put_acc", "index_add", "scatter_add", "scatter_reduce")
SET_MODES = ("index_put", "index_copy", "scatter")
REDUCES = ("sum", "prod", "mean", "amax", "amin")
SORT_KINDS = ("sort", "sort", "argsort", "msort", "topk", "kthvalue", "median", "unique",
              "unique_consecutive")


def _distinct(g, size: int, k: int, shape=None, dim: int = 0) -> int:
    """k distinct indices in [0, size) along `dim` of `shape` (default (size,)): a stable
    argsort of a fresh float input of that shape, cut to k along `dim`."""
    shape = tuple(shape) if shape is not None else (size,)
    src = g.new_input(shape, "float32")
    order = g.emit("argsort", [src], {"dim": dim, "descending": False},
                   V(shape, "int64", True))
    cut = list(shape)
    cut[dim] = k
    return g.emit("slice", [order], {"dim": dim, "start": 0, "end": k, "step": 1},
                  V(tuple(cut), "int64", True))


def op_scatter(g) -> int | None:
    r = g.r
    i = g.pick(lambda v: v.dtype in ("float32", "float64", "int64") and len(v.shape) >= 1
               and "B" not in v.shape[1:] and any(isinstance(s, int) for s in v.shape))
    v = g.vals[i]
    mode = r.choice(ACC_MODES + SET_MODES)
    if mode.startswith("index_put"):
        if v.shape[0] == "B":
            return None
        d = 0
    else:
        d = r.choice(g.static_dims(v))
    size = v.shape[d]
    k = r.randint(1, size if mode in SET_MODES else size + 3)
    exact = v.dtype == "int64" or (v.exact and mode in SET_MODES)
    if mode in ("index_put", "index_put_acc", "index_add", "index_copy"):
        idx = _distinct(g, size, k) if mode in SET_MODES else \
            g.new_input((k,), "int64", high=size)
        src_shape = v.shape[:d] + (k,) + v.shape[d + 1:]
        attrs = {"dim": d, "alpha": r.choice([1, 2]) if mode == "index_add" else 1}
    else:  # scatter: an index of x's rank, at most x's size in every other dim
        ishape = [s if s == "B" or dd == d else r.randint(1, s) for dd, s in enumerate(v.shape)]
        ishape[d] = k
        if mode == "scatter":
            full = list(ishape)
            full[d] = size
            idx = _distinct(g, size, k, full, d)
        else:
            idx = g.new_input(ishape, "int64", high=size)
        src_shape = tuple(ishape)
        attrs = {"dim": d, "reduce": r.choice(REDUCES) if mode == "scatter_reduce" else "sum",
                 "include_self": r.random() < 0.6}
    src = g.new_input(src_shape, v.dtype)
    return g.emit(mode, [i, idx, src], attrs, V(v.shape, v.dtype, exact))


def op_sort(g) -> int | None:
    r = g.r
    i = g.pick(lambda v: v.dtype in ("float32", "float64", "int64", "bool") and
               len(v.shape) >= 1)
    v = g.vals[i]
    kind = r.choice(SORT_KINDS)
    d = r.randrange(len(v.shape))
    if v.dtype == "bool" and kind in ("topk", "kthvalue", "median"):
        kind = "sort"  # (eager has no order statistics of bools)
    if kind in ("topk", "kthvalue") and v.shape[d] == "B":
        kind = "median"  # (k within a static size)
    drop = v.shape[:d] + v.shape[d + 1:]
    if kind == "sort":
        desc = r.random() < 0.5
        out = g.emit("sort", [i], {"dim": d, "descending": desc, "part": 0},
                     V(v.shape, v.dtype, v.exact))
        if v.exact:
            return g.emit("sort", [i], {"dim": d, "descending": desc, "part": 1},
                          V(v.shape, "int64", True))
        return out
    elif kind == "argsort":
        if v.exact:
            return g.emit("argsort", [i], {"dim": d, "descending": r.random() < 0.5},
                          V(v.shape, "int64", True))
        return None
    elif kind == "msort":
        return g.emit("msort", [i], {}, V(v.shape, v.dtype, v.exact))
    elif kind == "topk":
        k = r.randint(1, v.shape[d])
        s = list(v.shape)
        s[d] = k
        return g.emit("topk", [i], {"dim": d, "k": k, "largest": r.random() < 0.7},
                      V(tuple(s), v.dtype, v.exact))
    elif kind in ("kthvalue", "median"):
        keep = r.random() < 0.3
        k = r.randint(1, v.shape[d]) if kind == "kthvalue" else 0
        shape = v.shape[:d] + (1,) + v.shape[d + 1:] if keep else drop
        return g.emit(kind, [i], {"dim": d, "k": k, "keepdim": keep},
                      V(shape, v.dtype, v.exact))
    else:  # unique / unique_consecutive: a length known only from the data
        part = r.choice([0, 0, 1, 2])  # values, inverse indices, counts
        dim = None if kind == "unique" or r.random() < 0.5 else d
        shape = {0: (U,) if dim is None else v.shape[:d] + (U,) + v.shape[d + 1:],
                 1: v.shape if dim is None else (v.shape[d],), 2: (U,)}[part]
        return g.emit(kind, [i], {"part": part, "dim": dim},
                      V(shape, "int64" if part else v.dtype, v.exact))


def apply(g, seed: int, rate: float, skip: tuple) -> list[int]:
    """With probability `rate`, one to three ops of these families on program `seed`'s values,
    drawn from a stream of their own (`g.r` restored after); `skip`: the exceptions that
    mean no value fits (the generator's). Returns the values made, for the outputs."""
    own = random.Random(seed ^ 0x5C5071)
    if own.random() >= rate:
        return []
    saved, g.r = g.r, own
    made = []
    try:
        for _ in range(own.randint(1, 3)):
            try:
                made.append(own.choice([op_scatter, op_sort])(g))
            except skip:
                pass
    finally:
        g.r = saved
    return [k for k in made if k is not None]
