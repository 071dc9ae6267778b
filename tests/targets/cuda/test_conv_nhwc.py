"""The CUDA channels-last convolution without a GPU (passes/conv_nhwc.py, lowering/conv_nhwc.py,
targets/cuda/conv_template.py): the pass's regions (one conversion at each edge, max pooling
kept in NHWC, batch norm folded, chains fused), the kernels compiled for sm_90, and the
generated kernels computing what eager computes, run by Triton's interpreter (numpy) through
the Python runner in a subprocess: dense 3x3 / 7x7 / 1x1 (GEMM and strided), strides 1 and 2,
padding, dilation, groups (grouped and depthwise), channel counts off the 16 grid (the flat K
loop), bias / batch norm / residual / relu / relu6 / silu epilogues, a dynamic batch.
bfloat16 is left to the GPU tests (tests/targets/cuda/test_conv_nhwc_gpu.py): the interpreter
has no bfloat16 dot."""

from __future__ import annotations

import pathlib
import textwrap

import pytest
import sympy
import torch

triton = pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.frontend.export import import_program  # noqa: E402
from kiln.ir.graph import Graph  # noqa: E402
from kiln.ir.interp import run_loop  # noqa: E402
from kiln.lowering import lower  # noqa: E402
from kiln.passes.conv_nhwc import conv_nhwc  # noqa: E402
from kiln.passes.dce import dce  # noqa: E402
from kiln.options import Options  # noqa: E402
from tests.difftest import run_interpreted  # noqa: E402

OPTS = Options(cuda_archs=(90,), autotune=False)


class ConvChain(torch.nn.Module):
    """conv -> [bn] -> [+ residual] -> act, then a second convolution reading the first's
    result (so the NHWC region spans two convolutions)."""

    def __init__(self, cin=16, cout=16, k=3, stride=1, pad=1, dil=1, groups=1, bias=True,
                 bn=True, residual=False, act="relu"):
        super().__init__()
        self.c1 = torch.nn.Conv2d(cin, cout, k, stride, pad, dilation=dil, groups=groups,
                                  bias=bias)
        self.bn = torch.nn.BatchNorm2d(cout).eval() if bn else None
        self.c2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.residual, self.act = residual, act
        g = torch.Generator().manual_seed(3)
        if bn:
            self.bn.running_mean.copy_(torch.rand(cout, generator=g) - 0.5)
            self.bn.running_var.copy_(torch.rand(cout, generator=g) + 0.5)
            self.bn.weight.data.copy_(torch.rand(cout, generator=g) + 0.5)
            self.bn.bias.data.copy_(torch.rand(cout, generator=g) - 0.5)

    def _act(self, y):
        return {"relu": torch.relu, "relu6": torch.nn.functional.relu6,
                "silu": torch.nn.functional.silu, "none": lambda v: v}[self.act](y)

    def forward(self, x):
        y = self.c1(x)
        if self.bn is not None:
            y = self.bn(y)
        if self.residual:
            y = y + self.c2(y)
            return self._act(y)
        y = self._act(y)
        return torch.relu(self.c2(y) + y)


class Stem(torch.nn.Module):
    """ResNet's stem and first block: 7x7 stride 2 on 3 channels, batch norm, relu, 3x3
    stride-2 max pooling, a basic block, global average pooling."""

    def __init__(self, c=16):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, c, 7, 2, 3, bias=False)
        self.bn = torch.nn.BatchNorm2d(c).eval()
        self.a = torch.nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bna = torch.nn.BatchNorm2d(c).eval()
        self.b = torch.nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bnb = torch.nn.BatchNorm2d(c).eval()

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 3, 2, 1)
        z = torch.relu(self.bna(self.a(y)))
        z = torch.relu(self.bnb(self.b(z)) + y)
        return torch.nn.functional.adaptive_avg_pool2d(z, 1).flatten(1)


# (id, ConvChain kwargs, input [N, C, H, W])
CASES = [
    ("3x3", {}, (2, 16, 9, 9)),
    ("3x3_s2_nobias", {"stride": 2, "bias": False}, (2, 16, 11, 11)),
    ("3x3_dil2", {"pad": 2, "dil": 2, "bn": False}, (1, 16, 10, 10)),
    ("5x5_pad0_silu", {"k": 5, "pad": 0, "act": "silu"}, (1, 16, 12, 12)),
    ("7x7_c3_s2", {"cin": 3, "k": 7, "stride": 2, "pad": 3}, (2, 3, 17, 17)),
    ("3x3_c24_flat", {"cin": 24, "cout": 24, "act": "relu6"}, (1, 24, 7, 7)),
    ("grouped_g2", {"cin": 32, "cout": 32, "groups": 2}, (1, 32, 8, 8)),
    ("grouped_g4_c8", {"cin": 32, "cout": 32, "groups": 4, "bn": False}, (1, 32, 6, 6)),
    ("depthwise", {"cin": 32, "cout": 32, "groups": 32, "act": "relu6"}, (2, 32, 9, 9)),
    ("depthwise_s2", {"cin": 24, "cout": 24, "groups": 24, "stride": 2}, (1, 24, 10, 10)),
    ("depthwise_5x5_dil2", {"cin": 16, "cout": 16, "groups": 16, "k": 5, "pad": 4, "dil": 2},
     (1, 16, 9, 9)),
    ("1x1_gemm", {"k": 1, "pad": 0}, (2, 16, 7, 7)),
    ("1x1_s2", {"k": 1, "pad": 0, "stride": 2, "cout": 32}, (2, 16, 9, 9)),
    ("residual", {"residual": True}, (2, 16, 8, 8)),
    ("splitk_c128", {"cin": 128, "cout": 128}, (1, 128, 6, 6)),
    ("residual_1x1", {"k": 1, "pad": 0, "residual": True, "act": "none"}, (1, 16, 5, 5)),
]


def case_module(kw, shape, dtype=torch.float32):
    torch.manual_seed(0)
    m = ConvChain(**kw).eval().to(dtype)
    x = torch.randn(*shape).to(dtype)
    return m, x


def _graph_ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes]


def test_pass_keeps_regions_in_nhwc():
    """The stem and a basic block: no conversion in (the stem reads a view), max pooling
    stays NHWC, one conversion out (before the average pooling), batch norms folded, chains
    fused."""
    torch.manual_seed(0)
    m, x = Stem().eval(), torch.randn(2, 3, 32, 32)
    cm = kiln.compile(torch.export.export(m, (x,)), device="cuda", options=OPTS)
    ops = _graph_ops(cm.built.graph)
    assert ops.count("conv_nhwc") == 3 and "conv" not in ops and "batch_norm" not in ops
    # the RGB stem reads its NCHW input through an NHWC view: nothing is transposed
    assert ops.count("to_nhwc") == 0 and ops.count("max_pool_nhwc") == 1
    assert [n.op for n in cm.built.graph.nodes if n.name.endswith("_nhwc_view")] == ["permute"]
    assert ops.count("from_nhwc") == 1
    convs = [n for n in cm.built.graph.nodes if n.op == "conv_nhwc"]
    assert [n.attr("epilogue") for n in convs][-1].endswith("relu")
    assert any(n.attr("epilogue").startswith("+ ") or "+ " in n.attr("epilogue") for n in convs)
    assert "conv_nhwc" in cm.report["stages"]
    src = cm.sources["kernels_triton.py"]
    assert src.count("def conv_") == 3 and "flat K loop" in src and "taps K loop" in src
    assert set(cm.manifest["cuda"]["conv"]) == {f"conv_{n.name}" for n in convs}


def test_im2col_option_keeps_the_old_path():
    m, x = case_module({}, (1, 16, 6, 6))
    cm = kiln.compile(torch.export.export(m, (x,)), device="cuda",
                      options=Options(cuda_archs=(90,), autotune=False, cuda_conv="im2col"))
    assert "conv_nhwc" not in cm.report["stages"] and "def conv_" not in \
        cm.sources["kernels_triton.py"]
    with pytest.raises(ValueError, match="cuda_conv"):
        Options(cuda_conv="winograd")


def test_1x1_is_a_plain_gemm_with_max_autotune():
    """With max_autotune, a 1x1 stride-1 convolution is a GEMM on the NHWC matrix (timed like
    every GEMM); by default it is the NHWC kernel with its epilogue fused."""
    m, x = case_module({"k": 1, "pad": 0, "residual": True}, (2, 16, 5, 5))
    ep = torch.export.export(m, (x,))
    tuned = kiln.compile(ep, device="cuda", options=Options(cuda_archs=(90,), autotune=False,
                                                            max_autotune=True))
    plain = kiln.compile(ep, device="cuda", options=OPTS)
    gemms = [k for k in tuned.manifest["kernels"] if k["kind"].endswith("_gemm")]
    assert len(gemms) == 1, tuned.manifest["kernels"]
    assert tuned.sources["kernels_triton.py"].count("def conv_") == 1  # the 3x3
    assert plain.sources["kernels_triton.py"].count("def conv_") == 2
    assert not [k for k in plain.manifest["kernels"] if k["kind"].endswith("_gemm")]


def test_depthwise_and_grouped_kernels_are_not_gemms():
    m, x = case_module(dict(CASES[8][1]), CASES[8][2])
    cm = kiln.compile(torch.export.export(m, (x,)), device="cuda", options=OPTS)
    src = cm.sources["kernels_triton.py"]
    assert "depthwise" in src and src.count("tl.dot(") >= 1  # c2 (dense) is a GEMM
    dw = src[src.index("depthwise"):]
    dw = dw[:dw.index("tl.store(")]
    assert "tl.dot(" not in dw


@pytest.mark.parametrize("case", CASES + [("stem", None, (2, 3, 20, 20))],
                         ids=[c[0] for c in CASES] + ["stem"])
def test_loop_interpreter_twin_matches_eager(case):
    """The pass and the lowering, run by the Loop IR interpreter (the numpy twin of
    conv2d_nhwc in kiln.ir.interp): the packed weights, folded batch norm and regions."""
    name, kw, shape = case
    if kw is None:
        torch.manual_seed(0)
        m, x = Stem().eval(), torch.randn(*shape)
    else:
        m, x = case_module(kw, shape)
    imp = import_program(torch.export.export(m, (x,)), fused_attention=True)
    graph, weights = conv_nhwc(dce(imp.graph), dict(imp.weights))
    assert any(n.op == "conv_nhwc" for n in graph.nodes)
    prog = lower(graph)
    feeds = {i.name: x.numpy() for i in graph.user_inputs}
    feeds.update({k: v.numpy() for k, v in weights.items()})
    (got,) = run_loop(prog, feeds, {})
    with torch.no_grad():
        want = m.double()(x.double())
    torch.testing.assert_close(torch.tensor(got).double().reshape(want.shape), want,
                               rtol=1e-5, atol=1e-5)


def interp_checks(names: list[str]) -> list[tuple]:
    """(tag, module, export input, dynamic_shapes, more inputs, options) of the interpreter
    runs: the named CASES; with "all", also a 1x1 as a plain GEMM (max_autotune), dynamic
    batches and the stem."""
    out = []
    for name, kw, shape in CASES:
        if name in names:
            m, x = case_module(kw, shape)
            out.append((name, m, x, None, (), OPTS))
    if "all" not in names:
        return out
    m, x = case_module({"k": 1, "pad": 0, "residual": True}, (2, 16, 5, 5))
    out.append(("1x1_plain_gemm", m, x, None, (), Options(cuda_archs=(90,), autotune=False,
                                                          max_autotune=True)))
    batch = torch.export.Dim("batch", min=1, max=8)
    g = torch.Generator().manual_seed(5)
    m, x = case_module({"cin": 32, "cout": 32, "groups": 32}, (2, 32, 6, 6))
    out.append(("depthwise_dynamic_batch", m, x, ({0: batch},),
                (torch.randn(3, 32, 6, 6, generator=g), torch.randn(1, 32, 6, 6, generator=g)),
                OPTS))
    m, x = case_module({"stride": 2}, (2, 16, 9, 9))
    out.append(("3x3_s2_dynamic_batch", m, x, ({0: batch},),
                (torch.randn(5, 16, 9, 9, generator=g),), OPTS))
    m, x = case_module({"stride": 2}, (2, 16, 12, 12))
    hd, wd = torch.export.Dim("h", min=6, max=64), torch.export.Dim("w", min=6, max=64)
    out.append(("3x3_s2_dynamic_image", m, x, ({2: hd, 3: wd},),
                (torch.randn(2, 16, 9, 13, generator=g), torch.randn(2, 16, 20, 7, generator=g)),
                OPTS))
    m, x = case_module({"cin": 128, "cout": 128}, (2, 128, 5, 5))
    out.append(("splitk_dynamic_batch", m, x, ({0: batch},),
                (torch.randn(1, 128, 5, 5, generator=g),), OPTS))
    torch.manual_seed(0)
    out.append(("stem", Stem().eval(), torch.randn(2, 3, 20, 20), None, (), OPTS))
    return out


_INTERP = textwrap.dedent("""
    import sys, torch, kiln
    sys.path.insert(0, sys.argv[1])
    from test_conv_nhwc import interp_checks
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels
    bad = []
    for tag, m, x, dyn, runs, opts in interp_checks(sys.argv[2].split(",")):
        cm = kiln.compile(torch.export.export(m, (x,), dynamic_shapes=dyn), device="cuda",
                          options=opts)
        b = cm.built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        bufs = {v.name: v for v in b.loop.buffers}
        hints = {s.name: s.example for s in b.graph.symbols}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
        for xx in (x, *runs):
            (got,) = run_program(b.program, ks, mod, b.weights, [xx])
            want = m.double()(xx.double())
            err = (got.double().reshape(want.shape) - want).abs().max().item()
            scale = want.abs().max().item()
            print(tag, tuple(xx.shape), "error", err, "scale", scale, flush=True)
            if not err <= 1e-5 * max(1.0, scale):
                bad.append(f"{tag}: error {err} (scale {scale})")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
    sys.exit(1 if bad else 0)
""")


def _interpreted(names: list[str]) -> None:
    """The checks compiled here (the AOT compiler cannot run in interpreter mode), then run by
    Triton's interpreter in a child process; float32 to 1e-5 of the output's scale (the
    interpreter's tf32x3 dot is a float32 dot)."""
    for _, m, x, dyn, _, opts in interp_checks(names):
        kiln.compile(torch.export.export(m, (x,), dynamic_shapes=dyn), device="cuda",
                     options=opts)
    run_interpreted(_INTERP, str(pathlib.Path(__file__).parent), ",".join(names), timeout=1500)


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_conv_kernels_match_eager_in_interpreter():
    """A few cases covering both K loops, depthwise, grouped, 1x1 as a GEMM and a residual."""
    _interpreted(["7x7_c3_s2", "depthwise_s2", "grouped_g2", "residual_1x1", "splitk_c128"])


@pytest.mark.slow
def test_all_conv_cases_match_eager_in_interpreter():
    """Every case, dynamic batches, and the stem with its max pooling in NHWC."""
    _interpreted(["all"] + [c[0] for c in CASES])


@pytest.mark.parametrize("kw,shape,dtype", [
    ({"cin": 64, "cout": 64}, (8, 64, 56, 56), torch.bfloat16),
    ({"cin": 64, "cout": 64}, (8, 64, 56, 56), torch.float32),
    ({"cin": 96, "cout": 96, "groups": 96, "stride": 2}, (1, 96, 56, 56), torch.bfloat16),
], ids=["dense_bf16", "dense_fp32", "depthwise_bf16"])
def test_every_tuner_candidate_compiles_for_sm90(kw, shape, dtype):
    """What the compile-time tuner may pick on a GPU compiles here for sm_90 and fits in an
    sm_90 block's shared memory (the heuristic's config first)."""
    from kiln.targets.cuda.attention import SHARED_LIMIT
    from kiln.targets.cuda.build import conv_steps
    from kiln.targets.cuda.conv_template import conv_candidates, print_conv_kernel
    from kiln.toolchain import triton_aot
    m, x = case_module(kw, shape, dtype)
    cm = kiln.compile(torch.export.export(m, (x,)), device="cuda", options=OPTS)
    b = cm.built
    bufs = {v.name: v for v in b.loop.buffers}
    call = conv_steps(b.steps)[0]
    cands = conv_candidates(call, bufs, {})
    assert len(cands) >= 5
    tks = [print_conv_kernel(call, bufs, {}, c) for c in cands]
    for tk in tks:
        mod = triton_aot.import_module("import triton\nimport triton.language as tl\n\n\n"
                                       + tk.source, kiln.config.cache_dir())
        ck = triton_aot.compile_kernel(mod, tk, 90)
        assert ck.metadata.shared <= SHARED_LIMIT, (tk.config, ck.metadata.shared)
        if "tl.dot(" in tk.source and tk.config.xblock >= 64:
            assert "wgmma" in ck.asm["ptx"], tk.config  # Hopper's warp-group MMA


def test_split_k_only_where_tiles_cannot_fill_the_gpu():
    """ResNet-18's last stage at batch 1 (7x7 pixels, 512 channels, K = 4608) splits K; its
    first stage (56x56) and any depthwise convolution do not."""
    from kiln.ir import dtypes
    from kiln.ir.graph import Node, TensorType
    from kiln.passes.conv_nhwc import split_k

    def conv(n, c, hw, oc, groups=1, dt=dtypes.bfloat16):
        types = {"x": TensorType(dt, tuple(map(sympy.Integer, (n, c, hw, hw)))),
                 "w": TensorType(dt, tuple(map(sympy.Integer, (oc, c // groups, 3, 3))))}
        node = Node("y", "conv", ("x", "w"), TensorType(dt, tuple(map(sympy.Integer, (
            n, oc, hw, hw)))), (("groups", groups),))
        return node, types

    deep, types = conv(1, 512, 7, 512)
    assert split_k(deep, types, {}, False) == 8
    first, types1 = conv(8, 64, 56, 64)
    assert split_k(first, types1, {}, False) == 1
    assert split_k(deep, types, {}, True) == 1  # depthwise
    b8, types8 = conv(8, 512, 7, 512)
    assert 1 < split_k(b8, types8, {}, False) < 8
