"""Regression tests for wrong 16-bit answers found by the OpInfo dtype sweep
(`bench/opinfo_sweep.py --dtypes float16,bfloat16,...`, docs/coverage.md).

Each compares kiln with eager and with a float64 reference on the upcast inputs (test_half's
rule: kiln's error may exceed eager's by two units in the last place of the half type), at
several shapes, both 16-bit types, and non-contiguous inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftest import Checker, Fn, gen, rand
from test_half import HALVES, _ids, _run


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("lowp_opinfo"))


def _group_norms(x1, w1, b1, x2, w2, b2, x3):
    y1, mean1, rstd1 = torch.ops.aten.native_group_norm(x1, w1, b1, 2, 6, 5, 3, 0.5)
    return {"y1": y1, "mean1": mean1, "rstd1": rstd1,
            "y2": F.group_norm(x2, 2, w2, b2, eps=1e-5),
            "y3": F.group_norm(x3, 4, None, None),
            "y3_weight_only": F.group_norm(x3, 2, torch.ones_like(x3[0, :, 0]) * 3)}


@pytest.mark.parametrize("dtype", HALVES, ids=_ids)
def test_group_norm_rounds_once(check, dtype):
    """native_group_norm normalises in float32 and rounds y once, as eager does (it rounded
    the normalised value to the half type at the view before the affine: 3 ulps off)."""
    def inputs(seed):
        g = gen("group_norm", dtype, seed)
        x2 = rand((1, 4, 3, 3), dtype, g, -3, 3).to(memory_format=torch.channels_last)
        x3 = rand((8, 3, 7), dtype, g, -3, 3).transpose(0, 1)  # strided: (3, 8, 7)
        return (rand((2, 6, 5), dtype, g, -3, 3), rand((6,), dtype, g, -3, 3),
                rand((6,), dtype, g, -1, 1), x2, rand((4,), dtype, g, -3, 3),
                rand((4,), dtype, g, -1, 1), x3)
    _run(check, Fn(_group_norms), inputs(0), dtype, "group_norm",
         more=[inputs(k) for k in range(1, 6)])


def _addmms(x1, a1, b1, x2, a2, b2, xn):
    return {"ab": torch.addmm(x1, a1, b1, alpha=2 + 3j, beta=1 + 2j),
            "row_bias": torch.addmm(x2, a2, b2, alpha=0.5, beta=-1j),
            "scalar_bias": torch.addmm(x2[:1], a2, b2, alpha=1j),
            "beta0_nan": torch.addmm(xn, a2, b2, beta=0, alpha=-2),  # x ignored, NaN too
            "plain": torch.addmm(x1, a1, b1)}


@pytest.mark.parametrize("dtype", (torch.complex64, torch.complex128), ids=_ids)
def test_complex_addmm_scalars(check, dtype):
    """Complex addmm with alpha / beta (Python complex numbers the ATen fallback cannot pass):
    rewritten as beta * x + alpha * (a @ b) (scalar_ops.py; torch's decomposition left
    prims.mul behind and the op was refused). Compared with eager and complex128."""
    def inputs(seed):
        g = gen("addmm", dtype, seed)
        r = lambda *s: torch.randn(*s, dtype=dtype, generator=g)  # noqa: E731
        xn = r(4, 5)
        xn[0, 0] = complex("nan")
        return (r(2, 3), r(2, 2), r(3, 2).t(), r(5), r(6, 4).t(), r(6, 5), xn)
    _, runner = check.compile(Fn(_addmms), inputs(0))
    for seed in range(3):
        args = inputs(seed)
        got, want = runner(*args), _addmms(*args)
        ref = _addmms(*[a.to(torch.complex128) for a in args])
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            err_k = (got[k].to(torch.complex128) - ref[k]).abs()
            err_e = (want[k].to(torch.complex128) - ref[k]).abs()
            eps = torch.finfo(dtype).eps
            assert bool((err_k <= 2 * err_e + 8 * eps * (ref[k].abs() + 1)).all()), \
                (k, seed, float(err_k.max()), float(err_e.max()))


def _complex_fills(x, y):
    return {"pad": torch.constant_pad_nd(x, (1, 2), 1.5),
            "pad_crop": torch.constant_pad_nd(y, (1, -1, 0, 2), 1 - 2j),
            "pad_zero": F.pad(y, (0, 0, 2, 0)),
            "full": torch.full((2, 3), 1 + 2j), "full_dt": torch.full((4,), 2.0, dtype=x.dtype),
            "full_like": torch.full_like(y, 2 - 1j), "full_like_real": torch.full_like(x, 3.0),
            "scalar_tensor": torch.scalar_tensor(-0.5 + 1j, dtype=x.dtype),
            "fill_used": x * torch.full_like(x, 0.5j)}


@pytest.mark.parametrize(("dtype", "shape"), [(torch.complex64, (2, 3)),
                                              (torch.complex128, (1, 5, 4))], ids=_ids)
def test_complex_fills_and_pads(check, dtype, shape):
    """Complex full / full_like / scalar_tensor / constant_pad_nd (a complex fill value has no
    encoding in torch's stable C interface: the ops were refused, and constant_pad_nd crashed
    in torch's in-place decomposition): two real ops joined by `complex`. Exact vs eager."""
    g = gen("complex_fills", dtype, shape)
    x = torch.randn(shape, dtype=dtype, generator=g)
    y = torch.randn(shape[::-1], dtype=dtype, generator=g).transpose(0, -1)  # strided
    _, runner = check.compile(Fn(_complex_fills), (x, y))
    for k in range(2):
        a = (x * (k + 1), y - k)
        got, want = runner(*a), _complex_fills(*a)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            assert torch.equal(got[name], want[name]), name


def _complex_vars(x, y):
    return {"all": torch.var(x, correction=1), "dim": torch.var(x, 1, correction=0),
            "dims_keep": torch.var(y, (0, -1), correction=2, keepdim=True),
            "default": torch.var(y, -1)}


@pytest.mark.parametrize(("dtype", "shape"), [(torch.complex64, (3, 5, 4)),
                                              (torch.complex128, (2, 7, 3))], ids=_ids)
def test_complex_var_correction(check, dtype, shape):
    """Complex var with a correction (a Scalar the ATen fallback cannot pass: refused) as
    var(real) + var(imag). Compared with eager and complex128."""
    g = gen("complex_var", dtype, shape)
    x = torch.randn(shape, dtype=dtype, generator=g) * 3 + (1 + 2j)
    y = torch.randn(shape[::-1], dtype=dtype, generator=g).transpose(0, -1)  # strided
    _, runner = check.compile(Fn(_complex_vars), (x, y))
    got, want = runner(x, y), _complex_vars(x, y)
    ref = _complex_vars(x.to(torch.complex128), y.to(torch.complex128))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        err_k, err_e = (got[k].double() - ref[k]).abs(), (want[k].double() - ref[k]).abs()
        eps = torch.finfo(got[k].dtype).eps
        assert bool((err_k <= 2 * err_e + 8 * eps * ref[k].abs()).all()), (k, err_k.max())


def _complex_moves(x, y):
    a, b = torch.split_with_sizes(x, [1, x.shape[0] - 1], 0)
    c = torch.split(y, 2, 1)
    return {"a": a, "b": b, "c0": c[0], "c_last": c[-1], "flip": torch.flip(x, (0, -1)),
            "as_strided": torch.as_strided(x, (2, 2), (1, 2), 1),
            "diagonal": torch.diagonal(y, 1), "computed": b * 2}


@pytest.mark.parametrize(("dtype", "shape"), [(torch.complex64, (3, 4)),
                                              (torch.complex128, (5, 7))], ids=_ids)
def test_complex_moves(check, dtype, shape):
    """split / split_with_sizes / as_strided / flip / diagonal only move complex elements: kiln
    lowers them (they went to the ATen fallback, which refused split's list of results).
    Exact vs eager, on a contiguous and a transposed input."""
    g = gen("complex_moves", dtype, shape)
    x = torch.randn(shape, dtype=dtype, generator=g)
    y = torch.randn(shape, dtype=dtype, generator=g).t()  # strided
    compiled, runner = check.compile(Fn(_complex_moves), (x, y))
    # (the complex `b * 2` is kiln's own too: tests/frontend/test_complex_native.py)
    assert compiled.manifest["requires"]["aten_fallback_ops"] == []
    got, want = runner(x, y), _complex_moves(x, y)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
