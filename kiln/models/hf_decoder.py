"""Hugging Face decoder-only language models as kiln packages with two entry points, `prefill`
(a prompt of dynamic length) and `decode` (one token), sharing the weights and the KV cache.

Both programs are exported from one transformers static-cache wrapper
(`transformers.integrations.executorch.TorchExportableModuleWithStaticCache`: the cache is
registered buffers, written in place at `cache_position`), so their weights and cache buffers
have the same FQNs and the package stores the weights once and keeps one cache per loaded
instance. Each entry takes `input_ids` (int64 [1, T]; T = 1 for decode) and `cache_position`
(int64 [T]: the positions of those tokens) and returns the logits (float [1, T, vocab]).

    model = build("llama")                                 # random weights, no download
    compiled = kiln.compile(export_decoder(model, max_cache_len=128))
    runner = compiled.load("llama.kiln")
    tokens = kiln.runtime.generate(runner, [1, 2, 3], max_new_tokens=20).tokens

`eager_generate` runs the same loop (greedy) in eager on a fresh wrapper: the reference.
This module needs `transformers` (not one of kiln's own requirements; nothing else in kiln
imports it).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch.export import Dim
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

from kiln.errors import KilnError

#: tiny configurations per family (random weights): fast to export and compile
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "qwen2": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


def config(family: str, **overrides: Any):
    """A tiny transformers config of `family` ("llama", "qwen2"), `overrides` applied."""
    tf = transformers
    classes = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}
    if family not in classes:
        raise KilnError(f"hf_decoder: unknown family {family!r} (known: {', '.join(classes)})")
    return classes[family](**{**TINY[family], **overrides})


def build(family_or_config: Any = "llama", seed: int = 0,
          dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A causal LM with random weights (seeded) from a family's tiny config or a config."""
    tf = transformers
    cfg = config(family_or_config, **overrides) if isinstance(family_or_config, str) \
        else family_or_config
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def static_cache_module(model: torch.nn.Module, max_cache_len: int) -> torch.nn.Module:
    """transformers' static-cache wrapper of `model` (batch 1, cache of max_cache_len)."""
    gc = model.generation_config
    gc.use_cache = True
    gc.cache_implementation = "static"
    return TorchExportableModuleWithStaticCache(model, batch_size=1,
                                                max_cache_len=max_cache_len).eval()


def export_decoder(model: torch.nn.Module, max_cache_len: int = 128,
                   max_prompt: int | None = None) -> dict[str, torch.export.ExportedProgram]:
    """{"prefill": ..., "decode": ...} exported from one static-cache wrapper of `model`,
    for `kiln.compile`. Prefill takes prompts of 1 .. max_prompt (default max_cache_len)
    tokens."""
    module = static_cache_module(model, max_cache_len)
    top = max_prompt or max_cache_len
    if not 2 <= top <= max_cache_len:
        raise KilnError(f"hf_decoder: max_prompt must be in [2, max_cache_len={max_cache_len}], "
                        f"got {top}")
    t = Dim("prompt", min=1, max=top)
    # strict (dynamo) export, as transformers' own recipe: the non-strict trace of this
    # wrapper does not survive run_decompositions in this torch
    prefill = torch.export.export(
        module, (), {"input_ids": torch.zeros(1, 2, dtype=torch.long),
                     "cache_position": torch.arange(2)},
        dynamic_shapes={"input_ids": {1: t}, "cache_position": {0: t}}, strict=True)
    decode = torch.export.export(
        module, (), {"input_ids": torch.zeros(1, 1, dtype=torch.long),
                     "cache_position": torch.tensor([2])}, strict=True)
    return {"prefill": prefill, "decode": decode}


@torch.no_grad()
def eager_generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int,
                   max_cache_len: int = 128) -> list[int]:
    """Greedy tokens of the same prefill + decode loop in eager (a fresh cache): the
    reference for compiled packages."""
    module = static_cache_module(model, max_cache_len)
    ids = torch.tensor([prompt], dtype=torch.long)
    logits = module(input_ids=ids, cache_position=torch.arange(len(prompt)))
    out: list[int] = []
    pos = len(prompt)
    while len(out) < max_new_tokens:
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        logits = module(input_ids=torch.tensor([[tok]]), cache_position=torch.tensor([pos]))
        pos += 1
    return out
