"""The fuzz minimiser (`kiln/fuzz/minimise.py`) on injected faults: a big generated program
that fails shrinks to a few ops on small, static, float32, contiguous data, still failing the
same way. The fault lives only in this file: a check hook whose "compiled" side runs the
program with a wrong `sin` (fast), and, under `-m slow`, the real pipeline with kiln's C++
spelling of sin patched (`CPP_OPS`)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from kiln.fuzz import program
from kiln.fuzz.generator import generate
from kiln.fuzz.minimise import _key, _resize_all, _valid, minimise, size
from kiln.fuzz.program import FuzzModule, make_inputs, to_ref64, uses_float32
from kiln.fuzz.runner import Outcome, compare


@contextlib.contextmanager
def wrong_sin():
    """sin(x) + x/64 in the fuzz op table while the block runs (the injected fault)."""
    right = program.UNARY["sin"]
    program.UNARY["sin"] = lambda x: right(x) + x / 64
    try:
        yield
    finally:
        program.UNARY["sin"] = right


def faulty_check(spec: dict) -> Outcome:
    """Stands in for runner.check: the 'compiled' program has the wrong sin; compared with the
    float64 reference like the real check (dynamic programs at two sizes)."""
    for b in ((2, 9) if spec.get("dynamic") else (3,)):
        args = make_inputs(spec, spec["seed"] * 7919 + b, b)
        with torch.no_grad():
            want = FuzzModule(spec)(*args)
            ref = FuzzModule(spec, ref64=True)(*to_ref64(args))
            with wrong_sin():
                got = FuzzModule(spec)(*args)
        bad = compare(got, want, [r if w.is_floating_point() else w for w, r in zip(want, ref)],
                      uses_float32(spec), f"eager, B={b}")
        if bad:
            return Outcome("mismatch", bad)
    return Outcome("ok")


def _has_sin(spec: dict) -> bool:
    return any(op == "unary" and a.get("fn") == "sin" for op, _, a in spec["ops"])


def _big_failing_program(min_ops: int, dynamic: bool | None = None) -> dict:
    for seed in range(2000):
        spec = generate(seed, dynamic=dynamic, max_ops=20)
        if _has_sin(spec) and size(spec)[0] >= min_ops and size(spec)[1] >= 64 and \
                _valid(spec) and faulty_check(spec).failed:
            return spec
    raise AssertionError("no generated program shows the fault")


@pytest.mark.parametrize("dynamic", [False, True])
def test_big_program_shrinks(dynamic):
    warnings.filterwarnings("ignore")
    spec = _big_failing_program(10, dynamic)
    out = faulty_check(spec)
    small, small_out = minimise(spec, out, budget=400, check=faulty_check)
    n_ops, elems, params = size(small)
    assert small_out.failed and _key(small_out) == _key(out)
    assert faulty_check(small).failed  # the reproducer really reproduces
    assert _has_sin(small)
    assert n_ops <= 3, small["ops"]
    assert elems <= 4, small["inputs"]
    assert not small.get("dynamic")
    assert all(i["dtype"] == "float32" for i in small["inputs"]), small["inputs"]
    assert all(op not in ("permute", "transpose", "expand") for op, _, _ in small["ops"])
    assert size(spec)[0] >= 10 and size(spec)[1] >= 64


def test_attributes_shrink():
    """A hand-written program whose fault (sin) sits behind views, a float64 cast, a bias and
    scalar attributes: each is simplified while the sin mismatch stays."""
    spec = {"seed": 5, "dynamic": True, "dim": "no_max",
            "inputs": [{"shape": ["B", 6, 8], "dtype": "float64", "high": None}],
            "params": {"p0": {"shape": [5, 4], "init": "w"}, "p1": {"shape": [5], "init": "w"}},
            "ops": [["permute", [0], {"dims": [0, 2, 1]}],
                    ["slice", [1], {"dim": 1, "start": 1, "end": None, "step": 2}],
                    ["unary", [2], {"fn": "sin"}],
                    ["pad", [3], {"pad": [1, 2], "value": 1.5}],
                    ["transpose", [4], {"d0": 1, "d1": 2}],
                    ["cast", [5], {"dtype": "float32"}],
                    ["linear", [6], {"w": "p0", "b": "p1"}],
                    ["reduce", [7], {"fn": "amax", "dims": [0, 2], "keep": True}]],
            "outputs": [8]}
    assert _valid(spec)
    out = faulty_check(spec)
    assert out.failed
    # keep the structure: only shape, dtype and attribute candidates may apply
    small, _ = minimise(spec, out, budget=300, check=faulty_check)
    assert _has_sin(small)
    assert not small.get("dynamic")
    assert all(i["dtype"] == "float32" for i in small["inputs"])
    assert not small["params"] or all("b" not in a or a["b"] is None
                                      for _, _, a in small["ops"])
    for op, _, a in small["ops"]:
        assert op not in ("permute", "transpose") or a.get("dims", [0]) == sorted(
            a.get("dims", [0])), small["ops"]
        if op == "slice":
            assert a["step"] == 1 and a["start"] in (0, 1)
        if op == "pad":
            assert a["value"] in (0.0, 1.0)
    assert size(small) < size(spec)


def test_resize_keeps_dims_consistent():
    spec = {"seed": 1, "dynamic": False,
            "inputs": [{"shape": [4, 16], "dtype": "float32", "high": None},
                       {"shape": [3], "dtype": "int64", "high": 16}],
            "params": {"p0": {"shape": [8, 16], "init": "w"}},
            "ops": [["linear", [0], {"w": "p0", "b": None}],
                    ["index_select", [0, 1], {"dim": 1}],
                    ["reshape", [0], {"shape": [2, 2, 16]}]],
            "outputs": [2, 3, 4]}
    assert _valid(spec)
    s = _resize_all(spec, 16, 8)
    assert s["inputs"][0]["shape"] == [4, 8] and s["inputs"][1]["high"] == 8
    assert s["params"]["p0"]["shape"] == [8, 8]
    assert s["ops"][2][2]["shape"] == [2, 2, 8]
    assert _valid(s)


def test_key_ignores_sizes_and_dtypes():
    a = Outcome("mismatch", "eager, B=3: output 1 (torch.float64): 3 of 96 elements differ, "
                            "e.g. at [0, 1] got 1.0 want 2.0")
    b = Outcome("mismatch", "eager, B=2: output 0 (torch.float32): 1 of 1 elements differ, "
                            "e.g. at [] got 1.0 want 2.0")
    c = Outcome("mismatch", "interpreter, B=3: output 0 (torch.float32): 1 of 1 elements differ")
    d = Outcome("mismatch", "eager, B=3: output 0: dtype torch.float32 != torch.float64")
    assert _key(a) == _key(b) != _key(c)
    assert _key(a) != _key(d)
    e = Outcome("crash", "run (B=3): RuntimeError: bad size 12 for torch.float32")
    f = Outcome("crash", "run (B=9): RuntimeError: bad size 1 for torch.float64")
    assert _key(e) == _key(f)


@pytest.mark.slow
def test_real_pipeline_fault_shrinks(monkeypatch):
    """End to end: kiln's C++ spelling of sin made wrong, a generated program with sin fails
    the real differential check, and the minimiser (real compiles) shrinks it."""
    from kiln.targets.cpu import ops as cpp_ops
    from kiln.fuzz.runner import check

    warnings.filterwarnings("ignore")
    monkeypatch.setitem(cpp_ops.CPP_OPS, "sin", "(std::sin({0}) + {0} / 64)")
    spec = _big_failing_program(8, dynamic=False)
    out = check(spec)
    assert out.status == "mismatch", out.detail
    small, small_out = minimise(spec, out, budget=60)
    assert small_out.status == "mismatch" and _has_sin(small)
    assert size(small)[0] <= 3 and size(small)[1] <= 4, small


def test_compare_takes_a_reference_in_another_shape_of_the_same_size():
    """The Loop IR interpreter returns a 0-dim output as [1]: the comparison reads it in eager's
    shape (torch 2.11's isclose raised 'output with shape [] doesn't match the broadcast shape
    [1]' on it: 563 false crashes in a 7,300-program device run); a reference with another
    element count is a mismatch, never broadcast."""
    x = torch.tensor(1.5)
    assert compare([x], [x], [x.reshape(1)], True, "interpreter") is None
    bad = compare([x], [x], [torch.tensor([1.5, 1.5])], True, "interpreter")
    assert bad is not None and "2 elements" in bad
    assert compare([x], [x], [torch.tensor([2.5])], True, "interpreter") is not None
