"""The real-model corpus (issue 16): every architecture of `kiln/models/hf_corpus.py` (50
Hugging Face model types: decoders, MoE, encoders, encoder-decoders, vision, audio), built
from a shrunk config with random weights redrawn at trained magnitudes (std 1/sqrt(fan-in), so
that errors show), exported with dynamic batch and sequence (images: batch), compiled for the
CPU once and compared with eager at the example size and at two other sizes, every output.

Each model takes 10 to 90 s to compile on 2 cores: the default suite runs three cheap ones
(one text and one vision model), `-m slow` the rest. A model whose shrunk
config eager cannot run uses the type's default config (`hf_corpus.build`)."""

from __future__ import annotations

import pytest
import torch

import kiln

pytest.importorskip("transformers")

from kiln.models import hf_corpus as C  # noqa: E402 - needs transformers

FAST = {"opt", "convnext"}  # the default suite's share: about a minute together

# (batch, sequence length) of the runs, the example (2, 16) first (automatic dynamic dims start
# at 2); images: batch only
SIZES = ((2, 16), (4, 5), (3, 24))


def _ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |kiln - eager| over the tolerance 1e-3 * max |eager| + 1e-4 (float32 models)."""
    if not want.is_floating_point():
        return 0.0 if torch.equal(got, want) else float("inf")
    if not want.numel():
        return 0.0
    err = float((got.double() - want.double()).abs().max())
    return err / (1e-3 * float(want.double().abs().max()) + 1e-4)


@pytest.mark.parametrize("model_type", [
    pytest.param(m, marks=() if m in FAST else pytest.mark.slow) for m in C.ARCHS])
def test_model_matches_eager_at_three_dynamic_sizes(model_type, tmp_path):
    kind = C.ARCHS[model_type]
    flat, cfg, _ = C.build(model_type, realistic=True)
    example = C.inputs(kind, cfg, *SIZES[0])
    ep = C.export(flat, kind, example, dynamic=True)
    kiln.compile(ep, options=kiln.Options(num_threads=1)).save(tmp_path / "m.kiln")
    runner = kiln.load(tmp_path / "m.kiln")
    for batch, length in SIZES:
        x = C.inputs(kind, cfg, batch, length)
        with torch.no_grad():
            want = flat(**x)
        got = runner(**x)
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype, (k, g.shape, w.shape)
            assert torch.isfinite(w).all() if w.is_floating_point() else True, \
                f"eager output {k} is not finite at {batch}x{length}: weights too large"
            r = _ratio(g, w)
            assert r <= 1.0, f"output {k} at {batch}x{length}: error {r:.2f}x the tolerance"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", list(C.ARCHS))
def test_model_matches_eager_on_cuda(model_type, tmp_path):
    """The same on CUDA: compiled for the GPU, compared with eager on the GPU."""
    kind = C.ARCHS[model_type]
    flat, cfg, _ = C.build(model_type, device="cuda", realistic=True)
    example = {k: v.cuda() for k, v in C.inputs(kind, cfg, *SIZES[0]).items()}
    ep = C.export(flat, kind, example, dynamic=True)
    cm = kiln.compile(ep, device="cuda")
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    for batch, length in SIZES:
        x = {k: v.cuda() for k, v in C.inputs(kind, cfg, batch, length).items()}
        with torch.no_grad():
            want = flat(**x)
        got = runner(**x)
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype, (k, g.shape, w.shape)
            r = _ratio(g, w)
            assert r <= 1.0, f"output {k} at {batch}x{length}: error {r:.2f}x the tolerance"
