"""Graph IR -> Loop IR.

Walks the graph in order, lowering each node through `RULES` into a `Lazy` value, then decides
whether to materialise it: a value is inlined into its consumers (fusing pointwise chains and
reduction prologues/epilogues) unless it is used several times and not trivially cheap, or its
expression grew too large. Graph outputs always get their own output buffer."""

from __future__ import annotations

import sympy
from dataclasses import replace
from functools import partial

from kiln.ir import loop as L
from kiln.ir.graph import Graph, Node
from kiln.ir.sym import contiguous_strides, ivars
from kiln.lowering import collectives
from kiln.lowering import complex as complex_rules
from kiln.lowering import quant as quant_rules
from kiln.lowering import (attention, control, conv_nchwc, conv_nhwc, extern, fallback,
                           indexing, library, lowp, mixed, pointwise, random, reductions,
                           spatial, user_triton, views)
from kiln.lowering.core import Lazy, LowerCtx, View, from_view
from kiln.ops import ROWS
from kiln.errors import UnsupportedError

RULES = {
    **{name: pointwise.lower_pointwise for name in ROWS},  # kiln/ops/table.py
    "full": pointwise.lower_full,
    "iota": pointwise.lower_iota,
    "random": random.lower_random,
    "view": views.lower_view,
    "permute": views.lower_permute,
    "expand": views.lower_expand,
    "slice": views.lower_slice,
    "select": views.lower_select,
    "cat": views.lower_cat,
    "pad": views.lower_pad,
    "flip": views.lower_flip,
    "roll": views.lower_roll,
    "diagonal": views.lower_diagonal,
    "as_strided": views.lower_as_strided,
    "slice_scatter": views.lower_slice_scatter,
    "diagonal_scatter": views.lower_diagonal_scatter,
    "as_strided_scatter": views.lower_as_strided_scatter,
    "reduce": reductions.lower_reduce,
    "var": reductions.lower_var,
    "softmax": reductions.lower_softmax,
    "log_softmax": reductions.lower_softmax,
    "layer_norm": reductions.lower_layer_norm,
    "batch_norm": reductions.lower_batch_norm,
    "max_pool": spatial.lower_max_pool,
    "avg_pool": spatial.lower_avg_pool,
    "adaptive_pool": spatial.lower_adaptive_pool,
    "conv": spatial.lower_conv,
    "upsample": spatial.lower_upsample,
    "grid_sample": spatial.lower_grid_sample,
    "embedding": indexing.lower_embedding,
    "index": indexing.lower_index,
    "gather": indexing.lower_gather,
    "matmul": extern.lower_matmul,
    "attention": attention.lower_attention,
    "scaled_mm": lowp.lower_scaled_mm,  # CUDA (CPU builds expand it: passes/lowp_cpu.py)
    "int_mm": lowp.lower_int_mm,
    "mixed_mm": mixed.lower_mixed_mm,  # CUDA + Triton template (passes/mixed_gemm.py)
    "aten": fallback.lower_aten,
    "read_size": fallback.lower_read_size,
    "cond": control.lower_cond,
    "while_loop": control.lower_while,
    "ctl_result": control.lower_result,
    "user_kernel": user_triton.lower_user_kernel,
    "user_result": user_triton.lower_user_result,
    **library.RULES,
    **collectives.RULES,  # functional collectives (MPI / NCCL)
    **complex_rules.RULES,  # complex values as pairs of real parts
    **conv_nchwc.RULES,  # the CPU direct convolution (passes/conv_nchwc.py)
    **conv_nhwc.RULES,  # the CUDA channels-last convolution (passes/conv_nhwc.py)
    **quant_rules.RULES,  # CPU quantised / bf16 weight GEMMs (passes/quant_weights.py)
}

CHEAP = 2  # operators per element that may be recomputed by each consumer
MAX_INLINE = 60  # operators per element above which a value is always materialised


def _should_realize(node: Node, lz: Lazy, users: int) -> bool:
    if lz.view is not None:
        return False
    if lz.cost > MAX_INLINE:
        return True
    return users > 1 and lz.cost > CHEAP


def lower(graph: Graph, realize: frozenset[str] = frozenset(),
          attention_splits: bool = False) -> L.LoopProgram:
    """`realize`: nodes materialised whatever their cost (passes/store_once.py: sums a GEMM
    takes as its epilogue). `attention_splits`: few-row attention calls may split their keys
    among programs and get a scratch output for the partial states (the CUDA kernel's decode
    path, lowering/attention.py); the CPU routine takes no scratch."""
    ctx = LowerCtx(partial(lower, attention_splits=attention_splits),
                   attention_splits=attention_splits)
    env: dict[str, Lazy] = {}
    for i in graph.inputs:
        kind = {"user": "input", "weight": "weight", "state": "state"}[i.kind]
        ctx.declare(i.name, i.type.dtype, i.type.shape, kind)
        env[i.name] = ctx.buffer_lazy(i.name, i.type.dtype, i.type.shape)
    users = graph.users()
    for node in graph.nodes:
        rule = RULES.get(node.op)
        if rule is None:
            raise UnsupportedError(f"no lowering for op {node.op} (node {node.name})")
        lz = rule(ctx, node, [env[x] for x in node.inputs])
        if lz.view is None:
            lz = replace(lz, origin=node.name)
        if _should_realize(node, lz, users.get(node.name, 0)) or (
                node.name in realize and lz.view is None):
            lz = ctx.realize(node.name, lz, (node.source or node.name,))
        env[node.name] = lz
    outputs = []
    for k, name in enumerate(graph.outputs):
        outputs.append(_output(ctx, name, env[name], graph, k))
    mutations = []
    for state, value in graph.mutations:
        lz = env[value]
        src = lz.view.buf if lz.view is not None and ctx.is_whole_buffer(lz) else None
        if src is None:
            src = ctx.realize(f"{state}_next", lz, (value,)).view.buf
        mutations.append((state, src))
    types = graph.types()
    return L.LoopProgram(tuple(ctx.buffers), tuple(ctx.nodes), tuple(outputs),
                         tuple(i.name for i in graph.user_inputs),
                         tuple(types[o].shape for o in graph.outputs), tuple(mutations))


def _output(ctx: LowerCtx, name: str, lz: Lazy, graph: Graph, k: int) -> str:
    """Give output k its own buffer: retarget the temp that computes it when it reads that
    temp whole and in order (the output's shape may differ: the memory is the same)."""
    whole = ctx.is_whole_buffer(lz)
    if whole is not None:
        buf = next(b for b in ctx.buffers if b.name == whole)
        ctx.buffers[ctx.buffers.index(buf)] = L.Buffer(buf.name, buf.dtype, buf.shape, "output")
        return whole
    out = ctx.realize(f"out{k}_{name}", lz, (name,), kind="output")
    return out.view.buf


__all__ = ["lower", "RULES", "View", "from_view", "contiguous_strides", "sympy", "ivars"]
