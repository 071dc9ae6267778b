"""torch's own re-trace to core ATen can fail on a program eager runs: GPT-2 (Hugging Face)
views the output of scaled_dot_product_attention after a transpose, which is a view of the
fused op's output (laid out batch, sequence, head) but not of its math decomposition. kiln then
decomposes keeping the ops it converts directly, and the program compiles and matches eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln


class AttnThenView(torch.nn.Module):
    def __init__(self, heads: int = 4, dim: int = 16):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)
        self.proj = torch.nn.Parameter(torch.randn(heads * dim, heads * dim) / 8)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(self.heads * self.dim, dim=2)
        q, k, v = (t.view(b, s, -1, self.dim).transpose(1, 2) for t in (q, k, v))
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
        o = o.reshape(b, -1, s, self.dim).transpose(1, 2).reshape(b, s, -1)
        return self.drop(o.view(-1, o.size(-1)) @ self.proj)  # a view, as GPT-2's Conv1D


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_program_whose_full_decomposition_fails_compiles_and_matches(tmp_path):
    torch.manual_seed(0)
    m = AttnThenView().eval()
    ep = torch.export.export(m, (torch.randn(2, 16, 64),))
    # torch 2.13's ep.run_decompositions() raises "Cannot view a tensor with shape ..." here
    runner = kiln.compile(ep).load(tmp_path / "attn.kiln")
    for _ in range(2):
        x = torch.randn(2, 16, 64)
        torch.testing.assert_close(runner(x), m(x), rtol=1e-4, atol=1e-5)
