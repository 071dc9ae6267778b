"""A tiny language model with a KV-cache-like state buffer, for the entry-point tests: the
signature of kiln.models.hf_decoder's programs (input_ids [1, T], cache_position [T] ->
logits [1, T, vocab]), compiled in seconds."""

from __future__ import annotations

import copy

import torch
from torch.export import Dim


class ToyLM(torch.nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, max_len: int = 24) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("cache", torch.zeros(max_len, dim))

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids[0])  # [T, dim]
        self.cache.index_copy_(0, cache_position, x)
        n = self.cache.shape[0]
        mask = (torch.arange(n)[None, :] <= cache_position[:, None]).to(x.dtype)  # causal
        ctx = (mask @ self.cache) / mask.sum(1, keepdim=True)
        return self.head(torch.tanh(ctx + x))[None] * 4.0


def entries(model: ToyLM, max_prompt: int = 8) -> dict:
    t = Dim("prompt", min=1, max=max_prompt)
    return {"prefill": (model, (torch.zeros(1, 3, dtype=torch.long), torch.arange(3)),
                        {"input_ids": {1: t}, "cache_position": {0: t}}),
            "decode": (model, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])))}


@torch.no_grad()
def eager_greedy(model: ToyLM, prompt: list[int], n: int) -> list[int]:
    m = copy.deepcopy(model)
    m.cache.zero_()
    logits = m(torch.tensor([prompt]), torch.arange(len(prompt)))
    out = [int(logits[0, -1].argmax())]
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        out.append(int(m(torch.tensor([[out[-1]]]), torch.tensor([pos]))[0, -1].argmax()))
    return out
