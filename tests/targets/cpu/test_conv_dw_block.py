"""Depthwise -> project 1x1 without an expand as one `conv2d_block_nchwc` call
(passes/conv_block.py, kiln_conv.h's block overloads of 5 and 6 views): MobileNetV2's first
block (expand ratio 1), whose depthwise output is then never stored whole. Against eager with a
float64 reference: after a stem (NCHW input), with a residual, 5x5 stride 2 with rows that do
not split over 2 threads (the channel-group path), channels not a multiple of the block, batch
1 and 3, 1 and 2 threads; at x86-64-v3 (channel block 8); the numpy twin on the Loop IR."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from difftest import Checker, batch_norm, gen, rand, run_twin

F32 = torch.float32
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("conv_dw_block"))




def _init(m: nn.Module, g: torch.Generator) -> nn.Module:
    for c in m.modules():
        if isinstance(c, nn.Conv2d):
            with torch.no_grad():
                c.weight.copy_(torch.randn(c.weight.shape, generator=g) * 0.3)
    return m.eval()


class FirstBlock(nn.Module):
    """torchvision MobileNetV2's stem and first block: conv 3x3 s2 (bn, relu6) -> depthwise
    3x3 (bn, relu6) -> project 1x1 (bn)."""

    def __init__(self, g: torch.Generator, c: int = 32, out: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, 2, 1, bias=False)
        self.d = nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False)
        self.p = nn.Conv2d(c, out, 1, bias=False)
        self.bns = nn.ModuleList([batch_norm(c, g), batch_norm(c, g), batch_norm(out, g)])
        _init(self, g)

    def forward(self, x):
        x = F.relu6(self.bns[0](self.stem(x)))
        x = F.relu6(self.bns[1](self.d(x)))
        return self.bns[2](self.p(x))


class DwProject(nn.Module):
    """A dense 3x3 (so the depthwise reads NCHWc, and no 1x1 expand makes it a three-stage
    block) -> depthwise k x k stride s -> project [+ the 3x3's output]."""

    def __init__(self, g, c, k, s, out, act, residual) -> None:
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.d = nn.Conv2d(c, c, k, s, k // 2, groups=c)
        self.p = nn.Conv2d(c, out, 1)
        self.act, self.residual = act, residual
        _init(self, g)

    def forward(self, x):
        y = F.relu(self.a(x))
        z = self.p(self.act(self.d(y)))
        return z + y if self.residual else z


# (id, module args, input shape, threads)
CASES = [
    ("residual_silu", dict(c=24, k=3, s=1, out=24, act=F.silu, residual=True), (1, 24, 19, 17), 2),
    ("5x5_s2_7rows", dict(c=40, k=5, s=2, out=20, act=F.relu6, residual=False), (3, 40, 14, 15),
     2),
    ("odd_channels_1thr", dict(c=20, k=3, s=2, out=36, act=F.relu, residual=False),
     (1, 20, 23, 22), 1),
]


@pytest.mark.parametrize("threads", [1, 2])
def test_first_block_one_call(check, threads):
    g = torch.Generator().manual_seed(7)
    m = FirstBlock(g)
    x = rand((1, 3, 30, 27), F32, gen("first_block", threads), -2, 2)
    compiled = check(m, [x], tol=TOL, options=kiln.Options(num_threads=threads))
    src = compiled.sources["model.cpp"]
    assert src.count("kl::conv2d_block_nchwc(") == 1
    assert src.count("kl::conv2d_nchwc(") == 1  # the stem
    assert "inverted residual block (depthwise 3x3" in src


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dw_project_blocks(check, case):
    name, args, shape, threads = case
    g = torch.Generator().manual_seed(8)
    m = DwProject(g, **args)
    x = rand(shape, F32, gen("dw_project", name), -2, 2)
    compiled = check(m, [x], tol=TOL, options=kiln.Options(num_threads=threads))
    src = compiled.sources["model.cpp"]
    assert src.count("kl::conv2d_block_nchwc(") == 1 and src.count("kl::conv2d_nchwc(") == 1
    assert "inverted residual block (depthwise" in src  # no expand stage


def test_x86_64_v3(check, monkeypatch):
    """Channel block 8; conv.cpp specialising only this program's epilogue pairs (the block's
    stage 1 "none" is not one of them)."""
    monkeypatch.delenv("KILN_CONV_EPIS")
    g = torch.Generator().manual_seed(9)
    m = FirstBlock(g, c=24, out=20)
    x = rand((2, 3, 26, 21), F32, gen("v3_block"), -2, 2)
    compiled = check(m, [x], tol=TOL, options=kiln.Options(march="x86-64-v3", num_threads=2))
    assert "#define KILN_CONV_B8" in compiled.sources["conv.cpp"]
    assert compiled.sources["model.cpp"].count("kl::conv2d_block_nchwc(") == 1


def test_interpreter_twin(check):
    g = torch.Generator().manual_seed(10)
    m = DwProject(g, c=24, k=3, s=1, out=24, act=F.relu6, residual=True)
    x = rand((1, 24, 11, 13), F32, gen("twin_block"), -2, 2)
    compiled, _ = check.compile(m, [x])
    got, calls = run_twin(compiled.built, x)
    assert calls.get("conv2d_block_nchwc", 0) == 1
    with torch.no_grad():
        want = m.double()(x.double())
    torch.testing.assert_close(got.double(), want, **TOL)


@pytest.mark.parametrize("threads", [3, 4])
def test_blocks_with_more_threads_than_cores(check, threads):
    """Teams of 3 and 4 on this 2-core machine: members the OS has not scheduled have their
    shares taken by the others (kiln_conv.h's steal_for: the row bands of a block, with the
    expanded rows at the seams recomputed; the hidden and the output blocks of the
    channel-group path), results unchanged. Row path (28 rows) and channel path (14 rows on 3
    and 4 threads), with and without an expand."""
    g = torch.Generator().manual_seed(11)
    m = nn.Sequential(FirstBlock(g, c=32, out=16), nn.Conv2d(16, 96, 1, bias=False),
                      batch_norm(96, g),
                      nn.ReLU6(), nn.Conv2d(96, 96, 3, 2, 1, groups=96), nn.ReLU6(),
                      nn.Conv2d(96, 24, 1))
    _init(m, g)
    x = rand((1, 3, 56, 54), F32, gen("steal", threads), -2, 2)
    compiled = check(m, [x], tol=TOL, options=kiln.Options(num_threads=threads),
                     more=[(rand((1, 3, 56, 54), F32, gen("steal2", threads), -2, 2),)])
    src = compiled.sources["model.cpp"]
    assert src.count("kl::conv2d_block_nchwc(") == 2 and src.count("kl::conv2d_nchwc(") == 1
