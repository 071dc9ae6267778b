"""Batch > 1 decode with per-sequence positions, built from a Hugging Face decoder's own modules.

transformers' static-cache wrapper (kiln/models/hf_decoder.py) takes one `cache_position`
vector for the whole batch, so sequences of different lengths cannot decode together. This
module keeps the model's embeddings, decoder layers' projections, RMSNorms, MLPs, rotary
frequencies and head, and replaces only the attention's cache part: each layer has a static
cache `k_cache_<i>` / `v_cache_<i>` of shape [B, kv_heads, max_len, head_dim] (registered
buffers: kiln keeps them as the package's mutable state), sequence b writes its keys and
values at its own positions (a scatter along the position dimension), rotary embeddings are
taken at those positions, and each query attends to the cache slots at positions <= its own
(a boolean mask from the positions; GQA: in decode the query heads of each kv head are
grouped as rows against its cache, which is never repeated; in prefill the kv heads are
repeated).

    model = hf_decoder.build("llama")
    progs = export_batched(model, batch=4, max_len=64)       # {"prefill", "decode"}
    runner = kiln.compile(progs).load("b.kiln")
    out = generate_batch(runner, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_new_tokens=8)

Entry points (both share the weights and the caches):
- prefill(input_ids int64 [B, T], lengths int64 [B]) -> logits [B, vocab]: the prompts
  padded to T (any pad id), each sequence's tokens written at positions 0 .. T-1 (the padding
  slots past lengths[b] are masked now and overwritten by that sequence's later tokens); the
  logits are those of each sequence's last real token (position lengths[b] - 1).
- decode(input_ids int64 [B, 1], positions int64 [B]) -> logits [B, vocab]: token b at
  position positions[b].
`BatchedDecoder.forward(input_ids [B, T], positions [B])` -> logits [B, T, vocab] is the
general step (token t of row b at positions[b] + t).

Bad input: the eager module raises InputError (wrong B, positions outside the cache, lengths
outside [1, T]); in a package, kiln's input checks refuse a wrong B or T > max_prompt and its
scatter / gather bounds checks refuse a position past max_len or a length of 0 (KilnError,
no write outside the cache); kiln.runtime.generate_batch checks prompts, their count and
the cache room before running.

Families: Llama, Mistral (without a sliding window) and Qwen2 (without a sliding window): the
same decoder layer (pre-norm attention + gated MLP, rotary on all of the head); others are
refused with an error naming the supported ones. Takes a `transformers` model (this module
imports nothing of transformers itself).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch.export import Dim

from kiln.errors import InputError, KilnError
from kiln.runtime.generation import batched_loop

#: model_type of the supported families
FAMILIES = ("llama", "mistral", "qwen2")


def _check_model(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES or not hasattr(model, "model") or not hasattr(model, "lm_head"):
        raise KilnError(f"batched_decoder: {type(model).__name__} (model_type {kind!r}) is not "
                        f"supported; supported: a *ForCausalLM of {', '.join(FAMILIES)} "
                        "(pre-norm decoder layers with rotary attention on the whole head)")
    window = getattr(cfg, "sliding_window", None)
    if window is not None and (kind != "qwen2" or getattr(cfg, "use_sliding_window", False)):
        raise KilnError(f"batched_decoder: {kind} with sliding_window={window} is not "
                        "supported (attention over the whole cache only); set it to None")
    for i, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            raise KilnError(f"batched_decoder: layer {i} has an attention this module does not "
                            "rebuild (q/k norms or no self_attn)")
    return cfg


class BatchedDecoder(nn.Module):
    """The decoder at batch `batch` with a static cache of `max_len` positions per sequence
    (in the model's dtype, on its device). It shares the model's modules (not copies)."""

    def __init__(self, model: nn.Module, batch: int, max_len: int) -> None:
        super().__init__()
        cfg = _check_model(model)
        if batch < 1:
            raise KilnError(f"batched_decoder: batch must be >= 1, got {batch}")
        if max_len < 2:
            raise KilnError(f"batched_decoder: max_len must be >= 2, got {max_len}")
        inner = model.model
        self.embed_tokens, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary_emb, self.lm_head = inner.rotary_emb, model.lm_head
        self.batch, self.max_len = int(batch), int(max_len)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.vocab = cfg.vocab_size
        mod = importlib.import_module(type(self.layers[0]).__module__)
        self._rope = mod.apply_rotary_pos_emb
        p = next(model.parameters())
        for i in range(len(self.layers)):
            for kv in "kv":
                self.register_buffer(
                    f"{kv}_cache_{i}",
                    torch.zeros(self.batch, self.kv_heads, self.max_len, self.head_dim,
                                dtype=p.dtype, device=p.device), persistent=False)

    def reset(self) -> None:
        """Zero the caches (fresh sequences)."""
        for i in range(len(self.layers)):
            getattr(self, f"k_cache_{i}").zero_()
            getattr(self, f"v_cache_{i}").zero_()

    def check(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """InputError for inputs this module cannot take (eager only: not traced)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch:
            raise InputError(f"batched_decoder: input_ids must be [{self.batch}, T], got "
                             f"{list(input_ids.shape)}")
        if positions.shape != (self.batch,):
            raise InputError(f"batched_decoder: positions must be [{self.batch}], got "
                             f"{list(positions.shape)}")
        t = input_ids.shape[1]
        if t < 1 or positions.min() < 0 or positions.max() + t > self.max_len:
            raise InputError(f"batched_decoder: positions {positions.tolist()} with {t} "
                             f"token(s) per row fall outside the cache of {self.max_len}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T], positions [B] (row b's first token's position) -> [B, T, vocab]."""
        if not torch.compiler.is_compiling() and not _tracing():
            self.check(input_ids, positions)
        return self.lm_head(self._hidden(input_ids, positions))

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        dev = input_ids.device
        pos = positions[:, None] + torch.arange(t, device=dev)                 # [B, T]
        slots = torch.arange(self.max_len, device=dev)
        mask = (slots[None, None, :] <= pos[:, :, None])[:, None]               # [B, 1, T, L]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(x, pos)
        idx = pos[:, None, :, None].expand(b, self.kv_heads, t, self.head_dim)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + self._attention(layer.self_attn, h, cos, sin, idx, mask,
                                    getattr(self, f"k_cache_{i}"),
                                    getattr(self, f"v_cache_{i}"))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def _attention(self, attn: nn.Module, h: torch.Tensor, cos, sin, idx: torch.Tensor,
                   mask: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                   ) -> torch.Tensor:
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        k_cache.scatter_(2, idx, k)      # row b's keys at its own positions, in place
        v_cache.scatter_(2, idx, v)
        rep = self.heads // self.kv_heads
        keys, values = k_cache, v_cache
        if rep > 1 and isinstance(t, int) and t == 1:
            # decode, GQA by grouping: the `rep` query heads of a kv head are `rep` query
            # rows against that kv head's cache (never repeated; query head h = g * rep + r)
            q = q.reshape(b, self.kv_heads, rep, self.head_dim)
            out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                             scale=attn.scaling)
            out = out.reshape(b, self.heads, 1, self.head_dim)
        else:
            # prefill (t tokens, compute-bound): the kv heads repeated (grouping rep * t query
            # rows puts a guard on the dynamic prompt length in torch.export)
            if rep > 1:
                keys = keys.repeat_interleave(rep, dim=1)
                values = values.repeat_interleave(rep, dim=1)
            out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                             scale=attn.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def _tracing() -> bool:
    return detect_fake_mode() is not None


class _Prefill(nn.Module):
    """prefill(input_ids [B, T], lengths [B]) -> logits [B, vocab] of each last real token."""

    def __init__(self, core: BatchedDecoder) -> None:
        super().__init__()
        self.m = core

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        m = self.m
        zero = torch.zeros_like(lengths)
        if not _tracing():
            m.check(input_ids, zero)
            if lengths.min() < 1 or lengths.max() > input_ids.shape[1]:
                raise InputError(f"batched_decoder: lengths {lengths.tolist()} must be in "
                                 f"[1, {input_ids.shape[1]}]")
        h = m._hidden(input_ids, zero)                                        # [B, T, D]
        last = (lengths - 1)[:, None, None].expand(h.shape[0], 1, h.shape[2])
        return m.lm_head(h.gather(1, last)).squeeze(1)


class _Decode(nn.Module):
    """decode(input_ids [B, 1], positions [B]) -> logits [B, vocab]."""

    def __init__(self, core: BatchedDecoder) -> None:
        super().__init__()
        self.m = core

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not _tracing():
            self.m.check(input_ids, positions)
        return self.m.lm_head(self.m._hidden(input_ids, positions)).squeeze(1)


def entries(model_or_core: nn.Module, batch: int | None = None, max_len: int | None = None
            ) -> tuple[nn.Module, nn.Module]:
    """(prefill, decode) eager modules over one BatchedDecoder (built from a model, or given)."""
    core = model_or_core if isinstance(model_or_core, BatchedDecoder) \
        else BatchedDecoder(model_or_core, _need(batch, "batch"), _need(max_len, "max_len"))
    return _Prefill(core).eval(), _Decode(core).eval()


def _need(v: int | None, name: str) -> int:
    if v is None:
        raise KilnError(f"batched_decoder: {name} is required with a model")
    return v


def export_batched(model: nn.Module, batch: int, max_len: int = 128,
                   max_prompt: int | None = None) -> dict[str, torch.export.ExportedProgram]:
    """{"prefill": ..., "decode": ...} of BatchedDecoder(model, batch, max_len) for
    `kiln.compile`: prefill takes padded prompts of 1 .. max_prompt (default max_len) tokens.
    Both programs come from one module, so their weights and caches have the same FQNs (the
    package stores the weights once and keeps one cache per loaded instance)."""
    top = max_prompt or max_len
    if not 2 <= top <= max_len:
        raise KilnError(f"batched_decoder: max_prompt must be in [2, max_len={max_len}], "
                        f"got {top}")
    prefill, decode = entries(model, batch, max_len)
    dev = next(model.parameters()).device
    t = Dim("prompt", min=1, max=top)
    ids = torch.zeros(batch, 2, dtype=torch.long, device=dev)
    lens = torch.full((batch,), 2, dtype=torch.long, device=dev)
    with torch.no_grad():
        p = torch.export.export(prefill, (ids, lens), dynamic_shapes=({1: t}, None))
        d = torch.export.export(decode, (ids[:, :1], lens), dynamic_shapes=None)
    prefill.m.reset()
    return {"prefill": p, "decode": d}


@torch.no_grad()
def eager_generate_batch(model_or_core: nn.Module, prompts: list[list[int]],
                         max_new_tokens: int, batch: int | None = None,
                         max_len: int | None = None, **sampling: Any):
    """kiln.runtime.generate_batch's loop in eager over a BatchedDecoder (given, or built
    from a model at `batch` (default len(prompts)) and `max_len`): a BatchGeneration."""
    if not isinstance(model_or_core, BatchedDecoder):
        batch = batch or len(prompts)
        max_len = max_len or max(map(len, prompts)) + max_new_tokens
    prefill, decode = entries(model_or_core, batch, max_len)
    core = prefill.m
    dev = next(core.parameters()).device
    return batched_loop(prefill, decode, core.reset, core.batch, core.max_len, dev, prompts,
                        max_new_tokens, **sampling)
