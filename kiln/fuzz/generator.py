"""Random valid fuzz programs (see `kiln.fuzz.program` for the spec format).

`generate(seed)` grows a DAG: each step picks an op family, operands among the values built so
far (recent ones preferred, so chains form, older ones too, so DAGs form) and parameters that
make the op valid for the operands' shapes and dtypes. It tracks for each value its shape (with
"B" for the dynamic dim), dtype and whether it is *exact* -- known without rounding (inputs,
sign flips, max/min, views, casts of ints). Discontinuous ops (floor, comparisons, argmax,
float->int casts) only take exact operands, so the float64 reference and float32 kiln agree on
them. Ops that would make nan/inf are guarded (log(|x|+1), exp of a clamp, ...).
Non-contiguous data comes from views inside the program (permute, transpose, slices with a step,
expand), since kiln requires contiguous inputs."""

from __future__ import annotations

import math
import random

from kiln.fuzz.program import B_MIN, UNARY, V
from kiln.fuzz.program import bshape as _bshape
from kiln.fuzz import gen_coverage, gen_heavy, gen_index_sort

SMOOTH = [k for k in UNARY if k not in ("floor", "ceil", "round", "sign", "trunc")]
DISCONT = ["floor", "ceil", "round", "sign", "trunc"]
EXACT_UNARY = {"neg", "abs", "relu", "clamp"}
FLOAT_BIN = ["add", "sub", "mul", "maximum", "minimum", "div_s", "atan2", "add_alpha"]
INT_BIN = ["add", "sub", "mul", "maximum", "minimum", "bitwise_and", "bitwise_xor",
           "bitwise_or", "add_alpha"]
CMP = ["lt", "gt", "eq", "ge", "ne"]
BOOL_BIN = ["logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or"]


class Skip(Exception):
    """No operand fits this op family now: the generator tries another."""


class _Gen:
    def __init__(self, seed: int, dynamic: bool, max_ops: int) -> None:
        self.r = random.Random(seed)
        self.dynamic = dynamic
        self.max_ops = max_ops
        self.spec: dict = {"seed": seed, "dynamic": dynamic, "inputs": [], "params": {},
                           "ops": [], "outputs": []}
        self.vals: list[V] = []
        self.inputs: list[int] = []  # ids of the inputs among vals

    # -- values -----------------------------------------------------------------------------
    def new_input(self, shape, dtype: str, high: int | None = None) -> int:
        """A new graph input; ids are creation order here, renumbered by `finish`."""
        shape = tuple(shape)
        assert "B" not in shape[1:], "B only as dim 0 of an input"
        self.inputs.append(len(self.vals))
        self.spec["inputs"].append({"shape": list(shape), "dtype": dtype, "high": high})
        self.vals.append(V(shape, dtype, True))
        return len(self.vals) - 1

    def param(self, shape, init: str = "w") -> str:
        name = f"p{len(self.spec['params'])}"
        self.spec["params"][name] = {"shape": list(shape), "init": init}
        return name

    def emit(self, op: str, args: list[int], attrs: dict, v: V) -> int:
        self.spec["ops"].append([op, list(args), attrs])
        self.vals.append(v)
        return len(self.vals) - 1

    def pick(self, pred=lambda v: True) -> int:
        # ragged and complex values are gen_coverage's only (outputs, or reduced there)
        ids = [i for i, v in enumerate(self.vals) if pred(v) and not gen_coverage.special(v)]
        if not ids:
            raise Skip
        if self.r.random() < 0.6:
            return ids[-1] if self.r.random() < 0.5 else self.r.choice(ids[-3:])
        return self.r.choice(ids)

    def rand_shape(self, rank: int | None = None) -> tuple:
        r = self.r
        rank = r.choice([1, 2, 2, 3, 3, 4]) if rank is None else rank
        sizes = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16] + ([17, 33, 64] if rank <= 2 else [])
        shape = [r.choice(sizes) for _ in range(rank)]
        if self.dynamic and r.random() < 0.8:
            shape[0] = "B"
        return tuple(shape)

    def as_float(self, i: int) -> int:
        v = self.vals[i]
        if v.dtype.startswith("float"):
            return i
        return self.emit("cast", [i], {"dtype": "float32"}, V(v.shape, "float32", True))

    def static_dims(self, v: V, min_size: int = 1) -> list[int]:
        return [d for d, s in enumerate(v.shape) if s != "B" and s >= min_size]

    # -- ops --------------------------------------------------------------------------------
    def op_unary(self) -> None:
        i = self.pick(lambda v: v.dtype != "bool")
        v = self.vals[i]
        if v.dtype == "int64":
            fn = self.r.choice(["neg", "abs", "rem_c", "fdiv_c", "fmod_c", "bnot", "square"])
            self.emit("int_unary", [i], {"fn": fn}, V(v.shape, "int64", True))
            return
        fn = self.r.choice(DISCONT if v.exact and self.r.random() < 0.3 else SMOOTH)
        exact = v.exact and (fn in EXACT_UNARY or fn in DISCONT)
        self.emit("unary", [i], {"fn": fn}, V(v.shape, v.dtype, exact))

    def partner(self, v: V, dtype: str) -> int:
        """A value broadcastable against v: an existing one of the same shape, else an input
        with some dims set to 1 (and maybe leading dims dropped)."""
        same = [k for k, w in enumerate(self.vals) if w.shape == v.shape and w.dtype == dtype]
        if same and self.r.random() < 0.5:
            return self.r.choice(same)
        shape = [1 if (s != "B" and self.r.random() < 0.35) else s for s in v.shape]
        if shape and shape[0] != "B" and self.r.random() < 0.3:
            shape = shape[1:]
        if shape and shape[0] == "B" and self.r.random() < 0.2:
            shape[0] = 1
        shape = shape[:1] + [1 if d == "B" else d for d in shape[1:]]
        return self.new_input(shape, dtype)

    def op_binary(self) -> None:
        i = self.pick()
        v = self.vals[i]
        r = self.r
        if v.dtype == "bool":
            j = self.partner(v, "bool")
            fn = r.choice(BOOL_BIN)
            out = V(_bshape(v.shape, self.vals[j].shape), "bool", True)
        elif v.exact and r.random() < 0.3:
            j = self.partner(v, v.dtype)
            if not self.vals[j].exact:
                return
            fn = r.choice(CMP)
            out = V(_bshape(v.shape, self.vals[j].shape), "bool", True)
        else:
            dt = v.dtype if r.random() < 0.8 else r.choice(["float32", "float64", "int64"])
            if v.dtype == "int64" and dt.startswith("float"):
                dt = "int64"
            j = self.partner(v, dt)
            w = self.vals[j]
            fn = r.choice(INT_BIN if v.dtype == w.dtype == "int64" else FLOAT_BIN)
            res = "float64" if "float64" in (v.dtype, w.dtype) else (
                "float32" if "float32" in (v.dtype, w.dtype) else "int64")
            exact = v.exact and w.exact and fn in ("maximum", "minimum") or res == "int64"
            out = V(_bshape(v.shape, w.shape), res, exact)
        args = [i, j] if r.random() < 0.7 else [j, i]
        self.emit("binary", args, {"fn": fn}, out)

    def op_where(self) -> None:
        c = self.pick(lambda v: v.dtype == "bool")
        if c is None:
            return
        cv = self.vals[c]
        x = self.pick(lambda v: v.dtype != "bool" and len(v.shape) >= len(cv.shape))
        if x is None:
            return
        xv = self.vals[x]
        try:
            shape = _bshape(cv.shape, xv.shape)
        except ValueError:
            return
        y = self.partner(xv, xv.dtype)
        shape = _bshape(shape, self.vals[y].shape)
        self.emit("where", [c, x, y], {}, V(shape, xv.dtype, xv.exact and self.vals[y].exact))

    def op_cast(self) -> None:
        i = self.pick()
        v = self.vals[i]
        choices = ["float32", "float64"] + (["int64", "bool"] if v.exact else [])
        dt = self.r.choice([c for c in choices if c != v.dtype] or ["float32"])
        self.emit("cast", [i], {"dtype": dt}, V(v.shape, dt, v.exact))

    def op_reduce(self) -> None:
        i = self.pick(lambda v: len(v.shape) >= 1)
        v, r = self.vals[i], self.r
        rank, keep = len(v.shape), r.random() < 0.4
        if v.dtype == "bool":
            fn = r.choice(["any", "all"])
            dims = [r.randrange(rank)]
        elif v.exact and r.random() < 0.3:
            dim = r.randrange(rank)
            out = tuple(s for d, s in enumerate(v.shape) if d != dim or keep) if not keep else \
                tuple(1 if d == dim else s for d, s in enumerate(v.shape))
            self.emit("argmax", [i], {"dim": dim, "keep": keep, "max": r.random() < 0.5},
                      V(out, "int64", True))
            return
        else:
            fns = ["sum", "amax", "amin"] + (["mean", "var"] if v.dtype != "int64" else [])
            small = [d for d in self.static_dims(v) if v.shape[d] <= 4]
            fn = r.choice(fns + (["prod"] if small else []))
            dims = [r.choice(small)] if fn == "prod" else sorted(
                r.sample(range(rank), r.randint(1, rank)))
        if fn == "var" and not _reduces_two(v, dims):
            fn = "sum"
        out = tuple((1 if d in dims else s) for d, s in enumerate(v.shape) if keep or d not in dims)
        exact = v.exact and fn in ("amax", "amin", "any", "all") or v.dtype == "int64"
        dt = v.dtype
        if fn == "var":
            self.emit("var", [i], {"dims": dims, "corr": r.choice([0, 1]), "keep": keep},
                      V(out, dt, False))
        else:
            self.emit("reduce", [i], {"fn": fn, "dims": dims, "keep": keep}, V(out, dt, exact))

    def op_view(self) -> None:
        i = self.pick(lambda v: len(v.shape) >= 1)
        v, r = self.vals[i], self.r
        rank, s = len(v.shape), list(v.shape)
        kind = r.choice(["permute", "transpose", "slice", "select", "unsqueeze", "squeeze",
                         "reshape", "expand", "chunk", "pad", "contiguous"])
        st = self.static_dims(v, 2)
        if kind == "permute" and rank >= 2:
            dims = list(range(rank))
            r.shuffle(dims)
            self.emit("permute", [i], {"dims": dims}, V(tuple(s[d] for d in dims), v.dtype,
                                                         v.exact))
        elif kind == "transpose" and rank >= 2:
            d0, d1 = r.sample(range(rank), 2)
            s[d0], s[d1] = s[d1], s[d0]
            self.emit("transpose", [i], {"d0": d0, "d1": d1}, V(tuple(s), v.dtype, v.exact))
        elif kind in ("slice", "chunk") and st:
            d = r.choice(st)
            if kind == "chunk":
                n = r.randint(2, min(4, s[d]))
                k = r.randrange(len(range(0, s[d], -(-s[d] // n))))
                size = len(range(s[d])[k * -(-s[d] // n):(k + 1) * -(-s[d] // n)])
                s[d] = size
                self.emit("chunk", [i], {"n": n, "dim": d, "k": k}, V(tuple(s), v.dtype,
                                                                        v.exact))
                return
            start = r.randrange(s[d] - 1) if r.random() < 0.7 else -r.randint(1, s[d] - 1)
            step = r.choice([1, 1, 2, 3])
            end = r.choice([None, s[d], s[d] - r.randrange(s[d] // 2 + 1)])
            size = len(range(s[d])[start:end:step])
            if size == 0:
                return
            s[d] = size
            self.emit("slice", [i], {"dim": d, "start": start, "end": end, "step": step},
                      V(tuple(s), v.dtype, v.exact))
        elif kind == "select" and rank >= 2 and self.static_dims(v):
            d = r.choice(self.static_dims(v))
            idx = r.randrange(s[d]) if r.random() < 0.7 else -1
            self.emit("select", [i], {"dim": d, "index": idx},
                      V(tuple(s[:d] + s[d + 1:]), v.dtype, v.exact))
        elif kind == "unsqueeze" and rank < 5:
            d = r.randrange(rank + 1)
            self.emit("unsqueeze", [i], {"dim": d}, V(tuple(s[:d] + [1] + s[d:]), v.dtype,
                                                      v.exact))
        elif kind == "squeeze" and 1 in s and rank >= 2:
            d = s.index(1)
            self.emit("squeeze", [i], {"dim": d}, V(tuple(s[:d] + s[d + 1:]), v.dtype, v.exact))
        elif kind == "reshape" and "B" not in s[1:]:
            lead = s[:1] if s[0] == "B" else []
            n = math.prod(d for d in s if d != "B")
            new = lead + _factor(n, r)
            self.emit("reshape", [i], {"shape": new}, V(tuple(new), v.dtype, v.exact))
        elif kind == "expand" and 1 in s:
            new = [r.choice([2, 3, 5]) if d == 1 and r.random() < 0.7 else d for d in s]
            if r.random() < 0.3 and rank < 4:
                new = [r.choice([2, 3])] + new
            self.emit("expand", [i], {"shape": [-1 if d == "B" else d for d in new]},
                      V(tuple(new), v.dtype, v.exact))
        elif kind == "pad" and s[-1] != "B" and v.dtype != "bool":
            lo, hi = r.randint(0, 2), r.randint(0, 2)
            s[-1] += lo + hi
            self.emit("pad", [i], {"pad": [lo, hi], "value": r.choice([0.0, 1.5])},
                      V(tuple(s), v.dtype, v.exact))
        elif kind == "contiguous":  # of an input too: the export cannot tell it from `x`;
            # kiln returns the input itself only when it is contiguous (docs/reliability.md 8)
            self.emit("contiguous", [i], {}, V(v.shape, v.dtype, v.exact))

    def op_cat(self) -> None:
        i = self.pick(lambda v: len(v.shape) >= 1)
        v = self.vals[i]
        d = self.r.choice(self.static_dims(v) or [None])
        if d is None:
            return
        s = list(v.shape)
        s[d] = self.r.randint(1, 5)
        if "B" in s[1:]:
            return
        j = self.new_input(s, v.dtype)
        args = [i, j] if self.r.random() < 0.5 else [j, i, i]
        s[d] = sum(self.vals[k].shape[d] for k in args)
        self.emit("cat", args, {"dim": d}, V(tuple(s), v.dtype, v.exact))


def _reduces_two(v: V, dims) -> bool:
    n = 1
    for d in dims:
        n *= B_MIN if v.shape[d] == "B" else v.shape[d]
    return n >= 2


def _factor(n: int, r: random.Random) -> list[int]:
    out = []
    for _ in range(r.randint(0, 3)):
        divs = [d for d in range(2, n + 1) if n % d == 0]
        if not divs:
            break
        d = r.choice(divs)
        out.append(d)
        n //= d
    out.append(n)
    r.shuffle(out)
    return out



def generate(seed: int, dynamic: bool | None = None, max_ops: int = 8,
             bounded_dims: bool = False, index_sort: float = 0.3) -> dict:
    """One random program spec, reproducible from `seed` (`bounded_dims`: every Dim gets
    a min and a max, skipping the declarations that hit known compile crashes;
    `index_sort`: the share of programs with scatters and sorts, gen_index_sort.py)."""

    r = random.Random(seed)
    dynamic = r.random() < 0.35 if dynamic is None else dynamic
    g = _Gen(seed, dynamic, max_ops)
    if dynamic:
        kind = r.choice(["bounded"] * 5 + ["no_max", "default_min", "default"])
        g.spec["dim"] = "bounded" if bounded_dims else kind
    for _ in range(r.randint(1, 2)):
        dt = r.choice(["float32"] * 6 + ["float64", "int64", "bool"])
        g.new_input(g.rand_shape() if r.random() < 0.95 else (), dt)
    families = [(g.op_unary, 5), (g.op_binary, 5), (g.op_where, 1), (g.op_cast, 1),
                (g.op_reduce, 3), (g.op_view, 6), (g.op_cat, 1)]
    families += [(lambda f=f: f(g), w) for f, w in gen_heavy.FAMILIES + gen_coverage.FAMILIES]
    fns, weights = zip(*families)
    n_ops = r.randint(1, max_ops)
    tries = 0
    while len(g.spec["ops"]) < n_ops and tries < 20 * n_ops:
        tries += 1
        try:
            r.choices(fns, weights)[0]()
        except (Skip, ValueError):  # ValueError: shapes that do not broadcast
            pass
    if not g.spec["ops"]:
        g.op_unary()
    made = gen_index_sort.apply(g, seed, index_sort, (Skip, ValueError))
    spec = _finish(g, r, made + gen_coverage.alias_outputs(g))
    layout = gen_coverage.export_layout(seed)
    if layout:
        spec["export_layout"] = layout
    return spec


def _finish(g: _Gen, r: random.Random, extra: list[int] = ()) -> dict:
    """Pick outputs (the last value plus up to two values nothing reads, then `extra`: views
    of outputs and inputs) and renumber: inputs first, then ops, in creation order."""
    used = {i for _, args, _ in g.spec["ops"] for i in args}
    ops_ids = [i for i in range(len(g.vals)) if i not in g.inputs]
    leaves = [i for i in ops_ids[:-1] if i not in used]
    outs = [ops_ids[-1]] + r.sample(leaves, min(len(leaves), r.randint(0, 2)))
    if r.random() < 0.1:  # the same value twice, or a value that is also read by others
        outs.append(r.choice(ops_ids))
    outs += extra
    new = {old: k for k, old in enumerate(g.inputs + ops_ids)}
    for op in g.spec["ops"]:
        op[1] = [new[i] for i in op[1]]
    g.spec["outputs"] = [new[i] for i in outs]
    return g.spec


__all__ = ["V", "Skip", "generate"]
