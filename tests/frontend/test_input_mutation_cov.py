"""Programs that write a user input in place (issue 16 item 4; torch.export's
USER_INPUT_MUTATION: `x.add_(1)` on an input, batch norm's running stats passed as inputs) are
compiled: the new contents become extra outputs after the user outputs, named in the
manifest's `input_mutations`; the Python runner copies each into the caller's tensor after the
run (any strides) and returns the user outputs only. C callers get them as those outputs (the
C example here). Compared with eager: the outputs and the inputs after the call."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

from difftest import Checker, Fn, gen

from kiln.runtime.cbin import read_tensor_bin, write_tensor_bin


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("input_mutation"))


def _adds(x, y):
    x.add_(1)
    y.mul_(2)
    return x * 3, y.sum()


def _returns_input(x):
    x.sub_(0.5)
    return x


def _batch_norm(x, rm, rv):
    return F.batch_norm(x, rm, rv, training=True, momentum=0.1)


def _run_both(runner, fn, args):
    mine, theirs = [a.clone() for a in args], [a.clone() for a in args]
    got, want = runner(*mine), fn(*theirs)
    got, want = (got if isinstance(got, tuple) else (got,)), \
        (want if isinstance(want, tuple) else (want,))
    return mine, theirs, got, want


@pytest.mark.parametrize("fn", (_adds, _returns_input), ids=("adds", "returns_input"))
def test_user_input_written_back(check, fn):
    g = gen("input_mutation", fn.__name__)
    args = (torch.randn(3, 4, generator=g), torch.randn(4, generator=g))[:fn.__code__.co_argcount]
    compiled, runner = check.compile(Fn(fn), [a.clone() for a in args])
    writes = compiled.manifest["input_mutations"]
    assert [w["input"] for w in writes] == list(range(len(args)))
    for _ in range(2):  # twice: the second run starts from the written inputs
        mine, theirs, got, want = _run_both(runner, fn, args)
        for a, b in zip(mine + list(got), theirs + list(want)):
            torch.testing.assert_close(a, b)
        args = tuple(mine)
    if fn is _returns_input:  # eager returns the input object itself: so does the runner
        x = args[0].clone()
        assert runner(x) is x
    # a transposed input is written through its strides
    x = torch.randn(4, 3, generator=g).t()
    x_e = x.clone()
    rest = [torch.randn(4, generator=g)][:len(args) - 1]
    got = runner(x, *[r.clone() for r in rest])
    fn(x_e, *[r.clone() for r in rest])
    torch.testing.assert_close(x, x_e)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16),
                         ids=("f32", "f16", "bf16"))
def test_batch_norm_running_stats(check, dtype):
    """Training batch norm updates the running mean / var given as inputs (half types: through
    a cast of the float32 statistics, as eager's)."""
    g = gen("input_mutation_bn", dtype)
    args = (torch.randn(4, 3, 5, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype),
            (torch.rand(3, generator=g) + 0.5).to(dtype))
    _, runner = check.compile(Fn(_batch_norm), [a.clone() for a in args])
    mine, theirs, got, want = _run_both(runner, _batch_norm, args)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype != torch.float32 else {}
    for a, b in zip(mine + list(got), theirs + list(want)):
        torch.testing.assert_close(a, b, **tol)


def test_c_caller_gets_the_new_contents(check, run_model_exe, tmp_path):
    """The C example (examples/c/run_model.c) runs the package: outputs 0, 1 are the user
    outputs, 2 and 3 the new x and y, as the manifest says."""
    g = gen("input_mutation_c")
    x, y = torch.randn(3, 4, generator=g), torch.randn(4, generator=g)
    compiled, _ = check.compile(Fn(_adds), (x.clone(), y.clone()))
    pkg = tmp_path / "m.kiln"
    compiled.save(pkg)
    assert compiled.manifest["input_mutations"] == [{"input": 0, "output": 2},
                                                    {"input": 1, "output": 3}]
    write_tensor_bin(tmp_path / "x.bin", x)
    write_tensor_bin(tmp_path / "y.bin", y)
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([str(run_model_exe), "-o", str(tmp_path / "out"), str(pkg),
                           str(tmp_path / "x.bin"), str(tmp_path / "y.bin")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 4, proc.stdout
    x_e, y_e = x.clone(), y.clone()
    out, total = _adds(x_e, y_e)
    for k, want in enumerate((out, total, x_e, y_e)):
        torch.testing.assert_close(read_tensor_bin(tmp_path / f"out{k}.bin"), want)


def _views_and_repeats(x, y):
    x.add_(1)
    x.mul_(2)
    y[0].add_(5)  # a view of an input written: the whole input's new contents
    return (x + y).sum(0)


def test_dynamic_shapes_views_and_repeated_writes(check):
    from torch.export import Dim
    n = Dim("n", min=2, max=16)
    g = gen("input_mutation_dyn")
    args = (torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g))
    compiled, runner = check.compile(Fn(_views_and_repeats), [a.clone() for a in args],
                                     dynamic_shapes=({0: n}, {0: n}))
    assert [w["input"] for w in compiled.manifest["input_mutations"]] == [0, 1]
    for rows in (3, 7):
        args = (torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g))
        mine, theirs, got, want = _run_both(runner, _views_and_repeats, args)
        for a, b in zip(mine + list(got), theirs + list(want)):
            torch.testing.assert_close(a, b)


def test_entry_point_writes_its_inputs(tmp_path):
    """A package of several entry points: the entry's manifest record carries its
    input_mutations (package/entries.py ENTRY_KEYS)."""
    import kiln

    g = gen("input_mutation_entries")
    x, y = torch.randn(3, 4, generator=g), torch.randn(4, generator=g)
    c = kiln.compile({"writes": (Fn(_adds), (x.clone(), y.clone())),
                      "reads": (Fn(lambda t: t * 2), (x.clone(),))})
    r = c.load(tmp_path / "e.kiln")
    mine, theirs = (x.clone(), y.clone()), (x.clone(), y.clone())
    got, want = r.writes(*mine), _adds(*theirs)
    for a, b in zip(list(mine) + list(got), list(theirs) + list(want)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(r.reads(mine[0]), theirs[0] * 2)


def _returns_views(x):
    x.add_(1)
    return x[1:], x.t(), x * 2


def _shares(a, base) -> bool:
    return a.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
def test_views_of_a_written_input_share_its_storage(check, dynamic):
    """`x.add_(1); return x[1:], x.t()`: eager returns views of the caller's x, holding the new
    contents; so does the runner (the manifest records them as views of input 0). An input
    given with other strides than the export's keeps kiln's own copies (same values)."""
    from torch.export import Dim
    g = gen("input_mutation_views", str(dynamic))
    x0 = torch.randn(4, 5, generator=g)
    dyn = ({0: Dim("n", min=3, max=16)},) if dynamic else None
    compiled, runner = check.compile(Fn(_returns_views), [x0.clone()], dynamic_shapes=dyn)
    aliases = [o.get("alias") for o in compiled.manifest["outputs"]]
    assert [a and (a["of"], a["index"]) for a in aliases[:2]] == [("input", 0), ("input", 0)]
    assert aliases[2] is None
    for rows in ((4, 7, 3) if dynamic else (4,)):
        x = torch.randn(rows, 5, generator=g)
        mine, theirs = x.clone(), x.clone()
        got, want = runner(mine), _returns_views(theirs)
        torch.testing.assert_close(mine, theirs)
        for k, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b)
            assert a.shape == b.shape and a.stride() == b.stride()
            assert _shares(a, mine) == _shares(b, theirs), k
        mine[0, 0] = 123.0  # a later write to the caller's x shows through the views
        assert got[1][0, 0].item() == 123.0
    # other strides than at export (transposed storage): values right, storage kiln's own
    x = torch.randn(5, 4, generator=g).t()
    mine, theirs = x.clone().t().contiguous().t(), x.clone()
    got, want = runner(mine), _returns_views(theirs)
    torch.testing.assert_close(mine, theirs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
