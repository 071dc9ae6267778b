"""Converters for spatial ops: pooling, convolution (any rank, transposed), upsampling and
grid sampling. Arguments are read by their schema names (`_args`), so positional and keyword
forms and schema defaults are handled in one place. Every op here keeps its rank in its
attributes (one tuple entry per spatial dim); lowering is rank-generic (lowering/spatial.py)."""

from __future__ import annotations

from kiln.errors import UnsupportedError
from kiln.frontend.aten_high import Fallback
from kiln.frontend.aten_table import register


def _args(n) -> dict:
    """The node's arguments by schema name, schema defaults filled in."""
    out = {}
    schema = n.target._schema
    for k, a in enumerate(schema.arguments):
        if k < len(n.args):
            out[a.name] = n.args[k]
        elif a.name in n.kwargs:
            out[a.name] = n.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _tuple(v, d: int, default: int) -> tuple:
    """An int list argument as d entries (one value means every dim; empty means default)."""
    if v is None:
        return (default,) * d
    if isinstance(v, int):
        return (v,) * d
    v = tuple(v)
    if not v:
        return (default,) * d
    return v * d if len(v) == 1 else v


def _spatial_rank(n) -> int:
    name = str(n.target)
    for d in (1, 2, 3):
        if f"{d}d" in name:
            return d
    raise UnsupportedError(f"cannot tell the spatial rank of {name} (node {n.name})")


def _results(n) -> bool:
    return isinstance(n.meta.get("val"), (tuple, list))


# -- pooling -----------------------------------------------------------------------------------
@register("aten.max_pool1d.default", "aten.max_pool2d.default",
          "aten.max_pool1d_with_indices.default", "aten.max_pool2d_with_indices.default",
          "aten.max_pool3d_with_indices.default")
def _max_pool(b, n):
    a, d = _args(n), _spatial_rank(n)
    kernel = _tuple(a["kernel_size"], d, 1)
    attrs = dict(kernel=kernel, stride=_tuple(a["stride"], d, 0) if a["stride"] else kernel,
                 padding=_tuple(a["padding"], d, 0), dilation=_tuple(a["dilation"], d, 1),
                 ceil_mode=bool(a["ceil_mode"]))
    x = b.tensor(a["self"])
    if not _results(n):
        return b.emit("max_pool", [x], n, want="values", **attrs)
    return [b.emit("max_pool", [x], None, like=n, result=k, want=w, **attrs)
            for k, w in enumerate(("values", "indices"))]


@register("aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default")
def _avg_pool(b, n):
    a, d = _args(n), _spatial_rank(n)
    kernel = _tuple(a["kernel_size"], d, 1)
    return b.emit("avg_pool", [b.tensor(a["self"])], n, kernel=kernel,
                  stride=_tuple(a["stride"], d, 0) if a["stride"] else kernel,
                  padding=_tuple(a["padding"], d, 0), ceil_mode=bool(a["ceil_mode"]),
                  count_include_pad=bool(a["count_include_pad"]),
                  divisor=a.get("divisor_override"))


@register("aten._adaptive_avg_pool2d.default", "aten.adaptive_avg_pool2d.default",
          "aten.adaptive_avg_pool1d.default", "aten._adaptive_avg_pool3d.default",
          "aten.adaptive_avg_pool3d.default")
def _adaptive_avg(b, n):
    return b.emit("adaptive_pool", [b.tensor(n.args[0])], n, kind="avg", want="values",
                  dims=_spatial_rank(n))


@register("aten.adaptive_max_pool1d.default", "aten.adaptive_max_pool2d.default",
          "aten.adaptive_max_pool3d.default")
def _adaptive_max(b, n):
    x, d = b.tensor(n.args[0]), _spatial_rank(n)
    return [b.emit("adaptive_pool", [x], None, like=n, result=k, kind="max", want=w, dims=d)
            for k, w in enumerate(("values", "indices"))]


# -- convolution -------------------------------------------------------------------------------
def emit_conv(b, n, x, w, bias, stride, padding, dilation, groups, transposed=False,
              output_padding=None) -> str:
    """conv (any rank, optionally transposed), then the bias as a pointwise add (so it fuses
    into the consumer)."""
    d = b.rank(w) - 2
    if b.rank(x) != d + 2:
        raise UnsupportedError(f"convolution of a rank-{b.rank(x)} input with a rank-"
                               f"{b.rank(w)} weight (node {n.name}): batched input only")
    attrs = dict(stride=_tuple(stride, d, 1), padding=_tuple(padding, d, 0),
                 dilation=_tuple(dilation, d, 1), groups=int(groups), transposed=bool(transposed),
                 output_padding=_tuple(output_padding, d, 0))
    conv = b.emit("conv", [b.tensor(x), b.tensor(w)], n if bias is None else None, like=n,
                  **attrs)
    if bias is None:
        return conv
    size = b.shape(n)[1]
    bias_v = b.emit("view", [b.tensor(bias)], None, like=n, shape=(size,) + (1,) * d)
    return b.emit("add", [conv, bias_v], n)


@register("aten.convolution.default")
def _convolution(b, n):
    a = _args(n)
    return emit_conv(b, n, a["input"], a["weight"], a["bias"], a["stride"], a["padding"],
                     a["dilation"], a["groups"], a["transposed"], a["output_padding"])


@register("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
          "aten.conv_transpose1d.default", "aten.conv_transpose2d.input",
          "aten.conv_transpose3d.input")
def _conv_nd(b, n):
    a = _args(n)
    if isinstance(a["padding"], str) or b.rank(a["input"]) != _spatial_rank(n) + 2:
        raise Fallback("convolution with string padding or unbatched input")
    return emit_conv(b, n, a["input"], a["weight"], a["bias"], a["stride"], a["padding"],
                     a["dilation"], a["groups"], "transpose" in str(n.target),
                     a.get("output_padding"))


# -- upsampling and sampling -------------------------------------------------------------------
_UPSAMPLE = {"upsample_nearest": "nearest", "_upsample_nearest_exact": "nearest_exact",
             "upsample_linear": "linear", "upsample_bilinear": "linear",
             "upsample_trilinear": "linear", "upsample_bicubic": "cubic"}


def _upsample(b, n):
    """Scales as given (None: derived from the sizes, like eager); sizes from the metadata."""
    a, d = _args(n), _spatial_rank(n)
    mode = next(m for k, m in _UPSAMPLE.items() if str(n.target).split(".")[1].startswith(k))
    if "scale_factors" in a:  # .vec: either output sizes or scale factors
        scales = tuple(a["scale_factors"]) if a["scale_factors"] is not None else (None,) * d
    else:
        scales = tuple(a[k] for k in a if k.startswith("scales"))
    return b.emit("upsample", [b.tensor(a.get("input", a.get("self")))], n, mode=mode,
                  align_corners=bool(a.get("align_corners", False)),
                  scales=tuple(None if s is None else float(s) for s in scales))


for _k in _UPSAMPLE:
    for _d in ("1d", "2d", "3d"):
        register(f"aten.{_k}{_d}.vec", f"aten.{_k}{_d}.default")(_upsample)


@register("aten.grid_sampler_2d.default", "aten.grid_sampler.default")
def _grid_sampler(b, n):
    x, grid, mode, padding, align = n.args[:5]
    if b.rank(x) != 4:
        raise UnsupportedError(f"grid sampling of a rank-{b.rank(x)} input (node {n.name}): "
                               "2-D only")
    modes = {0: "bilinear", 1: "nearest"}
    if mode not in modes:
        raise UnsupportedError(f"grid sampling with interpolation mode {mode} (bicubic) "
                               f"(node {n.name})")
    return b.emit("grid_sample", [b.tensor(x), b.tensor(grid)], n, mode=modes[mode],
                  padding=("zeros", "border", "reflection")[padding], align_corners=bool(align))
