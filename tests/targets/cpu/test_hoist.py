"""Loop-invariant statements of a CPU kernel member are printed before its loops
(kernel.py, ExprPrinter.hoisted): an embedding row looked up through an id is tested once per
row and read contiguously inside the simd loop, not gathered per element. Only loops that run
at least once (static sizes) are hoisted out of; dynamic inner sizes keep every statement
inside. Results differential against float64 eager; bad ids still raise."""

from __future__ import annotations

import re

import pytest
import torch

import kiln
from kiln.errors import KilnError


class EmbedNorm(torch.nn.Module):
    """BERT/GPT input: token + position embeddings, then a LayerNorm."""

    def __init__(self, affine: bool = True):
        super().__init__()
        self.tok = torch.nn.Embedding(40, 48)
        self.pos = torch.nn.Embedding(64, 48)
        self.norm = torch.nn.LayerNorm(48, elementwise_affine=affine)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        return self.norm(self.tok(ids) + self.pos(pos))


class Lookup(torch.nn.Module):
    """A pointwise member reading a table row through an id: y + table[ids]."""

    def forward(self, table, ids, y):
        return y + table[ids] * 2.0


def _simd_bodies(src: str) -> list[str]:
    """The text of every `#pragma omp simd` loop (header to closing brace)."""
    lines, out = src.splitlines(), []
    for k, line in enumerate(lines):
        if "#pragma omp simd" not in line:
            continue
        depth, body = 0, []
        for j in range(k + 1, len(lines)):
            body.append(lines[j])
            depth += lines[j].count("{") - lines[j].count("}")
            if depth <= 0 and j > k + 1:
                break
        out.append("\n".join(body))
    return out


def _kernels(c) -> str:
    return "\n".join(t for n, t in c.sources.items() if n.startswith("kernels_"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_embedding_norm_tests_ids_once_per_row(tmp_path, dtype, affine):
    torch.manual_seed(0)
    m = EmbedNorm(affine).eval().to(dtype)
    ids = torch.randint(0, 40, (3, 17))
    c = kiln.compile(m, (ids,), options=kiln.Options(num_threads=1))
    bodies = _simd_bodies(_kernels(c))
    assert bodies
    # the id tests (bad_x...) and the id loads sit before the loops, none inside
    assert not any("bad_x" in b or "buf_ids[" in b for b in bodies), bodies
    assert any(re.search(r"buf_p_tok_weight\[[^\]]*x\d+", b) for b in bodies)  # row read
    r = c.load(tmp_path / "m.kiln")
    want = m.double()(ids)
    got = r(ids)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    bad = ids.clone()
    bad[2, 16] = 40
    with pytest.raises(KilnError, match="index out of range"):
        r(bad)
    torch.testing.assert_close(r(ids).double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dynamic", [False, True])
def test_pointwise_lookup_hoists_only_static_loops(tmp_path, dynamic):
    torch.manual_seed(1)
    table, ids, y = torch.randn(30, 37), torch.randint(-30, 30, (5,)), torch.randn(5, 37)
    dyn = None
    if dynamic:
        d = torch.export.Dim("d", min=2, max=64)
        dyn = ({1: d}, None, {1: d})
    ep = torch.export.export(Lookup(), (table, ids, y), dynamic_shapes=dyn)
    c = kiln.compile(ep, options=kiln.Options(num_threads=1))
    inside = any("bad_x" in b for b in _simd_bodies(_kernels(c)))
    assert inside == dynamic  # a loop that may run zero times keeps its statements
    r = c.load(tmp_path / "m.kiln")
    for width in ([37] if not dynamic else [37, 2, 64]):
        t, yy = torch.randn(30, width), torch.randn(5, width)
        torch.testing.assert_close(r(t, ids, yy).double(),
                                   Lookup()(t.double(), ids, yy.double()),
                                   rtol=1e-6, atol=1e-6)
