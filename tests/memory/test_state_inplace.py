"""State buffers updated in place (memory/inplace.py `state_updates`): a scatter of the whole
state into its new value writes the state's own storage (no CopyState) only when nothing reads
the old value afterwards; either way every run matches eager, state carried across runs."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.ir import program as P


class Cache(torch.nn.Module):
    """A cache written at `pos` by index_copy_ (as HF's static cache), read after the write;
    `old`: also read the value from before the write after it (must not be in place)."""

    def __init__(self, rows: int, width: int, dtype, old: bool, dim: int = 0) -> None:
        super().__init__()
        shape = (rows, width) if dim == 0 else (2, rows, width)
        self.register_buffer("cache", torch.zeros(shape, dtype=dtype))
        self.old, self.dim = old, dim

    def forward(self, x, pos):
        before = self.cache.clone() if self.old else None
        self.cache.index_copy_(self.dim, pos, x)
        out = (self.cache.float() * 2).sum(-1)
        if before is not None:
            out = out + before.float().sum(-1)
        return out


def _layout(compiled) -> tuple[list[str], list[str]]:
    lines = list(P.walk(compiled.built.program.lines))
    return ([x.dst for x in lines if isinstance(x, P.CopyState)],
            [x.state for x in lines if isinstance(x, P.Alloc) and x.state is not None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("old,dim", [(False, 0), (True, 0), (False, 1)])
def test_state_update(dtype, old, dim):
    rows, width = 6, 5
    eager = Cache(rows, width, dtype, old, dim)
    shape = (1, width) if dim == 0 else (2, 1, width)
    x0 = torch.randn(shape).to(dtype)
    compiled = kiln.compile(Cache(rows, width, dtype, old, dim), (x0, torch.tensor([0])),
                            options=kiln.Options(num_threads=2))
    copied, inplace = _layout(compiled)
    if old:  # the old value is read after the write: the whole-state copy stays
        assert copied == ["b_cache"] and inplace == []
    else:
        assert copied == [] and inplace == ["b_cache"]
    runner = compiled.load()
    g = torch.Generator().manual_seed(rows + dim)
    for pos in [0, 3, 5, 3, 1]:  # state carried across runs, positions revisited
        x = torch.randn(shape, generator=g).to(dtype)
        p = torch.tensor([pos])
        with torch.no_grad():
            want = eager(x, p)
        got = runner(x, p)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
