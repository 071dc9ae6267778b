"""Fusion across a flattening view: a pre-norm block's layer norm over [B, T, C] and the
[B*T, C] view its Linear reads are one kernel (the view's rows re-indexed over [B, T]; the
norm's statistics stay in registers), static and dynamic sizes; checked against eager."""

import pytest
import torch
from torch.export import Dim

import kiln
from kiln.frontend.export import import_program
from kiln.lowering import lower
from kiln.passes.dce import dce
from kiln.schedule import Kernel, schedule


class PreNorm(torch.nn.Module):
    def __init__(self, c=40, n=24):
        super().__init__()
        self.ln = torch.nn.LayerNorm(c)
        self.fc = torch.nn.Linear(c, n)

    def forward(self, x):
        return self.fc(self.ln(x * 2 + 1))


def _kernels(ep):
    loop = lower(dce(import_program(ep).graph))
    return [s for s in schedule(loop) if isinstance(s, Kernel)]


@pytest.mark.parametrize("dynamic", [False, True])
def test_norm_and_flattened_view_share_one_kernel(dynamic):
    x = torch.randn(3, 5, 40)
    dyn = ({0: Dim("b", max=8), 1: Dim("t", max=64)},) if dynamic else None
    ks = _kernels(torch.export.export(PreNorm(), (x,), dynamic_shapes=dyn))
    # stats + normalise + view in one kernel, then the GEMM, then its bias add
    assert len(ks) == 2, [k.name for k in ks]
    k = ks[0]
    assert len(k.outer) == 2 and len(k.locals) == 2  # over [B, T]; sum and sqsum in registers
    assert [m.reduce is None for m in k.members] == [False, False, True]
    assert {len(m.shape) for m in k.members} == {3}  # the [B*T, C] view iterated as [B, T, C]


@pytest.mark.parametrize("device", ["cpu"])
def test_prenorm_matches_eager(tmp_path, device):
    torch.manual_seed(0)
    m = PreNorm().eval()
    dyn = ({0: Dim("b", max=8), 1: Dim("t", max=64)},)
    ep = torch.export.export(m, (torch.randn(3, 5, 40),), dynamic_shapes=dyn)
    runner = kiln.load(kiln.compile(ep).save(tmp_path / "p.kiln"))
    for shape in [(3, 5, 40), (1, 7, 40), (4, 1, 40)]:
        x = torch.randn(shape)
        torch.testing.assert_close(runner(x), m(x), rtol=1e-5, atol=1e-5)
