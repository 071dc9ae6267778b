"""Llama decoders from Hugging Face configs (random weights, no downloads) exported with HF's
static-cache wrapper (`transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM`:
one token per call, the KV cache as module state), and a greedy decoding loop over a one-token
step function: shared by the LLM tests and bench/llm_gpu.py. Needs `transformers` (not imported
by the rest of kiln)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM


def llama(layers: int = 1, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
          vocab: int = 96, inter: int = 128, init: float = 0.1, device="cpu"):
    """A LlamaForCausalLM of these sizes, built on `device` (seed 0; `init` the weights'
    standard deviation: larger spreads the logits, so greedy tokens are no near-ties), set for
    a static cache. The defaults are a tiny one for tests."""

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      initializer_range=init)
    torch.manual_seed(0)
    with torch.device(device):
        m = LlamaForCausalLM(cfg).eval()
    m.generation_config.cache_implementation = "static"
    return m


def static_cache_module(model, max_cache_len: int, device="cpu", dtype=torch.float32):
    """(the wrapper module on `device` in `dtype`, its ExportedProgram for one token)."""
    model = model.to(device, dtype)
    w = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len,
                                             device=device)
    ep = w.export(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                  cache_position=torch.zeros(1, dtype=torch.long, device=device))
    return w, ep


def greedy(step, prompt: list[int], new: int, device="cpu") -> list[int]:
    """Greedy tokens from `step(input_ids [1, 1], cache_position [1]) -> logits [1, 1, V]`,
    feeding the prompt one token at a time, then each argmax."""
    out, tok = [], None
    for pos in range(len(prompt) + new - 1):
        t = prompt[pos] if pos < len(prompt) else tok
        logits = step(torch.tensor([[t]], device=device), torch.tensor([pos], device=device))
        tok = int(logits[0, -1].argmax())
        if pos >= len(prompt) - 1:
            out.append(tok)
    return out


def eager_step(w):
    """The eager one-token step of the wrapper from `static_cache_module`: its inner
    static-cache module (the outer forward of some transformers releases drops
    cache_position)."""
    inner = getattr(w, "model", w)
    return lambda ids, pos: inner(input_ids=ids, cache_position=pos)
