"""Fusion across size-1 dims (a one-token decode step): the residual sum over [1, 1, C] that is
kept for a later use and the RMSNorm after it (whose reduction's outer index space is empty
once its trailing 1s go) are one kernel, since merging them loses no parallelism. Checked
against eager on the CPU target (the same schedule)."""

import pytest
import torch

import kiln
from kiln.frontend.export import import_program
from kiln.lowering import lower
from kiln.passes.dce import dce
from kiln.schedule import Kernel, schedule


class ResidualNorm(torch.nn.Module):
    """h = two projections + the residual, materialised (read again by the last add); Hugging
    Face's RMSNorm of h in float32, rounded back before its weight; a projection of it + h."""

    def __init__(self, c=64):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(c))
        self.a = torch.nn.Linear(c, c, bias=False)
        self.b = torch.nn.Linear(c, c, bias=False)
        self.c = torch.nn.Linear(c, c, bias=False)

    def forward(self, x, r):
        h = self.a(x) + self.b(x) + r
        f = h.float()
        y = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype) * self.w
        return self.c(y) + h


def _kernels(m, args):
    loop = lower(dce(import_program(torch.export.export(m, args)).graph))
    return [s for s in schedule(loop) if isinstance(s, Kernel)]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_residual_and_rmsnorm_of_one_token_share_a_kernel(dt):
    args = (torch.randn(1, 1, 64, dtype=dt), torch.randn(1, 1, 64, dtype=dt))
    ks = _kernels(ResidualNorm().to(dt), args)
    # the residual sum, the norm's statistics and the normalised row; then the last add
    assert len(ks) == 2, [(k.name, k.outer) for k in ks]
    assert any(m.reduce is not None for m in ks[0].members) and len(ks[0].members) >= 2


def test_row_parallel_kernels_do_not_collapse():
    """[4, 1, 64]: four rows stay four parallel rows of the norm kernel."""
    args = (torch.randn(4, 1, 64), torch.randn(4, 1, 64))
    ks = _kernels(ResidualNorm(), args)
    assert all(int(k.outer[0]) == 4 for k in ks), [(k.name, k.outer) for k in ks]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_fused_step_matches_eager(tmp_path, dt):
    torch.manual_seed(0)
    m = ResidualNorm().to(dt)
    args = (torch.randn(1, 1, 64, dtype=dt), torch.randn(1, 1, 64, dtype=dt))
    got = kiln.load(kiln.compile(m, args).save(tmp_path / "p.kiln"))(*args)
    want = m.double()(*[a.double() for a in args])
    tol = 1e-5 if dt == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
