"""Aliases of kiln/models/hf_decoder.py (the one home of the Hugging Face decoder helpers) under
the names bench/llm_cpu.py uses: `build_model(family, dtype, seed, **sizes)` is
hf_decoder.build with init="fan_in" (logits far apart), `static_module` is
hf_decoder.static_cache_module, `greedy` returns (tokens, logits) (hf_decoder.greedy_steps)."""
from __future__ import annotations

import torch

from kiln.models.hf_decoder import (FAMILIES, config, export_decode, reset_caches,  # noqa: F401
                                    static_cache_module as static_module)
from kiln.models.hf_decoder import build, greedy_steps as greedy  # noqa: F401


def build_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **size):
    """A causal LM of `family` with random weights (seeded, std 1/sqrt(fan-in))."""
    return build(family, seed, dtype, init="fan_in", **size)
