"""Inputs and outputs of the AOT path: pytrees, constant scalar inputs, outputs that alias
inputs or each other or are views, repeated outputs, no-argument graphs, zero-size tensors,
inf/nan values, several dynamic dims and derived dims. Each through `kiln.load`, against eager."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

import kiln


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Fn2(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


def _check(tmp_path, model, args, dynamic_shapes=None, calls=None):
    runner = kiln.compile(model, args, dynamic_shapes=dynamic_shapes).load(tmp_path / "m.kiln")
    for call in calls or [args]:
        got, want = runner(*call), model(*call)
        assert pytree.tree_structure(got) == pytree.tree_structure(want)
        for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
            torch.testing.assert_close(g, w, equal_nan=True)
    return runner


X = torch.randn(4, 3)

CASES = {
    "alias_input": (Fn(lambda x: (x, x * 2)), (X,)),
    "repeated_output": (Fn(lambda x: [x + 1, x + 1]), (X,)),
    "same_value_twice": (Fn(lambda x: (lambda y: (y, y))(x + 1)), (X,)),
    "views": (Fn(lambda x: (x.t(), x[1:], x.reshape(-1))), (X,)),
    "zero_size": (Fn(lambda x: (x * 2 + 1, x.sum(0))), (torch.randn(0, 3),)),
    "inf_nan": (Fn(lambda x: (torch.softmax(x, -1), x.relu(), x.amax(-1))),
                (torch.tensor([[float("inf"), 1.0, float("nan")], [1.0, 2.0, 3.0]]),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_forms(tmp_path, name):
    model, args = CASES[name]
    _check(tmp_path, model, args)


def test_outputs_are_fresh_tensors(tmp_path):
    runner = _check(tmp_path, Fn(lambda x: (x, x)), (X,))
    a, b = runner(X)
    a.add_(1)  # mutating one output changes neither the input nor the other output
    torch.testing.assert_close(b, X)


def test_pytree_inputs_and_outputs(tmp_path):
    class Tree(torch.nn.Module):
        def forward(self, d, scale):
            return {"sum": d["x"] + d["y"][0], "list": [d["y"][1] * scale, d["x"].mean()]}

    args = ({"x": X, "y": (X * 2, X - 1)}, torch.tensor(0.5))
    runner = _check(tmp_path, Tree(), args)
    with pytest.raises(kiln.errors.InputError, match="exported structure"):
        runner({"x": X}, torch.tensor(0.5))


def test_no_argument_graph(tmp_path):
    class NoArgs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(2, 3))

        def forward(self):
            return self.w.relu() * 3

    _check(tmp_path, NoArgs(), ())


def test_constant_scalar_inputs(tmp_path):
    runner = _check(tmp_path, Fn2(lambda x, n: x * n), (X, 3))
    with pytest.raises(kiln.errors.InputError, match="exported with the constant 3, got 4"):
        runner(X, 4)
    _check(tmp_path, Fn2(lambda x, a: x * a), (X, 0.25))


def test_several_dynamic_dims(tmp_path):
    a, b = Dim("a", min=1, max=20), Dim("b", min=1, max=20)
    model = Fn2(lambda x, y: (x.sum(1), y @ y.t()))
    _check(tmp_path, model, (torch.randn(3, 5), torch.randn(4, 2)), ({0: a}, {0: b}),
           [(torch.randn(7, 5), torch.randn(1, 2)), (torch.randn(20, 5), torch.randn(20, 2))])


def test_derived_dims(tmp_path):
    d = Dim("d", min=2, max=20)
    runner = _check(tmp_path, Fn2(lambda x, y: x[1:] + y), (torch.randn(5), torch.randn(4)),
                    ({0: d + 1}, {0: d}), [(torch.randn(9), torch.randn(8))])
    with pytest.raises(kiln.errors.InputError, match=r"input 0 \(x\): expected size s0 \+ 1"):
        runner(torch.randn(9), torch.randn(7))


def test_grad_mode_enabled(tmp_path):
    m = torch.nn.Linear(3, 2)
    runner = kiln.compile(m, (X,)).load(tmp_path / "g.kiln")
    with torch.enable_grad():
        torch.testing.assert_close(runner(X), m(X).detach())


def test_several_models_in_one_process(tmp_path):
    runners = []
    for k in range(3):
        m = torch.nn.Sequential(torch.nn.Linear(3, 4 + k), torch.nn.Tanh())
        runners.append((m, kiln.compile(m, (X,)).load(tmp_path / f"m{k}.kiln")))
    for m, r in runners:
        torch.testing.assert_close(r(X), m(X).detach())


def test_plain_function_and_op_overload(tmp_path):
    def fn(x, y):
        return torch.tanh(x) @ y.t()

    x, y = torch.randn(4, 6), torch.randn(5, 6)
    runner = kiln.compile(fn, (x, y)).load(tmp_path / "fn.kiln")
    torch.testing.assert_close(runner(x, y), fn(x, y), rtol=1e-5, atol=1e-5)
    # a bare op overload with a non-tensor keyword: specialised to the value given
    cm = kiln.compile(torch.ops.aten.add.Tensor, (x, x * 2), example_kwargs={"alpha": 2.0})
    runner = cm.load(tmp_path / "add.kiln")
    torch.testing.assert_close(runner(x, x, alpha=2.0), x + 2 * x)
    with pytest.raises(kiln.errors.InputError, match="exported with the constant 2.0"):
        runner(x, x, alpha=3.0)
    with pytest.raises(kiln.errors.KilnError, match="a function"):
        kiln.compile(42, (x,))


def test_symbolic_int_outputs(tmp_path):
    class M(torch.nn.Module):
        def forward(self, x):
            return x * 2, x.shape[0] * 3 + 1, {"rows": x.shape[0]}

    n = Dim("n", min=1, max=64)
    cm = kiln.compile(M(), (torch.randn(5, 3),), dynamic_shapes=({0: n},))
    runner = cm.load(tmp_path / "m.kiln")
    for rows in (1, 5, 40):
        x = torch.randn(rows, 3)
        y, k, d = runner(x)
        torch.testing.assert_close(y, x * 2)
        assert k == rows * 3 + 1 and isinstance(k, int)
        assert d == {"rows": rows}


class IntInput(torch.nn.Module):
    """An int input marked dynamic: used as a value, as a size (arange, slice, view) and in
    float arithmetic, next to a dynamic tensor dim."""

    def forward(self, x, n: int, scale: int):
        rows = x[:n]
        return (rows * scale + torch.arange(n).unsqueeze(1) * 0.5,
                x.reshape(scale, -1).sum(0) / n,
                {"n_plus": n + x.shape[0]})


def _int_input_export():
    b = Dim("b", min=2, max=32)
    ep = torch.export.export(IntInput(), (torch.randn(6, 4), 3, 2),
                             dynamic_shapes=({0: b}, Dim.DYNAMIC, Dim.DYNAMIC))
    return ep


def test_dynamic_int_inputs(tmp_path):
    cm = kiln.compile(_int_input_export())
    ins = cm.manifest["inputs"]
    assert [i.get("python_int", False) for i in ins] == [False, True, True]
    runner = cm.load(tmp_path / "i.kiln")
    for rows, n, scale in ((6, 3, 2), (8, 8, 4), (12, 5, 3), (2, 2, 2)):
        x = torch.randn(rows, 4)
        got, want = runner(x, n, scale), IntInput()(x, n, scale)
        assert pytree.tree_structure(got) == pytree.tree_structure(want)
        for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
            torch.testing.assert_close(g, w)
    X4 = torch.randn(4, 4)
    # a 0-d int tensor is taken as its value; anything else names the input
    torch.testing.assert_close(runner(X4, torch.tensor(2), 2)[0], IntInput()(X4, 2, 2)[0])
    for bad, msg in ((2.0, "expected an int, got float"), (True, "expected an int, got bool"),
                     ("2", "expected an int, got str"),
                     (2**70, "1180591620717411303424 does not fit in int64")):
        with pytest.raises(kiln.errors.InputError, match=rf"input 1 \(n\): {msg}"):
            runner(X4, bad, 2)
    hi = cm.manifest["symbols"][ins[1]["symbol"]]["max"]
    with pytest.raises(kiln.errors.InputError, match=r"input 1 \(n\): the value is"):
        runner(X4, hi + 1 if hi < 2**62 else -5, 2)
    with pytest.raises(kiln.errors.InputError, match=r"input 2 \(scale\)"):
        runner(X4, 2, 5)  # 4 rows * 4 columns cannot be viewed as 5 rows
    with pytest.raises(kiln.errors.InputError,
                       match=r"input sizes: aten.reshape.* needs s\d+ != 0"):
        runner(X4, 2, 0)  # a size divisor of 0: a clear error, not a division by zero


def test_dynamic_int_inputs_python_printer(tmp_path):
    from kiln.backend import _load_python_wrapper

    cm = kiln.compile(_int_input_export())
    src = cm.sources["model.py"]
    assert "_int_input(inputs[1], 1, 'n')" in src and "int(inputs[1])" in src
    model = _load_python_wrapper(src, tmp_path).Model(cm.library, dict(cm.built.weights))
    x = torch.randn(10, 4)
    got, want = model(x, 4, 5), IntInput()(x, 4, 5)
    for g, w in zip(got, pytree.tree_leaves(want)):
        torch.testing.assert_close(g.reshape(w.shape) if isinstance(w, torch.Tensor) else
                                   int(g), w)
    with pytest.raises(ValueError, match=r"input 1 \(n\): expected an int, got float"):
        model(x, 4.0, 5)
    with pytest.raises(ValueError, match="input sizes: aten.reshape"):
        model(x, 4, 3)
