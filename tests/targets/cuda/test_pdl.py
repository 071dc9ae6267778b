"""Programmatic dependent launch (Options.cuda_pdl; kernel.with_pdl): for sm_90+ builds every
kiln kernel begins by waiting for the kernel before it (`_kl_pdl()` first in its body) and the
wrapper launches it with programmatic stream serialisation where the device and driver allow
(kc::pdl_supported). Without a GPU: the code says so, and says nothing of it for a build that
also targets sm_80 or turns it off. On a GPU: a chain of kernels whose buffers the arena reuses
(a write after another kernel's read of the same bytes) gives eager's values, launch after
launch, with and without CUDA graphs, and the same values with the option off."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.options import Options  # noqa: E402


class Chain(torch.nn.Module):
    """Linear -> LayerNorm -> GELU -> + residual, `depth` times, then a softmax: many small
    kernels, each reading what the one before wrote, and arena slots reused along the way."""

    def __init__(self, width: int = 384, depth: int = 4) -> None:
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(depth))

    def forward(self, x):
        for lin, norm in zip(self.lins, self.norms):
            x = x + torch.nn.functional.gelu(norm(lin(x)))
        return torch.softmax(x * 0.5, -1), x.sum(-1)


def _compile(rows: int, **opts):
    torch.manual_seed(0)
    m = Chain().eval()
    ep = torch.export.export(m, (torch.randn(rows, 384),))
    return m, kiln.compile(ep, device="cuda", options=Options(**opts))


def _kernel_bodies(text: str) -> dict[str, str]:
    """The first statement after each generated kernel's signature (the prelude's helpers
    start with `_`)."""
    out = {}
    for m in re.finditer(r"@triton\.jit\ndef (\w+)\(.*?\):\n(.*)\n", text):
        if not m.group(1).startswith("_"):
            out[m.group(1)] = m.group(2).strip()
    return out


def test_sm90_kernels_wait_first_and_launch_with_pdl():
    _, cm = _compile(1, cuda_archs=(90,))
    bodies = _kernel_bodies(cm.sources["kernels_triton.py"])
    assert len(bodies) >= 3
    assert all(b.startswith("_kl_pdl()") for b in bodies.values()), bodies
    wrapper = cm.sources["model_cuda.cpp"]
    launches = [ln for ln in wrapper.splitlines() if "kc::launch(" in ln]
    assert launches and all(ln.rstrip().endswith("args, self->pdl)) return 1;")
                            for ln in launches), launches
    assert "self->pdl = kc::pdl_supported(cc);" in wrapper


@pytest.mark.parametrize("opts", [dict(cuda_archs=(90,), cuda_pdl=False),
                                  dict(cuda_archs=(80, 90))], ids=["off", "sm80_too"])
def test_no_pdl_when_off_or_an_older_arch_is_targeted(opts):
    _, cm = _compile(1, **opts)
    bodies = _kernel_bodies(cm.sources["kernels_triton.py"])
    assert bodies and not any("_kl_pdl" in b for b in bodies.values())
    assert "self->pdl)" not in cm.sources["model_cuda.cpp"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "launches"])
@pytest.mark.parametrize("rows", [1, 48])
def test_pdl_chain_matches_eager_run_after_run(rows, graphs, tmp_path):
    m, on = _compile(rows, cuda_graphs=graphs)
    _, off = _compile(rows, cuda_graphs=graphs, cuda_pdl=False)
    cc = torch.cuda.get_device_capability()
    assert ("_kl_pdl()" in on.sources["kernels_triton.py"]) == (cc[0] >= 9)
    r_on = on.load(tmp_path / "on.kiln", device="cuda:0")
    r_off = off.load(tmp_path / "off.kiln", device="cuda:0")
    g = torch.Generator().manual_seed(1)
    for _ in range(12):  # captured on the second run, replayed after
        x = torch.randn(rows, 384, generator=g)
        with torch.no_grad():
            want = [w.double() for w in m.double()(x.double())]
            m.float()
        got_on = r_on(x.cuda())
        got_off = r_off(x.cuda())
        for a, b, w in zip(got_on, got_off, want):
            torch.testing.assert_close(a.cpu().double(), w, rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(a, b, rtol=0, atol=0)
