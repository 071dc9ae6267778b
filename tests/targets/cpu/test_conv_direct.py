"""The CPU direct convolution (Options.cpu_conv "direct": passes/conv_nchwc.py,
kiln/targets/cpu/include/kiln_conv.h) against torch eager with float64 references: kernel
sizes, strides, padding, dilation, depthwise, channel counts that are not a multiple of the
channel block, batch 1 and 3, fused epilogues (bias, batch norm, relu, relu6, silu, residual
add), non-contiguous weights; what falls back to im2col + GEMM; the NCHWc layout kept across a
chain of convolutions; ResNet-18 and a MobileNetV2-style chain end to end; a build for plain
x86-64 (no AVX); update_weights refused for packed weights, and accepted with
fold_constants=False (which turns the direct path off)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from difftest import Cases, Checker, batch_norm, dim, gen, rand, run_twin
from kiln.errors import InputError
from kiln.models.zoo import resnet18
from kiln.runtime import cpu_supports
from kiln.toolchain.cxx import CPU_FEATURES

F32 = torch.float32
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("conv_direct"))




class ConvBlock(nn.Module):
    """conv [-> bn] [+ residual] [-> act]; the residual is a 1x1 projection of the input (or
    the input itself) so it has the output's shape."""

    def __init__(self, cin, cout, k, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 bn=False, act=None, residual=False, seed=0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = nn.Conv2d(cin, cout, k, stride, padding, dilation, groups, bias=bias)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=g) * 0.3)
        self.bn = batch_norm(cout, g) if bn else None
        self.act = act
        self.proj = None
        if residual:
            self.proj = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        if self.proj is not None:
            y = y + self.proj(x)
        if self.act == "relu":
            y = F.relu(y)
        elif self.act == "relu6":
            y = F.relu6(y)
        elif self.act == "silu":
            y = F.silu(y)
        return y


def _sources(compiled) -> str:
    return "\n".join(compiled.sources.values())


def _direct_calls(compiled) -> int:
    return compiled.sources["model.cpp"].count("kl::conv2d_nchwc(")


# (id, ConvBlock arguments, input channels, spatial size)
CASES = [
    ("3x3_s1_p1", dict(cout=32, k=3, padding=1), 16, (9, 11)),
    ("3x3_s2_p1", dict(cout=24, k=3, stride=2, padding=1), 40, (13, 10)),
    ("7x7_s2_p3_stem", dict(cout=64, k=7, stride=2, padding=3, bias=False, bn=True,
                            act="relu"), 3, (23, 23)),
    ("1x1_s1", dict(cout=40, k=1), 24, (7, 9)),
    ("1x1_s2", dict(cout=48, k=1, stride=2, bias=False), 32, (9, 9)),
    ("dw3x3_s1", dict(cout=24, k=3, padding=1, groups=24, act="relu6"), 24, (10, 7)),
    ("dw3x3_s2", dict(cout=40, k=3, stride=2, padding=1, groups=40, bn=True, act="relu6"),
     40, (11, 12)),
    ("3x3_d2", dict(cout=16, k=3, padding=2, dilation=2), 16, (12, 12)),
    ("dw3x3_d2", dict(cout=32, k=3, padding=2, dilation=2, groups=32), 32, (9, 9)),
    ("5x3_rect_p0", dict(cout=20, k=(5, 3), stride=(1, 2), padding=(0, 1)), 8, (11, 14)),
    ("3x3_bn_relu", dict(cout=40, k=3, padding=1, bn=True, act="relu"), 24, (8, 8)),
    # ConvNeXt's patchify stem (an NCHW input, pixel step 4: a constant-step tap)
    ("4x4_s4_stem", dict(cout=40, k=4, stride=4, act="relu"), 3, (17, 22)),
    ("3x3_bias_silu", dict(cout=16, k=3, padding=1, act="silu"), 3, (6, 7)),
    ("3x3_bn_residual_relu", dict(cout=32, k=3, stride=2, padding=1, bias=False, bn=True,
                                  residual=True, act="relu"), 24, (10, 10)),
    ("1x1_residual", dict(cout=24, k=1, bias=False, bn=True, residual=True), 40, (5, 6)),
    # 7-pixel rows (ResNet's 7x7 maps): one 4 x 7 tile per row (AVX-512), with the padding
    # taps branch-free (a pixel left or right of the input), and without padding
    ("3x3_7wide_p1", dict(cout=80, k=3, padding=1, bn=True, act="relu"), 24, (7, 7)),
    ("3x3_s2_7wide_residual", dict(cout=64, k=3, stride=2, padding=1, residual=True,
                                   act="relu"), 32, (13, 14)),
    ("3x3_p0_7wide", dict(cout=72, k=3), 16, (9, 9)),
    # rows in 4 x 7 and 4 x 6 tiles (AVX-512, 4 output blocks): 20 = 7 + 7 + 6 pixels with
    # both edge tiles checked, 28 (ResNet's stride-2 3x3 into 28x28), 29 (no exact split:
    # 6-pixel tiles and a narrower one)
    ("3x3_20wide_p1", dict(cout=64, k=3, padding=1, act="relu"), 16, (5, 20)),
    ("3x3_s2_28wide_residual", dict(cout=64, k=3, stride=2, padding=1, bias=False, bn=True,
                                    residual=True, act="relu"), 24, (6, 55)),
    ("5x5_29wide", dict(cout=64, k=5, padding=2), 8, (4, 29)),
    # 14-pixel rows (ResNet's 14x14 maps): two 4 x 7 tiles per row with AVX-512's block, the
    # remainder groups of 2 and 1 blocks; stride 2 into 14 columns with a residual
    ("3x3_14wide_p1", dict(cout=112, k=3, padding=1, act="relu"), 32, (5, 14)),
    ("3x3_s2_14wide_residual", dict(cout=80, k=3, stride=2, padding=1, residual=True,
                                    act="relu"), 48, (9, 28)),
    # 1x1 over more input blocks than one weight chunk (L2): the tile resumes from the stored
    # partial sums, bias and residual added by the last chunk only
    ("1x1_chunks_residual", dict(cout=64, k=1, bias=False, bn=True, residual=True,
                                 act="relu"), 300, (5, 7)),
    # stride-1 depthwise rows in register-resident tiles, the padded edges and the last
    # narrow tile checked (zeros for the columns outside the input): ConvNeXt's 7x7 on wide,
    # 7-wide and narrower-than-kernel rows, padding wider than the kernel's half (rows wider
    # than the input), no padding; 5x5 stride 2 (interior tiles of the strided fast path)
    ("dw7x7_s1_p3", dict(cout=40, k=7, padding=3, groups=40, act="relu"), 40, (9, 29)),
    ("dw7x7_s1_7wide_res", dict(cout=24, k=7, padding=3, groups=24, residual=True), 24,
     (7, 7)),
    ("dw7x7_s1_narrow", dict(cout=16, k=7, padding=3, groups=16, bn=True), 16, (5, 3)),
    ("dw3x3_s1_p2", dict(cout=24, k=3, padding=2, groups=24, act="relu6"), 24, (6, 19)),
    ("dw3x3_s1_p0", dict(cout=32, k=3, groups=32), 32, (5, 21)),
    ("dw5x5_s2_wide", dict(cout=24, k=5, stride=2, padding=2, groups=24, act="silu"), 24,
     (9, 41)),
    # 1x1 tiles whose last input block is partly padding (the tile reads only the channels
    # with weights: 20 of 32, 40 of 48, 28 of 32, 19 of 32), through each unrolled
    # epilogue (relu6, relu + residual, silu, none) and flat rows of 4 x 7, 4 x 6, 2 x 14 and
    # narrower tiles; a strided 1x1 over odd sizes
    ("1x1_partial_block_relu6", dict(cout=96, k=1, act="relu6"), 20, (9, 15)),
    ("1x1_s2_partial_residual_relu", dict(cout=40, k=1, stride=2, residual=True, act="relu"),
     40, (11, 13)),
    ("1x1_partial_silu", dict(cout=24, k=1, act="silu"), 12 + 16, (6, 9)),
    ("1x1_partial_odd_cout", dict(cout=37, k=1, bn=True), 19, (3, 29)),
]


def _blocks(cases, seed, key, batch):
    """The ConvBlocks of `cases` as one difftest.Cases program (one package for all of them:
    each block keeps its own static shapes, weights and kernels), its inputs at two draws, and
    the number of convolutions in it."""
    mods, xs, more, convs = {}, [], [], 0
    for name, cfg, cin, hw in cases:
        mods[name] = (ConvBlock(cin, seed=seed, **cfg), 1)
        g = gen(key, str(cfg), seed)
        xs.append(rand((batch, cin, *hw), F32, g, -2, 2))
        more.append(rand((batch, cin, *hw), F32, g, -2, 2))
        convs += 1 + bool(cfg.get("residual"))
    return Cases(mods), xs, [more], convs


@pytest.mark.parametrize("batch", [1, 3])
def test_conv_direct_matches_eager(check, batch):
    """Every case of CASES at `batch`, in one package (outputs named by case id): each
    convolution is a direct one (as many kl::conv2d_nchwc calls as convolutions, no im2col)."""
    m, xs, more, convs = _blocks(CASES, batch, "conv_direct", batch)
    compiled = check(m, xs, tol=TOL, more=more)
    assert _direct_calls(compiled) == convs
    assert "im2col" not in _sources(compiled)


# the work splits of kiln_conv.h: a spatial share per thread (activations outweigh weights;
# shares that cross image boundaries, flat 1x1 rows split in pixel tiles), the dynamic split
# over output-channel groups (weights outweigh activations; also weights past 1 MiB, which
# the tap loop prefetches), depthwise row bands; wide rows
# so the interior depthwise tiles (stride 1 and 2, 3x3 and 5x5) run
SPLITS = [
    ("1x1_flat_spatial", dict(cout=24, k=1, bias=False, bn=True, act="relu6"), 16, (20, 23)),
    ("1x1_flat_spatial_4x7", dict(cout=64, k=1, act="relu6"), 24, (20, 23)),
    ("3x3_rows_spatial", dict(cout=40, k=3, padding=1, residual=True, act="relu"), 16,
     (13, 17)),
    ("1x1_weights_heavy", dict(cout=96, k=1, bn=True, act="relu"), 256, (5, 5)),
    ("3x3_s2_weights_heavy", dict(cout=72, k=3, stride=2, padding=1), 128, (7, 6)),
    # weights past 1 MiB (11 x 13 blocks x 3x3: 1.3 MB): the tap loop prefetches them ahead
    ("3x3_weights_past_l2", dict(cout=170, k=3, padding=1, residual=True, act="relu"), 200,
     (6, 9)),
    ("dw3x3_s2_wide", dict(cout=40, k=3, stride=2, padding=1, groups=40, bn=True,
                           act="relu6"), 40, (9, 37)),
    ("dw3x3_s1_wide_res", dict(cout=32, k=3, padding=1, groups=32, residual=True), 32,
     (7, 29)),
    ("dw5x5_s1_wide", dict(cout=24, k=5, padding=2, groups=24, act="silu"), 24, (6, 27)),
]


@pytest.mark.parametrize("threads", [2, 3])
def test_conv_work_splits(check, threads):
    """Every case of SPLITS, batch 3, with `threads` threads, in one package."""
    m, xs, more, convs = _blocks(SPLITS, threads, "conv_split", 3)
    compiled = check(m, xs, tol=TOL, options=kiln.Options(num_threads=threads), more=more)
    assert _direct_calls(compiled) == convs


def test_1x1_trailing_zero_weights(check):
    """A 1x1 convolution whose top real input channels carry zero weights for every output
    (24 channels, weights of 18..23 zeroed): the tile skips them with the padding, and the
    result is still eager's (finite inputs)."""
    m = ConvBlock(24, cout=48, k=1, act="relu6", seed=4)
    with torch.no_grad():
        m.conv.weight[:, 18:] = 0
    g = gen("conv_zero_tail")
    x = rand((2, 24, 7, 11), F32, g, -2, 2)
    compiled = check(m, [x], tol=TOL, more=[(rand((2, 24, 7, 11), F32, g, -2, 2),)])
    assert _direct_calls(compiled) == 1


def test_1x1_zero_weight_channel_keeps_eager_nan(tmp_path):
    """The same skipped channels holding an Inf or a NaN: eager's 0 * Inf makes that pixel's
    outputs NaN, so the tile must read them (`tail_finite`), at one pixel and not the others."""
    m = nn.Conv2d(24, 48, 1).eval()
    with torch.no_grad():
        m.weight[:, 18:] = 0
    g = gen("conv_zero_tail_nan")
    x = rand((2, 24, 7, 11), F32, g, -2, 2)
    runner = kiln.compile(torch.export.export(m, (x,))).load(tmp_path / "c.kiln")
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[1, 20, 3, 4] = bad
        want = m(y)
        got = runner(y)
        assert got[1, :, 3, 4].isnan().all() and want[1, :, 3, 4].isnan().all()
        torch.testing.assert_close(got, want, **TOL, equal_nan=True)
    torch.testing.assert_close(runner(x), m(x), **TOL)  # finite again: skipped


def _partial_block(march):
    """The 1x1 tile's partial last input block and unrolled epilogues, and the depthwise
    tiles' epilogue, with the channel block 8 (AVX2; plain x86-64: a vector in SSE
    registers): 20 input channels (4 of the third block), relu6, a residual (4 direct
    calls)."""
    m = nn.Sequential(nn.Conv2d(20, 44, 1), nn.ReLU6(), nn.Conv2d(44, 44, 3, 1, 1, groups=44),
                      nn.ReLU6()).eval()
    r = ConvBlock(20, cout=20, k=1, residual=True, act="relu", seed=5)
    x = rand((2, 20, 9, 17), F32, gen("partial_isa", march), -2, 2)
    return nn.Sequential(r, m), x


def _avx2_build():
    """march="x86-64-v3" (AVX2 and FMA, no AVX-512): channel block 8, 4-pixel depthwise tiles
    (the checked edges and last tiles of stride-1 3x3 and 7x7 rows, 13 and 11 pixels wide),
    the 1x1 tiles of the inverted residual block (3 direct calls and a block)."""
    g = torch.Generator().manual_seed(17)
    m = nn.Sequential(nn.Conv2d(3, 24, 3, 2, 1, bias=False), batch_norm(24, g), nn.ReLU(),
                      nn.Conv2d(24, 24, 7, 1, 3, groups=24), nn.Conv2d(24, 40, 1), nn.ReLU6(),
                      InvertedResidual(40, 40, 1, 3, g)).eval()
    return m, rand((2, 3, 25, 22), F32, gen("avx2"), -2, 2)


def _plain_x86_64_build():
    """march="x86-64" (SSE2 only): the header's vectors split into SSE registers, channel
    block 8 (one direct call, a max pool, a block)."""
    g = torch.Generator().manual_seed(13)
    m = nn.Sequential(nn.Conv2d(3, 24, 3, 2, 1, bias=False), batch_norm(24, g), nn.ReLU(),
                      nn.MaxPool2d(3, 1, 1), InvertedResidual(24, 24, 1, 2, g)).eval()
    return m, rand((2, 3, 12, 12), F32, gen("x86"), -2, 2)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_other_isa_builds(check, march, monkeypatch):
    """At x86-64-v3 and x86-64 (channel block 8): `_partial_block` and that level's build
    (`_avx2_build`, `_plain_x86_64_build`) in one program (difftest.Cases: each case its own
    shapes and calls, outputs named by the case), results unchanged. Without
    KILN_CONV_EPIS=all: conv.cpp specialises this program's (activation, residual) pairs only,
    as a user's package does (one conv.cpp per level either way; the all-pairs file is built
    at the native level by the other tests)."""
    monkeypatch.delenv("KILN_CONV_EPIS")
    v3 = march == "x86-64-v3"
    torch.manual_seed(0)  # the Conv2d layers' default init
    partial, xp = _partial_block(march)
    build, xb = _avx2_build() if v3 else _plain_x86_64_build()
    compiled = check(Cases({"partial": (partial, 1), "build": (build, 1)}), [xp, xb], tol=TOL,
                     options=kiln.Options(march=march))
    assert "#define KILN_CONV_B8" in compiled.sources["conv.cpp"]
    assert "#define KILN_CONV_EPIS 0xff" not in compiled.sources["conv.cpp"]
    # (x86-64-v3: the 7x7 depthwise and the 1x1 after it are a block without an expand)
    assert _direct_calls(compiled) == 4 + 1
    assert _block_calls(compiled) == (2 if v3 else 1)
    if not v3:
        src = compiled.sources["model.cpp"]
        assert "kl::max_pool2d_nchwc(" in src
        assert re.search(r"kl::view\(buf_\w+_w \+ 0, 6, d1\)", src)
        assert "avx" not in compiled.manifest["requires"].get("cpu_features", [])


def test_epilogue_pairs_selected_and_the_plain_store(check, monkeypatch):
    """Without KILN_CONV_EPIS=all (tests/conftest.py sets it), conv.cpp specialises only its
    calls' (activation, residual) pairs; a pair it does not list stores through the plain
    loop: here none is listed, and every store takes that loop, still eager's values."""
    from kiln.targets.cpu import conv as conv_target

    monkeypatch.delenv("KILN_CONV_EPIS")
    seen = []
    real = conv_target.epilogue_pairs
    monkeypatch.setattr(conv_target, "epilogue_pairs",
                        lambda steps: seen.append(real(steps)) or set())
    g = torch.Generator().manual_seed(5)

    class M(nn.Module):  # relu (pair 2), + residual and relu (3), a bare projection (0)
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(16, 16, 3, padding=1, bias=False), batch_norm(16, g)
            self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), batch_norm(16, g)
            self.c3 = nn.Conv2d(16, 32, 1, stride=2)

        def forward(self, x):
            y = F.relu(self.b1(self.c1(x)))
            y = F.relu(self.b2(self.c2(y)) + x)
            return self.c3(y)

    x = rand((2, 16, 12, 12), F32, gen("conv_epi_pairs"), -2, 2)
    compiled = check(M(), [x], tol=TOL)
    assert seen == [{0, 2, 3}]
    assert "#define KILN_CONV_EPIS 0x00" in compiled.sources["conv.cpp"]
    assert _direct_calls(compiled) == 3


def test_residual_is_the_input(check):
    """y = relu(bn(conv(x)) + x): the residual is the convolution's own (blocked) input."""
    g = torch.Generator().manual_seed(3)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(24, 24, 3, padding=1, bias=False), batch_norm(24, g)

        def forward(self, x):
            return F.relu(self.bn(self.conv(x)) + x)

    x = rand((2, 24, 7, 7), F32, gen("conv_res_in"), -2, 2)
    compiled = check(M(), [x], tol=TOL)
    assert _direct_calls(compiled) == 1


def test_weight_added_along_the_width_is_not_a_bias(check):
    """conv(x) + b.view(1, 1, 1, OC) with the width OC long broadcasts along the width, not
    the channels: it stays an add after the direct convolution (its epilogue took it as the
    bias before: a wrong result)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=False)
            self.b = nn.Parameter(torch.arange(8.0))

        def forward(self, x):
            return self.conv(x) + self.b.view(1, 1, 1, 8)

    compiled = check(M(), [rand((1, 4, 5, 8), F32, gen("conv_width_add"), -2, 2)], tol=TOL)
    assert _direct_calls(compiled) == 1


def test_non_contiguous_weight(check):
    conv = nn.Conv2d(16, 24, 3, padding=1)
    w = torch.randn(3, 3, 16, 24).permute(3, 2, 0, 1)  # [24, 16, 3, 3], not contiguous
    conv.weight = nn.Parameter(w)
    assert not conv.weight.is_contiguous()
    x = rand((1, 16, 8, 8), F32, gen("conv_ncw"), -2, 2)
    compiled = check(conv, [x], tol=TOL)
    assert _direct_calls(compiled) == 1


@pytest.mark.parametrize(("name", "module", "shape"), [
    ("groups2", nn.Conv2d(8, 12, 3, padding=1, groups=2), (2, 8, 6, 6)),
    ("transposed", nn.ConvTranspose2d(8, 4, 3, stride=2), (1, 8, 5, 5)),
    ("conv1d", nn.Conv1d(8, 16, 3), (2, 8, 9)),
    ("float64", nn.Conv2d(8, 16, 3).double(), (1, 8, 6, 6)),
])
def test_unsupported_falls_back_to_im2col(check, name, module, shape):
    dt = next(module.parameters()).dtype
    x = rand(shape, dt, gen("conv_fallback", name), -2, 2)
    compiled = check(module, [x], tol=TOL if dt == F32 else None)
    assert _direct_calls(compiled) == 0


def test_dynamic_batch_falls_back(check):
    """A symbolic batch size: im2col + GEMM (the direct path needs static sizes)."""
    m = ConvBlock(8, cout=16, k=3, padding=1, bn=True, act="relu")
    g = gen("conv_dyn")
    compiled = check(m, [rand((2, 8, 6, 6), F32, g, -2, 2)], tol=TOL,
                     dynamic_shapes=({0: dim("n")},), more=[(rand((5, 8, 6, 6), F32, g),)])
    assert _direct_calls(compiled) == 0


def test_layout_kept_across_a_chain(check):
    """conv-bn-relu -> depthwise -> 1x1 (+ residual): one conversion into NCHWc at the input
    and one out of it at the output, the first convolution a direct call with its epilogue, the
    depthwise -> 1x1 (+ residual) one block call without an expand."""
    g = torch.Generator().manual_seed(5)

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(24, 48, 3, padding=1, bias=False), batch_norm(48, g)
            self.dw = nn.Conv2d(48, 48, 3, padding=1, groups=48, bias=False)
            self.b2 = batch_norm(48, g)
            self.pw, self.b3 = nn.Conv2d(48, 24, 1, bias=False), batch_norm(24, g)

        def forward(self, x):
            y = F.relu(self.b1(self.c1(x)))
            y = F.relu6(self.b2(self.dw(y)))
            return self.b3(self.pw(y)) + x

    x = rand((1, 24, 10, 10), F32, gen("conv_chain"), -2, 2)
    compiled = check(Chain(), [x], tol=TOL)
    src = compiled.sources["model.cpp"]
    assert _direct_calls(compiled) == 1 and _block_calls(compiled) == 1
    assert len(set(re.findall(r"\bbuf_(\w+_nchwc) =", src)) - {"x_nchwc"}) == 2  # call outputs
    assert "buf_x_nchwc" in src  # the one input conversion
    assert len(re.findall(r"// k\d+_\w+: \w*x_nchwc\b", src)) == 1
    # each call named after its source ops, with its epilogue
    assert re.search(r"// direct conv \(dense 3x3, stride 1x1, NCHWc\) of [\w, ]*; "
                     r"epilogue: bias, relu", src)
    assert re.search(r"// inverted residual block \(depthwise 3x3 stride 1x1 \+ "
                     r"clamp\(0, 6\); project 1x1 \+ residual x_nchwc", src)
    assert "im2col" not in _sources(compiled)


def test_im2col_option(check):
    m = ConvBlock(16, cout=16, k=3, padding=1, bn=True, act="relu")
    x = rand((1, 16, 6, 6), F32, gen("conv_opt"), -2, 2)
    compiled = check(m, [x], tol=TOL, options=kiln.Options(cpu_conv="im2col"))
    assert _direct_calls(compiled) == 0 and "im2col" in _sources(compiled)
    with pytest.raises(ValueError, match="cpu_conv"):
        kiln.Options(cpu_conv="winograd")


def test_update_weights_refused_then_allowed_without_folding(check):
    m = ConvBlock(16, cout=24, k=3, padding=1, bn=True, act="relu", seed=7).eval()
    x = rand((1, 16, 6, 6), F32, gen("conv_update"), -2, 2)
    _, runner = check.compile(m, [x])
    with pytest.raises(InputError, match=r"folded.*conv\.weight.*fold_constants=False"):
        runner.update_weights(m.state_dict())
    compiled, runner = check.compile(m, [x], options=kiln.Options(fold_constants=False))
    assert _direct_calls(compiled) == 0
    m2 = copy.deepcopy(m)
    with torch.no_grad():
        for p in m2.parameters():
            p.mul_(-1.5)
    runner.update_weights(m2.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(runner(x), m2(x), **TOL)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand (bn, relu6), 3x3 depthwise (bn, relu6), 1x1 project
    (bn), plus the input when the shapes allow."""

    def __init__(self, cin, cout, stride, expand, g) -> None:
        super().__init__()
        hid = cin * expand
        layers = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hid, 1, bias=False), batch_norm(hid, g), nn.ReLU6()]
        layers += [nn.Conv2d(hid, hid, 3, stride, 1, groups=hid, bias=False), batch_norm(hid, g),
                   nn.ReLU6(), nn.Conv2d(hid, cout, 1, bias=False), batch_norm(cout, g)]
        self.body = nn.Sequential(*layers)
        self.skip = stride == 1 and cin == cout

    def forward(self, x):
        y = self.body(x)
        return x + y if self.skip else y


def test_mobilenet_v2_chain(check):
    g = torch.Generator().manual_seed(11)
    m = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), batch_norm(32, g), nn.ReLU6(),
                      InvertedResidual(32, 16, 1, 1, g), InvertedResidual(16, 24, 2, 6, g),
                      InvertedResidual(24, 24, 1, 6, g), InvertedResidual(24, 40, 2, 6, g),
                      nn.Conv2d(40, 64, 1, bias=False), batch_norm(64, g), nn.ReLU6(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).eval()
    x = rand((2, 3, 32, 32), F32, gen("mbv2"), -2, 2)
    compiled = check(m, [x], tol={"rtol": 1e-3, "atol": 1e-3})
    # the stem, the last 1x1; the block without expansion and three expanding blocks fused
    assert _direct_calls(compiled) == 2 and _block_calls(compiled) == 4
    assert "im2col" not in _sources(compiled)


def test_resnet18(check):
    spec = resnet18()
    x = spec.example_args[0]
    compiled = check(spec.module, [x], tol={"rtol": 1e-3, "atol": 1e-3},
                     more=[spec.make_inputs(1)])
    assert _direct_calls(compiled) == 20
    assert "im2col" not in _sources(compiled)


@pytest.mark.slow
def test_portable_levels(tmp_path):
    """march="portable": kiln_conv.h compiled at every level with the build machine's channel
    block (16 on an AVX-512 machine: a vector is two AVX2 or four SSE registers below it);
    each level's code, run by marking the levels above it as needing a feature this CPU lacks,
    matches eager on a stem, a 7x7 depthwise row (28 pixels: checked edge and last tiles)
    and a 3x3 convolution over 28-pixel rows (4 x 7 tiles with AVX-512's block)."""
    g = torch.Generator().manual_seed(19)
    m = nn.Sequential(nn.Conv2d(3, 64, 3, 2, 1, bias=False), batch_norm(64, g), nn.ReLU6(),
                      nn.Conv2d(64, 64, 7, 1, 3, groups=64), nn.Conv2d(64, 64, 3, 1, 1),
                      nn.ReLU()).eval()
    x = rand((1, 3, 56, 56), F32, gen("portable"), -2, 2)
    cm = kiln.compile(m, (x,), options=kiln.Options(march="portable"))
    missing = [f for f in CPU_FEATURES.values() if cpu_supports(f) is False]
    levels = cm.manifest["requires"]["cpu_levels"]
    for skip in range(len(levels) if missing else 1):
        for lv in levels[:skip]:
            lv["cpu_features"].append(missing[0])
        runner = kiln.load(cm.save(tmp_path / f"p{skip}.kiln"))
        assert runner.cpu_level == levels[skip]["march"] or skip == 0
        with torch.no_grad():
            torch.testing.assert_close(runner(x), m(x), **TOL)


POOLS = [  # (kernel, stride, padding, ceil, dilation, hw, batch)
    (3, 2, 1, False, 1, (15, 13), 2), (2, 2, 0, True, 1, (15, 13), 2),
    (3, 1, 0, False, 1, (15, 13), 2), (3, 2, 1, True, 2, (16, 19), 1),
    ((3, 2), (1, 2), (1, 0), False, 1, (9, 11), 3), (3, 2, 1, False, 1, (40, 45), 3)]


def test_max_pool_inside_a_region(check):
    """conv -> relu -> max pool -> conv: the pooling (kiln_conv.h's max_pool2d_nchwc, a vector
    of channels at a time) reads and writes NCHWc (no conversion between the convolutions);
    channel count 24 (a padded block); rectangular windows, dilation, ceil mode, a size that
    splits over threads. The cases of POOLS are one difftest.Cases program (one package): two
    direct convolutions and one NCHWc pooling per case, no pooling result in NCHW."""
    mods, xs = {}, []
    for i, (kernel, stride, padding, ceil, dilation, hw, batch) in enumerate(POOLS):
        g = torch.Generator().manual_seed(17)
        mods[f"pool{i}"] = (nn.Sequential(
            nn.Conv2d(3, 24, 3, padding=1, bias=False), batch_norm(24, g), nn.ReLU(),
            nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil),
            nn.Conv2d(24, 16, 3, padding=1)).eval(), 1)
        xs.append(rand((batch, 3, *hw), F32, gen("pool", kernel, stride, hw), -2, 2))
    compiled = check(Cases(mods), xs, tol=TOL)
    src = compiled.sources["model.cpp"]
    assert _direct_calls(compiled) == 2 * len(POOLS)
    assert src.count("kl::max_pool2d_nchwc(") == len(POOLS)
    assert len(re.findall(r"// max pool \(\d+x\d+, stride \d+x\d+, padding \d+x\d+, NCHWc",
                          src)) == len(POOLS)
    # never materialised in NCHW (buf_max_pool2d, buf_max_pool2d_<k>; *_nchwc is the NCHWc one)
    assert not re.search(r"buf_max_pool2d(_\d+)?\b", src)
    assert re.search(r"buf_max_pool2d_\d+_nchwc\b", src)  # the names the check above assumes


def test_max_pool_propagates_nan(check):
    """A NaN input pixel: NaN in exactly the pooled outputs whose window holds it (as eager);
    1x1 convolutions around the pooling keep it in its pixel."""
    m = nn.Sequential(nn.Conv2d(8, 16, 1), nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 8, 1)).eval()
    x = rand((2, 8, 12, 12), F32, gen("pool_nan"), -2, 2)
    x[1, :, 5, 6] = float("nan")
    compiled, runner = check.compile(m, [x])
    assert "kl::max_pool2d_nchwc(" in compiled.sources["model.cpp"]
    got = runner(x)
    with torch.no_grad():
        want = m(x)
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
    torch.testing.assert_close(got, want, **TOL, equal_nan=True)


def test_interpreter_twin_matches_eager(check):
    """The numpy twin of conv2d_nchwc (kiln.ir.interp, also behind the package's model.py)
    runs the compiled Loop IR: dense (NCHW input), the inverted residual block (expand,
    depthwise, project + residual, relu6), max pooling in NCHWc."""
    g = torch.Generator().manual_seed(19)
    m = nn.Sequential(nn.Conv2d(3, 24, 3, 2, 1, bias=False), batch_norm(24, g), nn.ReLU6(),
                      nn.MaxPool2d(2), InvertedResidual(24, 24, 1, 2, g)).eval()
    x = rand((2, 3, 14, 14), F32, gen("twin"), -2, 2)
    compiled, _ = check.compile(m, [x])
    got, calls = run_twin(compiled.built, x)
    assert calls.get("conv2d_nchwc", 0) == 1
    assert calls.get("conv2d_block_nchwc", 0) == 1
    assert calls.get("max_pool2d_nchwc", 0) == 1
    with torch.no_grad():
        want = m.double()(x.double())
    torch.testing.assert_close(got.double(), want, **TOL)


def test_profile_runs_a_direct_conv_package(check, tmp_path):
    """`kiln profile` runs the package's model.py, whose library calls (conv2d_nchwc,
    max_pool2d_nchwc) go to the numpy twins with the flat output buffer: the twins take their
    sizes from the operands, and model.py's result matches eager."""
    # deferred: the CLI's profiler imports torch.profiler, only this test needs it
    from kiln.cli.profile import _load_wrapper
    from kiln.package.reader import read_package

    g = torch.Generator().manual_seed(23)
    m = nn.Sequential(nn.Conv2d(3, 24, 3, 2, 1, bias=False), batch_norm(24, g), nn.ReLU(),
                      nn.MaxPool2d(3, 2, 1), InvertedResidual(24, 24, 1, 2, g)).eval()
    x = rand((2, 3, 16, 16), F32, gen("profile"), -2, 2)
    compiled, runner = check.compile(m, [x])
    path = tmp_path / "p.kiln"
    compiled.save(path)
    _, model = _load_wrapper(read_package(path), tmp_path)
    with torch.no_grad():
        got, want = model(x), m(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, want, **TOL)


def _block_calls(compiled) -> int:
    return compiled.sources["model.cpp"].count("kl::conv2d_block_nchwc(")


class _Block(nn.Module):
    """expand 1x1 (bn, act) -> depthwise kxk (bn, act) -> project 1x1 (bn) [+ x]: an inverted
    residual block with any kernel, stride, padding, dilation and activations."""

    def __init__(self, cin, hid, cout, k, stride, pad, dil, acts, g) -> None:
        super().__init__()
        self.e = nn.Conv2d(cin, hid, 1, bias=False)
        self.d = nn.Conv2d(hid, hid, k, stride, pad, dil, groups=hid, bias=True)
        self.p = nn.Conv2d(hid, cout, 1, bias=False)
        self.bns = nn.ModuleList([batch_norm(hid, g), batch_norm(hid, g), batch_norm(cout, g)])
        self.acts = acts
        self.skip = stride == 1 and cin == cout and k == 2 * pad // dil + 1
        for c in (self.e, self.d, self.p):
            with torch.no_grad():
                c.weight.copy_(torch.randn(c.weight.shape, generator=g) * 0.3)

    def forward(self, x):
        a1, a2 = self.acts
        y = a2(self.bns[1](self.d(a1(self.bns[0](self.e(x))))))
        y = self.bns[2](self.p(y))
        return x + y if self.skip else y


# (cin, hid, cout, k, stride, pad, dil, act, hw, batch, threads)
BLOCKS = [
    (24, 144, 24, 3, 1, 1, 1, "relu6", (23, 25), 1, 1),   # residual, 9 padded hidden channels
    (16, 96, 24, 3, 2, 1, 1, "relu6", (41, 37), 2, 2),    # stride 2, odd sizes, 2 threads
    (20, 120, 20, 5, 1, 2, 1, "silu", (26, 24), 3, 2),    # 5x5, channels not a block multiple
    (32, 192, 40, 3, 1, 2, 2, "relu", (19, 21), 2, 1),    # dilation 2, padding 2
    (24, 144, 32, 3, 2, 0, 1, "relu6", (24, 27), 1, 2),   # no padding, stride 2
    # rows that do not split over 2 threads: by channel groups, one barrier
    (32, 192, 40, 3, 1, 1, 1, "relu6", (7, 23), 1, 2),    # 7 rows
    (24, 120, 24, 3, 2, 1, 1, "relu6", (9, 31), 3, 2),    # batch 3 x 5 rows, stride 2
    (40, 240, 40, 5, 1, 2, 1, "silu", (7, 7), 1, 2),      # 5x5, residual
]


@pytest.mark.parametrize("threads", [1, 2])
def test_inverted_residual_block(check, threads):
    """expand -> depthwise -> project [+ residual] as one conv2d_block_nchwc call (row bands:
    sizes past one band), against eager with a float64 reference: kernel 3 and 5, stride 1 and
    2, padding 0-2, dilation 2, hidden and output channels not a multiple of the block, batch
    1-3, 1 and 2 threads, each stage's epilogue (bn folded, bias, relu6/relu/silu). The cases
    of BLOCKS at `threads` threads are one difftest.Cases program (one package): one block call
    per case, no direct call, and one block comment per case with its kernel and stride."""
    mods, xs, more, want = {}, [], [], []
    for i, (cin, hid, cout, k, stride, pad, dil, acts, hw, batch, th) in enumerate(BLOCKS):
        if th != threads:
            continue
        g = torch.Generator().manual_seed(29)
        act = {"relu6": nn.ReLU6(), "relu": nn.ReLU(), "silu": nn.SiLU()}[acts]
        mods[f"block{i}"] = (_Block(cin, hid, cout, k, stride, pad, dil, (act, act), g).eval(),
                             1)
        xs.append(rand((batch, cin, *hw), F32, gen("conv_block", cin, hid, k, stride, hw), -2,
                       2))
        more.append(rand((batch, cin, *hw), F32, gen("conv_block2", hid), -2, 2))
        want.append((str(k), str(stride)))
    compiled = check(Cases(mods), xs, tol=TOL, options=kiln.Options(num_threads=threads),
                     more=[more])
    assert _block_calls(compiled) == len(mods) and _direct_calls(compiled) == 0
    src = compiled.sources["model.cpp"]
    got = re.findall(r"// inverted residual block \(expand 1x1 \+ \w+.*; depthwise "
                     r"(\d+)x\1 stride (\d+)x\2.*project 1x1.*\) of \w+", src)
    assert sorted(got) == sorted(want), got


def test_inverted_residual_block_not_fused(check):
    """The expand's result also read elsewhere (a second output): the expand a direct call,
    the depthwise -> project a block without an expand."""
    g = torch.Generator().manual_seed(31)
    m = _Block(16, 96, 16, 3, 1, 1, 1, (nn.ReLU6(), nn.ReLU6()), g).eval()

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, x):
            h = F.relu6(self.m.bns[0](self.m.e(x)))
            y = self.m.bns[2](self.m.p(F.relu6(self.m.bns[1](self.m.d(h)))))
            return x + y, h

    x = rand((1, 16, 30, 30), F32, gen("conv_block_nf"), -2, 2)
    compiled = check(Both().eval(), [x], tol=TOL)
    assert _block_calls(compiled) == 1 and _direct_calls(compiled) == 1
    assert "inverted residual block (depthwise 3x3" in compiled.sources["model.cpp"]
