"""Float matmuls over K = 1 (rotary frequencies times positions, rank-1 updates) lower to one
product per element, a pointwise op fused with its neighbours, not a library call: values
against eager and float64 at several shapes, dtypes, batch broadcasts and strides."""

from __future__ import annotations

import pytest
import torch

import kiln
from tests.difftest import compare, gen


class Outer(torch.nn.Module):
    def forward(self, a, b, c, d):
        # bmm then a pointwise consumer, mm of a transposed view, broadcast batch matmul
        return torch.bmm(a, b) * 2 + 1, a[0] @ b[0].t().t(), torch.matmul(c, d)


@pytest.mark.parametrize("dtype,m,n", [(torch.float32, 7, 5), (torch.float64, 1, 33),
                                       (torch.bfloat16, 64, 1), (torch.float16, 7, 5)])
def test_matmul_over_k1_is_fused_and_matches_eager(tmp_path, dtype, m, n):
    g = gen("outer", m, n)
    shapes = [(3, m, 1), (3, 1, n), (2, 1, m, 1), (4, 1, n)]
    args = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    cm = kiln.compile(torch.export.export(Outer(), tuple(args)))
    assert all(k["kind"] == "cpp" for k in cm.manifest["kernels"]), cm.manifest["kernels"]
    r = cm.load(tmp_path / "o.kiln")
    for _ in range(2):  # fresh inputs, a transposed one among them
        args = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        args[1] = args[1].transpose(1, 2).contiguous().transpose(1, 2)
        want = Outer()(*args)
        want64 = Outer()(*[t.double() for t in args])
        if dtype in (torch.float32, torch.float64):
            compare(r(*args), want, want64)
        else:  # one rounding of the exact product, then eager's 16-bit pointwise ops
            for got, w in zip(r(*args), want):
                assert got.dtype == w.dtype and got.shape == w.shape
                torch.testing.assert_close(got.float(), w.float(), rtol=1e-2, atol=1e-2)
