"""Shape arithmetic from real models (issue 16, class 7), compiled with dynamic shapes and
compared with eager at several sizes: derived dims (`2 * Dim("h")`, whose symbol is in no input
dim alone), sizes computed by the model as op arguments (`repeat` by a size, an `arange` over a
product of dims), and `x[mask] = v` with one value per selected element."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from difftest import Fn

import kiln


def _compile(tmp_path, fn, args, shapes):
    ep = torch.export.export(Fn(fn), args, dynamic_shapes=shapes)
    kiln.compile(ep).save(tmp_path / "m.kiln")
    return kiln.load(tmp_path / "m.kiln")


def _same(got, ref):
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    for g, r in zip(got, ref, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def pairs(x):
    b, t = x.shape
    return x.view(b, t // 2, 2).sum(-1), x.unfold(1, 2, 2).amax(-1), torch.arange(b * t).view(
        b, t) + x


def test_derived_dim_binds_its_symbol(tmp_path):
    h = Dim("h", min=1, max=32)
    runner = _compile(tmp_path, pairs, (torch.randn(3, 8),),
                      (({0: Dim("b", min=1, max=16), 1: 2 * h},),))
    for shape in ((3, 8), (1, 4), (5, 14), (16, 64)):
        x = torch.randn(shape)
        _same(runner(x), pairs(x))
    with pytest.raises(kiln.errors.InputError, match=r"dim 1"):
        runner(torch.randn(3, 7))  # not 2 * h


def offset_dim(x, y):
    return x[:, 1:] * y


def test_derived_dim_with_an_offset(tmp_path):
    n = Dim("n", min=2, max=40)
    runner = _compile(tmp_path, offset_dim, (torch.randn(2, 6), torch.randn(2, 5)),
                      (({1: n + 1}, {1: n}),))
    for k in (2, 5, 33):
        x, y = torch.randn(2, k + 1), torch.randn(2, k)
        _same(runner(x, y), offset_dim(x, y))


def repeat_by_a_size(x):
    # bloom's alibi: repeat counts that are sizes of the program (FX nodes in the arguments)
    b, t = x.shape
    return x.repeat(1, b).sum(0), x[None].expand(t, b, t).reshape(t, b * t) * 2


def test_sizes_computed_by_the_model_as_arguments(tmp_path):
    runner = _compile(tmp_path, repeat_by_a_size, (torch.randn(3, 5),),
                      (({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},),))
    for shape in ((3, 5), (2, 2), (7, 11)):
        x = torch.randn(shape)
        _same(runner(x), repeat_by_a_size(x))


def put_selected(x, m, v):
    y = x.clone()
    y[m] = v
    return y


def double_positive(x):
    y = x.clone()
    y[y > 0] = y[y > 0] * 2  # one value per selected element
    return y


def put_rows(x, m, v):
    y = x * 1
    y[m] = v  # a mask over the leading dim: one row of v per selected row
    return y + 1


@pytest.mark.parametrize("case", ["values", "computed", "rows"])
def test_index_put_with_a_mask_and_one_value_per_element(tmp_path, case):
    if case == "values":
        m = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
        runner = _compile(tmp_path, put_selected, (torch.randn(6), m, torch.randn(3)),
                          ((None, None, {0: Dim("count", min=0, max=64)}),))
        for m in ([1, 0, 1, 0, 0, 1], [0] * 6, [1] * 6):
            m = torch.tensor(m, dtype=torch.bool)
            args = (torch.randn(6), m, torch.randn(int(m.sum())))
            _same(runner(*args), put_selected(*args))
    elif case == "computed":
        runner = _compile(tmp_path, double_positive, (torch.randn(4, 5),),
                          (({0: Dim.DYNAMIC},),))
        for x in (torch.randn(4, 5), torch.randn(9, 5), -torch.ones(2, 5)):
            _same(runner(x), double_positive(x))
    else:
        m = torch.tensor([True, False, True, True])
        runner = _compile(tmp_path, put_rows, (torch.randn(4, 3), m, torch.randn(3, 3)),
                          ((None, None, {0: Dim("count", min=0, max=64)}),))
        for m in ([1, 1, 0, 0], [0, 0, 0, 1]):
            m = torch.tensor(m, dtype=torch.bool)
            args = (torch.randn(4, 3), m, torch.randn(int(m.sum()), 3))
            _same(runner(*args), put_rows(*args))


def put_columns(x, m, v):
    y = x.clone()
    y[:, m] = v
    return y


def put_inner(x, m, v):
    y = x * 1
    y[:, :, m] = v  # a mask over two inner dims, v broadcast over dim 0
    return y


def accumulate_rows(x, m, v):
    return torch.index_put(x, (m,), v, accumulate=True)


@pytest.mark.parametrize("case", ["columns", "inner"])
def test_index_put_with_a_mask_over_inner_dims(tmp_path, case):
    """x[:, mask] = v and x[:, :, mask2d] = v with one value per selected element: the
    selected elements' dim sits inside v, at a size only the data gives."""
    count = Dim("count", min=0, max=64)
    if case == "columns":
        m = torch.tensor([True, False, True])
        runner = _compile(tmp_path, put_columns, (torch.randn(2, 3), m, torch.randn(2, 2)),
                          ((None, None, {1: count}),))
        for m in ([1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]):
            m = torch.tensor(m, dtype=torch.bool)
            args = (torch.randn(2, 3), m, torch.randn(2, int(m.sum())))
            _same(runner(*args), put_columns(*args))
    else:
        m = torch.rand(3, 4) > 0.5
        runner = _compile(tmp_path, put_inner,
                          (torch.randn(2, 5, 3, 4, 6), m, torch.randn(5, int(m.sum()), 6)),
                          ((None, None, {1: count}),))
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            m = torch.rand(3, 4, generator=g) > 0.5
            args = (torch.randn(2, 5, 3, 4, 6, generator=g), m,
                    torch.randn(5, int(m.sum()), 6, generator=g))
            _same(runner(*args), put_inner(*args))


def accumulate_columns(x, m, v):
    return torch.ops.aten.index_put(x, [None, m], v, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_index_put_accumulate_with_one_value_per_element(tmp_path, dtype):
    """x[mask] += v with one value per selected element: each element is selected at most
    once, so the values add into the selected rows; the others keep x bit for bit (-0, NaN)."""
    def make(shape, g):
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        if dtype == torch.int64:
            return torch.randint(-9, 9, shape, generator=g)
        return torch.randn(shape, generator=g)

    g = torch.Generator().manual_seed(0)
    m = torch.tensor([True, False, True])
    runner = _compile(tmp_path, accumulate_rows, (make((3, 2), g), m, make((2, 2), g)),
                      ((None, None, {0: Dim("count", min=0, max=64)}),))
    for rows in ([1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 1]):
        m = torch.tensor(rows, dtype=torch.bool)
        x = make((len(rows), 2), g)
        if dtype == torch.float32:
            x[0, 0], x[-1, 1] = -0.0, float("nan")
        args = (x, m, make((int(m.sum()), 2), g))
        _bits(runner(*args), accumulate_rows(*args))
    runner = _compile(tmp_path / "columns", accumulate_columns,
                      (make((2, 3), g), m[:3], make((2, int(m[:3].sum())), g)),
                      ((None, None, {1: Dim("count", min=0, max=64)}),))
    for cols in ([1, 0, 1], [0, 0, 0], [1, 1, 1]):
        m = torch.tensor(cols, dtype=torch.bool)
        args = (make((2, 3), g), m, make((2, int(m.sum())), g))
        _bits(runner(*args), accumulate_columns(*args))


def _bits(got, ref):
    """Equal bit for bit (-0 and NaN included): one rounding per element on both sides."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if got.dtype == torch.float32:
        got, ref = got.view(torch.int32), ref.view(torch.int32)
    assert torch.equal(got, ref), (got, ref)
