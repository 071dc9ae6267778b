"""Lowering rules for ops computed by library calls: float matmul (mm / bmm) as a `Gemm`
(convolution builds on `gemm`: spatial.py); integer matmul as a generated reduction. Bias and
activations that follow are ordinary pointwise ops, so they fuse into the consumer kernel."""

from __future__ import annotations


from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import ivars, rvars
from kiln.lowering.core import Lazy, LowerCtx
from kiln.ops.build import cast, op
from kiln.errors import UnsupportedError


def _blas_ok(strides) -> bool:
    return strides[-1] == 1 or strides[-2] == 1


def operand(ctx: LowerCtx, lz: Lazy, name: str, source) -> tuple[L.Operand, Lazy]:
    """A GEMM operand for `lz` ([..., rows, cols]); materialise it when not BLAS-compatible."""
    if lz.view is None or not _blas_ok(lz.view.strides):
        lz = ctx.realize(lz.origin or name, lz, source)
    v = lz.view
    return L.Operand(v.buf, v.offset, tuple(v.strides[:-2]), v.strides[-2], v.strides[-1]), lz


def gemm(ctx: LowerCtx, name: str, a: Lazy, b: Lazy, batch, source, dt) -> Lazy:
    oa, a = operand(ctx, a, name + "_lhs", source)
    ob, b = operand(ctx, b, name + "_rhs", source)
    out = ctx.unique(name)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    shape = (*batch, m, n)
    ctx.declare(out, dt, shape, "temp")
    ctx.nodes.append(L.Gemm(out, dt, tuple(batch), m, n, k, oa, ob, tuple(source)))
    return ctx.buffer_lazy(out, dt, shape)


def lower_matmul(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    a, b = args
    batch = node.type.shape[:-2]
    if not node.type.dtype.is_float:
        return int_matmul(ctx, node, a, b)
    if node.type.dtype.name not in ("float32", "float64", "float16", "bfloat16"):
        raise UnsupportedError(f"matmul of dtype {node.type.dtype} (node {node.name})")
    return gemm(ctx, node.name, a, b, batch, (node.source or node.name,), node.type.dtype)


def int_matmul(ctx: LowerCtx, node: Node, a: Lazy, b: Lazy) -> Lazy:
    """Integer matmul (BLAS has none): a generated reduction over k, exact, wrapping on
    overflow in the output dtype like eager."""
    dt = node.type.dtype
    if dt == dtypes.bool_:
        raise UnsupportedError(f"matmul of dtype bool (node {node.name})")
    nb = len(node.type.shape) - 2
    iv, (r,) = ivars(nb + 2), rvars(1)
    body = op("mul", cast(a.load((*iv[:nb], iv[nb], r)), dt),
              cast(b.load((*iv[:nb], r, iv[nb + 1])), dt))
    return ctx.reduction(node.name, dt, node.type.shape, "sum", (a.shape[-1],), body,
                         (node.source or node.name,))


__all__ = ["lower_matmul", "int_matmul", "gemm", "ivars"]
