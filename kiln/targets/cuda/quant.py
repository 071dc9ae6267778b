"""Weight-only quantised GEMMs, the CUDA target's half (Options.weight_quant "int8" / "int4";
the CPU's is targets/cpu/quant.py): the stage that stores constant GEMM weights quantised, as
kiln's GEMV template reads them (M = 1, decode) or calling kiln/gemm/quant_gemv.py's Triton
kernels (other M).

A `matmul(x, B)` node (2-D, K and N static, M static or a size symbol; float32, bfloat16 or
float16 throughout) whose B is a weight [K, N], or `permute(W, (1, 0))` of a weight W [N, K]
(nn.Linear), with M = 1 at compile time (decode) becomes, where the Triton GEMM backend is
allowed, a GEMM that reads the quantised weight itself, its rows along K (lowering/mixed.py:
a `Gemm` with `mixed` side "b", ir/loop.py's MixedGemm):

    int8   mixed_mm(x, permute(q, (1, 0)), s)                  s[n] scales row n's sum
    int4   mixed_mm(x, permute(p, (1, 0)), permute(s, (1, 0))) attr group: s[n, k // G]
           (attr tc: p in int4_tc.py's `pack_tc` order, quant_gemv.py `tc_packed`: bfloat16,
           groups >= 128; the GEMV template then multiplies on the tensor cores)

which the GEMV template computes (gemm/select.py, gemm/gemv.py, targets/cuda/
gemv_template.py) with every fusion of a float GEMV: the RMSNorm or silu * mul producing x
recomputed in its prologue, bias / residual epilogues. Other M (prefill) become
a user Triton kernel call, the path of user-written kernels
(frontend/user_triton.py: a `user_kernel` node and its `user_result`, named as the matmul was):

    qlinear_<mode>_kernel(x, q, s, out, M, N, K[, G])    out: a fresh [M, N] of x's dtype

with q, s new weights (quant_gemv.py's layouts, rows along K) named `<weight>_q8` / `_q4` and
`<weight>_s`, FQN `<quantised MODE of FQN>` (update_weights refuses them). M = 1 at compile time
(decode) launches the GEMV configurations, others the tensor-core tiles; kiln's user-kernel
autotuning picks one per GEMM on the compile machine's GPU (Options.autotune), else the
heuristic's first. GEMMs kept as they were: int4 where K is not a multiple of the group (or the
group not a power of two >= 32), GEMMs in control-flow regions, batched GEMMs. The stage runs
after merge_gemms (merged q/k/v and gate/up weights are quantised as one) and before freeze.
A pure pass: returns a new graph and weight table."""

from __future__ import annotations

from dataclasses import replace

import sympy
import torch

from kiln.frontend.user_triton import UserConfig, UserKernelSpec
from kiln.gemm import quant_gemv as QG
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Graph, Input, Node, TensorType, fresh_name
from kiln.ir.sym import FloorDiv
from kiln.options import GemmBackend
from kiln.passes.dce import dce
from kiln.passes.quant_weights import quantisable_weights, quantised_inputs, weight_b
from kiln.targets.stages import Build

SUFFIX = {"int8": "q8", "int4": "q4"}
FLOATS = (dtypes.float32, dtypes.bfloat16, dtypes.float16)


def quant_enabled(state: Build) -> bool:
    return state.options.weight_quant in ("int8", "int4")


def quant_weights(state: Build) -> Build:
    o = state.options
    graph, weights = quantize_gemms(state.graph, dict(state.weights), o.weight_quant,
                                    o.weight_quant_group,
                                    gemv=GemmBackend.TRITON in o.gemm_backends,
                                    tc_order=o.cuda_int4_tensor_core)
    return replace(state, graph=graph, weights=weights)


def _static_int(e) -> int | None:
    e = sympy.sympify(e)
    return int(e) if isinstance(e, sympy.Integer) else None


def _spec(mode: str, m, n: int, k: int, group: int, dtype, tc: bool = False) -> UserKernelSpec:
    """The user-kernel call of one quantised GEMM (operands: x, q, s, out)."""
    fn = QG.KERNELS[mode]
    m_static = _static_int(m)
    args = [("x_ptr", L.UserOperand(0)), ("q_ptr" if mode == "int8" else "p_ptr",
                                          L.UserOperand(1)),
            ("s_ptr", L.UserOperand(2)), ("out_ptr", L.UserOperand(3)),
            ("M", L.UserInt(sympy.sympify(m))), ("N", L.UserInt(sympy.Integer(n))),
            ("K", L.UserConstexpr(k))]
    if mode == "int4":
        args.append(("G", L.UserConstexpr(group)))
    args.append(("PRECISION", L.UserConstexpr(QG.PRECISION[dtype.torch])))
    if tc:
        args.append(("TC", L.UserConstexpr(True)))
    tunable = ("BLOCK_M", "BLOCK_N", "BLOCK_K") if mode == "int8" else ("BLOCK_M", "BLOCK_N",
                                                                         "GPI")
    args += [(p, L.UserConfigured()) for p in tunable]
    configs = []
    for consts, warps, stages in QG.configs(mode, m_static, n, k, group):
        bm, bn = consts["BLOCK_M"], consts["BLOCK_N"]
        grid = (sympy.Integer(-(-n // bn)), FloorDiv(sympy.sympify(m) + bm - 1, bm),
                sympy.Integer(1))
        configs.append(UserConfig(tuple(sorted(consts.items())), warps, stages, grid))
    return UserKernelSpec(fn.__name__, fn, tuple(args), tuple(configs), ("M", "N", "K"),
                          ("out_ptr",), frozenset({"out_ptr"}))


def _gemv_nodes(n: Node, mode: str, group: int, q: str, s: str, types, names: set[str],
                views: dict[str, str], tc: bool = False) -> list[Node]:
    """The decode GEMM of quantised weight (q, s) as a `mixed_mm` the GEMV template reads:
    the views of q (and int4's s) it takes, made once per weight (`views`), then the GEMM."""
    src = n.source or n.name
    out: list[Node] = []

    def transposed(x: str) -> str:
        if x not in views:
            t = types[x]
            views[x] = fresh_name(f"{x}_t", names)
            out.append(Node(views[x], "permute", (x,), TensorType(
                t.dtype, (t.shape[1], t.shape[0])), (("dims", (1, 0)),), src))
        return views[x]

    ins = (n.inputs[0], transposed(q), s if mode == "int8" else transposed(s))
    attrs = (("side", "b"), ("scaled", True)) + ((("group", group),) if mode == "int4" else ()) \
        + ((("tc", True),) if tc else ())
    return out + [Node(n.name, "mixed_mm", ins, n.type, attrs, src)]


def quantize_gemms(g: Graph, weights: dict[str, torch.Tensor], mode: str, group: int,
                   gemv: bool = False, tc_order: bool = False
                   ) -> tuple[Graph, dict[str, torch.Tensor]]:
    """`gemv`: M = 1 GEMMs become GEMMs of the quantised weight (the GEMV template's; needs
    the Triton GEMM backend), not kernel calls. `tc_order`: Options.cuda_int4_tensor_core."""
    if mode not in QG.KERNELS:
        return g, weights
    types = g.types()
    nodes = {n.name: n for n in g.nodes}
    weights_in = quantisable_weights(g)
    names = set(types)
    new_weights = dict(weights)
    added: list[Input] = []
    # (weight, transposed) -> (q, s, stored in pack_tc's order)
    done: dict[tuple[str, bool], tuple[str, str, bool]] = {}
    views: dict[str, str] = {}  # quantised weight -> its permute (the GEMV's B / scales)
    out_nodes: list[Node] = []
    for n in g.nodes:
        wb = weight_b(n, types, nodes, weights_in)
        shape = types[n.inputs[0]].shape if wb else ()
        k = _static_int(shape[1]) if wb else None
        nn_ = _static_int(n.type.shape[1]) if wb else None
        if wb is None or k is None or nn_ is None or not QG.supported(mode, k, group) or \
                n.type.dtype not in FLOATS or \
                not types[n.inputs[0]].dtype == weights_in[wb[0]].type.dtype == n.type.dtype:
            out_nodes.append(n)
            continue
        wname, transposed = wb
        if (wname, transposed) not in done:
            w = weights[wname] if transposed else weights[wname].t()  # [N, K]
            # (the order depends on the dtype and group only: prefill and decode graphs of
            # one package store the same bytes)
            tc = mode == "int4" and QG.tc_packed(group, n.type.dtype.torch, tc_order)
            parts = QG.quantize_int8(w) if mode == "int8" else QG.quantize_int4(w, group, tc)
            new = quantised_inputs(wname, mode, SUFFIX[mode], parts, weights_in, names)
            added += [i for i, _ in new]
            new_weights.update((i.name, t) for i, t in new)
            done[(wname, transposed)] = (new[0][0].name, new[1][0].name, tc)
        q, s, tc = done[(wname, transposed)]
        m = shape[0]
        if gemv and _static_int(m) == 1:
            new_types = {**types, **{i.name: i.type for i in added}}
            out_nodes += _gemv_nodes(n, mode, group, q, s, new_types, names, views, tc)
            continue
        out = fresh_name(f"{n.name}_out", names)
        call = fresh_name(f"{n.name}_{SUFFIX[mode]}", names)
        spec = _spec(mode, m, nn_, k, group, n.type.dtype, tc)
        src = n.source or n.name
        out_nodes += [
            Node(out, "full", (), n.type, (("value", 0),), src),
            Node(call, "user_kernel", (n.inputs[0], q, s, out), TensorType(dtypes.bool_, ()),
                 (("spec", spec),), src),
            Node(n.name, "user_result", (call,), n.type, (("index", 0),), src),
        ]
    if not done:
        return g, weights
    res = dce(replace(g, inputs=g.inputs + tuple(added), nodes=tuple(out_nodes)))
    live = {i.name for i in res.inputs}
    return res, {k: v for k, v in new_weights.items() if k in live}
