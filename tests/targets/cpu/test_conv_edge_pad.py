"""Asymmetric zero pads read through by the CPU direct convolution (passes/fold_pad.py's
`edge_pad`, passes/conv_nchwc.py): TensorFlow's "same" padding at stride 2 (0 before, 1 after:
Hugging Face's MobileNetV2), and other non-negative zero pads, become the `conv_nchwc` node's
top / left padding plus the output size of the padded input; kiln_conv.h reads zeros past the
bottom / right edge. Against eager with a float64 reference: dense (NCHW stem input and NCHWc),
depthwise 3x3 / 5x5 at stride 1 and 2, inside an inverted residual block, a 1x1 whose last
output row and column lie wholly in the padding, more before than after, rows wholly in the
padding; at the native level (AVX-512 here) and at x86-64-v3 (channel block 8); and the
numpy twin (kiln.ir.interp) on the compiled Loop IR."""

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
    return Checker(tmp_path_factory.mktemp("conv_edge_pad"))




class HfStyle(nn.Module):
    """Hugging Face MobileNetV2's shape: every strided convolution reads F.pad(x, (0, 1, 0, 1))
    (a stem on the NCHW image; a depthwise 3x3 stride 2 between an expand and a project, which
    the inverted residual block fuses), and a stride-1 block for the layout to continue."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, 2, bias=False)
        self.e1 = nn.Conv2d(32, 96, 1, bias=False)
        self.d1 = nn.Conv2d(96, 96, 3, 2, groups=96, bias=False)
        self.p1 = nn.Conv2d(96, 24, 1, bias=False)
        self.e2 = nn.Conv2d(24, 144, 1, bias=False)
        self.d2 = nn.Conv2d(144, 144, 3, 1, 1, groups=144, bias=False)
        self.p2 = nn.Conv2d(144, 24, 1, bias=False)
        self.bns = nn.ModuleList([batch_norm(c, g) for c in (32, 96, 96, 24, 144, 144, 24)])
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)

    def forward(self, x):
        b = self.bns
        x = F.relu6(b[0](self.stem(F.pad(x, (0, 1, 0, 1)))))
        y = F.relu6(b[1](self.e1(x)))
        y = F.relu6(b[2](self.d1(F.pad(y, (0, 1, 0, 1)))))
        y = b[3](self.p1(y))
        z = F.relu6(b[4](self.e2(y)))
        z = F.relu6(b[5](self.d2(z)))
        return y + b[6](self.p2(z))


class Odd(nn.Module):
    """Pads TensorFlow never writes but F.pad can: a 1x1 whose last row / column is padding
    only (bias), 5x5 depthwise stride 2 padded (1, 2), a 2x2 stride 1 padded (0, 1), a dense
    3x3 stride 2 with more before than after (2, 1 / 1, 0) and three rows wholly past the
    bottom (+ the conv's own padding 1), a dense 3x3 stride 1 on an NCHWc input padded (0, 1)."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.a = nn.Conv2d(20, 24, 1)
        self.b = nn.Conv2d(24, 24, 5, 2, groups=24)
        self.c = nn.Conv2d(24, 40, 2)
        self.d = nn.Conv2d(40, 16, 3, 2, padding=1)
        self.e = nn.Conv2d(16, 24, 3)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g))

    def forward(self, x):
        x = F.relu(self.a(F.pad(x, (0, 1, 0, 1))))
        x = self.b(F.pad(x, (1, 2, 1, 2)))
        x = F.silu(self.c(F.pad(x, (0, 1, 0, 1))))
        x = F.relu6(self.d(F.pad(x, (2, 1, 1, 4))))
        return self.e(F.pad(x, (0, 1, 0, 1)))


def _calls(compiled, routine: str) -> int:
    return compiled.sources["model.cpp"].count(f"kl::{routine}(")


def _pads_left(compiled) -> int:
    return sum(n.op == "pad" for n in compiled.built.graph.nodes)


@pytest.mark.parametrize("march", [None, "x86-64-v3"])
def test_hf_style_pads_read_through(check, march):
    g = torch.Generator().manual_seed(3)
    m = HfStyle(g).eval()
    x = rand((2, 3, 30, 27), F32, gen("hf_pad", march), -2, 2)
    opts = kiln.Options(march=march) if march else None
    compiled = check(m, [x], tol=TOL, options=opts)
    assert _pads_left(compiled) == 0
    assert _calls(compiled, "conv2d_nchwc") == 1  # the stem
    assert _calls(compiled, "conv2d_block_nchwc") == 2  # both blocks, the padded one too
    if march:
        assert "#define KILN_CONV_B8" in compiled.sources["conv.cpp"]


@pytest.mark.parametrize("march", [None, "x86-64-v3"])
@pytest.mark.parametrize("threads", [1, 2])
def test_odd_pads_read_through(check, march, threads):
    g = torch.Generator().manual_seed(4)
    m = Odd(g).eval()
    x = rand((1, 20, 17, 22), F32, gen("odd_pad", march, threads), -2, 2)
    opts = kiln.Options(march=march, num_threads=threads) if march else \
        kiln.Options(num_threads=threads)
    compiled = check(m, [x], tol=TOL, options=opts)
    assert _pads_left(compiled) == 0
    assert _calls(compiled, "conv2d_nchwc") == 5


def test_pad_with_other_readers_stays_for_them(check):
    """A pad also read by something other than a convolution stays (for that reader); the
    convolution still reads its input through it."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 16, 3, 2)

        def forward(self, x):
            p = F.pad(x, (0, 1, 0, 1))
            return self.conv(p), p.sum()

    compiled = check(M(), [rand((1, 8, 12, 11), F32, gen("shared_pad"), -2, 2)], tol=TOL)
    assert _pads_left(compiled) == 1
    assert _calls(compiled, "conv2d_nchwc") == 1


def test_interpreter_twin_reads_past_the_edge(check):
    """kiln.ir.interp's conv2d_nchwc / conv2d_block_nchwc twins on the compiled Loop IR: the
    padding after is what the output size needs."""
    g = torch.Generator().manual_seed(5)
    m = HfStyle(g).eval()
    x = rand((1, 3, 20, 19), F32, gen("twin_pad"), -2, 2)
    compiled, _ = check.compile(m, [x])
    got, calls = run_twin(compiled.built, x)
    assert calls.get("conv2d_block_nchwc", 0) == 2
    with torch.no_grad():
        want = m.double()(x.double())
    torch.testing.assert_close(got.double(), want, **TOL)
