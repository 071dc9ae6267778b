"""Fuzzer reproducers (fixed): outputs sharing storage where eager's do not, once the inputs
come in another layout than the export's (issue 16's device run; values were right).

- `kiln fuzz --seed 16 --start 1888 --n 1`: `x.reshape(6).reshape(3, 2)` of a (3, 2) input is a
  whole view of x at export, and the runner returned it as a view of x in any layout; eager's
  first reshape copies a transposed or step-2 x (the dims cannot be merged), so its result
  shares nothing. A whole view whose chain has such a reshape is now a view of a compact input
  only (`"compact_only"`), and a view compact at export may be eager's `v.contiguous()` (a no-op
  there, so not in the graph): a view only when it is contiguous at run time (`"contiguous"`).
- `kiln fuzz --seed 16 --start 2342 --n 1`: `y = x == x` returned as `y.contiguous()` beside
  `chunk(y, 3, 1)[1]`. Compact at export, `contiguous()` leaves no trace in the graph (the
  graph is that of `return y, y[:, 1:2]`); for a transposed x eager lays y out transposed and
  `contiguous()` copies. A sharing between outputs that rests on eager's layout (either output
  compact at export, or a reshape on the way) now holds only when the inputs come with the
  export's strides (`"when_strides"`, kiln/frontend/aliasing.py, kiln/runtime/aliases.py).

Checked by the fuzzer's runner (values against eager and float64, storage sharing both ways)
and directly: kiln never shares where eager does not; for compact inputs exported compact it
shares exactly where eager does."""

import pytest
import torch

import kiln
from kiln.fuzz.runner import check

RESHAPE_TWICE = {'dynamic': False,
 'inputs': [{'dtype': 'float32', 'high': None, 'shape': [3, 2]}],
 'ops': [['chunk', [0], {'dim': 0, 'k': 1, 'n': 2}],
         ['reshape', [0], {'shape': [6]}],
         ['unary', [2], {'fn': 'exp_c'}],
         ['reshape', [2], {'shape': [3, 2]}],
         ['pad', [3], {'pad': [2, 1], 'value': 1.5}]],
 'outputs': [5, 4, 1],
 'params': {},
 'seed': 16001936}

CONTIGUOUS_OF_OUTPUT = {'dim': 'bounded',
 'dynamic': True,
 'inputs': [{'dtype': 'float32', 'high': None, 'shape': ['B', 3]}],
 'ops': [['binary', [0, 0], {'fn': 'eq'}],
         ['reduce', [1], {'dims': [1], 'fn': 'any', 'keep': False}],
         ['contiguous', [1], {}],
         ['linear', [0], {'b': 'p0', 'w': 'p1'}],
         ['binary', [4, 4], {'fn': 'mul'}],
         ['chunk', [1], {'dim': 1, 'k': 1, 'n': 3}]],
 'outputs': [6, 2, 3],
 'params': {'p0': {'init': 'w', 'shape': [16]}, 'p1': {'init': 'w', 'shape': [16, 3]}},
 'seed': 16002390}


def test_fuzz_1888_reshape_twice(tmp_path):
    out = check(RESHAPE_TWICE, tmp_path)
    assert out.status == "ok", out.detail


def test_fuzz_2342_contiguous_of_an_output(tmp_path):
    out = check(CONTIGUOUS_OF_OUTPUT, tmp_path)
    assert out.status == "ok", out.detail


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


def _sharing(outs, inputs) -> list[tuple[int, int]]:
    """Pairs (i, j), i an output, j a later output or (len(outs) + k) input k, on one storage."""
    everything = list(outs) + list(inputs)
    return [(i, j) for i in range(len(outs)) for j in range(i + 1, len(everything))
            if _storage(everything[i]) == _storage(everything[j])]


def _layouts(x):
    yield "contiguous", x
    yield "transposed", x.t().contiguous().t()
    big = torch.zeros(2 * x.shape[0], *x.shape[1:], dtype=x.dtype)
    big[::2] = x
    yield "step", big[::2]


class ReshapeViews(torch.nn.Module):
    """Whole views of x: one through a reshape merging dims (a view of a compact x only), one
    through views any layout allows; and a view of an output through such a reshape."""

    def forward(self, x):
        y = x * 2
        return (x.reshape(-1).reshape(x.shape), x.t().t(), y, y.reshape(-1)[1:],
                x.unsqueeze(0)[0])


class ContiguousOrNot(torch.nn.Module):
    """The same graph at a compact export: eager's sharing differs once y is laid out
    otherwise (y follows x's strides)."""

    def __init__(self, contiguous: bool):
        super().__init__()
        self.contiguous = contiguous

    def forward(self, x):
        y = x.abs()
        return (y.contiguous() if self.contiguous else y), y[:, 1:2], y.t()


def _check_layouts(tmp_path, module, x0, name, exported_compact=True):
    runner = kiln.load(kiln.compile(torch.export.export(module, (x0,))).save(
        tmp_path / f"{name}.kiln"))
    for layout, x in _layouts(torch.randn(x0.shape)):
        got, want = runner(x), module(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        shared_g, shared_w = set(_sharing(got, [x])), set(_sharing(want, [x]))
        assert shared_g <= shared_w, (layout, shared_g - shared_w)  # never where eager does not
        if layout == "contiguous" and exported_compact:
            assert shared_g == shared_w, (layout, shared_w - shared_g)


def test_whole_views_through_a_merging_reshape(tmp_path):
    _check_layouts(tmp_path, ReshapeViews(), torch.randn(4, 6), "reshape")


@pytest.mark.parametrize("contiguous", [True, False])
def test_contiguous_of_an_output_or_not(tmp_path, contiguous):
    _check_layouts(tmp_path, ContiguousOrNot(contiguous), torch.randn(4, 6), "c")


class TransposedContiguous(torch.nn.Module):
    def forward(self, x):
        return x.t().contiguous(), x.t()[1:], x[::2]


def test_contiguous_of_a_view_exported_transposed(tmp_path):
    """x exported transposed: x.t() is contiguous there, so `x.t().contiguous()` is the
    graph of `x.t()`; for a compact x eager's `contiguous()` copies."""
    _check_layouts(tmp_path, TransposedContiguous(), torch.randn(6, 4).t(), "t",
                   exported_compact=False)
