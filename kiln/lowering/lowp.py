"""Lowering of low-precision GEMMs for CUDA: `scaled_mm` (8-bit float operands) and `int_mm`
(int8 operands) become one `Gemm` with `lowp` set, which the CUDA wrapper runs through
cuBLASLt. (CPU builds never see these ops: passes/lowp_cpu.py expands them.)

cuBLASLt multiplies 8-bit floats and int8 only in one layout ("TN" in its column-major terms):
kiln's row-major A[M, K] must be row-major and B[K, N] column-major (B.t() contiguous), with
leading dimensions and start addresses 16-byte aligned (4 elements for int8). An operand in
another layout is first copied into the required one by a kiln kernel (a transposed copy for
B), so a layout cuBLASLt refuses never reaches it. Tensor-wise scales go to cuBLASLt as device
pointers (A_SCALE_POINTER / B_SCALE_POINTER) and a bias of the output dtype as its bias
epilogue; row-wise scales ([M, 1], [1, N]) and other biases are a pointwise epilogue on a
float32 GEMM result, which fuses into the consumer like any other."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.core import Lazy, LowerCtx, View, pointwise
from kiln.lowering.pointwise import load_broadcast
from kiln.ops.build import cast, op

ALIGN_BYTES = 16


def _multiple(e, unit: int) -> bool:
    """True when the (symbolic, integer-valued) expression is provably a multiple of `unit`."""
    e = sympy.expand(sympy.sympify(e))
    terms = e.args if isinstance(e, sympy.Add) else (e,)
    for t in terms:
        c, _ = t.as_coeff_Mul()
        if not (c.is_Integer and int(c) % unit == 0) and t != 0:
            return False
    return True


def _ld_unit(dt: dtypes.DType) -> int:
    """Leading dimensions must be multiples of this many elements."""
    return 4 if dt.name == "int8" else ALIGN_BYTES // dt.itemsize


def _tn_ok(v, inner: int, outer: int, dt: dtypes.DType) -> bool:
    return (v is not None and v.strides[inner] == 1 and _multiple(v.strides[outer], _ld_unit(dt))
            and _multiple(v.offset * dt.itemsize, ALIGN_BYTES))


def _operand_a(ctx: LowerCtx, a: Lazy, name: str, source) -> L.Operand:
    """A[M, K] row-major (k stride 1), else a contiguous copy."""
    if not _tn_ok(a.view, 1, 0, a.dtype):
        a = ctx.realize(name + "_lhs", a, source)
    v = a.view
    if not _tn_ok(v, 1, 0, a.dtype):
        raise UnsupportedError(f"{name}: cuBLASLt needs K ({a.shape[1]}) to be a multiple of "
                               f"{_ld_unit(a.dtype)} for {a.dtype} operands")
    return L.Operand(v.buf, v.offset, (), v.strides[0], v.strides[1])


def _operand_b(ctx: LowerCtx, b: Lazy, name: str, source) -> L.Operand:
    """B[K, N] column-major (k stride 1), else a transposed copy: a contiguous [N, K] buffer."""
    if not _tn_ok(b.view, 0, 1, b.dtype):
        t = Lazy(b.dtype, (b.shape[1], b.shape[0]), lambda idx: b.load((idx[1], idx[0])),
                 None, b.cost)
        t = ctx.realize(name + "_rhs_t", t, source)
        v = t.view
        b = Lazy(b.dtype, b.shape, lambda idx: t.load((idx[1], idx[0])),
                 View(v.buf, v.offset, (v.strides[1], v.strides[0])))
    v = b.view
    if not _tn_ok(v, 0, 1, b.dtype):
        raise UnsupportedError(f"{name}: cuBLASLt needs K ({b.shape[0]}) to be a multiple of "
                               f"{_ld_unit(b.dtype)} for {b.dtype} operands")
    return L.Operand(v.buf, v.offset, (), v.strides[0], v.strides[1])


def _pointer(ctx: LowerCtx, x: Lazy, name: str, source) -> tuple[str, sympy.Expr]:
    """(buffer, element offset) of a one-element value."""
    if x.view is None:
        x = ctx.realize(name, x, source)
    return x.view.buf, x.view.offset


def _gemm(ctx: LowerCtx, node: Node, a: Lazy, b: Lazy, dt: dtypes.DType, lowp: L.LowpGemm,
          source) -> Lazy:
    oa = _operand_a(ctx, a, node.name, source)
    ob = _operand_b(ctx, b, node.name, source)
    out = ctx.unique(node.name + ("_acc" if dt != node.type.dtype else ""))
    shape = (a.shape[0], b.shape[1])
    ctx.declare(out, dt, shape, "temp")
    ctx.nodes.append(L.Gemm(out, dt, (), a.shape[0], b.shape[1], a.shape[1], oa, ob,
                            tuple(source), lowp))
    return ctx.buffer_lazy(out, dt, shape)


def lower_int_mm(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    a, b = args
    return _gemm(ctx, node, a, b, dtypes.int32, L.LowpGemm("int", a.dtype, b.dtype),
                 (node.source or node.name,))


def lower_scaled_mm(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    a, b, sa, sb, *rest = args
    bias = rest[0] if rest else None
    out_dt, shape = node.type.dtype, node.type.shape
    source = (node.source or node.name,)
    rowwise = not all(d == 1 for d in (*sa.shape, *sb.shape))
    bias_fused = (bias is not None and not rowwise and bias.dtype == out_dt
                  and out_dt.name in dtypes.HALF)
    bias_buf = None
    if bias_fused:
        if not (bias.view is not None and bias.view.offset == 0 and bias.view.strides == (1,)):
            bias = ctx.realize(node.name + "_bias", bias, source)
        bias_buf = bias.view.buf
    direct = not rowwise and (bias is None or bias_fused)
    scales = {} if rowwise else {
        "scale_a": _pointer(ctx, sa, node.name + "_scale_a", source),
        "scale_b": _pointer(ctx, sb, node.name + "_scale_b", source)}
    lowp = L.LowpGemm("scaled", a.dtype, b.dtype, bias=bias_buf, **scales)
    acc = _gemm(ctx, node, a, b, out_dt if direct else dtypes.float32, lowp, source)
    if direct:
        return acc
    f32 = dtypes.float32

    def fn(idx):  # float32: acc * (scale_a * scale_b) [+ bias], rounded once to out_dt
        v = acc.load(idx)
        if rowwise:
            s = op("mul", cast(load_broadcast(sa, idx, shape), f32),
                   cast(load_broadcast(sb, idx, shape), f32))
            v = op("mul", v, s)
        if bias is not None:
            v = op("add", v, cast(load_broadcast(bias, idx, shape), f32))
        return cast(v, out_dt)

    return pointwise(out_dt, shape, fn, acc, sa, sb, *([bias] if bias is not None else []))
