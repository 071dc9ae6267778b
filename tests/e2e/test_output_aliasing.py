"""Outputs that share storage in eager (issue 16, class 2) share it through the Python runner:
`return x, x`, `return y, y`, `return y, y[1:]`, `return y, y.t()`, a view of an input. The
manifest records each such output as a view (base input or output, sizes, strides, offset;
kiln/frontend/aliasing.py) and the runner returns views of the base (kiln/runtime/loader.py
`_share_storage`). Checked against eager at several sizes and dtypes: the values, the strides
and storage offsets, that the storage is the base's (a write through one output shows in the
other exactly as in eager), and that outputs eager does not alias stay separate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln


class Views(torch.nn.Module):
    def forward(self, x):
        y = x * 2 + 1
        z = x.sum(1)
        return x, x, y, y, y[1:], y.t(), x.view(-1), y.t()[0], y[:, ::2], z, x[1:].t()


class Nested(torch.nn.Module):
    def forward(self, x, n):
        y = x.abs()
        return {"y": y, "rows": y[1:n.shape[0]], "first": (y[0], x.unsqueeze(0))}


class NotAliased(torch.nn.Module):
    """Eager shares storage here too: the root of y.t() and y[0] is not returned (kiln keeps
    copies); w is laid out transposed by eager and compactly by kiln, so w[1] is the view
    `select` makes of a compact w (the chain replayed, not the metadata's strides)."""

    def forward(self, x):
        y = x + 1
        w = x.t() * 3
        return y.t(), y[0], w, w[1]


class MatmulViews(torch.nn.Module):
    """A 4-D matmul's result is eager's view of a bmm no output returns: the first output that
    views all of it stands in for the root (found by the fuzzer)."""

    def forward(self, x):
        m = x @ x.transpose(-1, -2)
        return m.select(1, 1), m, m, m[:, 0]


class SplitViews(torch.nn.Module):
    """Views taken through ops with several results (chunk, split, unbind): getitem of a list
    whose elements alias the op's input."""

    def forward(self, x):
        y = x * 2
        return torch.chunk(x, 1, 1)[0], torch.split(x, 2, 1)[1], y, torch.unbind(y, 1)[2]


B = torch.export.Dim("B", min=3, max=64)


def _compile(tmp_path, module, args, dynamic):
    c = kiln.compile(module, args, dynamic_shapes=dynamic)
    return c, kiln.load(c.save(tmp_path / f"{type(module).__name__}.kiln"))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _same_sharing(got, want, inputs) -> None:
    """Values, strides and offsets as eager; outputs (and inputs) share storage with exactly
    the tensors eager's share it with, and a write through one shows in the others."""
    got, want = list(got), list(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    everything_g, everything_w = got + list(inputs), want + list(inputs)
    for i, (a, b) in enumerate(zip(everything_g, everything_w)):
        for k in range(i + 1, len(everything_g)):
            shared_w = _storage(b) == _storage(everything_w[k])
            assert (_storage(a) == _storage(everything_g[k])) == shared_w, (i, k)
            if shared_w and i < len(got):
                assert (a is everything_g[k]) == (b is everything_w[k]), (i, k)
    for g, w in zip(got, want):
        if any(_storage(w) == _storage(o) for o in want if o is not w):
            assert g.stride() == w.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_views_of_outputs_and_inputs(tmp_path, dtype):
    make = (lambda *s: torch.randn(*s)) if dtype.is_floating_point else \
        (lambda *s: torch.randint(-50, 50, s))
    c, runner = _compile(tmp_path, Views(), (make(4, 6).to(dtype),), ({0: B},))
    aliases = [o.get("alias") for o in c.manifest["outputs"]]
    assert aliases[0]["of"] == "input" and aliases[1]["of"] == "input"
    # y is compact at export: `return y, y` is also the graph of `return y, y.contiguous()`,
    # so the sharing holds for the export's input strides (eager's y is compact then)
    assert aliases[2] is None and aliases[3] == {"of": "output", "index": 2, "sizes": ["s0", 6],
                                                  "strides": [6, 1], "offset": 0, "same": True,
                                                  "when_strides": [[6, 1]]}
    assert aliases[4]["offset"] == 6 and aliases[9] is None
    for n in (3, 4, 17):
        x = make(n, 6).to(dtype)
        got, want = runner(x), Views()(x)
        _same_sharing(got, want, [x])
        assert got[0] is x and got[2] is got[3]
        # a write through one output reaches the others as in eager
        got[2][1, 0] = 100
        want[2][1, 0] = 100
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_nested_outputs_and_int_symbols(tmp_path):
    m = Nested()
    x, n = torch.randn(7, 3), torch.zeros(4)
    rows = torch.export.Dim("rows", min=6, max=64)
    c, runner = _compile(tmp_path, m, (x, n), ({0: rows}, {0: torch.export.Dim("n", min=3,
                                                                                  max=6)}))
    assert c.manifest["outputs"][1]["alias"]["sizes"] == ["s1 - 1", 3]
    for rows, k in ((6, 3), (9, 5)):
        x, n = torch.randn(rows, 3), torch.zeros(k)
        got, want = runner(x, n), m(x, n)
        flat_g = [got["y"], got["rows"], *got["first"]]
        flat_w = [want["y"], want["rows"], *want["first"]]
        _same_sharing(flat_g, flat_w, [x, n])


def test_outputs_eager_lays_out_otherwise_keep_their_storage(tmp_path):
    c, runner = _compile(tmp_path, NotAliased(), (torch.randn(4, 5),), ({0: B},))
    aliases = [o.get("alias") for o in c.manifest["outputs"]]
    assert aliases[:3] == [None, None, None]
    assert aliases[3] == {"of": "output", "index": 2, "sizes": ["s0"], "strides": [1],
                          "offset": "s0"}  # w[1] of a compact (5, s0) w
    for n in (3, 7):
        x = torch.randn(n, 5)
        got, want = runner(x), NotAliased()(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert len({_storage(g) for g in got[:3]}) == 3 and _storage(got[3]) == _storage(got[2])
        got[2][1, 0] = 5.0  # a write through w shows in w[1], as in eager
        assert got[3][0] == 5.0


def test_views_of_inputs_in_other_layouts(tmp_path):
    """A transposed input is copied in compact: its view stays a copy with eager's values, and
    `return x` (exported compact: also the graph of `x.contiguous()`) is that compact copy; a
    numpy input's view shares the array's memory."""
    _, runner = _compile(tmp_path, Views(), (torch.randn(4, 6),), ({0: B},))
    xt = torch.randn(6, 5).t()
    got, want = runner(xt), Views()(xt.contiguous())  # eager's x.view(-1) refuses xt
    assert got[0] is not xt and got[0].is_contiguous() and _storage(got[0]) != _storage(xt)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    a = np.random.default_rng(0).standard_normal((5, 6), dtype=np.float32)
    got = runner(a)
    assert np.shares_memory(got[6].numpy(), a)
    got[6][0] = 42.0
    assert a[0, 0] == 42.0


class MayAlias(torch.nn.Module):
    """reshape's schema says "may alias": a view where the strides allow one, else a copy."""

    def forward(self, x):
        return x, x.t().reshape(-1), x.reshape(-1), x.t().flatten()


@pytest.mark.parametrize("shape", [(3, 5), (4, 1), (2, 7)])
def test_reshape_that_copies_is_not_a_view(tmp_path, shape):
    x = torch.randn(shape)
    runner = kiln.load(kiln.compile(torch.export.export(MayAlias(), (x,))).save(
        tmp_path / "m.kiln"))
    fresh = torch.randn(shape)
    got, want = runner(fresh), MayAlias()(fresh)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert g.shape == w.shape
    assert got[2].untyped_storage().data_ptr() == fresh.untyped_storage().data_ptr()


def test_views_of_an_output_whose_root_is_not_returned(tmp_path):
    ints = lambda *s: torch.randint(-4, 5, s).float()  # noqa: E731 - exact sums: equal values
    c, runner = _compile(tmp_path, MatmulViews(), (ints(4, 2, 3, 5),), ({0: B},))
    aliases = [o.get("alias") for o in c.manifest["outputs"]]
    assert aliases[1] is None and all(a["of"] == "output" and a["index"] == 1
                                      for a in (aliases[0], aliases[2], aliases[3]))
    for n in (3, 9):
        x = ints(n, 2, 3, 5)
        got, want = runner(x), MatmulViews()(x)
        _same_sharing(got, want, [x])


def test_views_through_ops_with_several_results(tmp_path):
    c, runner = _compile(tmp_path, SplitViews(), (torch.randn(4, 6),), ({0: B},))
    aliases = [o.get("alias") for o in c.manifest["outputs"]]
    assert [a and (a["of"], a["index"]) for a in aliases] == [
        ("input", 0), ("input", 0), None, ("output", 2)]
    for n in (3, 8):
        x = torch.randn(n, 6)
        got, want = runner(x), SplitViews()(x)
        _same_sharing(got, want, [x])  # chunk(x, 1)[0]: a new view object of x, as eager's
        for g, w in zip(got, want):
            assert g.stride() == w.stride() and g.storage_offset() == w.storage_offset()
        assert got[0] is not x and got[0].data_ptr() == x.data_ptr()
        assert [_storage(g) for g in got] == [_storage(x)] * 2 + [_storage(got[2])] * 2
        got[2][0, 2] = 7.0  # a write through y shows in its unbind view
        assert got[3][0] == 7.0


class WholeViews(torch.nn.Module):
    """Views of all of a tensor (eager: new tensor objects on the same storage) beside the
    tensor itself (eager: the very object)."""

    def forward(self, x):
        y = x * 3
        return (x[:], torch.chunk(x, 1, 1)[0], x.view(x.shape), x, y, y[:], y.view(y.shape), y,
                x.reshape(x.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_whole_views_are_new_objects_on_the_same_storage(tmp_path, dtype):
    make = (lambda *s: torch.randn(*s, dtype=dtype)) if dtype.is_floating_point else \
        (lambda *s: torch.randint(-50, 50, s, dtype=dtype))
    c, runner = _compile(tmp_path, WholeViews(), (make(4, 6),), ({0: B},))
    aliases = [o.get("alias") for o in c.manifest["outputs"]]
    assert [bool(a and a.get("same")) for a in aliases] == [False, False, False, True, False,
                                                            False, False, True, False]
    for n in (3, 5, 17):
        x = make(n, 6)
        got, want = runner(x), WholeViews()(x)
        _same_sharing(got, want, [x])
        for g, w in zip(got, want):
            assert g.data_ptr() == w.data_ptr() or w.untyped_storage().data_ptr() != \
                x.untyped_storage().data_ptr()
            assert (g is x) == (w is x)
            assert g.stride() == w.stride() and g.storage_offset() == w.storage_offset()
        assert got[3] is x and got[7] is got[4]
        assert all(got[k] is not x and got[k].data_ptr() == x.data_ptr() for k in (0, 1, 2, 8))
        assert all(got[k] is not got[4] and got[k].data_ptr() == got[4].data_ptr()
                   for k in (5, 6))
        got[0][0, 0] = 9  # a write through a whole view reaches x and the other views
        want[0][0, 0] = 9
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


class SameInOtherLayouts(torch.nn.Module):
    """The same tensor twice, where eager lays it out transposed (a pointwise op on x.t()),
    and an input returned as it is."""

    def forward(self, x):
        w = x.t() * 3
        return w, w, x, x


@pytest.mark.parametrize("exported", ["contiguous", "transposed"])
def test_the_same_tensor_twice_in_any_layout(tmp_path, exported):
    x0 = torch.randn(4, 6)
    x0 = x0.t().contiguous().t() if exported == "transposed" else x0
    c, runner = _compile(tmp_path, SameInOtherLayouts(), (x0,), None)
    aliases = [o.get("alias") for o in c.manifest["outputs"]]
    assert aliases[0] is None and aliases[1]["same"] and aliases[1]["index"] == 0
    assert aliases[2]["same"] and aliases[2]["of"] == "input"
    # exported compact, `return x` is also the graph of `return x.contiguous()`: x itself
    # when x is contiguous, else kiln's compact copies (eager's contiguous() copies; its
    # `return x` shares: kiln shares less, never more); exported transposed, x itself always.
    # Likewise `w, w` (w compact at export when x is transposed) is the graph of
    # `w, w.contiguous()`: one object only for the export's input strides
    assert aliases[2].get("contiguous", False) == (exported == "contiguous")
    assert ("when_strides" in aliases[1]) == (exported == "transposed")
    for x in (torch.randn(4, 6), torch.randn(6, 4).t()):
        got, want = runner(x), SameInOtherLayouts()(x)
        if exported == "contiguous" or x.stride() == x0.stride():
            assert got[1] is got[0]
        else:
            assert _storage(got[1]) != _storage(got[0])
        if exported == "contiguous" and not x.is_contiguous():
            assert got[2] is not x and got[3] is not x
            for g in got[2:]:
                assert g.is_contiguous() and _storage(g) != _storage(x)
        else:
            assert got[2] is x and got[3] is x
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


class ContiguousOfInput(torch.nn.Module):
    """`x.contiguous()` of an input (a no-op on the compact example: the graph returns x) and
    of a value eager lays out transposed (a copy in the graph), beside a view of the input
    and a computed value."""

    def forward(self, x):
        return x.contiguous(), x.t().contiguous(), x[1:], x * 2


def _relaid(x, layout):
    if layout == "transposed":
        return x.t().contiguous().t()
    if layout == "step":
        big = torch.zeros(2 * x.shape[0], x.shape[1], dtype=x.dtype)
        big[::2] = x
        return big[::2]
    if layout == "offset":  # contiguous, 3 elements into its storage: eager returns it
        big = torch.zeros(x.numel() + 3, dtype=x.dtype)
        big[3:] = x.reshape(-1)
        return big[3:].view(x.shape)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
@pytest.mark.parametrize("dynamic", [False, True])
def test_contiguous_of_an_input(tmp_path, dtype, dynamic):
    """Eager's `x.contiguous()` returns x itself when x is contiguous (any storage offset)
    and a compact copy otherwise; kiln's result does the same (docs/reliability.md item 8)."""
    make = (lambda *s: torch.randn(*s).to(dtype)) if dtype.is_floating_point else \
        (lambda *s: torch.randint(-50, 50, s, dtype=dtype))
    c, runner = _compile(tmp_path, ContiguousOfInput(), (make(5, 6),),
                         ({0: B},) if dynamic else None)
    alias = c.manifest["outputs"][0]["alias"]
    assert alias["same"] and alias["contiguous"] and alias["of"] == "input"
    for n, layout in [(5, "contiguous"), (5, "offset"), (5, "transposed"), (5, "step")] + (
            [(3, "transposed"), (9, "contiguous"), (12, "offset")] if dynamic else []):
        x = _relaid(make(n, 6), layout)
        got, want = runner(x), ContiguousOfInput()(x)
        for k, (g, w) in enumerate(zip(got, want)):  # (x[1:], x * 2: compact in kiln)
            assert g.dtype == w.dtype and (k >= 2 or g.stride() == w.stride())
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert (got[0] is x) == (want[0] is x) == x.is_contiguous()
        if x.is_contiguous():
            _same_sharing(got, want, [x])
        else:  # copies: a write through the result leaves x alone, as in eager
            assert _storage(got[0]) != _storage(x) and got[0].is_contiguous()
            got[0][0, 0] += 1
            torch.testing.assert_close(x, want[0], rtol=0, atol=0)


class ExportedStrided(torch.nn.Module):
    def forward(self, x):
        return x.t()[1:], x * 2, x[::2]


@pytest.mark.parametrize("layout", ["step", "transposed"])
def test_views_of_an_input_exported_with_other_strides(tmp_path, layout):
    """An input exported as a step-2 slice or transposed: eager's views of it share its
    storage; kiln's record is the chain replayed on a compact input, so a compact input at run
    time gets views of itself (as eager), and one in another layout is copied in (copies)."""
    x0 = torch.randn(8, 6)
    x0 = torch.randn(16, 6)[::2] if layout == "step" else x0.t().contiguous().t()
    c, runner = _compile(tmp_path, ExportedStrided(), (x0,), None)
    aliases = [o.get("alias") for o in c.manifest["outputs"]]
    # exported transposed, x.t()[1:] is contiguous there: also the graph of
    # `x.t()[1:].contiguous()`, so a view only where it is contiguous at run time
    assert aliases[0] == {"of": "input", "index": 0, "sizes": [5, 8], "strides": [1, 6],
                          "offset": 1, **({"contiguous": True} if layout == "transposed"
                                          else {})} and aliases[1] is None
    assert aliases[2] == {"of": "input", "index": 0, "sizes": [4, 6], "strides": [12, 1],
                          "offset": 0}
    x = torch.randn(8, 6)
    got, want = runner(x), ExportedStrided()(x)
    if layout == "step":
        _same_sharing(got, want, [x])
    else:  # x.t()[1:] is not contiguous: kiln's copy (eager's `.contiguous()` copies too)
        _same_sharing(got[1:], want[1:], [x])
        assert _storage(got[0]) != _storage(x)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for other in (torch.randn(16, 6)[::2], torch.randn(6, 8).t()):
        got, want = runner(other), ExportedStrided()(other)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
