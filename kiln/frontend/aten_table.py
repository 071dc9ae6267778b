"""One table: aten overload -> kiln Graph IR op.

Each converter receives a `Builder` (see export.py) and the FX node, and returns the name of the
kiln value that stands for the node's (first) result. Converters only translate; they never
decide how an op is computed (that is lowering's job)."""

from __future__ import annotations

from collections.abc import Callable

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.ops import ROWS

Converter = Callable[..., str]
TABLE: dict[str, Converter] = {}

#: aten op name -> kiln pointwise op (a row of kiln/ops/table.py, which says what it computes).
#: The row's arity picks the overloads registered: `.default` for one operand, the Tensor /
#: Scalar variants (`BINARY_OVERLOADS`) for two.
POINTWISE = {
    "neg": "neg", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh",
    "sigmoid": "sigmoid", "relu": "relu", "abs": "abs", "sin": "sin", "cos": "cos", "erf": "erf",
    "logical_not": "logical_not", "reciprocal": "reciprocal", "floor": "floor", "ceil": "ceil",
    "round": "round", "log1p": "log1p", "expm1": "expm1", "sign": "sign", "silu": "silu",
    "exp2": "exp2", "log2": "log2", "trunc": "trunc", "bitwise_not": "bitwise_not",
    "isnan": "isnan", "isinf": "isinf", "tan": "tan", "atan": "atan", "asin": "asin",
    "acos": "acos", "sinh": "sinh", "cosh": "cosh", "asinh": "asinh", "acosh": "acosh",
    "atanh": "atanh", "erfc": "erfc", "hardswish": "hardswish", "hardsigmoid": "hardsigmoid",
    "mish": "mish", "softplus_default": "softplus", "log10": "log10", "i0": "i0",
    "special_i0": "i0", "signbit": "signbit",
    "add": "add", "sub": "sub", "mul": "mul", "div": "div", "pow": "pow", "maximum": "maximum",
    "minimum": "minimum", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "logical_and": "logical_and", "logical_or": "logical_or", "logical_xor": "logical_xor",
    "remainder": "remainder", "fmod": "fmod", "atan2": "atan2", "bitwise_and": "bitwise_and",
    "bitwise_or": "bitwise_or", "bitwise_xor": "bitwise_xor", "floor_divide": "floor_divide",
    "hypot": "hypot", "copysign": "copysign", "nextafter": "nextafter",
    "bitwise_left_shift": "shift_left", "__lshift__": "shift_left",
    "bitwise_right_shift": "shift_right", "__rshift__": "shift_right",
    "__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor",
}
REDUCTIONS = {"sum": "sum", "amax": "max", "amin": "min", "prod": "prod", "any": "any",
              "all": "all", "mean": "mean"}


def register(*names: str):
    def deco(fn: Converter) -> Converter:
        for n in names:
            TABLE[n] = fn
        return fn
    return deco


def _unary(op: str) -> Converter:
    return lambda b, n: b.emit(op, [b.tensor(n.args[0])], n)


def _binary(op: str) -> Converter:
    def conv(b, n):
        x, y = b.promoted_operands(n, n.args[0], n.args[1])
        alpha = n.kwargs.get("alpha", 1)
        if op in ("add", "sub") and alpha != 1:
            y = b.emit("mul", [y, b.scalar(alpha, b.meta_dtype(n))], None, like=n)
        attrs = {}
        if op == "div" and n.kwargs.get("rounding_mode"):
            attrs["rounding_mode"] = n.kwargs["rounding_mode"]
        return b.emit(op, [x, y], n, **attrs)
    return conv


BINARY_OVERLOADS = ("Tensor", "Scalar", "default", "Tensor_Scalar", "Scalar_Tensor",
                    "Tensor_Tensor", "Tensor_mode", "Scalar_mode")
for _name, _op in POINTWISE.items():
    if ROWS[_op].arity == 1:
        register(f"aten.{_name}.default")(_unary(_op))
    else:
        for _ov in BINARY_OVERLOADS:
            register(f"aten.{_name}.{_ov}")(_binary(_op))
register("aten.true_divide.Tensor")(_binary("div"))
register("aten.min.other")(_binary("minimum"))  # torch.min(a, b): T5's position buckets
register("aten.max.other")(_binary("maximum"))
register("aten.rsub.Scalar", "aten.rsub.Tensor")(
    lambda b, n: b.emit("sub", list(reversed(b.promoted_operands(n, n.args[0], n.args[1]))), n))


@register("aten.gelu.default")
def _gelu(b, n):
    default = ROWS["gelu"].default("approximate")
    return b.emit("gelu", [b.tensor(n.args[0])], n, approximate=n.kwargs.get(
        "approximate", n.args[1] if len(n.args) > 1 else default))


@register("aten.leaky_relu.default")
def _leaky(b, n):
    slope = n.args[1] if len(n.args) > 1 else ROWS["leaky_relu"].default("slope")
    return b.emit("leaky_relu", [b.tensor(n.args[0])], n, slope=float(slope))


@register("aten.hardtanh.default", "aten.clamp.default", "aten.clamp_min.default",
          "aten.clamp_max.default")
def _clamp(b, n):
    name = str(n.target)
    lo = hi = None
    if "clamp_min" in name:
        lo = n.args[1]
    elif "clamp_max" in name:
        hi = n.args[1]
    elif "hardtanh" in name:
        lo, hi = (list(n.args[1:3]) + [-1.0, 1.0][len(n.args) - 1:])[:2]
    else:
        lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
        hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
    return b.emit("clamp", [b.tensor(n.args[0])], n, min=lo, max=hi)


@register("aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther",
          "aten.where.Scalar")
def _where(b, n):
    x, y = b.promoted_operands(n, n.args[1], n.args[2])
    return b.emit("where", [b.tensor(n.args[0]), x, y], n)


@register("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
def _masked_fill(b, n):
    x, v = b.promoted_operands(n, n.args[0], n.args[2])
    return b.emit("where", [b.tensor(n.args[1]), v, x], n)


@register("aten._to_copy.default", "aten.clone.default", "aten.alias.default",
          "aten.lift_fresh_copy.default", "aten.contiguous.default", "aten.detach.default",
          # as exported (before decomposition): `x.to(...)` and HF's `detach_()`; the device
          # is the target's
          "aten.to.dtype", "aten.to.device", "aten.to.dtype_layout", "aten.to.other",
          "aten.detach_.default", "aten.type_as.default")
def _copy(b, n):
    src = n.args[0]
    if b.meta_dtype(n) != b.meta_dtype(src):
        return b.emit("cast", [b.tensor(src)], n)
    return b.alias(n, b.tensor(src))


@register("aten._assert_tensor_metadata.default")
def _assert_metadata(b, n):
    """A check torch.export inserts before casts; it has no result (meta val None)."""
    return b.tensor(n.args[0])


@register("aten.scalar_tensor.default")
def _scalar_tensor(b, n):
    return b.emit("full", [], n, value=n.args[0])


@register("aten.full.default", "aten.full_like.default", "aten.zeros.default",
          "aten.ones.default", "aten.zeros_like.default", "aten.ones_like.default",
          "aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default",
          "aten.empty.memory_format", "aten.empty_like.default")
def _full(b, n):
    name = str(n.target)
    if "zeros" in name or "empty" in name:
        value = 0
    elif "ones" in name:
        value = 1
    elif name in ("aten.full.default", "aten.full_like.default"):
        value = n.args[1]
    else:
        value = n.args[2]
    if isinstance(value, torch.fx.Node):  # a fill value computed from sizes
        sym = b.int_or_sym(value)
        if isinstance(sym, (int, sympy.Expr)):  # an int size expression
            return b.emit("full", [], n, value=sym)
        v = b.tensor(value)  # a float / bool of sizes: a 0-d value, broadcast and cast
        v = b.emit("expand", [v], None, like=n, dtype=b.types[v].dtype)
        return b.emit("cast", [v], n)
    return b.emit("full", [], n, value=value)


@register("aten.arange.start_step", "aten.arange.default", "aten.arange.start")
def _arange(b, n):
    args = list(n.args)
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
    return b.emit("iota", [], n, start=start, step=step)


@register("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
          "aten.squeeze.dims", "aten.squeeze.dim", "aten.squeeze.default",
          "aten.unsqueeze.default", "aten.flatten.using_ints", "aten.view_copy.default")
def _view(b, n):
    b.check_same_numel(n, b.shape(n.args[0]), b.shape(n))
    return b.emit("view", [b.tensor(n.args[0])], n)


@register("aten.permute.default", "aten.permute_copy.default")
def _permute(b, n):
    rank = len(n.args[1])
    return b.emit("permute", [b.tensor(n.args[0])], n, dims=tuple(d % rank for d in n.args[1]))


@register("aten.t.default", "aten.transpose.int", "aten.numpy_T.default")
def _transpose(b, n):
    rank = b.rank(n.args[0])
    d0, d1 = (n.args[1] % rank, n.args[2] % rank) if len(n.args) > 2 else (0, 1)
    dims = list(range(rank))
    if rank >= 2:
        dims[d0], dims[d1] = dims[d1], dims[d0]
    return b.emit("permute", [b.tensor(n.args[0])], n, dims=tuple(dims))


@register("aten.expand.default", "aten.expand_copy.default")
def _expand(b, n):
    return b.emit("expand", [b.tensor(n.args[0])], n)


@register("aten.repeat.default")
def _repeat(b, n):
    """x [s0, s1] repeated [r0, r1] = view [1, s0, 1, s1] -> expand [r0, s0, r1, s1] -> view."""
    reps = list(n.args[1])
    shape = (1,) * (len(reps) - b.rank(n.args[0])) + tuple(b.shape(n.args[0]))
    ones = [d for s in shape for d in (1, s)]
    wide = [d for r, s in zip(reps, shape) for d in (r, s)]
    v = b.emit("view", [b.tensor(n.args[0])], None, like=n, shape=ones)
    e = b.emit("expand", [v], None, like=n, shape=wide)
    return b.emit("view", [e], n)


@register("aten.slice.Tensor", "aten.slice_copy.Tensor")
def _slice(b, n):
    args = list(n.args) + [None] * 5
    rank = b.rank(n.args[0])
    dim = (args[1] or 0) % rank
    step = args[4] or 1
    return b.emit("slice", [b.tensor(n.args[0])], n, dim=dim, start=b.int_or_sym(args[2] or 0),
                  end=b.int_or_sym(args[3]) if args[3] is not None else None, step=step)


@register("aten.select.int", "aten.select_copy.int")
def _select(b, n):
    rank = b.rank(n.args[0])
    return b.emit("select", [b.tensor(n.args[0])], n, dim=n.args[1] % rank,
                  index=b.int_or_sym(n.args[2]))


@register("aten.cat.default", "aten.concat.default")
def _cat(b, n):
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    inputs = [t for t in n.args[0] if b.numel_nonzero(t)]
    return b.emit("cat", [b.tensor(t) for t in inputs], n, dim=dim % b.rank(n))


@register("aten.constant_pad_nd.default")
def _pad(b, n):
    value = n.args[2] if len(n.args) > 2 else 0
    return b.emit("pad", [b.tensor(n.args[0])], n, pad=tuple(n.args[1]), value=value)


def _dims(b, n, arg_index: int):
    rank = b.rank(n.args[0])
    dims = n.args[arg_index] if len(n.args) > arg_index else n.kwargs.get("dim")
    if dims is None or dims == []:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(d % max(rank, 1) for d in dims))


def _reduction(kind: str) -> Converter:
    def conv(b, n):
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        x = b.tensor(n.args[0])
        if b.meta_dtype(n) != b.meta_dtype(n.args[0]) and kind not in ("any", "all"):
            x = b.emit("cast", [x], None, like=n, shape_of=n.args[0])
        return b.emit("reduce", [x], n, kind=kind, dims=_dims(b, n, 1), keepdim=bool(keep))
    return conv


for _name, _kind in REDUCTIONS.items():
    for _ov in ("default", "dim", "dim_IntList", "dims", "dim_int"):
        register(f"aten.{_name}.{_ov}")(_reduction(_kind))
register("aten.max.default")(_reduction("max"))
register("aten.min.default")(_reduction("min"))


@register("aten.argmax.default", "aten.argmin.default")
def _argmax(b, n):
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    rank = b.rank(n.args[0])
    # no dim: the flat index of the extreme over all elements (row-major order)
    dims = tuple(range(rank)) if dim is None else (dim % max(rank, 1),)
    kind = "argmax" if "argmax" in str(n.target) else "argmin"
    return b.emit("reduce", [b.tensor(n.args[0])], n, kind=kind, dims=dims, keepdim=bool(keep))


@register("aten.var.correction", "aten.var.dim")
def _var(b, n):
    corr = n.kwargs.get("correction", 1)
    if str(n.target).endswith("dim"):
        corr = 1 if (n.args[2] if len(n.args) > 2 else True) else 0
    keep = n.kwargs.get("keepdim", n.args[3] if len(n.args) > 3 else False)
    corr = 1 if corr is None else corr
    if float(corr) != int(corr):
        raise UnsupportedError(f"var with fractional correction {corr} (node {n.name})")
    return b.emit("var", [b.tensor(n.args[0])], n, dims=_dims(b, n, 1),
                  correction=int(corr), keepdim=bool(keep))


@register("aten._softmax.default", "aten._log_softmax.default", "aten.softmax.int",
          "aten.log_softmax.int")
def _softmax(b, n):
    op = "log_softmax" if "log" in str(n.target) else "softmax"
    return b.emit(op, [b.tensor(n.args[0])], n, dim=n.args[1] % max(b.rank(n), 1))


@register("aten._native_batch_norm_legit_no_training.default")
def _batch_norm(b, n):
    x, w, bias, mean, var, _momentum, eps = n.args
    ins = [b.tensor(x), b.tensor(mean), b.tensor(var)]
    ins += [b.tensor(t) for t in (w, bias) if t is not None]
    return b.emit("batch_norm", ins, n, eps=float(eps), has_weight=w is not None,
                  has_bias=bias is not None)


@register("aten.mm.default", "aten.bmm.default")
def _mm(b, n):
    return b.emit("matmul", [b.tensor(n.args[0]), b.tensor(n.args[1])], n)


@register("aten.addmm.default")
def _addmm(b, n):
    bias, x, w = n.args
    beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)
    mm = b.emit("matmul", [b.tensor(x), b.tensor(w)], None, like=n)
    if alpha != 1:
        mm = b.emit("mul", [mm, b.scalar(alpha, b.meta_dtype(n))], None, like=n)
    bt = b.tensor(bias)
    if beta != 1:
        bt = b.emit("mul", [bt, b.scalar(beta, b.meta_dtype(n))], None, like=n, shape_of=bias)
    return b.emit("add", [mm, bt], n)


@register("aten.embedding.default")
def _embedding(b, n):
    return b.emit("embedding", [b.tensor(n.args[0]), b.tensor(n.args[1])], n)


@register("aten.index.Tensor")
def _index(b, n):
    idx = n.args[1]
    present = tuple(i for i, t in enumerate(idx) if t is not None)
    return b.emit("index", [b.tensor(n.args[0])] + [b.tensor(idx[i]) for i in present], n,
                  positions=present)


@register("aten.index_select.default")
def _index_select(b, n):
    dim = n.args[1] % max(b.rank(n.args[0]), 1)
    if b.rank(n.args[0]) == 0:  # selecting from a scalar: the index must be 0; result = input
        idx = b.tensor(n.args[2])
        if b.rank(n.args[2]) != b.rank(n):  # a one-element index [1] of a 0-d result
            idx = b.emit("view", [idx], None, like=n.args[2], shape=())
        return b.emit("index", [b.emit("view", [b.tensor(n.args[0])], None, like=n,
                                       shape=(1,)), idx], n, positions=(0,), select=True)
    return b.emit("index", [b.tensor(n.args[0]), b.tensor(n.args[2])], n, positions=(dim,),
                  select=True)


@register("aten.gather.default")
def _gather(b, n):
    return b.emit("gather", [b.tensor(n.args[0]), b.tensor(n.args[2])], n,
                  dim=n.args[1] % b.rank(n.args[0]))


@register("aten.split_with_sizes.default", "aten.split.Tensor",
          "aten.split_with_sizes_copy.default",
          "aten.unbind.int", "aten.chunk.default")
def _split(b, n):
    """Each result is a slice (or, for unbind, a select) of the input: views, no copies."""
    x = n.args[0]
    rank = b.rank(x)
    dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % rank
    if str(n.target).startswith("aten.unbind"):
        dim = (n.args[1] if len(n.args) > 1 else 0) % rank
        return [b.emit("select", [b.tensor(x)], None, like=n, result=k, dim=dim, index=k)
                for k in range(len(n.meta["val"]))]
    out, start = [], 0
    for k, v in enumerate(n.meta["val"]):
        size = b.int_or_sym(v.shape[dim])
        out.append(b.emit("slice", [b.tensor(x)], None, like=n, result=k, dim=dim,
                          start=start, end=start + size, step=1))
        start = start + size
    return out


@register("aten.max.dim", "aten.min.dim")
def _max_dim(b, n):
    """(values, indices) of a max/min over one dim: two reductions, one per result."""
    x = n.args[0]
    rank = b.rank(x)
    dim = (n.args[1] if len(n.args) > 1 else 0) % max(rank, 1)
    keep = bool(n.args[2]) if len(n.args) > 2 else bool(n.kwargs.get("keepdim", False))
    kind = "max" if str(n.target).startswith("aten.max") else "min"
    values = b.emit("reduce", [b.tensor(x)], None, like=n, result=0, kind=kind, dims=(dim,),
                    keepdim=keep)
    index = b.emit("reduce", [b.tensor(x)], None, like=n, result=1, kind=f"arg{kind}",
                   dims=(dim,), keepdim=keep)
    return [values, index]


@register("aten._native_batch_norm_legit_functional.default")
def _batch_norm_train(b, n):
    """Training-mode batch norm: batch statistics normalise; the running statistics are
    updated (results 3 and 4, which export writes back into the module's buffers)."""
    x, w, bias, run_mean, run_var, _training, momentum, eps = n.args
    rank = b.rank(x)
    dims = tuple(d for d in range(rank) if d != 1)
    count = 1
    for d in dims:
        size = b.shape(x)[d]
        if not size.is_Integer:
            raise UnsupportedError(f"training-mode batch norm over dynamic dims (node {n.name})")
        count *= int(size)
    stat = torch_float(b, n)
    out, mean, var, rstd = batch_statistics_norm(b, n, x, w, bias, eps)
    keep = b.scalar(1.0 - momentum, stat)
    new_mean = b.emit("add", [b.emit("mul", [b.tensor(run_mean), keep], None, like=n, result=3),
                              b.emit("mul", [mean, b.scalar(momentum, stat)], None, like=n,
                                     result=3)], None, like=n, result=3)
    unbiased = momentum * count / max(count - 1, 1)
    new_var = b.emit("add", [b.emit("mul", [b.tensor(run_var), keep], None, like=n, result=4),
                             b.emit("mul", [var, b.scalar(unbiased, stat)], None, like=n,
                                    result=4)], None, like=n, result=4)
    return [out, mean, rstd, new_mean, new_var]


def batch_statistics_norm(b, n, x, w, bias, eps):
    """Batch norm of `x` by its own batch statistics over every dim but 1: (out, mean, biased
    variance, rstd); results 0 and 1 of `n` give the shapes of out and of a statistic."""
    dims = tuple(d for d in range(b.rank(x)) if d != 1)
    xs = b.tensor(x)
    mean = b.emit("reduce", [xs], None, like=n, result=1, kind="mean", dims=dims,
                  keepdim=False)
    var = b.emit("var", [xs], None, like=n, result=1, dims=dims, correction=0, keepdim=False)
    ins = [xs, mean, var] + [b.tensor(t) for t in (w, bias) if t is not None]
    out = b.emit("batch_norm", ins, None, like=n, result=0, eps=float(eps),
                 has_weight=w is not None, has_bias=bias is not None)
    eps_v = b.emit("add", [var, b.scalar(float(eps), b.meta_dtype(n))], None, like=n, result=1)
    return out, mean, var, b.emit("rsqrt", [eps_v], None, like=n, result=1)


def torch_float(b, n):
    return b.meta_dtype(n)
