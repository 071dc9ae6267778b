"""Aliases of kiln/models/hf_decoder.py (the one home of the Hugging Face decoder helpers), kept
for existing callers: `llama`, `greedy`, `eager_step`, and `static_cache_module(model,
max_cache_len, device, dtype)` -> (the static-cache module, its one-token program), which is
hf_decoder.export_step."""

from __future__ import annotations

from kiln.models.hf_decoder import eager_step, greedy, llama
from kiln.models.hf_decoder import export_step as static_cache_module

__all__ = ["eager_step", "greedy", "llama", "static_cache_module"]
