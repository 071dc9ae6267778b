"""Size arithmetic used as tensor data (issue 16, item 3 in part): `torch.sym_float` of a
size, powers and true division of sizes (floats), comparisons on sizes (`ge`: bools) and int
arithmetic kiln's size expressions do not model, each a 0-d value computed at run time
(kiln/frontend/sym_values.py). Checked against eager at sizes on both sides of the
comparisons, float32 and float64."""

from __future__ import annotations

import pytest
import torch

import kiln


class SizeMath(torch.nn.Module):
    def forward(self, x):
        n, m = x.shape[0], x.shape[1]
        return (x / torch.sym_float(n), x * n ** 0.5, x * (n >= 5), x + (n * m) / 3,
                x + (n > m), x * ((n - 1) ** 2))


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_size_arithmetic_values_match_eager(tmp_path, dt):
    n = torch.export.Dim("n", min=2, max=64)
    m = torch.export.Dim("m", min=2, max=64)
    x = torch.randn(4, 3, dtype=dt)
    c = kiln.compile(SizeMath(), (x,), dynamic_shapes=({0: n, 1: m},))
    runner = kiln.load(c.save(tmp_path / "s.kiln"))
    for rows, cols in ((2, 3), (5, 5), (9, 4), (64, 2)):
        x = torch.randn(rows, cols, dtype=dt)
        got, want = runner(x), SizeMath()(x)
        for k, (a, w) in enumerate(zip(got, want)):
            assert a.dtype == w.dtype and a.shape == w.shape, k
            torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6, msg=f"output {k}")
