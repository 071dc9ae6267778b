"""Lowering of `random` nodes: uniform [0, 1) or standard normal values as a pure pointwise
function of (seed, run counter, the node's stream, the element's row-major index).

The bits come from the Loop IR `philox` operator (Philox4x32-10; C++ in kiln_kernels.h,
Triton in targets/cuda/ops.py, numpy in ir/interp.py: the same words everywhere). float32 uniform
takes the top 24 bits of one word; float64 uniform 53 bits of two; normal is Box-Muller on two
uniforms (1 - u, so the log never sees 0). No state is read or written per element, so the
value inlines and fuses like any other pointwise expression."""

from __future__ import annotations

import math

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import contiguous_strides, linear_index
from kiln.lowering.core import Index, Lazy, LowerCtx, pointwise
from kiln.ops.build import cast, const, op

I64 = dtypes.int64


def _uniform(word, dt: dtypes.DType, lane: int) -> L.Expr:
    """A uniform in [0, 1) of dtype dt from word(lane) (and word(lane + 1) for float64)."""
    if dt == dtypes.float64:
        hi = op("shift_right", word(lane), const(5, I64))  # 27 bits
        lo = op("shift_right", word(lane + 1), const(6, I64))  # 26 bits
        bits = op("add", op("mul", hi, const(1 << 26, I64)), lo)
        return op("mul", cast(bits, dt), const(2.0 ** -53, dt))
    bits = op("shift_right", word(lane), const(8, I64))
    return op("mul", cast(bits, dt), const(2.0 ** -24, dt))


def lower_random(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (state,) = args
    dt, shape = node.type.dtype, node.type.shape
    stream, dist = node.attr("stream"), node.attr("dist")
    strides = contiguous_strides(shape)
    per_value = 2 if dt == dtypes.float64 else 1

    def fn(idx: Index) -> L.Expr:
        seed, run = state.load((0,)), state.load((1,))
        index = L.Index(linear_index(idx, strides), I64)

        def word(lane: int) -> L.Expr:
            return op("philox", seed, run, const(stream, I64), index, const(lane, I64), dtype=I64)

        u = _uniform(word, dt, 0)
        if dist == "uniform":
            return u
        v = _uniform(word, dt, per_value)
        radius = op("sqrt", op("mul", const(-2.0, dt), op("log", op("sub", const(1.0, dt), u))))
        return op("mul", radius, op("cos", op("mul", const(2 * math.pi, dt), v)))

    return pointwise(dt, shape, fn, state)
