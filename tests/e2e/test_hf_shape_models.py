"""Hugging Face models built from small configs (no downloads) whose programs carry the shape
arithmetic of issue 16 class 7: gpt2 (a view that torch's re-trace for decomposition cannot
make with the decomposed attention's strides), bloom (repeat counts that are program sizes).
Compiled with dynamic batch and sequence, compared with eager at the example and two other
sizes, weights scaled up so errors show. Slow (a minute or two each on 2 cores)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import kiln

transformers = pytest.importorskip("transformers")


class Wrap(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


def _gpt2():
    return transformers.GPT2Model(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128))


def _bloom():
    return transformers.BloomModel(transformers.BloomConfig(
        vocab_size=128, hidden_size=64, n_layer=2, n_head=4))


@pytest.mark.slow
@pytest.mark.parametrize("make", [_gpt2, _bloom], ids=["gpt2", "bloom"])
def test_model_matches_eager_at_dynamic_sizes(tmp_path, make):
    torch.manual_seed(0)
    model = Wrap(make().eval())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    ep = torch.export.export(model, (torch.randint(0, 128, (2, 8)),), strict=False,
                             dynamic_shapes=({0: Dim("b", min=1, max=16),
                                              1: Dim("s", min=2, max=64)},))
    kiln.compile(ep, options=kiln.Options(num_threads=1)).save(tmp_path / "m.kiln")
    runner = kiln.load(tmp_path / "m.kiln")
    for shape in ((2, 8), (1, 3), (5, 37)):
        x = torch.randint(0, 128, shape)
        with torch.no_grad():
            ref = model(x)
        torch.testing.assert_close(runner(x), ref, rtol=1e-4, atol=1e-4)
