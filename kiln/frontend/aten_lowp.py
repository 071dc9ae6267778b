"""Converters for low-precision GEMMs: `aten._scaled_mm` (8-bit float operands, float32 scales)
and `aten._int_mm` (int8 x int8 -> int32).

Graph IR: `scaled_mm(a, b, scale_a, scale_b[, bias])`, the node's dtype the output dtype, and
`int_mm(a, b)`. How they are computed is the backend's choice: CPU builds expand them into
float32 / int32 GEMMs (passes/lowp_cpu.py), CUDA builds call cuBLASLt (lowering/lowp.py).
Arguments eager would reject are rejected here with the node, the argument and what was given."""

from __future__ import annotations

import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_table import register

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _arg(n, k: int, name: str, default=None):
    return n.args[k] if len(n.args) > k else n.kwargs.get(name, default)


def _check(cond: bool, n, what: str) -> None:
    if not cond:
        raise UnsupportedError(f"{n.target} (node {n.name}): {what}")


@register("aten._scaled_mm.default")
def _scaled_mm(b, n):
    a, w, sa, sb = (_arg(n, k, nm) for k, nm in enumerate(("self", "mat2", "scale_a",
                                                           "scale_b")))
    bias, scale_result = _arg(n, 4, "bias"), _arg(n, 5, "scale_result")
    for x, nm in ((a, "self"), (w, "mat2")):
        _check(b.rank(x) == 2 and b.meta_dtype(x) in _FLOAT8, n,
               f"{nm} must be a 2-D float8_e4m3fn / float8_e5m2 tensor, got "
               f"{b.rank(x)}-D {b.meta_dtype(x)}")
    _check(b.meta_dtype(n) in _OUT, n, "out_dtype must be bfloat16, float16 or float32 (an "
           f"8-bit output needs scale_result, not supported), got {b.meta_dtype(n)}")
    _check(scale_result is None, n, "scale_result is not supported (8-bit outputs)")
    m, k = b.shape(a)
    nn = b.shape(w)[1]
    for s, nm, rows in ((sa, "scale_a", (m, 1)), (sb, "scale_b", (1, nn))):
        shp = b.shape(s)
        _check(b.meta_dtype(s) == torch.float32, n, f"{nm} must be float32, got "
               f"{b.meta_dtype(s)}")
        _check(all(d == 1 for d in shp) or tuple(shp) == rows, n,
               f"{nm} must have one element (tensor-wise) or shape {list(rows)} (row-wise), "
               f"got shape {list(shp)}")
    ins = [b.tensor(a), b.tensor(w), b.tensor(sa), b.tensor(sb)]
    if bias is not None:
        _check(b.rank(bias) == 1 and b.shape(bias)[0] == nn, n,
               f"bias must have shape [{nn}], got {list(b.shape(bias))}")
        ins.append(b.tensor(bias))
    return b.emit("scaled_mm", ins, n)


@register("aten._int_mm.default")
def _int_mm(b, n):
    a, w = n.args[0], n.args[1]
    for x, nm in ((a, "self"), (w, "mat2")):
        _check(b.rank(x) == 2 and b.meta_dtype(x) == torch.int8, n,
               f"{nm} must be a 2-D int8 tensor, got {b.rank(x)}-D {b.meta_dtype(x)}")
    return b.emit("int_mm", [b.tensor(a), b.tensor(w)], n)
