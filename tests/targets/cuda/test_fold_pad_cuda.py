"""Zero pads folded into convolutions on the CUDA target too (kiln/passes/fold_pad.py, stage
`fold_pads` after `dce`): Hugging Face's TensorFlow-style padding (an explicit F.pad before a
convolution of padding 0). Without a GPU: the package compiled for sm_90 has a kernel reading
the asymmetric pad and none for the symmetric ones (their amounts are the convolutions'
padding now). On a GPU (`-m gpu`): the package against eager at three batch sizes, float32 and
bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.options import Options  # noqa: E402


class TfPadded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 16, 3, 2)
        self.c2 = torch.nn.Conv2d(16, 16, 3, 1, groups=16)
        self.c3 = torch.nn.Conv2d(16, 32, 1)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.5

    def forward(self, x):
        x = self.c1(F.pad(x, (0, 1, 0, 1)))               # asymmetric: stays a pad
        x = torch.relu(self.c2(F.pad(x, (1, 1, 1, 1))))  # symmetric: the conv's padding
        return self.c3(F.pad(x, (0, 0, 0, 0)))            # identity: dropped


def _export(dtype, device="cpu"):
    m = TfPadded().to(device=device, dtype=dtype).eval()
    x = torch.randn(2, 3, 33, 31, device=device, dtype=dtype)
    batch = torch.export.Dim("batch", min=1, max=8)
    return m, torch.export.export(m, (x,), dynamic_shapes=({0: batch},))


def _comments(cm) -> list[str]:
    """The comment lines of the package's Triton kernels (each names its source ops)."""
    return [line.strip() for line in cm.sources["kernels_triton.py"].splitlines()
            if line.lstrip().startswith("#")]


def test_symmetric_pads_fold_on_cuda_without_gpu():
    _, ep = _export(torch.float32)
    cm = kiln.compile(ep, device="cuda", options=Options(cuda_archs=(90,), autotune=False))
    lines = _comments(cm)
    # the depthwise convolution reads its symmetric pad as its own padding
    depthwise = [ln for ln in lines if "groups 16" in ln]
    assert depthwise and all("padding 1x1" in ln for ln in depthwise), depthwise
    # one pad kernel is left: the asymmetric one (here fused with the NHWC conversion)
    pad_kernels = [ln for ln in lines if ln.startswith("# k") and "pad" in ln]
    assert len(pad_kernels) == 1, pad_kernels


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("f32", "bf16"))
def test_folded_pads_match_eager_on_gpu(tmp_path, dtype):
    m, ep = _export(dtype, "cuda")
    runner = kiln.compile(ep, device="cuda").load(tmp_path / "pads.kiln")
    g = torch.Generator(device="cuda").manual_seed(1)
    for n in (1, 2, 5):
        x = torch.randn(n, 3, 33, 31, device="cuda", dtype=dtype, generator=g)
        with torch.no_grad():
            want = m(x)
            want64 = m.double()(x.double())
            m.to(dtype)
        got = runner(x)
        # within twice eager's own distance from float64 math, plus a rounding of the scale
        scale = float(want64.abs().max())
        tol = (1e-5 if dtype == torch.float32 else 8e-3) * scale
        err = (got.double() - want64).abs().max()
        assert err <= 2 * (want.double() - want64).abs().max() + tol, (n, float(err))
