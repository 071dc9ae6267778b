"""Converters for more views (flip, roll, diagonal, as_strided), the scatter-into-view family
(slice_scatter, diagonal_scatter, as_strided_scatter), pointwise ops that have no single kiln
op (clamp with tensor bounds, round with decimals, elu) and the statistics results of the
norms (mean and rstd of native_layer_norm / native_group_norm / batch norm).

Registered into the same `TABLE` as aten_table.py; like those, converters only translate."""

from __future__ import annotations

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_high import Fallback
from kiln.frontend.aten_table import batch_statistics_norm, register
from kiln.ir import dtypes


def _arg(n, k: int, name: str, default=None):
    if len(n.args) > k:
        return n.args[k]
    return n.kwargs.get(name, default)


# -- views --------------------------------------------------------------------------------------
@register("aten.flip.default")
def _flip(b, n):
    rank = b.rank(n.args[0])
    dims = tuple(sorted({d % max(rank, 1) for d in n.args[1]}))
    return b.emit("flip", [b.tensor(n.args[0])], n, dims=dims)


@register("aten.roll.default")
def _roll(b, n):
    """roll over static dims; no dims: roll the flattened tensor. Dynamic sizes decompose."""
    x = n.args[0]
    shifts = list(_arg(n, 1, "shifts"))
    dims = list(_arg(n, 2, "dims", []) or [])
    shape = b.shape(x)
    if any(not d.is_Integer for d in shape):
        raise Fallback("roll of a dynamic size")
    if not dims:
        flat = 1
        for d in shape:
            flat *= int(d)
        v = b.emit("view", [b.tensor(x)], None, like=n, shape=(flat,))
        r = b.emit("roll", [v], None, like=n, shape=(flat,), shifts=(int(shifts[0]),), dims=(0,))
        return b.emit("view", [r], n)
    rank = b.rank(x)
    return b.emit("roll", [b.tensor(x)], n, shifts=tuple(int(s) for s in shifts),
                  dims=tuple(d % rank for d in dims))


@register("aten.diagonal.default", "aten.diagonal_copy.default")
def _diagonal(b, n):
    rank = b.rank(n.args[0])
    return b.emit("diagonal", [b.tensor(n.args[0])], n, offset=int(_arg(n, 1, "offset", 0)),
                  dim1=_arg(n, 2, "dim1", 0) % rank, dim2=_arg(n, 3, "dim2", 1) % rank)


def _storage_offset(b, n, x, k: int) -> object:
    """as_strided's storage offset relative to the first element of `x` (kiln addresses the
    storage of a value as its contiguous row-major layout)."""
    given = _arg(n, k, "storage_offset")
    own = b.val(x).storage_offset()
    offset = b.int_or_sym(given if given is not None else own)
    return sympy.sympify(offset) - sympy.sympify(b.int_or_sym(own))


def _meta_strides(b, x) -> tuple:
    return tuple(sympy.sympify(b.int_or_sym(s)) for s in b.val(x).stride())


def _check_extent(b, n, x, size, stride, offset) -> None:
    """The view must stay inside the storage span of `x` itself (first to last element)."""
    span = sum(((d - 1) * st for d, st in zip(b.shape(x), _meta_strides(b, x))),
               sympy.Integer(0))
    last = offset + sum(((sympy.sympify(s) - 1) * st for s, st in zip(size, stride)),
                        sympy.Integer(0))
    empty = any(sympy.sympify(s) == 0 for s in size)
    if not empty and last.is_Integer and span.is_Integer and (
            int(offset) < 0 or int(last) > int(span)):
        raise UnsupportedError(f"as_strided of node {n.name} reads outside its input's storage "
                               f"span [0, {span}] (storage offset {offset}, last {last})")


@register("aten.as_strided.default", "aten.as_strided_copy.default")
def _as_strided(b, n):
    x = n.args[0]
    size = tuple(b.int_or_sym(s) for s in n.args[1])
    stride = tuple(sympy.sympify(b.int_or_sym(s)) for s in n.args[2])
    offset = _storage_offset(b, n, x, 3)
    _check_extent(b, n, x, size, stride, offset)
    return b.emit("as_strided", [b.tensor(x)], n, stride=stride, offset=offset,
                  src_strides=_meta_strides(b, x))


# -- scatter into a view: out = input, with the view's elements replaced by src ----------------
@register("aten.slice_scatter.default")
def _slice_scatter(b, n):
    x, src = n.args[0], n.args[1]
    rank = b.rank(x)
    dim = _arg(n, 2, "dim", 0) % rank
    start, end = _arg(n, 3, "start"), _arg(n, 4, "end")
    xs, ss = b.promoted_operands(n, x, src)
    return b.emit("slice_scatter", [xs, ss], n, dim=dim,
                  start=b.int_or_sym(start) if start is not None else None,
                  end=b.int_or_sym(end) if end is not None else None,
                  step=int(_arg(n, 5, "step", 1)))


@register("aten.diagonal_scatter.default")
def _diagonal_scatter(b, n):
    x, src = n.args[0], n.args[1]
    rank = b.rank(x)
    xs, ss = b.promoted_operands(n, x, src)
    return b.emit("diagonal_scatter", [xs, ss], n, offset=int(_arg(n, 2, "offset", 0)),
                  dim1=_arg(n, 3, "dim1", 0) % rank, dim2=_arg(n, 4, "dim2", 1) % rank)


@register("aten.as_strided_scatter.default")
def _as_strided_scatter(b, n):
    x, src = n.args[0], n.args[1]
    size = tuple(b.int_or_sym(s) for s in n.args[2])
    stride = tuple(sympy.sympify(b.int_or_sym(s)) for s in n.args[3])
    offset = _storage_offset(b, n, x, 4)
    if not b.val(x).is_contiguous():
        raise UnsupportedError(f"as_strided_scatter into a non-contiguous input (node {n.name})")
    _check_extent(b, n, x, size, stride, offset)
    xs, ss = b.promoted_operands(n, x, src)
    return b.emit("as_strided_scatter", [xs, ss], n, size=size, stride=stride, offset=offset)


# -- pointwise compositions ---------------------------------------------------------------------
@register("aten.clamp.Tensor", "aten.clamp_min.Tensor", "aten.clamp_max.Tensor")
def _clamp_tensor(b, n):
    """clamp with tensor bounds (either may be None) = minimum(maximum(x, lo), hi), in the
    promoted dtype; NaN in x or a bound propagates."""
    name = str(n.target)
    if "clamp_min" in name:
        lo, hi = n.args[1], None
    elif "clamp_max" in name:
        lo, hi = None, n.args[1]
    else:
        lo, hi = _arg(n, 1, "min"), _arg(n, 2, "max")
    dt = b.meta_dtype(n)
    y = b.cast_to(b.tensor(n.args[0]), dt, n)  # broadcasts to the bounds' shape below
    ops = [(t, op) for t, op in ((lo, "maximum"), (hi, "minimum")) if t is not None]
    if not ops:
        raise UnsupportedError(f"clamp with neither min nor max (node {n.name})")
    for k, (t, op) in enumerate(ops):
        bound = b.scalar(t, dt) if isinstance(t, (int, float)) else b.cast_to(b.tensor(t), dt, n)
        y = b.emit(op, [y, bound], n if k == len(ops) - 1 else None, like=n)
    return y


@register("aten.round.decimals")
def _round_decimals(b, n):
    """torch's definition: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d for
    negative d, with 10^|d| in the tensor's dtype."""
    decimals = int(_arg(n, 1, "decimals", 0))
    x = b.tensor(n.args[0])
    if decimals == 0:
        return b.emit("round", [x], n)
    dt = b.meta_dtype(n)
    ten = b.scalar(float(10.0 ** abs(decimals)), dt)
    first, second = ("mul", "div") if decimals > 0 else ("div", "mul")
    scaled = b.emit(first, [x, ten], None, like=n)
    r = b.emit("round", [scaled], None, like=n)
    return b.emit(second, [r, ten], n)


@register("aten.elu.default")
def _elu(b, n):
    """elu(x) = x * scale for x > 0, else alpha * scale * expm1(x * input_scale)."""
    alpha = float(_arg(n, 1, "alpha", 1.0))
    scale = float(_arg(n, 2, "scale", 1.0))
    input_scale = float(_arg(n, 3, "input_scale", 1.0))
    dt = b.meta_dtype(n)
    x = b.tensor(n.args[0])
    pos = b.emit("mul", [x, b.scalar(scale, dt)], None, like=n)
    neg = b.emit("expm1", [b.emit("mul", [x, b.scalar(input_scale, dt)], None, like=n)], None,
                 like=n)
    neg = b.emit("mul", [neg, b.scalar(alpha * scale, dt)], None, like=n)
    cond = b.emit("gt", [x, b.scalar(0.0, dt)], None, like=n, dtype=_bool())
    return b.emit("where", [cond, pos, neg], n)


def _bool():
    return dtypes.bool_


# -- norms with their statistics ----------------------------------------------------------------
def _stats(b, n, x: str, dims, eps: float, keepdim: bool, results=(1, 2)):
    """(mean, rstd) of `x` over `dims` (biased variance), as results `results` of node n."""
    dt = b.meta_dtype(n)
    mean = b.emit("reduce", [x], None, like=n, result=results[0], kind="mean", dims=dims,
                  keepdim=keepdim)
    var = b.emit("var", [x], None, like=n, result=results[1], dims=dims, correction=0,
                 keepdim=keepdim)
    eps_v = b.emit("add", [var, b.scalar(eps, dt)], None, like=n, result=results[1])
    return mean, b.emit("rsqrt", [eps_v], None, like=n, result=results[1])


@register("aten.native_layer_norm.default")
def _native_layer_norm(b, n):
    x, shape, w, bias, eps = n.args
    rank = b.rank(x)
    ins = [b.tensor(x)] + [b.tensor(t) for t in (w, bias) if t is not None]
    out = b.emit("layer_norm", ins, None, like=n, result=0, norm_rank=len(shape),
                 eps=float(eps), has_weight=w is not None, has_bias=bias is not None)
    dims = tuple(range(rank - len(shape), rank))
    mean, rstd = _stats(b, n, b.tensor(x), dims, float(eps), keepdim=True)
    return [out, mean, rstd]


@register("aten.native_group_norm.default")
def _native_group_norm(b, n):
    """x [N, C, *] -> view [N, G, C/G * prod(*)] -> layer_norm over the last dim -> view back,
    then the per-channel affine (weight/bias viewed as [C, 1, ...]); mean and rstd [N, G].
    A 16-bit x is normalised in float32 and rounded once at the end, like eager (the views
    between the steps would otherwise round the normalised value before the affine)."""
    x, w, bias, _n, _c, _hw, groups, eps = n.args
    shape = b.shape(x)
    inner = shape[1] // groups
    for d in shape[2:]:
        inner = inner * d
    grouped = (shape[0], groups, inner)
    xt = b.tensor(x)
    narrow = dtypes.is_narrow(b.types[xt].dtype)
    wide = dtypes.float32 if narrow else None

    def f32(name: str) -> str:
        return b.cast_to(name, torch.float32, n) if narrow else name

    v = b.emit("view", [xt], None, like=n, result=0, shape=grouped)
    ln = b.emit("layer_norm", [f32(v)], None, like=n, result=0, shape=grouped, norm_rank=1,
                eps=float(eps), has_weight=False, has_bias=False, dtype=wide)
    y = b.emit("view", [ln], None, like=n, result=0, dtype=wide)
    for t, op in ((w, "mul"), (bias, "add")):
        if t is not None:
            tv = b.emit("view", [f32(b.tensor(t))], None, like=n, result=0,
                        shape=(shape[1],) + (1,) * (len(shape) - 2), dtype=wide)
            y = b.emit(op, [y, tv], None, like=n, result=0, dtype=wide)
    if narrow:
        y = b.cast_to(y, b.meta_dtype(x), n)
    mean, rstd = _stats(b, n, v, (2,), float(eps), keepdim=False)
    return [y, mean, rstd]


@register("aten._native_batch_norm_legit.no_stats")
def _batch_norm_no_stats(b, n):
    """Batch norm with batch statistics and no running statistics: (out, mean, rstd)."""
    x, w, bias, training, _momentum, eps = n.args
    if not training:
        raise UnsupportedError(f"batch norm without running statistics in eval mode "
                               f"(node {n.name})")
    out, mean, _var, rstd = batch_statistics_norm(b, n, x, w, bias, eps)
    return [out, mean, rstd]


@register("aten._native_batch_norm_legit.default")
def _batch_norm_legit(b, n):
    """With running statistics: eval mode normalises with them (results 1 and 2 are empty);
    training mode updates them in place: the program is decomposed to the functional form."""
    x, w, bias, mean, var, training, _momentum, eps = n.args
    if training:  # decomposed, it becomes _native_batch_norm_legit_functional
        raise Fallback("batch norm updating its running statistics in place")
    ins = [b.tensor(x), b.tensor(mean), b.tensor(var)]
    ins += [b.tensor(t) for t in (w, bias) if t is not None]
    out = b.emit("batch_norm", ins, None, like=n, result=0, eps=float(eps),
                 has_weight=w is not None, has_bias=bias is not None)
    empty = [b.emit("full", [], None, like=n, result=k, value=0) for k in (1, 2)]
    return [out, *empty]


@register("aten.select_scatter.default")
def _select_scatter(b, n):
    """select_scatter = slice_scatter of src with the selected dim put back (size 1)."""
    x, src = n.args[0], n.args[1]
    rank = b.rank(x)
    dim = _arg(n, 2, "dim") % rank
    index = b.int_or_sym(_arg(n, 3, "index"))
    if isinstance(index, int) and index < 0:
        index = b.shape(x)[dim] + index
    xs, ss = b.promoted_operands(n, x, src)
    shape = list(b.shape(x))
    shape[dim] = sympy.Integer(1)
    sv = b.emit("view", [ss], None, like=n, shape=tuple(shape))
    return b.emit("slice_scatter", [xs, sv], n, dim=dim, start=index, end=index + 1, step=1)


@register("aten.copy.default")
def _copy_into(b, n):
    """copy(self, src): src broadcast to self's shape, in self's dtype."""
    src = b.emit("expand", [b.tensor(n.args[1])], None, like=n, dtype=b.type_of(n.args[1]).dtype)
    return b.emit("cast", [src], n)


@register("aten.fill.Scalar", "aten.fill.Tensor")
def _fill(b, n):
    value = n.args[1]
    if not isinstance(value, (bool, int, float)):  # a 0-d tensor
        v = b.emit("expand", [b.tensor(value)], None, like=n, dtype=b.type_of(value).dtype)
        return b.emit("cast", [v], n)
    return b.emit("full", [], n, value=value)


@register("aten.empty_strided.default")
def _empty_strided(b, n):
    """Uninitialised memory in eager; zeros here (kiln's outputs are contiguous)."""
    return b.emit("full", [], n, value=0)
