"""Grouped matrix products that mixture-of-experts layers export: Hugging Face's
`transformers::grouped_mm_fallback` (defined here with the same schema and body when
transformers is not installed) and `aten._grouped_mm` (2-D x 3-D with offsets), against eager
at several group layouts: empty groups, all rows in one group, rows past the last offset."""

from __future__ import annotations

import pytest
import torch

import kiln


def _reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def _hf_op():
    if not hasattr(torch.ops, "transformers") or \
            not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        torch.library.custom_op("transformers::grouped_mm_fallback", mutates_args=())(
            _reference).register_fake(
            lambda x, w, offs: x.new_empty(x.shape[0], w.shape[2]))
    return torch.ops.transformers.grouped_mm_fallback


class Experts(torch.nn.Module):
    def __init__(self, op, groups=4, k=16, n=24):
        super().__init__()
        self.op = op
        self.w = torch.nn.Parameter(torch.randn(groups, k, n) / 4)

    def forward(self, x, offs):
        return self.op(x, self.w, offs) * 2


OFFS = [[3, 3, 7, 10], [0, 0, 0, 10], [10, 10, 10, 10], [1, 4, 6, 8], [0, 0, 0, 0]]


@pytest.mark.parametrize("which,dtype", [("transformers", torch.float32),
                                         ("aten", torch.bfloat16)])
def test_grouped_mm_matches_eager(tmp_path, which, dtype):
    """aten._grouped_mm runs in eager for bfloat16 only; the reference is float64 math."""
    torch.manual_seed(0)
    op = torch._grouped_mm if which == "aten" else _hf_op()
    m = Experts(op).eval().to(dtype)
    dt = torch.int32 if which == "aten" else torch.int64
    x0 = torch.randn(10, 16, dtype=dtype)
    ep = torch.export.export(m, (x0, torch.tensor(OFFS[0], dtype=dt)))
    runner = kiln.compile(ep).load(tmp_path / "experts.kiln")
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for offs in OFFS:
        x, o = torch.randn(10, 16).to(dtype), torch.tensor(offs, dtype=dt)
        want = _reference(x.double(), m.w.detach().double(), o) * 2
        torch.testing.assert_close(runner(x, o).double(), want, **tol)
