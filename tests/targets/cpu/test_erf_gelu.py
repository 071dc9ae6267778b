"""kr::erf (kiln_kernels.h: the branch-free rational x*P(x^2)/Q(x^2)) through compiled packages:
a dense sweep and special values against float64 math.erf, and GELU (exact and tanh), fused into
a GEMM's epilogue and standalone, against float64 eager at several shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln

ERF_ATOL = 4e-7  # kiln_kernels.h documents 3.6e-7 (measured over every float)


class Erf(torch.nn.Module):
    def forward(self, x):
        return torch.erf(x)


def test_erf_sweep_and_special_values(tmp_path):
    sweep = np.round(np.arange(-60000, 60001) * 1e-4, 4)
    tiny = np.finfo(np.float32).tiny
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, tiny, -tiny, 1e-30, 3.9249,
               3.925, 3.9251, 4.0, -4.0, 10.0, -10.0, 1e30, -1e30, 3.4028235e38, -3.4028235e38]
    x = torch.from_numpy(np.concatenate([sweep, special]).astype(np.float32))
    runner = kiln.compile(Erf(), (x,)).load(tmp_path / "m.kiln")
    got = runner(x).numpy().astype(np.float64)
    ref = np.array([math.erf(v) if not math.isnan(v) else math.nan for v in x.double().tolist()])
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    err = np.abs(got[~nan] - ref[~nan])
    worst = int(np.argmax(err))
    assert err[worst] <= ERF_ATOL, (float(x[~torch.from_numpy(nan)][worst]), err[worst])
    # odd, exact at the ends: -0.0 keeps its sign, +-inf and large |x| give exactly +-1
    out = got[len(sweep):]
    at = {name: i for i, name in enumerate(["0", "-0", "inf", "-inf"])}
    assert out[at["0"]] == 0.0 and math.copysign(1.0, out[at["0"]]) == 1.0
    assert out[at["-0"]] == 0.0 and math.copysign(1.0, out[at["-0"]]) == -1.0
    big = np.abs(x.numpy()[len(sweep):]) >= 4.0
    assert np.array_equal(out[big], np.sign(x.numpy()[len(sweep):][big]))
    # small inputs: relative accuracy (erf(x) ~ 2x/sqrt(pi)), no flush to zero
    small = (np.abs(ref) > 1e-37) & (np.abs(ref) < 1e-3)  # normal results (subnormals round)
    assert np.max(np.abs(got[small] - ref[small]) / np.abs(ref[small])) < 1e-6


class FcGelu(torch.nn.Module):
    def __init__(self, k, n, approximate):
        super().__init__()
        self.fc = torch.nn.Linear(k, n)
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(self.fc(x), approximate=self.approximate)


@pytest.mark.parametrize("approximate,shape,n", [("none", (2, 16, 32), 64), ("none", (37, 48), 40),
                                                 ("tanh", (5, 24), 72)])
def test_gelu_gemm_epilogue_vs_float64(tmp_path, approximate, shape, n):
    torch.manual_seed(0)
    m = FcGelu(shape[-1], n, approximate).eval()
    x = torch.randn(*shape) * 2
    runner = kiln.compile(m, (x,)).load(tmp_path / "m.kiln")
    with torch.no_grad():
        ref = m.double()(x.double())
    got = runner(x).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_pointwise_vs_float64(tmp_path, approximate):
    class G(torch.nn.Module):
        def forward(self, x):
            return F.gelu(x, approximate=approximate)

    x = torch.linspace(-12, 12, 24003).reshape(3, 8001)
    runner = kiln.compile(G(), (x,)).load(tmp_path / "m.kiln")
    ref = F.gelu(x.double(), approximate=approximate)
    # float32 rounding of the input and of x * 0.5 * (1 + erf) dominate: a few ulp of |x|
    torch.testing.assert_close(runner(x).double(), ref, rtol=2e-6, atol=1e-6)
