"""kiln.models.quant_report: KL divergence of next-token distributions of a quantised compiled
Llama-shaped decoder (kiln/models/tp.py) from the unquantised one."""

from __future__ import annotations

import math

import pytest
import torch

import kiln
from kiln.models.quant_report import kl_report, kl_stats, small_llama, token_stream


def test_kl_stats_of_known_distributions():
    ref = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]], dtype=torch.float64)
    got = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    s = kl_stats(ref, got)
    # row 1: P = (3/4, 1/4), Q = (1/2, 1/2): KL = 3/4 log(3/2) + 1/4 log(1/2)
    want = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert abs(s["kl_max"] - want) < 1e-12 and abs(s["kl_mean"] - want / 2) < 1e-12
    assert s["top1_agree"] == 1.0 and s["positions"] == 2
    assert kl_stats(ref, ref)["kl_max"] == 0.0


@pytest.mark.slow  # two quantised decoder compiles; test_hf_decoders checks both formats
def test_int8_diverges_less_than_int4_and_both_stay_close():
    model = small_llama(hidden_size=64, intermediate_size=160, vocab_size=128,
                        num_attention_heads=4, num_key_value_heads=2)
    tokens = token_stream(128, 32)
    rep = kl_report(model, tokens, 16, {
        "int8": kiln.Options(weight_quant="int8"),
        "int4": kiln.Options(weight_quant="int4", weight_quant_group=32)})
    assert rep["int8"]["positions"] == 32
    assert 0 < rep["int8"]["kl_mean"] < rep["int4"]["kl_mean"]
    assert rep["int8"]["kl_max"] < 1e-2 and rep["int4"]["kl_max"] < 0.5
