"""Lowering of user Triton kernels (frontend/user_triton.py) to Loop IR `UserKernel` nodes.

A kernel reads raw pointers, so every tensor argument is a whole contiguous buffer (a lazy or
strided value is materialised first; an input or weight is passed as it is). Functional
semantics: each argument the kernel writes gets a fresh buffer of its own (the node's `outs`),
initialised with a copy of the value passed in unless that value was `empty` (`inits`). The
results (`user_result` nodes) read those buffers."""

from __future__ import annotations

from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.lowering.control import _token, _whole
from kiln.lowering.core import Lazy, LowerCtx


def lower_user_kernel(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    spec = node.attr("spec")
    src = node.source or node.name
    bufs: dict[int, str] = {}
    outs, inits = [], []
    for pname, v in spec.args:
        if not isinstance(v, L.UserOperand):
            continue
        lz = args[v.index]
        if pname in spec.written:
            out = ctx.unique(f"{node.name}_{pname}")
            ctx.declare(out, lz.dtype, lz.shape, "temp")
            init = None if pname in spec.uninit else _whole(ctx, lz, f"{node.name}_{pname}_in",
                                                            src)
            outs.append(out)
            inits.append(init)
            bufs[v.index] = out
        else:
            bufs[v.index] = _whole(ctx, lz, f"{node.name}_{pname}", src)
    loop_args = tuple((p, L.UserBuf(bufs[v.index]) if isinstance(v, L.UserOperand) else v)
                      for p, v in spec.args)
    ctx.nodes.append(L.UserKernel(node.name, spec.name, loop_args, tuple(outs), tuple(inits),
                                  spec, (src,)))
    return _token(node)


def lower_user_result(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """Result `index` (a written argument) of the user kernel that is this node's input."""
    owner = next(n for n in reversed(ctx.nodes) if isinstance(n, L.UserKernel)
                 and n.name == node.inputs[0])
    return ctx.buffer_lazy(owner.outs[node.attr("index")], node.type.dtype, node.type.shape)
