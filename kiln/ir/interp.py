"""Reference interpreter of Loop IR, in numpy: the second oracle beside torch eager.

It shares nothing with code generation: each `Compute` is evaluated over its whole index
space at once (numpy broadcasting over one axis per loop variable), reductions reduce the
trailing r-axes, a `Gemm` is `np.matmul` over strided views, and an `Extern` runs the numpy
twin of its routine (`ROUTINES`, written apart from kiln_lib.h: plain Python loops over rows
and updates). Buffers are flat numpy arrays.
It is slow and meant for small shapes (tests, the fuzzer, bisecting a wrong kernel)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.sym import evaluate, ivars, rvars
from kiln.ir.quant import routine as quant_routine
from kiln.errors import UnsupportedError
import cmath
import fractions
import math
import torch


def _erf(x):
    return np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x


def _where_div(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return np.where(b == 0, 0, np.trunc(a / np.where(b == 0, 1, b))).astype(a.dtype)
    return a / b


def _floordiv(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return np.where(b == 0, 0, np.floor_divide(a, np.where(b == 0, 1, b)))
    return np.floor(a / b)


def _complex(re, im):
    """The complex values with parts `re` and `im` (not re + 1j * im: inf * 1j has a NaN
    real part)."""
    re, im = np.broadcast_arrays(re, im)
    out = np.empty(re.shape, np.result_type(re.dtype, np.complex64))
    out.real, out.imag = re, im
    return out


def _maximum(a, b):
    return np.maximum(a, b)


def _shift_left(a, b):
    bits = a.dtype.itemsize * 8
    ok = (b >= 0) & (b < bits)
    return np.where(ok, np.left_shift(a, np.where(ok, b, 0).astype(a.dtype)), 0)


def _shift_right(a, b):
    bits = a.dtype.itemsize * 8
    ok = (b >= 0) & (b < bits)
    return np.where(ok, np.right_shift(a, np.where(ok, b, 0).astype(a.dtype)),
                    np.where(a < 0, -1, 0))


def philox4x32(key: tuple, counter: tuple) -> tuple:
    """Philox4x32-10 over numpy uint32 arrays (the kr::philox of kiln_kernels.h)."""
    m = np.uint64(0xFFFFFFFF)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & m for k in key)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & m for c in counter)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & m,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & m)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m, (k1 + np.uint64(0xBB67AE85)) & m
    return c0, c1, c2, c3


def _philox(seed, run, stream, index, lane):
    u = [np.asarray(x).astype(np.int64).view(np.uint64) for x in (seed, run, stream, index)]
    words = philox4x32((u[0], u[0] >> np.uint64(32)),
                       (u[3], u[3] >> np.uint64(32), u[2], u[1]))
    lane = np.asarray(lane)
    out = np.where(lane == 0, words[0], np.where(lane == 1, words[1],
                                                  np.where(lane == 2, words[2], words[3])))
    return out.astype(np.int64)


NP_OPS = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "tanh": np.tanh, "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "relu": lambda x: np.where(x < 0, np.zeros_like(x), x), "abs": np.abs, "sin": np.sin,
    "cos": np.cos, "tan": np.tan, "atan": np.arctan, "asin": np.arcsin, "acos": np.arccos,
    "sinh": np.sinh, "cosh": np.cosh, "asinh": np.arcsinh, "acosh": np.arccosh,
    "atanh": np.arctanh, "erf": _erf, "erfc": lambda x: 1 - _erf(x),
    "logical_not": np.logical_not, "reciprocal": lambda x: 1 / x, "floor": np.floor,
    "ceil": np.ceil, "round": np.round, "trunc": np.trunc, "log1p": np.log1p, "expm1": np.expm1,
    "sign": np.sign, "exp2": np.exp2, "log2": np.log2, "isnan": np.isnan, "isinf": np.isinf,
    "bitwise_not": np.invert, "to_bool": lambda x: x != 0, "square": np.square,
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _where_div,
    "truediv_floor": _floordiv, "truediv_trunc": lambda a, b: np.trunc(a / b).astype(a.dtype),
    "pow": np.power, "maximum": _maximum, "minimum": np.minimum, "eq": np.equal,
    "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "logical_and": np.logical_and, "logical_or": np.logical_or,
    "logical_xor": np.logical_xor, "remainder": lambda a, b: a - np.floor_divide(a, b) * b,
    "fmod": np.fmod, "atan2": np.arctan2, "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
    "where": np.where,
    "log10": np.log10, "i0": np.i0, "signbit": np.signbit, "hypot": np.hypot,
    "copysign": np.copysign, "nextafter": np.nextafter, "shift_left": _shift_left,
    "shift_right": _shift_right, "philox": _philox,
    "real": np.real, "imag": np.imag, "complex": _complex,
}
NP_REDUCE = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min, "any": np.any,
             "all": np.all, "argmax": np.argmax, "argmin": np.argmin}
_LAMBDIFY = [{"FloorDiv": np.floor_divide, "ModIdx": np.mod, "Max": np.maximum,
              "Min": np.minimum}, "numpy"]


class InterpError(ValueError):
    pass


class _Eval:
    def __init__(self, bufs, env, grid: dict[sympy.Symbol, np.ndarray]):
        self.bufs, self.env, self.grid = bufs, env, grid
        self.memo: dict = {}

    def index(self, e: sympy.Expr, extra: Mapping) -> np.ndarray:
        e = sympy.sympify(e)  # (sizes by name: an unbacked size's symbol may be nonnegative)
        e = e.xreplace({s: sympy.Integer(self.env[s.name]) for s in e.free_symbols
                        if s.name in self.env})
        syms = sorted(e.free_symbols, key=lambda s: s.name)
        if not syms:
            return np.asarray(int(e), dtype=np.int64)
        fn = sympy.lambdify(syms, e, modules=_LAMBDIFY)
        vals = [extra[s] if s in extra else self.grid[s] for s in syms]
        return np.asarray(fn(*vals), dtype=np.int64)

    def value(self, e: L.Expr) -> np.ndarray:
        if e in self.memo:
            return self.memo[e]
        dt = e.dtype.numpy
        if isinstance(e, L.Const):
            out = np.asarray(e.value, dtype=dt)
        elif isinstance(e, L.Index):
            out = self.index(e.expr, {}).astype(dt)
        elif isinstance(e, L.Load):
            extra = {}
            for ind in e.indirect:
                v = self.value(ind.value).astype(np.int64)
                bound = evaluate(ind.bound, self.env)
                v = np.where(v < 0, v + bound, v) if ind.wrap else v
                if v.size and (v.min() < 0 or v.max() >= bound):
                    raise InterpError(f"index out of range reading {e.buf}")
                extra[ind.var] = v
            out = self.bufs[e.buf][self.index(e.index, extra)]
        elif e.op == "cast":
            out = self.value(e.args[0]).astype(dt)
        else:
            with np.errstate(all="ignore"):
                out = np.asarray(NP_OPS[e.op](*[self.value(a) for a in e.args])).astype(dt)
        self.memo[e] = out
        return out


def _grid(shape: tuple[int, ...], names) -> dict:
    n = len(shape)
    return {v: np.arange(s).reshape([1] * k + [s] + [1] * (n - k - 1))
            for k, (v, s) in enumerate(zip(names, shape))}


def _compute(node: L.Compute, bufs, env) -> np.ndarray:
    out_shape = tuple(evaluate(d, env) for d in node.shape)
    red = tuple(evaluate(d, env) for d in node.reduce.sizes) if node.reduce else ()
    names = list(ivars(len(out_shape))) + list(rvars(len(red)))
    full = out_shape + red
    vals = _Eval(bufs, env, _grid(full, names)).value(node.body)
    vals = np.broadcast_to(vals, full)
    if node.reduce is None:
        return np.ascontiguousarray(vals).reshape(-1)
    axes = tuple(range(len(out_shape), len(full)))
    kind = node.reduce.kind
    if kind in ("argmax", "argmin"):
        flat = vals.reshape(out_shape + (-1,))
        return NP_REDUCE[kind](flat, axis=-1).astype(np.int64).reshape(-1)
    dt = node.dtype.numpy
    # float sums and products accumulate in float64 (as _gemm does): the reference's own
    # rounding stays below any float32 summation order's
    wide = {"dtype": np.float64} if kind in ("sum", "prod") and vals.dtype.kind == "f" else {}
    with np.errstate(all="ignore"):
        return np.asarray(NP_REDUCE[kind](vals, axis=axes, **wide)).astype(dt).reshape(-1)


def _gemm(g: L.Gemm, bufs, env) -> np.ndarray:
    if g.lowp is not None:  # CUDA-only nodes (CPU programs expand them: passes/lowp_cpu.py)
        raise NotImplementedError(f"{g.name}: the interpreter has no low-precision GEMM")
    def view(op: L.Operand, rows, cols):
        base = bufs[op.buf]
        item = base.itemsize
        sizes = [evaluate(b, env) for b in g.batch] + [rows, cols]
        strides = [evaluate(s, env) for s in (*op.batch_strides, op.rows, op.cols)]
        start = base[evaluate(op.offset, env):]
        return np.lib.stride_tricks.as_strided(start, sizes, [s * item for s in strides])

    m, n, k = (evaluate(x, env) for x in (g.m, g.n, g.k))
    a = view(g.a, m, k).astype(np.float64)
    if g.mixed is not None and g.mixed.group:  # int4: two nibbles a byte, per-group scales
        p = view(g.b, k // 2, n).astype(np.int64)
        q = np.stack([(p & 15) - 8, (p >> 4) - 8], axis=-2).reshape(p.shape[:-2] + (k, n))
        if g.mixed.tc:  # pack_tc's order: position 8 j + i of each 32 holds k = 4 i + j
            q = np.swapaxes(q.reshape(q.shape[:-2] + (k // 32, 4, 8, n)), -3, -2).reshape(
                q.shape)
        s = view(g.mixed.scale, k // g.mixed.group, n).astype(np.float64)
        out = np.matmul(a, q * np.repeat(s, g.mixed.group, axis=-2))
        return out.astype(g.dtype.numpy).reshape(-1)
    b = view(g.b, k, n).astype(np.float64)
    out = np.matmul(a, b)
    if g.mixed is not None and g.mixed.scale is not None:  # int8 operands convert exactly
        out = out * view(g.mixed.scale, m, n).astype(np.float64)
    return out.astype(g.dtype.numpy).reshape(-1)


def call_aten(c: L.AtenCall, tensor, env) -> list:
    """Runs ATen fallback call `c` through torch.ops (shared by this interpreter and the
    Python printer, targets/cuda/wrapper_py.py): `tensor(arg)` turns an `AtenTensor` argument
    into a torch tensor, the other arguments decode here. Returns (AtenResult, torch result)
    for every result `c` writes."""

    def value(a: L.AtenArg):
        match a:
            case L.AtenTensor():
                return tensor(a)
            case L.AtenTensors(items=items):
                return [value(x) for x in items]
            case L.AtenOptional(value=x):
                return value(x)
            case L.AtenNone():
                return None
            case L.AtenInt(value=v):
                return evaluate(v, env)
            case L.AtenInts(values=vs):
                return [evaluate(x, env) for x in vs]
            case L.AtenDtype(dtype=dt):
                return dt.torch
            case L.AtenFloat(value=v):
                return float(v)
            case L.AtenBool(value=v) | L.AtenStr(value=v):
                return v
        raise TypeError(a)

    name = c.op.split("::", 1)[1]
    fn = getattr(getattr(torch.ops.aten, name), c.overload or "default")
    n_pos = len(c.args) - len(c.keywords)
    out = fn(*[value(a) for a in c.args[:n_pos]],
             **{k: value(a) for k, a in zip(c.keywords, c.args[n_pos:])})
    return [(r, out[r.result] if c.n_results > 1 else out) for r in c.results()]


def _aten(c: L.AtenCall, bufs, env) -> dict[str, np.ndarray]:
    """The ATen fallback runs ATen itself, through torch (the reference has nothing else)."""

    def tensor(a: L.AtenTensor):  # the operand as the strided view of its buffer
        flat = torch.from_numpy(np.ascontiguousarray(bufs[a.buf]).reshape(-1))
        return torch.as_strided(flat, [evaluate(d, env) for d in a.shape],
                                [evaluate(s, env) for s in a.strides], evaluate(a.offset, env))
    got = {}
    for r, t in call_aten(c, tensor, env):
        for d, sym, _ in r.binds:  # data-dependent sizes are known from here on
            env[sym] = int(t.shape[d])
        got[r.name] = t.resolve_conj().resolve_neg().contiguous().numpy().astype(
            r.dtype.numpy).reshape(-1)
    return got


def _truth(pred, expr, bufs, env) -> bool:
    if pred is not None:
        return bool(bufs[pred].reshape(-1)[0])
    return bool(sympy.sympify(expr).subs({sympy.Symbol(k, integer=True, positive=True): v
                                          for k, v in env.items()}))


def _run_nodes(nodes, bufs: dict, env: dict[str, int], prog=None) -> None:
    """Evaluate `nodes` in order into `bufs`; control nodes run their regions (a region's
    buffers are named in the same space as its parent's)."""
    for node in nodes:
        if isinstance(node, L.Branch):
            region = node.then if _truth(node.pred, node.expr, bufs, env) else node.orelse
            _run_nodes(region.prog.nodes, bufs, env)
        elif isinstance(node, L.Loop):
            for c, i in zip(node.carries, node.inits):
                bufs[c] = bufs[i].copy()
            while True:
                _run_nodes(node.cond.prog.nodes, bufs, env)
                if not _truth(node.pred, None, bufs, env):
                    break
                _run_nodes(node.body.prog.nodes, bufs, env)
                for c, x in zip(node.carries, node.nexts):
                    bufs[c] = bufs[x].copy()
        elif isinstance(node, L.Extern):
            bufs.update(zip(node.outs, _extern(node, bufs, dict(env), prog)))
        elif isinstance(node, L.UserKernel):
            raise UnsupportedError(f"the interpreter cannot run user Triton kernel "
                                   f"{node.kernel} (node {node.name}): run the CUDA package")
        elif isinstance(node, L.AtenCall):
            bufs.update(_aten(node, bufs, env))  # binds data-dependent sizes in env
        elif isinstance(node, L.ReadSize):
            env[node.symbol] = int(bufs[node.src][0])
            bufs[node.name] = np.array([env[node.symbol]], dtype=np.int64)
        else:
            fn = _gemm if isinstance(node, L.Gemm) else _compute
            bufs[node.name] = fn(node, bufs, dict(env))


def _rows(x: np.ndarray):
    """x as [rows, n] over its last dim (a copy; rank 0 counts as one row of one)."""
    x = np.asarray(x)
    n = x.shape[-1] if x.ndim else 1
    return x.reshape(-1, n) if x.size else np.zeros((int(np.prod(x.shape[:-1])), n), x.dtype)


def _key(v):
    """Sort key: NaN after every number."""
    f = float(v)
    return (1, 0.0) if f != f else (0, v)


def _lib_sort(outs, attrs, x):
    rows = _rows(x)
    vals, idx = np.empty_like(rows), np.empty(rows.shape, np.int64)
    for r, row in enumerate(rows):
        # Python's sort is stable, also with reverse=True (equal items keep their order)
        order = sorted(range(len(row)), key=lambda j: _key(row[j]), reverse=attrs["descending"])
        idx[r], vals[r] = order, row[order]
    return [vals, idx]


def _lib_topk(outs, attrs, x):
    k = attrs["k"]
    vals, idx = _lib_sort(outs, {"descending": attrs["largest"]}, x)
    return [vals[:, :k], idx[:, :k]]


def _log_add_exp_c(x: complex, y: complex) -> complex:
    """kiln_lib.h's complex log_add_exp (ATen's _log_add_exp_helper) on Python complexes."""
    def nan(z):
        return z != z
    mn, mx = (y, y) if nan(y) else (x, x) if nan(x) else (x, y) if x.real < y.real else (y, x)
    if nan(mn):
        return complex(math.nan, math.nan)
    if not math.isfinite(mn.real) and mn.real == mx.real:
        return mn if mn.real < 0 else cmath.log(cmath.exp(mn) + cmath.exp(mx))
    z = cmath.exp(mn - mx)
    u = z + 1
    if u == 1:
        return z + mx
    lu = cmath.log(u)
    return (lu if u - 1 == z else lu * (z / (u - 1))) + mx


def _fma(a, b, c, own):
    """a * b + c rounded once to `own` (float32: through float64, a second rounding in rare
    ties); the IEEE product / sum rules for non-finite operands."""
    if not all(math.isfinite(float(v)) for v in (a, b, c)):
        return own(float(a) * float(b) + float(c))
    exact = fractions.Fraction(float(a)) * fractions.Fraction(float(b)) + \
        fractions.Fraction(float(c))
    try:
        return own(float(exact))
    except OverflowError:
        return own(math.copysign(math.inf, exact))


def _lib_scan(outs, attrs, x):
    dt = dtypes.dtype(outs[0][0]).numpy
    if np.issubdtype(dt, np.complexfloating):
        rows = _rows(x).astype(np.complex128)
        out = np.empty_like(rows)
        if attrs["kind"] in (1, 3):  # products, left to right, with kiln_lib.h's fmas
            own = np.float64 if attrs["kind"] == 1 else np.finfo(dt).dtype.type
            with np.errstate(all="ignore"):
                for r, row in enumerate(rows):
                    ar, ai = own(1), own(0)
                    for j, v in enumerate(row):
                        c, d = own(v.real), own(v.imag)
                        ar, ai = _fma(ar, c, -(ai * d), own), _fma(ar, d, ai * c, own)
                        out[r, j] = complex(ar, ai)
            return [out.astype(dt)]
        for r, row in enumerate(rows):
            acc = complex(-math.inf, 0.0)
            for j, v in enumerate(row):
                acc = out[r, j] = _log_add_exp_c(complex(v), acc)
        return [out.astype(dt)]
    rows = _rows(x).astype(dt)
    acc_dt = np.float64 if np.issubdtype(dt, np.floating) else np.int64
    kind = attrs["kind"]
    with np.errstate(all="ignore"):
        if kind == 0:
            out = np.cumsum(rows.astype(acc_dt), axis=1)
        elif kind == 1:
            out = np.cumprod(rows.astype(acc_dt), axis=1)
        else:
            out = np.logaddexp.accumulate(rows.astype(np.float64), axis=1) if rows.size else \
                rows.astype(np.float64)
    return [out.astype(dt)]


def _lib_scan_extreme(outs, attrs, x):
    rows = _rows(x)
    vals, idx = np.empty_like(rows), np.zeros(rows.shape, np.int64)
    better = np.greater_equal if attrs["is_max"] else np.less_equal
    for r, row in enumerate(rows):
        best, at = None, 0
        for j, v in enumerate(row):
            if best is None or v != v or (best == best and better(v, best)):
                best, at = v, j
            vals[r, j], idx[r, j] = best, at
    return [vals, idx]


def _lib_put(outs, attrs, self_, values, *index):
    out = np.array(self_, dtype=self_.dtype, copy=True)
    mode, dims, wrap = attrs["mode"], attrs["dims"], attrs["wrap"]
    count = np.full(out.shape, 1 if attrs["include_self"] else 0, np.int64)
    ident = {2: 1, 4: -np.inf, 5: np.inf}.get(mode, 0)
    if mode in (4, 5) and not np.issubdtype(out.dtype, np.floating):
        info = np.iinfo(out.dtype) if out.dtype != np.bool_ else None
        ident = (info.min if mode == 4 else info.max) if info else mode == 5

    def dest(it):
        pos = []
        for d, m in enumerate(dims):
            if m >= 0:
                pos.append(it[m])
                continue
            c = int(index[-m - 1][it])
            n = out.shape[d]
            c2 = c + n if wrap and -n <= c < 0 else c
            if not 0 <= c2 < n:
                raise InterpError(f"index out of range: index {c} for dim {d} of size {n}")
            pos.append(c2)
        return tuple(pos)

    its = list(np.ndindex(*values.shape))
    if not attrs["include_self"]:
        for it in its:
            out[dest(it)] = ident
    for it in its:
        p, v = dest(it), values[it]
        if mode == 0:
            out[p] = v
        elif mode in (1, 3):
            out[p] = out[p] + v
        elif mode == 2 and np.iscomplexobj(out):  # kiln_lib.h cput_combine: with fmas
            own = np.finfo(out.dtype).dtype.type
            a, b_, c, d = (own(t) for t in (out[p].real, out[p].imag, v.real, v.imag))
            out[p] = complex(_fma(a, c, -(b_ * d), own), _fma(a, d, b_ * c, own))
        elif mode == 2:
            out[p] = out[p] * v
        elif mode == 4:
            out[p] = v if v != v else max(out[p], v) if out[p] == out[p] else out[p]
        else:
            out[p] = v if v != v else min(out[p], v) if out[p] == out[p] else out[p]
        count[p] += 1
    if mode == 3:
        c = np.maximum(count, 1)
        out = np.where(count > 0, out / c if np.issubdtype(out.dtype, np.floating)
                       else np.floor_divide(out, c), out).astype(out.dtype)
    return [out, count] if len(outs) == 2 else [out]


def _lib_masked_scatter(outs, attrs, self_, mask, source, csum=None):
    out = np.array(self_, copy=True).reshape(-1)
    m = np.broadcast_to(mask, self_.shape).reshape(-1)
    src = np.asarray(source).reshape(-1)
    if m.sum() > src.size:
        raise InterpError(f"masked_scatter: the mask selects more elements than source has "
                          f"({src.size})")
    out[m] = src[:int(m.sum())]
    return [out]


def _lib_nonzero(outs, attrs, mask, count):
    m = np.asarray(mask, dtype=bool)
    out = np.argwhere(m).astype(np.int64).reshape(-1, m.ndim)
    if len(out) != int(np.asarray(count).reshape(-1)[0]):
        raise InterpError("nonzero: the count differs from the true elements")
    return [out]


def _lib_embedding_bag(outs, attrs, weight, indices, offsets, psw=None):
    n = indices.size
    ids, offs = indices.reshape(-1).astype(np.int64), offsets.reshape(-1).astype(np.int64)
    if n and (ids.min() < 0 or ids.max() >= weight.shape[0]):
        raise InterpError("embedding_bag: index out of range")
    bags = offs.size - (1 if attrs["include_last_offset"] else 0)
    out = np.zeros((bags, weight.shape[1]), np.float64)
    for b in range(bags):
        hi = offs[b + 1] if b + 1 < offs.size else n
        rows = [(i, ids[i]) for i in range(offs[b], hi) if ids[i] != attrs["padding_idx"]]
        if not rows:
            continue
        vecs = np.stack([weight[j].astype(np.float64) * (1 if psw is None else psw[i])
                         for i, j in rows])
        if attrs["mode"] == 2:  # the first row, then each greater one (eager's NaN rule)
            top = vecs[0].copy()
            for v in vecs[1:]:
                top = np.where(v > top, v, top)
            out[b] = top
            continue
        out[b] = [vecs.sum(0), vecs.mean(0)][attrs["mode"]]
    return [out.astype(weight.dtype)]


def _lib_attention(outs, attrs, q, k, v, mask=None):
    """softmax(scale * q @ k^T (+ mask / where mask, causal: key <= query)) @ v in float64,
    one (batch, head) at a time; a row whose keys are all masked gives zeros, as eager does.
    A second output (the CUDA decode path's split-K scratch, lowering/attention.py) holds no
    result: zeros."""
    (dt, shape), *scratch = outs
    out = np.zeros(shape, dtype=np.float64)
    lq, s = q.shape[2], k.shape[2]
    g = attrs.get("group", 1)  # grouped queries: head h reads kv head h // g
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    keep = np.tril(np.ones((lq, s), dtype=bool)) if attrs["causal"] else np.ones((lq, s), bool)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            sc = attrs["scale"] * (q[b, h].astype(np.float64) @ k[b, h].astype(np.float64).T)
            kept = keep.copy()
            if attrs["mask"] == 1:
                kept &= mask[b, h].astype(bool)
            elif attrs["mask"] == 2:
                sc = sc + mask[b, h].astype(np.float64)
            sc = np.where(kept, sc, -np.inf)
            top = sc.max(axis=1, keepdims=True) if s else np.zeros((lq, 1))
            top = np.where(np.isneginf(top), 0.0, top)
            p = np.exp(sc - top)
            total = p.sum(axis=1, keepdims=True)
            out[b, h] = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0) @ \
                v[b, h].astype(np.float64)
    return [out, *(np.zeros(sh, np.float32) for _, sh in scratch)]


def _lib_conv2d_nchwc(outs, attrs, x, w, b, res=None):
    """kiln_conv.h's direct convolution: NCHWc (or NCHW) x, packed w, in float64."""
    a = attrs
    # sizes from the operands (the package's model.py passes its flat buffer as the output)
    n, ocb, oh, ow, blk = x.shape[0], w.shape[0], a["oh"], a["ow"], w.shape[-1]
    x = x.astype(np.float64)
    if x.ndim == 5:  # [N, Cb, H, W, B] -> [N, C, H, W]
        x = x.transpose(0, 1, 4, 2, 3).reshape(x.shape[0], -1, x.shape[2], x.shape[3])
    if a["depthwise"]:  # [Cb, KH, KW, B] -> [C, KH, KW]
        wf = w.astype(np.float64).transpose(0, 3, 1, 2).reshape(-1, w.shape[1], w.shape[2])
    else:  # [OCb, ICb, KH, KW, i, o] -> [OC, IC, KH, KW]
        wf = w.astype(np.float64).transpose(0, 5, 1, 4, 2, 3)
        wf = wf.reshape(wf.shape[0] * blk, wf.shape[2] * wf.shape[3], *wf.shape[4:])
    kh, kw = wf.shape[-2:]
    # padding after: what the output size needs (an asymmetric pad folded into the
    # convolution, passes/fold_pad.py's edge_pad, reads zeros past the bottom / right edge)
    after = [max(p, (o - 1) * st + (k - 1) * d + 1 - i - p) for p, o, st, k, d, i in (
        (a["ph"], oh, a["sh"], kh, a["dh"], x.shape[2]),
        (a["pw"], ow, a["sw"], kw, a["dw"], x.shape[3]))]
    xp = np.pad(x, ((0, 0), (0, 0), (a["ph"], after[0]), (a["pw"], after[1])))
    out = np.zeros((n, ocb * blk, oh, ow))
    for ky in range(kh):
        for kx in range(kw):
            y0, x0 = ky * a["dh"], kx * a["dw"]
            channels = wf.shape[0 if a["depthwise"] else 1]
            win = xp[:, :channels, y0:y0 + a["sh"] * (oh - 1) + 1:a["sh"],
                     x0:x0 + a["sw"] * (ow - 1) + 1:a["sw"]]
            if a["depthwise"]:
                out += win * wf[None, :, ky, kx, None, None]
            else:
                out += np.einsum("oc,nchw->nohw", wf[:, :, ky, kx], win)
    out += b.astype(np.float64).reshape(1, -1, 1, 1)
    out = out.reshape(n, ocb, blk, oh, ow).transpose(0, 1, 3, 4, 2)
    if res is not None:
        out = out + res.astype(np.float64)
    act = a["act"]
    if act == 1:
        out = np.maximum(out, 0)
    elif act == 2:
        out = np.minimum(np.maximum(out, a["lo"]), a["hi"])
    elif act == 3:
        out = out / (1 + np.exp(-out))
    return [out]


def _lib_conv2d_block_nchwc(outs, attrs, x, *ops):
    """kiln_conv.h's inverted residual block: expand 1x1 -> depthwise -> project 1x1
    [+ res], each stage's epilogue (act{i}, lo{i}, hi{i}), in float64; operands (w1, b1, w2,
    b2, w3, b3[, res]), or without the expand (w2, b2, w3, b3[, res])."""
    a = attrs
    if len(ops) in (4, 5):  # no expand: the depthwise reads x
        w2, b2, w3, b3, *rest = ops
        geo = {k: a[k] for k in ("oh", "ow", "sh", "sw", "ph", "pw", "dh", "dw")}
        (d,) = _lib_conv2d_nchwc(outs, {"act": a["act2"], "lo": a["lo2"], "hi": a["hi2"],
                                        "depthwise": True, **geo}, x, w2, b2)
        return _lib_conv2d_nchwc(outs, {"act": a["act3"], "lo": a["lo3"], "hi": a["hi3"],
                                        "ph": 0, "pw": 0, "sh": 1, "sw": 1, "dh": 1, "dw": 1,
                                        "depthwise": False, "oh": a["oh"], "ow": a["ow"]},
                                 d, w3, b3, *rest)
    w1, b1, w2, b2, w3, b3, *rest = ops
    res = rest[0] if rest else None
    h, w = x.shape[2], x.shape[3]

    def stage(i, **geo):
        return {"act": a[f"act{i}"], "lo": a[f"lo{i}"], "hi": a[f"hi{i}"], "ph": 0, "pw": 0,
                "sh": 1, "sw": 1, "dh": 1, "dw": 1, "depthwise": False, **geo}

    (e,) = _lib_conv2d_nchwc(outs, stage(1, oh=h, ow=w), x, w1, b1)
    geo = {k: a[k] for k in ("oh", "ow", "sh", "sw", "ph", "pw", "dh", "dw")}
    (d,) = _lib_conv2d_nchwc(outs, stage(2, depthwise=True, **geo), e, w2, b2)
    return _lib_conv2d_nchwc(outs, stage(3, oh=a["oh"], ow=a["ow"]), d, w3, b3, res)


def _lib_conv2d_nhwc(outs, attrs, x, w, b=None, res=None):
    """The CUDA NHWC convolution (targets/cuda/conv_template.py): x [N, H, W, C], packed w
    ([G, KH * KW * Cg, OCg], or [KH, KW, C] depthwise), float32 [scale; shift], in float64. Split-K
    (attribute split S > 1): S partial sums [S, N, OH, OW, OC] without the epilogue (here
    the whole sum in the first, zeros in the others)."""
    a = attrs
    n, oh, ow, oc = outs[0][1][-4:]
    kh, kw, g = a["kh"], a["kw"], a["groups"]
    x = x.astype(np.float64)
    c = x.shape[3]
    if a["depthwise"]:  # [KH, KW, C] -> [C, 1, KH, KW]
        wf = w.astype(np.float64).transpose(2, 0, 1)[:, None]
    else:  # [G, (KH, KW, Cg), OCg] -> [G * OCg, Cg, KH, KW]
        wf = w.astype(np.float64).reshape(g, kh, kw, c // g, oc // g).transpose(0, 4, 3, 1, 2)
        wf = wf.reshape(oc, c // g, kh, kw)
    xp = np.pad(x, ((0, 0), (a["ph"], a["ph"]), (a["pw"], a["pw"]), (0, 0)))
    out = np.zeros((n, oh, ow, oc))
    cg, ocg = c // g, oc // g
    for ky in range(kh):
        for kx in range(kw):
            y0, x0 = ky * a["dh"], kx * a["dw"]
            win = xp[:, y0:y0 + a["sh"] * (oh - 1) + 1:a["sh"],
                     x0:x0 + a["sw"] * (ow - 1) + 1:a["sw"], :]
            for gi in range(g):
                out[..., gi * ocg:(gi + 1) * ocg] += np.einsum(
                    "nhwc,oc->nhwo", win[..., gi * cg:(gi + 1) * cg],
                    wf[gi * ocg:(gi + 1) * ocg, :, ky, kx])
    if a.get("split", 1) > 1:
        parts = np.zeros((a["split"], n, oh, ow, oc))
        parts[0] = out
        return [parts]
    b = b.astype(np.float64)
    out = out * b[:oc] + b[oc:]
    if res is not None:
        out = out + res.astype(np.float64)
    act = a["act"]
    if act == 1:
        out = np.maximum(out, 0)
    elif act == 2:
        out = np.minimum(np.maximum(out, a["lo"]), a["hi"])
    elif act == 3:
        out = out / (1 + np.exp(-out))
    return [out]


def _lib_max_pool2d_nchwc(outs, attrs, x):
    """kiln_conv.h's max pooling of an NCHWc x [N, Cb, H, W, B]: the window clipped to the
    input, NaN propagating."""
    a = attrs
    n, cb, oh, ow, blk = x.shape[0], x.shape[1], a["oh"], a["ow"], x.shape[4]
    pad = ((0, 0), (0, 0), (a["ph"], a["ph"] + a["sh"] * oh), (a["pw"], a["pw"] + a["sw"] * ow),
           (0, 0))
    xp = np.pad(x.astype(np.float32), pad, constant_values=-np.inf)
    out = np.full((n, cb, oh, ow, blk), -np.inf, np.float32)
    for ky in range(a["kh"]):
        for kx in range(a["kw"]):
            y0, x0 = ky * a["dh"], kx * a["dw"]
            win = xp[:, :, y0:y0 + a["sh"] * (oh - 1) + 1:a["sh"],
                     x0:x0 + a["sw"] * (ow - 1) + 1:a["sw"]]
            out = np.where((win > out) | np.isnan(win), win, out)
    return [out]


# routine -> numpy twin: (outs [(dtype name, shape)], attrs, *operands) -> one array per out
ROUTINES = {"sort": _lib_sort, "topk": _lib_topk, "scan": _lib_scan,
            "scan_extreme": _lib_scan_extreme, "put": _lib_put, "put_mean": _lib_put,
            "masked_scatter": _lib_masked_scatter, "embedding_bag": _lib_embedding_bag,
            "nonzero": _lib_nonzero,
            "attention": _lib_attention, "conv2d_nchwc": _lib_conv2d_nchwc,
            "conv2d_block_nchwc": _lib_conv2d_block_nchwc,
            "conv2d_nhwc": _lib_conv2d_nhwc,
            "max_pool2d_nchwc": _lib_max_pool2d_nchwc,
            "qgemm": quant_routine}


def run_routine(call: L.Extern, outs, operands: list[np.ndarray]) -> list[np.ndarray]:
    """Run the numpy twin of `call` on operands (arrays shaped like its LibArgs); `outs` are the
    (dtype name, shape) of its outputs. Returns flat arrays."""
    got = ROUTINES[call.routine](outs, dict(call.attrs), *operands)
    return [np.ascontiguousarray(g).astype(dtypes.dtype(dt).numpy).reshape(-1) for g, (dt, _) in
            zip(got, outs)]


def _extern(node: L.Extern, bufs, env, prog: L.LoopProgram) -> list[np.ndarray]:
    ops = []
    for a in node.args:
        base = bufs[a.buf]
        sizes = [evaluate(d, env) for d in a.shape]
        strides = [evaluate(s, env) * base.itemsize for s in a.strides]
        start = base[evaluate(a.offset, env):]
        ops.append(np.lib.stride_tricks.as_strided(start, sizes, strides).copy())
    outs = [(prog.buffer(o).dtype.name, tuple(evaluate(d, env) for d in prog.buffer(o).shape))
            for o in node.outs]
    return run_routine(node, outs, ops)


def run_loop(prog: L.LoopProgram, inputs: Mapping[str, np.ndarray],
             env: Mapping[str, int]) -> list[np.ndarray]:
    """Run `prog` on named inputs and weights (numpy arrays) with sizes `env`; returns the
    outputs, shaped by the program's output shapes."""
    bufs = {k: np.ascontiguousarray(v).reshape(-1) for k, v in inputs.items()}
    env = dict(env)
    _run_nodes(prog.nodes, bufs, env, prog)
    return [bufs[o].reshape([evaluate(d, env) for d in shape])
            for o, shape in zip(prog.outputs, prog.output_shapes)]
