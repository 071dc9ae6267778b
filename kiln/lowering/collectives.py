"""Lowering rules for the collectives (`frontend/aten_collectives.py`): each `collective` node
becomes one `Extern` step whose routine is the collective's kind ("all_reduce", "all_gather",
"reduce_scatter", "all_to_all"; `COLLECTIVES`), reading its operand as one contiguous
buffer (a view that is not contiguous is materialised first) and writing a fresh contiguous
result buffer: the functional form, the input is left as it was. The memory planner plans
that buffer like any other step's output: it lives from the collective's step to the last
reader after the wait.

Attributes: `reduce` (the index in `REDUCE_OPS`; -1 for none), `group_size` (the size given at
export; 0: any, for all_reduce of a group gone before compiling). A package runs on one
communicator: collectives on two different process groups are refused.

`collective_wait` lowers to its operand's value: the collective step is complete when it
returns on the CPU (MPI, blocking), so readers of the wait read the collective's buffer, after
it in program order. On CUDA the Program IR gets a wait line back, as late as the data allows
(targets/collectives.py `async_waits`): NCCL runs on the communication stream meanwhile."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.frontend.aten_collectives import REDUCE_OPS
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import contiguous_strides
from kiln.lowering.core import Lazy, LowerCtx

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _contiguous(ctx: LowerCtx, lz: Lazy, name: str, source) -> Lazy:
    v = lz.view
    if v is not None and all(sympy.expand(s - c) == 0 for s, c, d in
                             zip(v.strides, contiguous_strides(lz.shape), lz.shape) if d != 1):
        return lz
    return ctx.realize(name, lz, source)


def lower_collective(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    kind = node.attr("kind")
    if kind not in COLLECTIVES:
        raise UnsupportedError(f"collective kind {kind!r} (node {node.name})")
    source = (node.source or node.name,)
    x = _contiguous(ctx, x, node.name + "_send", source)
    v = x.view
    shape = tuple(x.shape) or (sympy.Integer(1),)
    arg = L.LibArg(v.buf, v.offset, shape, contiguous_strides(shape))
    out = ctx.unique(node.name)
    ctx.declare(out, node.type.dtype, node.type.shape, "temp")
    group = ctx.shared.setdefault(("collective", "group"), str(node.attr("group")))
    if group != str(node.attr("group")):
        raise UnsupportedError(f"collective {node.name}: process group {node.attr('group')!r}, "
                               f"but an earlier collective used group {group!r}: a package "
                               "runs on one communicator (one process group)")
    op = node.attr("reduce")
    attrs = (("reduce", REDUCE_OPS.index(op) if op else -1),
             ("group_size", int(node.attr("group_size"))))
    ctx.nodes.append(L.Extern(kind, (out,), (arg,), attrs, source))
    return ctx.buffer_lazy(out, node.type.dtype, node.type.shape)


def lower_wait(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    return args[0]


RULES = {"collective": lower_collective, "collective_wait": lower_wait}
