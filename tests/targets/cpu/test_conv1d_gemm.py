"""1-D convolutions on the CPU as one GEMM over a channels-last view (passes/conv1d_gemm.py):
the im2col matrix is a view of the padded channels-last input whose rows overlap where
K > stride, read in place by kiln's own GEMM (never BLAS / oneDNN). Against eager with a
float64 reference: Whisper's stem (k3 -> GELU -> k3 stride 2 -> GELU -> channels-last), kernel
sizes 1-5, strides 1-3 (rows that overlap, touch, and leave gaps), pads 0-3 (more than the
last window needs, and rows left unread at the end), batch 1-3, with and without a bias,
float32 and float64; at the native level and at x86-64-v3, 1 and 2 threads; the numpy twin
(kiln.ir.interp) on the compiled Loop IR; what stays on im2col (dilation, groups, no kiln GEMM
allowed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from difftest import Checker, gen, rand, run_twin
from kiln.ir import loop as L

F32 = torch.float32
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("conv1d_gemm"))


class Stem(nn.Module):
    """Whisper's encoder stem, small: two Conv1d with GELU, then channels-last + positions."""

    def __init__(self, g: torch.Generator, mel: int = 12, d: int = 40, t: int = 30) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(mel, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.pos = nn.Parameter(torch.randn(t // 2, d, generator=g))
        _init(self, g)

    def forward(self, x):
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x))
        return x.permute(0, 2, 1) + self.pos


class One(nn.Module):
    def __init__(self, g: torch.Generator, c: int, oc: int, k: int, stride: int, pad: int,
                 bias: bool, act) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c, oc, k, stride=stride, padding=pad, bias=bias)
        self.act = act
        _init(self, g)

    def forward(self, x):
        y = self.conv(x)
        return self.act(y) if self.act is not None else y


def _init(m: nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _convs_left(compiled) -> int:
    return sum(n.op == "conv" for n in compiled.built.graph.nodes)


def _overlap_gemms(compiled) -> list[str]:
    return [n.name for n in compiled.built.graph.nodes if n.attr("rows_overlap")]


def _overlap_backends(compiled) -> list[str]:
    """The backend of each compiled GEMM whose A rows overlap."""
    b = compiled.built
    return [b.gemms[s.name].backend.value for s in L.flat_steps(b.steps)
            if isinstance(s, L.Gemm) and not s.blas_operands()]


@pytest.mark.parametrize("march", [None, "x86-64-v3"])
@pytest.mark.parametrize("threads", [1, 2])
def test_whisper_stem(check, march, threads):
    g = torch.Generator().manual_seed(1)
    m = Stem(g).eval()
    x = rand((1, 12, 30), F32, gen("stem", march, threads))
    opts = kiln.Options(march=march or "native", num_threads=threads)
    compiled = check(m, [x], tol=TOL, options=opts)
    assert _convs_left(compiled) == 0
    gemms = _overlap_gemms(compiled)
    assert len(gemms) == 2
    assert _overlap_backends(compiled) == ["cpp", "cpp"]
    # the bias and GELU run on the channels-last result: no node reads it permuted
    names = {n.name for n in compiled.built.graph.nodes}
    assert {"gelu_cl", "gelu_1_cl"} <= names


# (batch, in channels, length, out channels, kernel, stride, pad)
SHAPES = [
    (1, 80, 61, 48, 3, 1, 1),   # Whisper's first stem convolution, small
    (2, 16, 37, 24, 3, 2, 1),   # its second: rows overlap by one
    (3, 5, 29, 7, 5, 3, 2),     # K > stride, the last input rows unread
    (1, 4, 20, 8, 2, 2, 0),     # K == stride: rows touch
    (2, 6, 31, 10, 2, 3, 0),    # stride > K: gaps between rows
    (2, 3, 11, 6, 1, 1, 0),     # 1x1
    (1, 8, 9, 16, 4, 1, 3),     # padding wider than the kernel's reach at the end
    (1, 1, 50, 12, 10, 5, 0),   # one input channel (a raw waveform's stem)
]


@pytest.mark.parametrize("march", [None, "x86-64-v3"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(check, march, shape):
    n, c, t, oc, k, s, p = shape
    g = torch.Generator().manual_seed(sum(shape))
    act = F.relu if k % 2 else None
    m = One(g, c, oc, k, s, p, bias=t % 2 == 1, act=act).eval()
    x = rand((n, c, t), F32, gen("shape", shape, march))
    opts = kiln.Options(march=march or "native", num_threads=2)
    compiled = check(m, [x], tol=TOL, options=opts)
    assert _convs_left(compiled) == 0
    assert _overlap_backends(compiled) in (["cpp"], [])  # K == stride: rows do not overlap


def test_float64(check):
    g = torch.Generator().manual_seed(7)
    m = One(g, 6, 9, 3, 2, 1, bias=True, act=torch.tanh).double().eval()
    x = rand((2, 6, 23), torch.float64, gen("f64"))
    compiled = check(m, [x], tol={"rtol": 1e-10, "atol": 1e-10})
    assert _convs_left(compiled) == 0


def test_result_read_twice(check):
    """A convolution whose result is also an output keeps its readers: the bias and the
    activation stay after the permute back."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(8, 16, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return y, F.gelu(y) * 2

    compiled = check(M(), [rand((2, 8, 19), F32, gen("twice"))], tol=TOL)
    assert _convs_left(compiled) == 0


def test_bias_along_time_stays_after_the_permute(check):
    """An add of a [OC] weight viewed along time (T == OC) is not the convolution's bias: it
    stays an add of the [N, OC, T] result."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(4, 12, 3, padding=1, bias=False)
            self.b = nn.Parameter(torch.arange(12.0))

        def forward(self, x):
            return F.relu(self.conv(x) + self.b.view(1, 1, 12))

    compiled = check(M(), [rand((2, 4, 12), F32, gen("time_bias"))], tol=TOL)
    assert _convs_left(compiled) == 0


def test_what_stays_on_im2col(check):
    """Dilated and grouped 1-D convolutions, an empty batch, and any convolution where kiln's
    GEMM is not allowed stay im2col + GEMM (BLAS cannot read overlapping rows)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv1d(8, 8, 3, padding=2, dilation=2)
            self.b = nn.Conv1d(8, 8, 3, padding=1, groups=2)

        def forward(self, x):
            return self.b(F.relu(self.a(x)))

    x = rand((1, 8, 25), F32, gen("stays"))
    compiled = check(M(), [x], tol=TOL)
    assert _convs_left(compiled) == 2
    compiled = check(M(), [rand((0, 8, 25), F32, gen("stays", 0))], tol=TOL)  # empty batch
    assert _convs_left(compiled) == 2
    g = torch.Generator().manual_seed(9)
    compiled = check(One(g, 8, 12, 3, 1, 1, True, None), [x], tol=TOL,
                     options=kiln.Options(gemm_backends=("blas",)))
    assert _convs_left(compiled) == 1 and not _overlap_gemms(compiled)


def test_interpreter_twin(check):
    """kiln.ir.interp's GEMM on the compiled Loop IR reads the overlapping view as the
    package does."""
    g = torch.Generator().manual_seed(11)
    m = Stem(g).eval()
    x = rand((1, 12, 30), F32, gen("twin"))
    compiled, _ = check.compile(m, [x])
    b = compiled.built
    weights = dict(b.weights)
    for w in b.program.weights:  # the packed GEMMs' B panels [P, K, NR] read back as K x N
        if w.packed:
            t, rec = weights[w.name], w.packed
            weights[w.name] = t.permute(1, 0, 2).reshape(rec["k"], -1)[:, :rec["n"]].contiguous()
    got, _ = run_twin(replace(b, weights=weights), x)
    with torch.no_grad():
        want = m.double()(x.double())
    torch.testing.assert_close(got.double(), want, **TOL)
