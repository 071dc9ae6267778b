"""The Python runner's fast path (plain positional tensors written into preallocated DLTensors,
kiln/runtime/loader.py Runner._call_fast) against its general path (Runner._call_general): the
same results bit for bit, and the same error type and message for every wrong input (dtype,
rank, size, device, layout, conj/neg views, subclasses, too many dimensions, not a tensor);
non-contiguous inputs give eager's values on both. Also that plain inputs do take the fast path,
odd ones fall back, and a runner
shared by threads (each call its own scratch buffer) stays correct.

    .venv/bin/python -m pytest tests/runtime/test_fast_path.py -q
"""

from __future__ import annotations

import threading

import pytest
import torch

import kiln
from kiln.runtime import loader


def _two(x, y):
    return x * y + 1, (x - y).relu().sum(0)


def _one(x):
    return x + 1


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    d = tmp_path_factory.mktemp("fast")
    two = kiln.compile(_two, (torch.randn(3, 4), torch.randn(3, 4))).save(d / "two.kiln")
    one = kiln.compile(_one, (torch.randn(4),)).save(d / "one.kiln")
    with kiln.load(two) as r2, kiln.load(one) as r1:
        yield r1, r2


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the error itself is the result compared
        return type(e), str(e)


def _same(a, b) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "ok":
        xs, ys = (a[1], b[1]) if isinstance(a[1], tuple) else ((a[1],), (b[1],))
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
            assert torch.equal(x, y)
    else:
        assert a[1] == b[1]


def test_plain_inputs_take_the_fast_path(runners):
    r1, r2 = runners
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    out = r2._call_fast((x, y))
    assert out is not loader._MISS
    _same(("ok", out), ("ok", r2._call_general((x, y), {})))
    torch.testing.assert_close(out, _two(x, y))
    v = torch.randn(4)
    assert torch.equal(r1._call_fast((v,)), v + 1)
    # a view with a storage offset is still a plain strided tensor
    big = torch.randn(8)
    _same(("ok", r1._call_fast((big[4:],))), ("ok", r1._call_general((big[4:],), {})))


def _bad_inputs():
    good = torch.randn(3, 4)
    yield "float64", good.double()
    yield "int32", good.int()
    yield "bool", good > 0
    yield "rank 1", torch.randn(12)
    yield "rank 3", torch.randn(3, 4, 1)
    yield "rank 0", torch.tensor(1.0)
    yield "wrong size", torch.randn(3, 5)
    yield "empty", torch.randn(0, 4)
    yield "transposed", torch.randn(4, 3).t()
    yield "strided", torch.randn(3, 8)[:, ::2]
    yield "expanded", torch.randn(1, 4).expand(3, 4)
    yield "meta", torch.randn(3, 4, device="meta")
    yield "sparse", good.to_sparse()
    yield "complex", torch.randn(3, 4, dtype=torch.complex64)
    yield "conj", torch.randn(3, 4, dtype=torch.complex64).conj()
    yield "neg view", torch._neg_view(torch.randn(3, 4, dtype=torch.complex64).conj())
    yield "nine dims", torch.randn([1] * 9)
    yield "parameter", torch.nn.Parameter(torch.randn(3, 4))
    yield "list", [[1.0] * 4] * 3
    yield "int", 3
    yield "none", None


@pytest.mark.parametrize("position", [0, 1])
def test_wrong_inputs_fail_the_same_on_both_paths(runners, position):
    _, r2 = runners
    for what, bad in _bad_inputs():
        args = [torch.randn(3, 4), torch.randn(3, 4)]
        args[position] = bad
        fast = _outcome(lambda: r2(*args))
        general = _outcome(lambda: r2._call_general(tuple(args), {}))
        _same(fast, general)
        if what in ("float64", "int32", "rank 1", "wrong size", "meta"):
            assert fast[0] is not str and issubclass(fast[0], kiln.errors.InputError), \
                (what, fast)
            assert f"input {position}" in fast[1], (what, fast)
        if what in ("float64", "int32", "rank 1", "wrong size"):
            with pytest.raises(kiln.errors.InputError):  # the model's check, on the fast path
                r2._call_fast(tuple(args))
        if what in ("transposed", "strided", "expanded"):  # other strides: copied in by libkiln
            out = r2._call_fast(tuple(args))
            assert out is not loader._MISS, what
            for got, want in zip(out, _two(*args), strict=True):
                torch.testing.assert_close(got, want)
        if what in ("meta", "sparse", "conj", "neg view", "nine dims", "parameter", "int"):
            assert r2._call_fast(tuple(args)) is loader._MISS, what
        if what == "parameter":  # a subclass: the general path, same (correct) result
            assert fast[0] == "ok"


def test_argument_count_and_keywords_keep_their_errors(runners):
    _, r2 = runners
    x = torch.randn(3, 4)
    for args, kwargs in (((x,), {}), ((x, x, x), {}), ((x,), {"y": x}), ((), {})):
        with pytest.raises(kiln.errors.InputError):
            r2(*args, **kwargs)


def test_closed_runner(tmp_path):
    path = kiln.compile(_one, (torch.randn(4),)).save(tmp_path / "one.kiln")
    r = kiln.load(path)
    r(torch.randn(4))
    r.close()
    with pytest.raises(kiln.errors.KilnError, match="closed"):
        r(torch.randn(4))


def test_shared_runner_across_threads(runners):
    _, r2 = runners
    inputs = [(torch.randn(3, 4), torch.randn(3, 4)) for _ in range(8)]
    want = [_two(*a) for a in inputs]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(200):
                got = r2(*inputs[k])
                torch.testing.assert_close(got, want[k])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_reused_slot_rewritten_when_anything_but_data_changes(runners):
    """A scratch slot whose dtype, sizes and strides match the last call's only gets the new
    data pointer; any other change rewrites it, and bad inputs after good ones (and good ones
    after bad ones) still get the model's checks: the same error, naming the input."""
    r1, r2 = runners
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(3):  # same tensors: the pointer-only update
        _same(_outcome(lambda: r2(x, y)), _outcome(lambda: r2._call_general((x, y), {})))
    x2, y2 = torch.randn(3, 4), torch.randn(3, 4)  # same layout, other memory
    torch.testing.assert_close(r2(x2, y2), _two(x2, y2))
    bad = [x.double(), torch.randn(4, 3), torch.randn(3, 5), torch.randn(3, 4, 1),
           torch.randn(4, 3).t(), torch.randn(3, 8)[:, ::2], torch.randn(4)]
    for b in bad:  # after a good call the slot holds the good layout
        r2(x, y)
        got = _outcome(lambda: r2(b, y))
        _same(got, _outcome(lambda: r2._call_general((b, y), {})))
        if got[0] != "ok":
            assert "x" in got[1] or "input 0" in got[1], got
        else:  # a transposed / strided view of the right shape: eager's values
            torch.testing.assert_close(got[1][0], _two(b, y)[0])
        torch.testing.assert_close(r2(x, y), _two(x, y))  # and back
    _same(_outcome(lambda: r1(torch.randn(4, dtype=torch.float64))),
          _outcome(lambda: r1._call_general((torch.randn(4, dtype=torch.float64),), {})))
    z = torch.randn(4)
    torch.testing.assert_close(r1(z), z + 1)
