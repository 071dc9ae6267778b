"""The CUDA channels-last convolution on a GPU (skipped without CUDA): every case of
test_conv_nhwc.py (3x3 / 5x5 / 7x7 / 1x1, strides 1 and 2, padding, dilation, grouped and
depthwise, bias / batch norm / residual / relu / relu6 / silu epilogues) at batch 1 and 8, in
float32 (eager with TF32 off), float16 and bfloat16, with NCHW and channels-last inputs, and
the ResNet-18 / MobileNetV2 zoo models, against eager.

Tolerances: float32 to 1e-4 of the output's scale (3xTF32 products; eager without TF32);
16-bit against a float64 reference of the same 16-bit weights and inputs: kiln's error at most
three times eager's in the same dtype plus 2e-3 of the output's scale (kiln applies the
epilogue in float32 and rounds once; eager rounds after every op)."""

from __future__ import annotations

import sys

import pytest
import torch

import kiln
from kiln.options import Options

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from test_conv_nhwc import CASES, Stem, case_module  # noqa: E402

OPTS = Options(autotune=False)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _check(module, runner, x, dt, tag=""):
    got = runner(x)
    want = module(x)
    ref = module.double()(x.double())
    module.to(dt)
    err = (got.double() - ref).abs().max().item()
    eager_err = (want.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"{tag} {dt}: kiln err {err:.3g}, eager err {eager_err:.3g}, scale {scale:.3g}",
          file=sys.stderr)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dt == torch.float32:
        assert err <= 1e-4 * max(scale, 1.0), (err, scale)
    else:
        assert err <= 3 * eager_err + 2e-3 * max(scale, 1.0), (err, eager_err, scale)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_conv_cases_match_eager(case, dtype, tmp_path):
    name, kw, shape = case
    dt = DTYPES[dtype]
    m, x = case_module(kw, (2, *shape[1:]), dt)  # batch 2: export keeps the dim dynamic
    m, x = m.cuda(), x.cuda()
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: batch},))
    cm = kiln.compile(ep, device="cuda", options=OPTS)
    assert any(n.op == "conv_nhwc" for n in cm.built.graph.nodes)
    runner = kiln.load(cm.save(tmp_path / "c.kiln"), device="cuda:0")
    for b in (1, 8):
        xb = torch.randn(b, *shape[1:], device="cuda").to(dt)
        _check(m, runner, xb, dt, f"{name} b{b}")
    # a channels-last input (the runner copies it in) computes the same
    xb = torch.randn(8, *shape[1:], device="cuda").to(dt).to(memory_format=torch.channels_last)
    _check(m, runner, xb, dt, f"{name} channels_last")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_stem_with_max_pool_in_nhwc(dtype, tmp_path):
    dt = DTYPES[dtype]
    torch.manual_seed(0)
    m = Stem(32).eval().to(dt).cuda()
    x = torch.randn(2, 3, 64, 64, device="cuda").to(dt)
    cm = kiln.compile(torch.export.export(m, (x,)), device="cuda", options=OPTS)
    runner = kiln.load(cm.save(tmp_path / "s.kiln"), device="cuda:0")
    _check(m, runner, x, dt, "stem")


@pytest.mark.parametrize("model", ["resnet18", "mobilenet_v2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zoo_models_match_eager(model, dtype, tmp_path):
    """End to end with the default options (launch configs and conv tiles measured here)."""
    from kiln.models import ALL_MODELS
    dt = DTYPES[dtype]
    spec = ALL_MODELS[model]()
    torch.manual_seed(0)
    m = spec.module.eval().to(dt).cuda()
    x = torch.randn(8, *spec.example_args[0].shape[1:], device="cuda").to(dt)
    cm = kiln.compile(torch.export.export(m, (x,)), device="cuda")
    assert cm.manifest["cuda"]["conv"]
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    got = runner(x).float()
    want = m(x).float()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{model} {dtype}: max error / max |eager| {rel:.3g}", file=sys.stderr)
    assert rel <= (1e-3 if dt == torch.float32 else 5e-2), rel
