"""Generator families for the capabilities of issue 16: data-dependent sizes without an upper
bound, complex values, and outputs that alias (another output, or an input). Strided inputs
come from the runner, which runs every program on inputs in other layouts too
(`runner.relaid`), and from `export_layout`: one program in five is exported with its inputs in
another layout (a transposed weight, a step-2 slice as the input itself, a storage offset,
channels-last), so kiln specialises to the strides the export records.

Values these families make that other families must not take (a data-dependent dim "U", a
complex dtype) are "special" (`special`): `_Gen.pick` skips them, and they end as outputs or
are reduced to an ordinary value here.

- `op_ragged`: `torch.repeat_interleave(x, repeats)` (an ATen call whose result length is
  data-dependent and unbounded) or `torch.ones(k, c) * x` with `k = repeats.sum().item()`
  checked only `>= 0` (a size kiln reads itself), then maybe a reduction over the ragged dim;
- `op_complex`: two float values made complex (`torch.complex`), an op on complex values
  (product, conjugate product, exp, FFT over the last dim), back to a real value, or kept
  complex as an output;
- `alias_outputs`: extra outputs that are views (slice, transpose, select, unsqueeze) of an
  output or of an input, or an input itself; the runner checks that kiln's outputs share
  storage exactly where eager's do."""

from __future__ import annotations

import random

from kiln.fuzz.program import LAYOUTS, V, bshape

U = "U"  # a data-dependent dim without an upper bound


def special(v: V) -> bool:
    """A value only these families handle: a ragged dim, or complex elements."""
    return U in v.shape or v.dtype.startswith("complex")


def export_layout(seed: int) -> str | None:
    """The layout of program `seed`'s export inputs (None: contiguous). Drawn from a stream of
    its own so that the rest of each program stays what it was before this family."""
    r = random.Random(seed ^ 0x1A70)
    return r.choice(LAYOUTS) if r.random() < 0.2 else None


def _float_1d(g, most: int = 12) -> int:
    """A rank-1 static float value (an existing one, or a new input)."""
    i = g.pick(lambda v: len(v.shape) == 1 and isinstance(v.shape[0], int)
               and v.shape[0] <= most and v.dtype.startswith("float")) \
        if g.r.random() < 0.5 else None
    if i is None:
        i = g.new_input((g.r.randint(1, most),), g.r.choice(["float32"] * 3 + ["float64"]))
    return i


def op_ragged(g) -> None:
    r = g.r
    x = _float_1d(g)
    v = g.vals[x]
    if r.random() < 0.5:
        reps = g.new_input(v.shape, "int64", high=r.choice([2, 4, 6]))
        y = g.emit("repeat_interleave", [x, reps], {}, V((U,), v.dtype, v.exact))
    else:
        reps = g.new_input((r.randint(1, 4),), "int64", high=r.choice([3, 5]))
        y = g.emit("item_rows", [reps, x], {}, V((U, v.shape[0]), v.dtype, v.exact))
    if r.random() < 0.4:  # a pointwise op on the ragged value
        y = g.emit("ragged_scale", [y], {}, V(g.vals[y].shape, v.dtype, False))
    if r.random() < 0.6:  # back to an ordinary value: a sum over the ragged dim
        g.emit("ragged_sum", [y], {}, V(g.vals[y].shape[1:], v.dtype, False))


COMPLEX_FNS = ["mul_abs", "conj_mul_real", "exp_imag", "add_real", "fft_abs", "keep"]


def op_complex(g) -> None:
    r = g.r
    i = g.pick(lambda v: v.dtype in ("float32", "float64") and len(v.shape) >= 1)
    v = g.vals[i]
    j = g.partner(v, v.dtype)
    w = g.vals[j]
    shape = bshape(v.shape, w.shape)
    fns = [f for f in COMPLEX_FNS if f != "fft_abs" or shape[-1] != "B"]
    fn = r.choice(fns)
    if fn == "keep":
        cdt = "complex128" if v.dtype == "float64" else "complex64"
        g.emit("complex", [i, j], {"fn": fn}, V(shape, cdt, False))
        return
    g.emit("complex", [i, j], {"fn": fn}, V(shape, v.dtype, False))


def alias_outputs(g) -> list[int]:
    """Value ids to return besides the generator's outputs: views of the last value or of
    an input, or an input itself (each with some probability)."""
    r, out = g.r, []
    ops = [k for k in range(len(g.vals)) if k not in g.inputs]
    if ops and r.random() < 0.25:
        last = ops[-1]
        k = _view_of(g, last)
        if k is not None:
            out += [last, k]
    if g.inputs and r.random() < 0.15:
        x = r.choice(g.inputs)
        k = _view_of(g, x) if r.random() < 0.7 else x
        if k is not None:
            out.append(k)
    return out


def _view_of(g, i: int) -> int | None:
    v, r = g.vals[i], g.r
    if special(v) or not v.shape:
        return None
    s, rank = list(v.shape), len(v.shape)
    kind = r.choice(["slice", "transpose", "select", "unsqueeze"])
    static = [d for d, n in enumerate(s) if n != "B" and n >= 2]
    if kind == "transpose" and rank >= 2:
        d0, d1 = r.sample(range(rank), 2)
        s[d0], s[d1] = s[d1], s[d0]
        return g.emit("transpose", [i], {"d0": d0, "d1": d1}, V(tuple(s), v.dtype, v.exact))
    if kind == "slice" and static:
        d = r.choice(static)
        start, step = r.randrange(s[d] - 1), r.choice([1, 2])
        s[d] = len(range(start, s[d], step))
        return g.emit("slice", [i], {"dim": d, "start": start, "end": None, "step": step},
                      V(tuple(s), v.dtype, v.exact))
    if kind == "select" and static and rank >= 2:
        d = r.choice(static)
        return g.emit("select", [i], {"dim": d, "index": r.randrange(s[d])},
                      V(tuple(s[:d] + s[d + 1:]), v.dtype, v.exact))
    d = r.randrange(rank + 1)
    return g.emit("unsqueeze", [i], {"dim": d}, V(tuple(s[:d] + [1] + s[d:]), v.dtype, v.exact))


FAMILIES = [(op_ragged, 1), (op_complex, 1)]
