"""Data-dependent sizes without an upper bound (issue 16, class 3): `x.item()` used as a size
with no `torch._check(value <= N)`, ops whose result length depends on data with no bound
(`repeat_interleave` with a repeats tensor). The CPU package allocates the buffers such a size
sizes at run time, outside the arena (P.Alloc.heap, P.CallAten.allocs); checked against eager
at 0, at the example value and well above it. Also: numbers returned as Python numbers
(`y.item()` as a float, a comparison on sizes as a bool)."""

from __future__ import annotations

import pytest
import torch

from difftest import Fn

import kiln
import kiln.backend
from kiln.ir import program as P


def _compile(tmp_path, fn, args, **opts):
    cm = kiln.compile(torch.export.export(Fn(fn), args), options=kiln.Options(**opts))
    cm.save(tmp_path / "m.kiln")
    return cm, kiln.load(tmp_path / "m.kiln")


def _same(got, ref, atol: float = 1e-5):
    """`atol`: sums over n data-dependent rows differ from eager's by float32 rounding in
    another order, up to about n * eps * the magnitude of a row."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert type(g) is type(r)
        if isinstance(r, torch.Tensor):
            assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-5, atol=atol, equal_nan=True)


def sized_by_an_item(x, n):
    k = n.item()
    torch._check(k >= 0)  # a lower bound only
    y = torch.ones(k, 3) * x.sum()
    return y, torch.arange(k) * 2, torch.cat([y, y + 1]).sum(0), (y * 2).relu().sum()


def test_item_without_upper_bound_allocates_at_run_time(tmp_path):
    cm, runner = _compile(tmp_path, sized_by_an_item, (torch.randn(4), torch.tensor(3)))
    src = cm.sources["model.cpp"]
    assert "int64_t u0 = 0;  // data-dependent size, no upper bound" in src
    # outputs sized by u0 are allocated at their exact shape once u0 is read
    assert src.index("u0 = static_cast<int64_t>") < src.index("outs[0] = kr::new_output")
    for k in (0, 3, 1, 1000, 5):  # sizes far above the example
        x = torch.randn(4)
        scale = 2 * k * (x.sum().abs().item() + 1)  # the magnitude the cat-sum adds up
        _same(runner(x, torch.tensor(k)), sized_by_an_item(x, torch.tensor(k)),
              atol=max(1e-5, 4 * scale * torch.finfo(torch.float32).eps))
    with pytest.raises(kiln.errors.KilnError, match=r"\.item\(\) is -1, below 0"):
        runner(torch.randn(4), torch.tensor(-1))


def unchecked_item(x, n):
    return torch.zeros(n.item(), 2) + x.sum()


def test_item_without_any_check(tmp_path):
    _, runner = _compile(tmp_path, unchecked_item, (torch.randn(4), torch.tensor(3)))
    for k in (0, 2, 300):
        x = torch.randn(4)
        _same(runner(x, torch.tensor(k)), unchecked_item(x, torch.tensor(k)))


def interleave(x, r):
    # the ATen call's own result (u0 elements) is allocated inside the call, once it returned
    y = torch.repeat_interleave(x, r)
    z = torch.repeat_interleave(r, r).float()
    return y * 2, z.mean(), y.cumsum(0), (z[:, None] * x).sum(0)


def test_result_of_unbounded_length_through_the_aten_fallback(tmp_path):
    cm, runner = _compile(tmp_path, interleave, (torch.randn(4), torch.tensor([1, 2, 0, 3])))
    call = next(x for x in cm.built.program.lines if isinstance(x, P.CallAten))
    assert call.allocs and all(getattr(a, "heap", True) for a in call.allocs)
    for r in ([0, 0, 0, 0], [1, 2, 0, 3], [40, 7, 100, 3], [0, 0, 9, 0]):
        x = torch.randn(4)
        _same(runner(x, torch.tensor(r)), interleave(x, torch.tensor(r)))


def test_unbounded_sizes_through_the_python_printer(tmp_path):
    torch._dynamo.reset()
    made = []

    def backend(gm, inputs):
        made.append(kiln.backend.kiln_backend(gm, inputs))
        return made[-1]

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True,
                                    capture_scalar_outputs=True):
        f = torch.compile(interleave, backend=backend, fullgraph=True)
        for r in ([1, 2, 0, 3], [5, 0, 0, 1]):
            x = torch.randn(4)
            _same(f(x, torch.tensor(r)), interleave(x, torch.tensor(r)))
    assert made and all(hasattr(m, "kiln_compiled") for m in made)


def numbers(x):
    idx = torch.nonzero(x > 0)
    return x * 2, x.sum().item(), idx.shape[0] >= 2, (x > 0).sum().item()


def test_python_numbers_as_outputs(tmp_path):
    cm, runner = _compile(tmp_path, numbers, (torch.randn(6),))
    outs = cm.manifest["outputs"]
    assert outs[1].get("python_number") and outs[2].get("python_number")
    for x in (torch.randn(6), torch.zeros(6), torch.ones(6)):
        got = runner(x)
        _same(got, numbers(x))
        assert isinstance(got[1], float) and isinstance(got[2], bool) and isinstance(got[3], int)


def sliced_by_an_item(x, y, n):
    k = n.item()
    return (x[:k] * 1.0 + y[:k]) * 2


def test_item_read_only_as_an_aten_argument(tmp_path):
    """`x[:k]` with k = n.item(): the slice runs through the ATen fallback with k as its end,
    and only its results' sizes (new symbols) size buffers; the read of k must stay (dead code
    elimination follows the symbols inside ATen arguments; it dropped k and the C++ failed)."""
    cm, runner = _compile(tmp_path, sliced_by_an_item,
                          (torch.randn(64), torch.randn(64), torch.tensor(37)),
                          aten_fallback=True)
    assert "u0 = static_cast<int64_t>" in cm.sources["model.cpp"]
    for k in (37, 0, 64, 5, 100):  # past the end: slice semantics
        x, y = torch.randn(64), torch.randn(64)
        _same(runner(x, y, torch.tensor(k)), sliced_by_an_item(x, y, torch.tensor(k)))
    with pytest.raises(kiln.errors.KilnError, match=r"\.item\(\) is -3, below 0"):
        runner(torch.randn(64), torch.randn(64), torch.tensor(-3))  # the export assumed >= 0
