"""masked_select and boolean-mask indexing in kiln's own code (issue 16: both went to the ATen
fallback on every target): nonzero of the mask (broadcast for masked_select) gives the
selected positions in row-major order, a flat index into the mask's dims, which gathers from
x viewed with those dims merged (frontend/aten_library.py `_selected`). Masks over leading
dims, inner dims (x[:, mask]) and all dims, broadcast masks, transposed and step-2 operands,
int / bool / float16 values, empty, partial and full selections, results used by later kiln
ops, dynamic shapes: equal to eager bit for bit, and the package calls no ATen op. (CUDA:
tests/targets/cuda/test_cuda_scan_cov.py runs the same forms in Triton's interpreter.)"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

from difftest import Checker, Fn, gen


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("masked_select"))


def selects(x, m, m2, m3, h):
    return {"ms": torch.masked_select(x, x > 0), "ms_bcast": torch.masked_select(x, m3),
            "ms_t": torch.masked_select(x.transpose(0, 2), m3.transpose(0, 2)),
            "lead": x[m], "lead2": x[m2[:4]], "inner": x[:, m2[0]],
            "all": x[x > 0.5], "step": x[:, ::2][m], "ints": (x > 0).long()[m],
            "bools": (x > 0)[:, m2[1]], "half": h[h > 0], "used": x[m].sum(0) * 2 + 1,
            "ms_used": (torch.masked_select(x, m3) ** 2).sum()}


def _inputs(seed: int, p: float = 0.5):
    g = gen("masked_select", seed)
    x = torch.randn(4, 6, 3, generator=g)
    m = torch.rand(4, generator=g) < p
    m2 = torch.rand(5, 6, generator=g) < p
    m3 = torch.rand(4, 1, 3, generator=g) < p
    h = torch.randn(9, generator=g).to(torch.float16)
    return x, m, m2, m3, h


def _check(got, want):
    """Selected values bit for bit; the sums over them (another order) within 1e-6."""
    for (k, w), g in zip(pytree.tree_leaves_with_path(want), pytree.tree_leaves(got)):
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.shape, w.shape)
        if "used" in str(k) or "'s'" in str(k):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(g, w), k


def test_masked_select_and_bool_index_native(check):
    compiled, runner = check.compile(Fn(selects), _inputs(0))
    assert compiled.manifest["requires"]["aten_fallback_ops"] == []
    for seed, p in ((1, 0.5), (2, 0.0), (3, 1.0)):  # some, none, all
        args = _inputs(seed, p)
        _check(runner(*args), selects(*args))


def test_masked_select_dynamic_shapes(check):
    def f(x, m):
        return {"ms": torch.masked_select(x, m), "b": x[m[:, 0]], "s": x[m].sum()}
    g = gen("masked_select", 9)
    dims = ({0: Dim("a", min=1, max=64)}, {0: Dim("a", min=1, max=64)})
    x, m = torch.randn(6, 5, generator=g), torch.rand(6, 5, generator=g) < 0.5
    compiled, runner = check.compile(Fn(f), (x, m), dynamic_shapes=dims)
    assert compiled.manifest["requires"]["aten_fallback_ops"] == []
    for n in (1, 6, 40):
        x, m = torch.randn(n, 5, generator=g), torch.rand(n, 5, generator=g) < 0.5
        _check(runner(x, m), f(x, m))
