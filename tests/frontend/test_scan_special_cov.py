"""cumsum / cumprod / logcumsumexp / prod with inf, -inf, NaN and zeros in the middle of the
sequence (issue 16), real and complex, on the CPU, against eager and float64 math.

Eager's CPU scans are sequential loops (cumsum / cumprod / logcumsumexp accumulate in
acc_type: double, complex<double>), and so is its prod reduction for rows shorter than four
vectors (in the element type). Where a product meets an infinity, the order decides the NaN
pattern of a complex result ((0.5+0.5i)(2-i)(inf+0i) is inf+inf i left to right, inf+NaN i
from the right), so kiln's CPU code multiplies complex values left to right too (kiln_lib.h
`scan_complex`; a pairwise tree did not match eager before). Rules checked per element:
- the non-finite pattern (NaN, +inf, -inf; each part of a complex value) equals eager's;
- finite values are within 2x eager's distance from float64 math (complex128) plus the dtype's
  tolerance.
Eager is not one order for complex prod over rows of four vectors or more (its vectorised
reduction keeps several accumulators, the count depending on the CPU's vector width): there
kiln is checked against float64 math in left-to-right order instead (`test_long_complex_prod`).
Inputs: rows of odd length with each special value at the first, a middle and the last
position and pairs of them, read through transposed and step-2 views, static and dynamic sizes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.export import Dim

from difftest import Checker, Fn, gen

from kiln.ir.interp import _fma

INF, NAN = math.inf, math.nan
REAL = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
COMPLEX = (torch.complex64, torch.complex128)
TOL = {torch.float32: 1.3e-6, torch.float64: 1e-7, torch.bfloat16: 1.6e-2,
       torch.float16: 1e-3, torch.complex64: 1.3e-6, torch.complex128: 1e-7}


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("scan_special"))


def _rows(n: int, seed: int) -> torch.Tensor:
    """float64 rows of length n: random finite values in [-2, 2] (none near 0), each special
    value at positions 0, n // 2 and n - 1, and pairs (inf then 0, 0 then inf, inf then -inf,
    NaN then 0, two infs, two zeros)."""
    g = gen("scan_special", n, seed)
    specials = (INF, -INF, NAN, 0.0, -0.0)
    pairs = ((INF, 0.0), (0.0, INF), (INF, -INF), (NAN, 0.0), (-INF, -INF), (INF, INF),
             (0.0, -0.0))
    count = len(specials) * 3 + len(pairs) + 2
    base = torch.rand(count, n, generator=g, dtype=torch.float64) * 1.5 + 0.5
    base = base * torch.where(torch.rand(count, n, generator=g) < 0.5, -1.0, 1.0)
    r = 0
    for s in specials:
        for pos in (0, n // 2, n - 1):
            base[r, pos] = s
            r += 1
    for a, b_ in pairs:
        base[r, 1], base[r, n - 2] = a, b_
        r += 1
    return base  # (the last two rows: all finite)


def _inputs(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    re = _rows(n, seed)
    if not dtype.is_complex:
        return re.to(dtype)
    im = _rows(n, seed + 100).roll(5, 0)
    # specials in the real part, the imaginary part, both, and with a zero other part
    return torch.cat([torch.complex(re, im), torch.complex(im, re),
                      torch.complex(re, torch.zeros_like(re)),
                      torch.complex(torch.zeros_like(re), re), torch.complex(re, re)]).to(dtype)


def _scans(x):
    return {"cumsum": x.cumsum(1), "cumprod": x.cumprod(1), "lcse": torch.logcumsumexp(x, 1),
            "prod": x.prod(1), "prod0_keep": x.t().prod(0, keepdim=True),
            "cumprod_t": x.t().cumprod(0), "cumsum_t": x.t().cumsum(0),
            "lcse_t": torch.logcumsumexp(x.t(), 0), "cumprod_step": x[:, ::2].cumprod(1),
            "prod_step": x[:, 1::2].prod(1), "prod_all": x[-4:].prod()}


def _parts(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _compare(got: dict, want: dict, ref: dict, what: str) -> None:
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, g.shape, w.shape)
        g, w = _parts(g).double(), _parts(w).double()
        r = _parts(ref[k]).double()
        for name, mask in (("NaN", torch.isnan), ("+inf", lambda t: t == INF),
                           ("-inf", lambda t: t == -INF)):
            bad = (mask(g) != mask(w)).nonzero()
            assert not len(bad), (what, k, name, bad[:4].tolist(),
                                  g[tuple(bad[0])].item(), w[tuple(bad[0])].item())
        fin = torch.isfinite(g) & torch.isfinite(w) & torch.isfinite(r)
        tol = TOL[want[k].dtype]
        bound = 2 * (w - r).abs() + tol * (r.abs() + 1)
        over = (fin & ((g - r).abs() > bound)).nonzero()
        assert not len(over), (what, k, over[:4].tolist(), g[tuple(over[0])].item(),
                               w[tuple(over[0])].item(), r[tuple(over[0])].item())


def _wide(dtype):
    return torch.complex128 if dtype.is_complex else torch.float64


@pytest.mark.parametrize("dtype", REAL + COMPLEX, ids=lambda d: str(d).split(".")[1])
def test_scans_with_special_values(check, dtype):
    """Static sizes (rows of 7), three draws: the non-finite pattern equals eager's, finite
    values as close to float64 math as eager's (see the module doc)."""
    fn = Fn(_scans)
    _, runner = check.compile(fn, (_inputs(dtype, 7, 0),))
    for seed in range(3):
        x = _inputs(dtype, 7, seed)
        got = runner(x)
        with torch.no_grad():
            want, ref = _scans(x), _scans(x.to(_wide(dtype)))
        _compare(got, want, ref, f"{dtype} seed {seed}")


@pytest.mark.parametrize("dtype", (torch.float32,) + COMPLEX, ids=lambda d: str(d).split(".")[1])
def test_scans_dynamic_size(check, dtype):
    """The scanned dim dynamic (compiled at 6, run at 3, 5, 7: below eight, where eager's
    complex128 prod is still its left-to-right loop with AVX2's vectors): the same rules."""
    def f(x):
        return {"cumprod": x.cumprod(1), "prod": x.prod(1), "cumsum": x.cumsum(1),
                "lcse": torch.logcumsumexp(x, 1)}
    x = _inputs(dtype, 6, 0)
    _, runner = check.compile(Fn(f), (x,), dynamic_shapes=({1: Dim("n", min=2, max=64)},))
    for n in (3, 5, 7):
        x = _inputs(dtype, n, n)
        got = runner(x)
        with torch.no_grad():
            want, ref = f(x), f(x.to(_wide(dtype)))
        _compare(got, want, ref, f"{dtype} n={n}")


def _fold(x: torch.Tensor) -> torch.Tensor:
    """Left-to-right product of each row of complex x from 1 + 0i in x's own precision, each
    step eager's contracted textbook product (re = fma(a, c, -bd), im = fma(a, d, bc); fmas
    rounded once, in exact rational arithmetic)."""
    own = np.float32 if x.dtype == torch.complex64 else np.float64
    out = []
    with np.errstate(all="ignore"):
        for row in x.tolist():
            ar, ai = own(1), own(0)
            for v in row:
                c, d = own(v.real), own(v.imag)
                ar, ai = _fma(ar, c, -(ai * d), own), _fma(ar, d, ai * c, own)
            out.append(complex(ar, ai))
    return torch.tensor(out, dtype=x.dtype)


@pytest.mark.parametrize("dtype", COMPLEX, ids=lambda d: str(d).split(".")[1])
def test_long_complex_prod(check, dtype):
    """Rows of 40: eager's vectorised reduction has its own order (machine-dependent), so
    kiln's product (left to right, eager's order for short rows) is checked against that
    order's math (`_fold`): the same non-finite pattern, finite values within the dtype's
    tolerance times the row length."""
    x = _inputs(dtype, 40, 0)
    _, runner = check.compile(Fn(lambda t: t.prod(1)), (x,))
    got = torch.view_as_real(runner(x)).double()
    ref = torch.view_as_real(_fold(x)).double()
    for mask in (torch.isnan, lambda t: t == INF, lambda t: t == -INF):
        assert torch.equal(mask(got), mask(ref))
    fin = torch.isfinite(ref)
    assert torch.allclose(got[fin], ref[fin], rtol=40 * TOL[dtype], atol=0)
