"""Lowering of control nodes (cond, while_loop; see frontend/control.py) to Loop IR `Branch` and
`Loop` nodes.

Operands reach a region as whole contiguous parent buffers (a lazy or strided operand is
materialised first). Each region graph is lowered on its own (`lower`, so nothing fuses across
the region boundary), then renamed into the parent's name space: its inputs become the parent
buffers passed in, its outputs the parent buffers it must write, and every other buffer gets
the prefix `<node>_<region>_`."""

from __future__ import annotations

from dataclasses import replace

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Graph, Node
from kiln.ir.sym import contiguous_strides
from kiln.lowering.core import Lazy, LowerCtx, pointwise
from kiln.passes.dce import dce


def _whole(ctx: LowerCtx, lz: Lazy, base: str, source: str) -> str:
    """The parent buffer holding `lz` whole and contiguous (materialised when it is not)."""
    v = lz.view
    if v is not None and sympy.sympify(v.offset) == 0:
        buf = next((b for b in ctx.buffers if b.name == v.buf), None)
        numel = sympy.Integer(1)
        for d in lz.shape:
            numel *= d
        if buf is not None and sympy.expand(buf.numel - numel) == 0 and all(
                sympy.expand(a - b) == 0 for a, b in zip(v.strides, contiguous_strides(lz.shape))):
            return buf.name
    return ctx.realize(base, lz, (source,)).view.buf


def _rename_expr(e: L.Expr, f, memo: dict) -> L.Expr:
    if e in memo:
        return memo[e]
    out = e
    if isinstance(e, L.Load):
        ind = tuple(replace(i, value=_rename_expr(i.value, f, memo)) for i in e.indirect)
        out = L.Load(f(e.buf), e.index, e.dtype, ind)
    elif isinstance(e, L.Op):
        out = L.Op(e.op, tuple(_rename_expr(a, f, memo) for a in e.args), e.dtype)
    memo[e] = out
    return out


def _rename_node(n, f):
    if isinstance(n, L.Compute):
        return replace(n, name=f(n.name), body=_rename_expr(n.body, f, {}))
    if isinstance(n, L.Gemm):
        lp = n.lowp
        if lp is not None:
            lp = replace(lp, **{k: (f(getattr(lp, k)[0]), getattr(lp, k)[1])
                                for k in ("scale_a", "scale_b") if getattr(lp, k)},
                         bias=f(lp.bias) if lp.bias else None)
        mx = n.mixed
        if mx is not None and mx.scale is not None:
            mx = replace(mx, scale=replace(mx.scale, buf=f(mx.scale.buf)))
        return replace(n, name=f(n.name), a=replace(n.a, buf=f(n.a.buf)),
                       b=replace(n.b, buf=f(n.b.buf)), lowp=lp, mixed=mx)
    if isinstance(n, L.Extern):
        return replace(n, outs=tuple(map(f, n.outs)),
                       args=tuple(replace(a, buf=f(a.buf)) for a in n.args))
    if isinstance(n, L.AtenCall) and not n.all_binds():
        return replace(n, name=f(n.name), args=tuple(_rename_aten_arg(a, f) for a in n.args),
                       also=tuple(replace(r, name=f(r.name)) for r in n.also))
    if isinstance(n, (L.AtenCall, L.ReadSize)):
        raise UnsupportedError(f"{n.name}: data-dependent sizes inside torch.cond / while_loop "
                               "bodies are not supported (the size would change per branch or "
                               "iteration): compute it before the region")
    if isinstance(n, L.UserKernel):
        raise UnsupportedError(f"{n.name}: user Triton kernels inside torch.cond / while_loop "
                               "bodies are not supported yet")
    regions = {k: L.Region(rename(getattr(n, k).prog, f)) for k in (
        ("then", "orelse") if isinstance(n, L.Branch) else ("cond", "body"))}
    if isinstance(n, L.Branch):
        return replace(n, name=f(n.name), pred=None if n.pred is None else f(n.pred),
                       operands=tuple(map(f, n.operands)), results=tuple(map(f, n.results)),
                       **regions)
    return replace(n, name=f(n.name), inits=tuple(map(f, n.inits)), extra=tuple(map(f, n.extra)),
                   carries=tuple(map(f, n.carries)), pred=f(n.pred), nexts=tuple(map(f, n.nexts)),
                   locals=tuple(replace(b, name=f(b.name)) for b in n.locals), **regions)


def _rename_aten_arg(arg: L.AtenArg, f) -> L.AtenArg:
    return L.map_aten_tensors(arg, lambda t: replace(t, buf=f(t.buf)))


def rename(prog: L.LoopProgram, f) -> L.LoopProgram:
    """`prog` with every buffer (and node) name `x` replaced by `f(x)`; buffers that become
    one name are declared once."""
    buffers: dict[str, L.Buffer] = {}
    for b in prog.buffers:
        buffers.setdefault(f(b.name), replace(b, name=f(b.name)))
    return L.LoopProgram(tuple(buffers.values()), tuple(_rename_node(n, f) for n in prog.nodes),
                         tuple(map(f, prog.outputs)), tuple(map(f, prog.inputs)),
                         prog.output_shapes, prog.mutations)


def lower_region(ctx: LowerCtx, g: Graph, prefix: str, inputs: list[str], outputs: list[str]
                 ) -> L.Region:
    """Lower region `g` reading parent buffers `inputs` (one per region input, in order) and
    writing parent buffers `outputs` (one per region output)."""

    prog = ctx.lower_graph(dce(g))
    if prog.mutations:
        raise UnsupportedError(f"region {prefix.rstrip('_')} updates module state")
    mapping = dict(zip((i.name for i in g.user_inputs), inputs))
    mapping.update(zip(prog.outputs, outputs))
    return L.Region(rename(prog, lambda x: mapping.get(x, prefix + x)))


def _token(node: Node) -> Lazy:
    """The value of a control node itself: a token its ctl_result nodes hang on."""
    return pointwise(dtypes.bool_, (), lambda idx: L.Const(True, dtypes.bool_))


def _declare_results(ctx: LowerCtx, node: Node, graph_types) -> list[str]:
    out = []
    for name, t in zip(node.attr("results"), graph_types):
        buf = ctx.unique(name)
        ctx.declare(buf, t.dtype, t.shape, "temp")
        out.append(buf)
    return out


def lower_cond(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    then, orelse = node.attr("then"), node.attr("else")
    expr = node.attr("pred_expr")
    pred = None
    if expr is None:
        pred = _whole(ctx, args[0], f"{node.name}_pred", node.source or node.name)
        args = args[1:]
    ops = [_whole(ctx, a, f"{node.name}_arg{k}", node.source or node.name)
           for k, a in enumerate(args)]
    results = _declare_results(ctx, node, [then.types()[o] for o in then.outputs])
    ctx.nodes.append(L.Branch(
        node.name, pred, expr, lower_region(ctx, then, f"{node.name}_then_", ops, results),
        lower_region(ctx, orelse, f"{node.name}_else_", ops, results), tuple(ops), tuple(results),
        (node.source or node.name,)))
    return _token(node)


def lower_while(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    cond, body = node.attr("cond"), node.attr("body")
    n = node.attr("n_carried")
    ins = [_whole(ctx, a, f"{node.name}_arg{k}", node.source or node.name)
           for k, a in enumerate(args)]
    carried_types = [body.types()[o] for o in body.outputs]
    carries = _declare_results(ctx, node, carried_types)
    pred = ctx.unique(f"{node.name}_pred")
    nexts = [ctx.unique(f"{node.name}_next{k}") for k in range(n)]
    pt = cond.types()[cond.outputs[0]]
    local = (L.Buffer(pred, pt.dtype, pt.shape, "temp"),) + tuple(
        L.Buffer(x, t.dtype, t.shape, "temp") for x, t in zip(nexts, carried_types))
    operands = carries + ins[n:]
    ctx.nodes.append(L.Loop(
        node.name, tuple(ins[:n]), tuple(ins[n:]), tuple(carries), pred, tuple(nexts),
        lower_region(ctx, cond, f"{node.name}_cond_", operands, [pred]),
        lower_region(ctx, body, f"{node.name}_body_", operands, nexts), local,
        (node.source or node.name,)))
    return _token(node)


def lower_result(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """Result `index` of the control node that is this node's input."""
    owner = next(n for n in reversed(ctx.nodes) if isinstance(n, L.CONTROL)
                 and n.name == node.inputs[0])
    buf = owner.writes[node.attr("index")]
    return ctx.buffer_lazy(buf, node.type.dtype, node.type.shape)
