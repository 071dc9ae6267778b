"""kiln/models/hf_decoder.py, the one home of the Hugging Face decoder helpers (issue 17): the
aliases kept for older callers (kiln/models/llm.py, tests/e2e/hf_decoders.py) are its own
functions; bad arguments raise KilnError naming what is expected; the one-token loop and the
prefill + decode loop give the same greedy tokens in eager; `export_decoder(sampler=...)` adds
the device sampler's program for the decode logits' vocabulary and dtype."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kiln.errors import KilnError  # noqa: E402
from kiln.models import hf_decoder, llm  # noqa: E402

import hf_decoders  # noqa: E402


def test_aliases_are_the_home_functions():
    assert llm.llama is hf_decoder.llama and llm.greedy is hf_decoder.greedy
    assert llm.static_cache_module is hf_decoder.export_step
    assert hf_decoders.static_module is hf_decoder.static_cache_module
    assert hf_decoders.greedy is hf_decoder.greedy_steps
    assert hf_decoders.FAMILIES == hf_decoder.FAMILIES


def test_bad_arguments_name_what_is_expected():
    with pytest.raises(KilnError, match="unknown family 'gpt9'.*llama, qwen2"):
        hf_decoder.config("gpt9")
    with pytest.raises(KilnError, match="init must be"):
        hf_decoder.build("llama", init="xavier")
    with pytest.raises(KilnError, match="max_prompt must be in"):
        hf_decoder.export_decoder(hf_decoder.build("llama"), max_cache_len=16, max_prompt=32)


@pytest.mark.parametrize("family", hf_decoder.FAMILIES)
def test_one_token_and_prefill_loops_agree_in_eager(family):
    model = hf_decoder.build(family, seed=3, init="fan_in")
    prompt = [5, 9, 2, 77]
    module = hf_decoder.static_cache_module(model, 32)
    with torch.no_grad():
        one = hf_decoder.greedy(hf_decoder.eager_step(module), prompt, 6)
    assert one == hf_decoder.eager_generate(model, prompt, 6, max_cache_len=32)


def test_export_decoder_adds_the_sampler_program():
    pytest.importorskip("triton")
    from kiln.models import device_sampler

    model = hf_decoder.build("llama", dtype=torch.bfloat16, vocab=300)
    progs = hf_decoder.export_decoder(model, max_cache_len=16, max_prompt=8,
                                      sampler=device_sampler.export_sampler)
    assert list(progs) == ["prefill", "decode", "sample"]
    logits = progs["sample"].graph_signature.user_inputs[0]
    val = next(n for n in progs["sample"].graph.nodes if n.name == logits).meta["val"]
    assert val.dtype == torch.bfloat16 and val.shape[-1] == 300
