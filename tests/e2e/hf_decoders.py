"""Hugging Face decoders with a static KV cache, exported for one-token decode (test and bench
helper; no downloads: every model is built from a config with random weights).

`export_decode(family, ...)` builds a tiny (or given-size) model of one family, wraps it in
transformers' own static-cache module (`TorchExportableModuleWithStaticCache`, what
`TorchExportableModuleForDecoderOnlyLM` uses) and exports one decode step: inputs
`input_ids` [1, 1] and `cache_position` [1], output logits [1, 1, vocab], the caches state
buffers the program updates. `greedy(step, prompt, n)` runs a prompt token by token through
a step function and then `n` greedy tokens, the same loop for eager and kiln.
"""
from __future__ import annotations

from typing import Callable

import torch

FAMILIES = ("llama", "qwen2", "gemma", "mistral", "phi")


def config(family: str, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
           intermediate: int = 128, vocab: int = 256, max_pos: int = 256):
    """A transformers config of `family` at the given size (tiny by default)."""
    import transformers as tr  # deferred: transformers is a test-only dependency

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate,
                  vocab_size=vocab, max_position_embeddings=max_pos, use_cache=True)
    if family == "llama":
        return tr.LlamaConfig(**common, tie_word_embeddings=False)
    if family == "qwen2":
        return tr.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if family == "gemma":
        return tr.GemmaConfig(**common, head_dim=hidden // heads, hidden_act="gelu_pytorch_tanh",
                              hidden_activation="gelu_pytorch_tanh")
    if family == "mistral":
        return tr.MistralConfig(**common, sliding_window=None)
    if family == "phi":
        return tr.PhiConfig(**common, partial_rotary_factor=0.5)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def build_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A causal LM of `family` with random weights (seeded), in eval mode and `dtype`."""
    import transformers as tr  # deferred: transformers is a test-only dependency

    cfg = config(family, **size)
    torch.manual_seed(seed)
    model = tr.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():  # larger weights than the init's 0.02 std: logits far apart
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return model.to(dtype).eval()


def static_module(model, max_cache_len: int):
    """transformers' static-cache decode module around `model` (batch 1)."""
    from transformers import GenerationConfig  # deferred: test-only dependency
    from transformers.integrations.executorch import (  # deferred: test-only dependency
        TorchExportableModuleWithStaticCache)

    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": max_cache_len})
    return TorchExportableModuleWithStaticCache(model, 1, max_cache_len).eval()


def export_decode(module) -> torch.export.ExportedProgram:
    """One decode step (input_ids [1, 1], cache_position [1]) of a static-cache module."""
    ids = torch.tensor([[1]], dtype=torch.long)
    pos = torch.tensor([0], dtype=torch.long)
    with torch.no_grad():
        return torch.export.export(module, (), {"input_ids": ids, "cache_position": pos},
                                   strict=True)


def greedy(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], prompt: list[int],
           new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Feed `prompt` one token at a time, then `new_tokens` greedy tokens; returns the new
    tokens and the logits of every step."""
    tokens, logits = [], []
    nxt = None
    for pos in range(len(prompt) + new_tokens - 1):
        tok = prompt[pos] if pos < len(prompt) else nxt
        out = step(torch.tensor([[tok]], dtype=torch.long), torch.tensor([pos], dtype=torch.long))
        logits.append(out.detach().reshape(-1).clone())
        if pos >= len(prompt) - 1:
            nxt = int(out.reshape(-1).argmax())
            tokens.append(nxt)
    return tokens, logits


def reset_caches(module) -> None:
    """Zero the static caches of an eager module (a fresh sequence)."""
    for name, buf in module.named_buffers():
        if "cache" in name:
            buf.zero_()
