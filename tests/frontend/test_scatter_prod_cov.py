"""Complex scatter products (issue 16: they went to the ATen fallback): scatter(reduce=
"multiply") with a tensor or a Python complex number, scatter_reduce("prod") with and
without include_self, through a transposed view; duplicate destinations, with inf, NaN and
zero sources. kiln's CPU put routine multiplies complex values in update order with eager's
contracted textbook product (kiln_lib.h `cput_combine`), so the non-finite pattern of each
part equals eager's; finite values are within 2x eager's distance from complex128 math plus
the dtype's tolerance. The package calls no ATen op."""

from __future__ import annotations

import math

import pytest
import torch

from difftest import Checker, Fn, gen
from test_scan_special_cov import TOL, _compare

C64, C128 = torch.complex64, torch.complex128


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("scatter_prod"))


def _products(x, idx, src):
    return {"reduce_prod": torch.scatter_reduce(x, 1, idx, src, "prod"),
            "prod_no_self": torch.scatter_reduce(x, 1, idx, src, "prod", include_self=False),
            "multiply": torch.scatter(x, 1, idx, src, reduce="multiply"),
            "multiply_value": torch.scatter(x, 0, idx[:2, :6] % 4, 2 - 1j, reduce="multiply"),
            "prod_t": torch.scatter_reduce(x.t(), 0, idx.t(), src.t(), "prod")}


def _inputs(dtype, seed):
    g = gen("scatter_prod", dtype, seed)
    x = torch.randn(4, 6, dtype=dtype, generator=g)
    src = torch.randn(4, 9, dtype=dtype, generator=g)
    src[1, 3] = complex(math.inf, 0)
    src[2, 4] = complex(math.nan, 1)
    src[3, 2] = 0
    src[0, 5] = complex(-math.inf, math.inf)
    idx = torch.randint(0, 6, (4, 9), generator=g)  # (duplicates in each row)
    return x, idx, src


@pytest.mark.parametrize("dtype", (C64, C128), ids=("complex64", "complex128"))
def test_complex_scatter_products(check, dtype):
    assert dtype in TOL
    compiled, runner = check.compile(Fn(_products), _inputs(dtype, 0))
    assert compiled.manifest["requires"]["aten_fallback_ops"] == []
    for seed in range(3):
        args = _inputs(dtype, seed)
        got = runner(*args)
        with torch.no_grad():
            want = _products(*args)
            ref = _products(*(a.to(C128) if a.is_complex() else a for a in args))
        _compare(got, want, ref, f"{dtype} seed {seed}")
