"""Memory-aware reordering: independent branches run one after the other when that lowers the
peak of live intermediates; results stay identical; dependences are never broken."""

from __future__ import annotations

import pytest
import torch

import kiln


class Branches(torch.nn.Module):
    """Two independent GEMM branches: program order keeps both wide intermediates alive."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(64, 1024), torch.nn.Linear(64, 1024)
        self.v1, self.v2 = torch.nn.Linear(1024, 8), torch.nn.Linear(1024, 8)

    def forward(self, x):
        a = torch.relu(self.w1(x))
        b = torch.relu(self.w2(x))
        return self.v1(a) + self.v2(b)


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_reordering_lowers_peak_and_keeps_results(tmp_path):
    torch.manual_seed(0)
    m, x = Branches().eval(), torch.randn(32, 64)
    on = kiln.compile(m, (x,))
    off = kiln.compile(m, (x,), options=kiln.Options(reorder_for_memory=False))
    before, after = on.report["reorder_peak_bytes"].values()
    assert after < before
    assert on.report["arena_bytes"] < off.report["arena_bytes"]
    with torch.no_grad():
        want = m(x)
    for c, name in ((on, "on"), (off, "off")):
        torch.testing.assert_close(c.load(tmp_path / f"{name}.kiln")(x), want, rtol=1e-5,
                                   atol=1e-5)
