"""Hugging Face decoder-only language models as kiln programs: the one home of the helpers that
build them (random weights, no downloads), wrap them in transformers' static-cache module,
export them and run the eager reference loops (the LLM tests, bench/llm_gpu.py,
bench/llm_cpu.py; kiln/models/llm.py and tests/e2e/hf_decoders.py are aliases of this module).

Packages with entry points: `prefill` (a prompt of dynamic length) and `decode` (one token)
share the weights and the KV cache, and on CUDA `sample` (kiln/models/device_sampler.py:
sampling on the device). Both programs are exported from one transformers static-cache wrapper
(`transformers.integrations.executorch.TorchExportableModuleWithStaticCache`: the cache is
registered buffers, written in place at `cache_position`), so their weights and cache buffers
have the same FQNs and the package stores the weights once and keeps one cache per loaded
instance. Each entry takes `input_ids` (int64 [1, T]; T = 1 for decode) and `cache_position`
(int64 [T]: the positions of those tokens) and returns the logits (float [1, T, vocab]).

    model = build("llama")                                 # random weights, no download
    compiled = kiln.compile(export_decoder(model, max_cache_len=128))
    runner = compiled.load("llama.kiln")
    tokens = kiln.runtime.generate(runner, [1, 2, 3], max_new_tokens=20).tokens

One-token programs (no prefill: the prompt fed token by token): `export_step(model, ...)` ->
(the static-cache module, its ExportedProgram), `greedy(step, prompt, n)` over a step function
(eager's: `eager_step(module)`). `eager_generate` runs the prefill + decode loop (greedy) in
eager on a fresh wrapper: the reference for packages with entry points.
This module needs `transformers` (not one of kiln's own requirements; nothing else in kiln
imports it).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import transformers
from torch.export import Dim
from transformers.integrations.executorch import (TorchExportableModuleForDecoderOnlyLM,
                                                  TorchExportableModuleWithStaticCache)

from kiln.errors import KilnError

#: the families `config` knows (tiny by default)
FAMILIES = ("llama", "qwen2", "gemma", "mistral", "phi")


def config(family: str, *, hidden: int = 64, layers: int = 2, heads: int = 4,
           kv_heads: int = 2, intermediate: int = 128, vocab: int = 256, max_pos: int = 512,
           **overrides: Any):
    """A transformers config of `family` at the given size (tiny by default), `overrides`
    (transformers' own field names) applied last."""
    tf = transformers
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate,
                  vocab_size=vocab, max_position_embeddings=max_pos, use_cache=True)
    per_family = {
        "llama": (tf.LlamaConfig, dict(tie_word_embeddings=False)),
        "qwen2": (tf.Qwen2Config, dict(tie_word_embeddings=True, use_sliding_window=False)),
        "gemma": (tf.GemmaConfig, dict(head_dim=hidden // heads,
                                       hidden_act="gelu_pytorch_tanh",
                                       hidden_activation="gelu_pytorch_tanh")),
        "mistral": (tf.MistralConfig, dict(sliding_window=None)),
        "phi": (tf.PhiConfig, dict(partial_rotary_factor=0.5)),
    }
    if family not in per_family:
        raise KilnError(f"hf_decoder: unknown family {family!r} (known: {', '.join(FAMILIES)})")
    cls, extra = per_family[family]
    return cls(**{**common, **extra, **overrides})


def build(family_or_config: Any = "llama", seed: int = 0,
          dtype: torch.dtype = torch.float32, *, init: float | str | None = None,
          device: str | torch.device = "cpu", **sizes: Any) -> torch.nn.Module:
    """A causal LM with random weights (seeded), in eval mode, `dtype`, on `device`, from a
    family's config (`sizes`: config's keywords) or a config. `init`: None keeps transformers'
    initialisation; a float is its standard deviation (initializer_range); "fan_in" redraws
    every matrix with std 1/sqrt(fan-in), which spreads the logits (greedy tokens far from
    ties)."""
    cfg = config(family_or_config, **sizes) if isinstance(family_or_config, str) \
        else family_or_config
    if isinstance(init, float):
        cfg.initializer_range = init
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if init == "fan_in":
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    elif init is not None and not isinstance(init, float):
        raise KilnError(f"hf_decoder.build: init must be None, a float or 'fan_in', got {init!r}")
    return model.to(dtype).eval()


def llama(layers: int = 1, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
          vocab: int = 96, inter: int = 128, init: float = 0.1, device="cpu"):
    """A Llama of these sizes (seed 0, weights of standard deviation `init`: larger spreads
    the logits), in float32 on `device`. The defaults are a tiny one for tests."""
    model = build("llama", 0, torch.float32, init=float(init), device=device, layers=layers,
                  hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                  intermediate=inter, max_pos=256)
    # set for a static cache: callers wrap it in transformers' static-cache module themselves
    model.generation_config.cache_implementation = "static"
    return model


def static_cache_module(model: torch.nn.Module, max_cache_len: int) -> torch.nn.Module:
    """transformers' static-cache wrapper of `model` (batch 1, cache of max_cache_len, on the
    model's device and in its dtype)."""
    gc = model.generation_config
    gc.use_cache = True
    gc.cache_implementation = "static"
    return TorchExportableModuleWithStaticCache(model, batch_size=1,
                                                max_cache_len=max_cache_len).eval()


def export_decode(module: torch.nn.Module) -> torch.export.ExportedProgram:
    """One decode step (input_ids [1, 1], cache_position [1]) of a static-cache module, on
    the module's device."""
    dev = next(module.parameters()).device
    ids = torch.tensor([[1]], dtype=torch.long, device=dev)
    pos = torch.tensor([0], dtype=torch.long, device=dev)
    # strict (dynamo) export, as transformers' own recipe: the non-strict trace of this
    # wrapper does not survive run_decompositions in this torch
    with torch.no_grad():
        return torch.export.export(module, (), {"input_ids": ids, "cache_position": pos},
                                   strict=True)


def export_step(model: torch.nn.Module, max_cache_len: int, device="cpu",
                dtype: torch.dtype = torch.float32
                ) -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    """(the static-cache module of `model` moved to `device` and `dtype`, its one-token
    program). Exported on `device`: on a GPU in bf16, attention is cuDNN's."""
    module = static_cache_module(model.to(device, dtype), max_cache_len)
    return module, export_decode(module)


def export_decoder(model: torch.nn.Module, max_cache_len: int = 128,
                   max_prompt: int | None = None, sampler: Callable | None = None
                   ) -> dict[str, torch.export.ExportedProgram]:
    """{"prefill": ..., "decode": ...} exported from one static-cache wrapper of `model`,
    for `kiln.compile`. Prefill takes prompts of 1 .. max_prompt (default max_cache_len)
    tokens. `sampler`: also "sample", `sampler(vocab, logits dtype, max_rows)` (CUDA packages:
    `kiln.models.device_sampler.export_sampler`, a user Triton kernel, which
    kiln.runtime.generate then uses to sample on the device)."""
    module = static_cache_module(model, max_cache_len)
    top = max_prompt or max_cache_len
    if not 2 <= top <= max_cache_len:
        raise KilnError(f"hf_decoder: max_prompt must be in [2, max_cache_len={max_cache_len}], "
                        f"got {top}")
    dev = next(module.parameters()).device
    t = Dim("prompt", min=1, max=top)
    prefill = torch.export.export(
        module, (), {"input_ids": torch.zeros(1, 2, dtype=torch.long, device=dev),
                     "cache_position": torch.arange(2, device=dev)},
        dynamic_shapes={"input_ids": {1: t}, "cache_position": {0: t}}, strict=True)
    decode = torch.export.export(
        module, (), {"input_ids": torch.zeros(1, 1, dtype=torch.long, device=dev),
                     "cache_position": torch.tensor([2], device=dev)}, strict=True)
    out = {"prefill": prefill, "decode": decode}
    if sampler is not None:
        name = decode.graph_signature.user_outputs[0]  # after any buffer mutations
        val = next(n for n in decode.graph.nodes if n.name == name).meta["val"]
        out["sample"] = sampler(int(val.shape[-1]), val.dtype, top)
    return out


def eager_step(module: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The eager one-token step of a static-cache module: (input_ids, cache_position) ->
    logits. Of transformers' decoder-only export wrapper, its inner static-cache module: the
    outer forward of some transformers releases drops cache_position."""
    if isinstance(module, TorchExportableModuleForDecoderOnlyLM):
        module = module.model
    return lambda ids, pos: module(input_ids=ids, cache_position=pos)


def greedy_steps(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], prompt: list[int],
                 new_tokens: int, device="cpu") -> tuple[list[int], list[torch.Tensor]]:
    """Feed `prompt` one token at a time through `step(input_ids [1, 1], cache_position [1])
    -> logits [1, 1, V]`, then `new_tokens` greedy tokens; returns the new tokens and the
    logits of every step."""
    tokens, logits = [], []
    nxt = None
    for pos in range(len(prompt) + new_tokens - 1):
        tok = prompt[pos] if pos < len(prompt) else nxt
        out = step(torch.tensor([[tok]], dtype=torch.long, device=device),
                   torch.tensor([pos], dtype=torch.long, device=device))
        logits.append(out.detach().reshape(-1).clone())
        if pos >= len(prompt) - 1:
            nxt = int(out.reshape(-1, out.shape[-1])[-1].argmax())
            tokens.append(nxt)
    return tokens, logits


def greedy(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], prompt: list[int],
           new_tokens: int, device="cpu") -> list[int]:
    """The tokens of `greedy_steps`."""
    return greedy_steps(step, prompt, new_tokens, device)[0]


def reset_caches(module: torch.nn.Module) -> None:
    """Zero the static caches of an eager module (a fresh sequence)."""
    for name, buf in module.named_buffers():
        if "cache" in name:
            buf.zero_()


@torch.no_grad()
def eager_generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int,
                   max_cache_len: int = 128) -> list[int]:
    """Greedy tokens of the same prefill + decode loop in eager (a fresh cache, on the
    model's device): the reference for compiled packages."""
    module = static_cache_module(model, max_cache_len)
    dev = next(module.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    logits = module(input_ids=ids, cache_position=torch.arange(len(prompt), device=dev))
    out: list[int] = []
    pos = len(prompt)
    while len(out) < max_new_tokens:
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        logits = module(input_ids=torch.tensor([[tok]], device=dev),
                        cache_position=torch.tensor([pos], device=dev))
        pos += 1
    return out
