"""The ATen fallback: ops kiln does not lower are called in ATen through torch's stable C
interface (runtime/model/kiln_aten.h). Checked against eager through `kiln.load`, through the
C example (with and without libtorch on the library path) and through the Python printer."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
import torch

from difftest import Fn

import kiln
import kiln.backend
from kiln.runtime.cbin import read_tensor_bin, write_tensor_bin


def _compile(tmp_path, fn, args, dynamic_shapes=None, **opts):
    ep = torch.export.export(Fn(fn), args, dynamic_shapes=dynamic_shapes)
    cm = kiln.compile(ep, options=kiln.Options(**opts))
    path = tmp_path / "m.kiln"
    cm.save(path)
    return cm, path


def _spd(n, batch=()):
    a = torch.randn(*batch, n, n, dtype=torch.float64)
    return (a @ a.transpose(-1, -2) + n * torch.eye(n, dtype=torch.float64)).float()


def _check(runner, fn, args, **tol):
    got = runner(*args)
    ref = fn(*args)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g, r, **tol)


def inv_chain(x, y):
    # kiln kernels before and after the fallback call; y is passed to ATen transposed (a view)
    a = torch.linalg.inv_ex(x * 2 + 1e-3)[0]
    return torch.relu(a @ y.t() + 1), torch.lgamma(y.t().abs() + 0.5) * 3


def test_fallback_matches_eager_and_manifest_lists_ops(tmp_path):
    args = (_spd(5), torch.randn(3, 5))
    cm, path = _compile(tmp_path, inv_chain, args)
    req = cm.manifest["requires"]
    assert req["libtorch"] is True
    assert req["aten_fallback_ops"] == ["aten::lgamma.default", "aten::linalg_inv_ex.default"]
    assert "kiln_aten.h" in cm.sources["model.cpp"]
    assert "#include <ATen" not in cm.sources["model.cpp"]
    runner = kiln.load(path)
    for _ in range(3):  # fresh inputs each run
        _check(runner, inv_chain, (_spd(5), torch.randn(3, 5)), rtol=1e-4, atol=1e-4)


def test_multi_result_op_and_dynamic_batch(tmp_path):
    def fn(x):
        sign, logdet = torch.linalg.slogdet(x)
        return sign * 2, logdet + 1

    b = torch.export.Dim("b", min=1, max=16)
    cm, path = _compile(tmp_path, fn, (_spd(4, (3,)),), dynamic_shapes=(({0: b},),))
    runner = kiln.load(path)
    for n in (1, 3, 7):
        _check(runner, fn, (_spd(4, (n,)),), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["cdist", "bucketize", "qr_str_arg", "digamma_int"])
def test_fallback_argument_kinds(tmp_path, case):
    # float + optional int (cdist), tensor + bool kwargs (bucketize), a str argument (qr),
    # an int input promoted by the op (digamma of int64 -> float32)
    fns = {
        "cdist": (lambda a, b: torch.cdist(a, b) * 2, (torch.randn(4, 3), torch.randn(6, 3))),
        "bucketize": (lambda a, b: torch.bucketize(a, b, right=True) + 1,
                      (torch.randn(5, 7), torch.sort(torch.randn(9))[0])),
        "qr_str_arg": (lambda a: torch.linalg.qr(a, mode="complete")[1].abs(),
                       (torch.randn(5, 3),)),
        "digamma_int": (lambda a: torch.digamma(a), (torch.randint(1, 9, (4, 5)),)),
    }
    fn, args = fns[case]
    _, path = _compile(tmp_path, fn, args)
    runner = kiln.load(path)
    fresh = tuple(torch.randint(1, 9, a.shape) if a.dtype == torch.int64 else
                  (torch.sort(torch.randn(a.shape))[0] if case == "bucketize" and k == 1
                   else torch.randn(a.shape)) for k, a in enumerate(args))
    _check(runner, fn, fresh, rtol=1e-4, atol=1e-4)


def test_fallback_can_be_refused(tmp_path):
    with pytest.raises(kiln.errors.UnsupportedError, match="lgamma"):
        _compile(tmp_path, lambda x: torch.lgamma(x), (torch.randn(3),), aten_fallback=False)


def test_unencodable_arguments_are_clear_errors(tmp_path, monkeypatch):
    # a Scalar argument cannot cross torch's stable C interface: without a rewrite of the op
    # (kiln/frontend/scalar_ops.py; tests/frontend/test_fallback_scalars.py) it is refused
    import kiln.frontend.export as export

    monkeypatch.setattr(export, "rewrite_table", lambda ops: None)
    with pytest.raises(kiln.errors.UnsupportedError, match=r"argument .* has type Scalar"):
        _compile(tmp_path, lambda x: torch.special.zeta(x, 2.0), (torch.rand(3) + 1,))


def test_fallback_on_cuda(tmp_path):
    """CUDA packages call ATen on the device (tests/targets/cuda/test_cuda_codegen.py checks
    the wrapper, tests/targets/cuda/test_cuda_dds.py the data-dependent sizes)."""
    ep = torch.export.export(Fn(lambda x: torch.lgamma(x)), (torch.randn(3),))
    cm = kiln.compile(ep, device="cuda", options=kiln.Options(cuda_archs=(90,)))
    assert cm.manifest["requires"]["aten_fallback_ops"] == ["aten::lgamma.default"]


def unique_parts(x):  # (over a dim with rows of 17 elements: ATen's; unique is kiln's)
    u, inv, counts = torch.unique(x.unsqueeze(1).expand(-1, 17), dim=0, return_inverse=True,
                                  return_counts=True)
    return u * 2, inv + 1, counts


@pytest.mark.parametrize("fn,make", [
    (lambda x: tuple(r + 1 for r in torch.linalg.slogdet(x)), lambda: _spd(4, (3,))),
    (unique_parts, lambda: torch.randint(0, 5, (12,)).float()),  # data-dependent sizes
], ids=["slogdet", "unique"])
def test_multi_result_op_is_called_once(tmp_path, fn, make):
    from kiln.ir.interp import run_loop

    cm, path = _compile(tmp_path, fn, (make(),))
    for src, mark in (("model.cpp", "// aten fallback"), ("model.py", "# aten fallback")):
        calls = [ln for ln in cm.sources[src].splitlines() if ln.strip().startswith(mark)]
        assert len(calls) == 1, calls  # one call writes every result
    runner = kiln.load(path)
    loop = cm.built.loop
    for _ in range(3):
        x = make()
        _check(runner, fn, (x,), rtol=1e-4, atol=1e-4)
        got = run_loop(loop, {loop.buffers[0].name: x.numpy()}, {})
        for g, r in zip(got, fn(x)):
            torch.testing.assert_close(torch.from_numpy(g.copy()).reshape(r.shape), r,
                                       rtol=1e-4, atol=1e-4)


def test_python_printer_runs_the_fallback(tmp_path):
    args = (_spd(5), torch.randn(3, 5))
    cm, _ = _compile(tmp_path, inv_chain, args)
    assert "torch.ops.aten.linalg_inv_ex.default(" in cm.sources["model.py"]
    made = []

    def backend(gm, inputs):
        made.append(kiln.backend.kiln_backend(gm, inputs))
        return made[-1]

    torch._dynamo.reset()
    f = torch.compile(inv_chain, backend=backend, fullgraph=True)
    x, y = _spd(5), torch.randn(3, 5)
    for g, r in zip(f(x, y), inv_chain(x, y)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    assert made and all(hasattr(m, "kiln_compiled") for m in made)


def test_c_program_needs_libtorch_on_the_path(tmp_path, run_model_exe):
    fn = lambda x: torch.lgamma(x) + 1  # noqa: E731
    _, path = _compile(tmp_path, fn, (torch.randn(4, 3),))
    x = torch.rand(4, 3) + 0.1
    write_tensor_bin(str(tmp_path / "in0.bin"), x)
    prefix = str(tmp_path / "out")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    proc = subprocess.run([str(run_model_exe), "-o", prefix, str(path), str(tmp_path / "in0.bin")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "needs libtorch" in proc.stderr and "aten::lgamma.default" in proc.stderr
    env["LD_LIBRARY_PATH"] = str(pathlib.Path(torch.__file__).parent / "lib")
    proc = subprocess.run([str(run_model_exe), "-o", prefix, str(path), str(tmp_path / "in0.bin")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(read_tensor_bin(prefix + "0.bin"), fn(x))


def test_interpreter_agrees(tmp_path):
    from kiln.ir.interp import run_loop

    args = (_spd(5), torch.randn(3, 5))
    cm, _ = _compile(tmp_path, inv_chain, args)
    loop = cm.built.loop
    names = [b.name for b in loop.buffers if b.kind == "input"]
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    feeds.update({k: v.numpy() for k, v in cm.built.weights.items()})
    got = run_loop(loop, feeds, {})
    for g, r in zip(got, inv_chain(*args)):
        torch.testing.assert_close(torch.from_numpy(g), r, rtol=1e-4, atol=1e-4)


def test_interpreter_reads_strided_operands(tmp_path):
    """An ATen call on a view (transposed, sliced) reads the view's strides and offset in the
    Loop IR interpreter as in the package (the interpreter once read the buffer flat)."""
    from kiln.ir.interp import run_loop

    x = torch.rand(4, 4) + 0.5
    cm, path = _compile(tmp_path, lambda x: torch.lgamma(x.t()[1:]) * 2, (x,))
    feeds = {b.name: x.numpy() for b in cm.built.loop.buffers if b.kind == "input"}
    (got,) = run_loop(cm.built.loop, feeds, {})
    want = torch.lgamma(x.t()[1:]) * 2
    torch.testing.assert_close(torch.from_numpy(got).reshape(want.shape), want)
    torch.testing.assert_close(kiln.load(path)(x), want)


def test_effect_tokens_are_a_clear_error(tmp_path):
    with pytest.raises(kiln.errors.UnsupportedError, match=r"_linalg_check_errors.*linalg.inv_ex"):
        _compile(tmp_path, lambda x: torch.linalg.inv(x), (_spd(3),))


def select_positive(x):
    # data-dependent sizes: nonzero's rows (u0), the masked values (u1) and their distinct
    # values (u2), with kiln kernels consuming them (a u2-long pointwise chain and a reduction
    # over u2 elements); nonzero and x[mask] are kiln's own (sessions 14, 15), unique over a
    # dim with rows of more than 16 elements is ATen's (unique is kiln's since session 18)
    idx = torch.nonzero(x > 0)
    v = torch.unique(x[x > 0].unsqueeze(1).expand(-1, 17), dim=0)[:, 0]
    return idx * 2, torch.relu(v) + 1, (v * 2).sum()


@pytest.mark.parametrize("dynamic", [False, True])
def test_data_dependent_sizes(tmp_path, dynamic):
    shapes = None
    if dynamic:
        shapes = (({0: torch.export.Dim("n", min=1, max=64)},),)
    cm, path = _compile(tmp_path, select_positive, (torch.randn(6, 5),), dynamic_shapes=shapes)
    # (nonzero is kiln's own since session 14: tests/frontend/test_nonzero_cov.py; x[mask]
    # since session 15: tests/frontend/test_masked_select_cov.py)
    assert cm.manifest["requires"]["aten_fallback_ops"] == ["aten::unique_dim.default"]
    runner = kiln.load(path)
    rows = (6, 1, 17, 64) if dynamic else (6,)
    for n in rows:
        for x in (torch.randn(n, 5), -torch.ones(n, 5), torch.ones(n, 5)):  # some, none, all
            got = runner(x)
            ref = select_positive(x)
            for g, r in zip(got, ref):
                assert g.shape == r.shape and g.dtype == r.dtype
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_data_dependent_sizes_in_python_printer_and_interpreter(tmp_path):
    from kiln.ir.interp import run_loop

    cm, _ = _compile(tmp_path, select_positive, (torch.randn(6, 5),))
    assert "u2 = _r[0].shape[0]" in cm.sources["model.py"]  # (unique_dim: ATen; u0, u1: nonzero)
    x = torch.randn(6, 5)
    got = run_loop(cm.built.loop, {cm.built.loop.buffers[0].name: x.numpy()}, {})
    for g, r in zip(got, select_positive(x)):
        torch.testing.assert_close(torch.from_numpy(g).reshape(r.shape), r)
    torch._dynamo.reset()
    made = []

    def backend(gm, inputs):
        made.append(kiln.backend.kiln_backend(gm, inputs))
        return made[-1]

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        f = torch.compile(select_positive, backend=backend, fullgraph=True)
        for g, r in zip(f(x), select_positive(x)):
            torch.testing.assert_close(g, r)
    assert made and all(hasattr(m, "kiln_compiled") for m in made)


def spectrum(x, z):
    # complex values: ATen computes masked_select (a scatter_reduce product until session 14,
    # now kiln's: tests/frontend/test_scatter_prod_cov.py), kiln the rest (the fft too)
    f = torch.fft.rfft(x)
    idx = torch.zeros(2, 4, dtype=torch.long)
    z = torch.scatter_reduce(z, 0, idx, z[:2], "prod")
    z = z + torch.masked_select(z, z.real > 0).sum()
    return f.abs() * 2, torch.fft.irfft(f * 2, n=x.shape[-1]), f.t(), (z * f[:, :4]).conj()


def test_complex_values_and_fft(tmp_path):
    args = (torch.randn(4, 30), torch.randn(4, 4, dtype=torch.complex64))
    cm, path = _compile(tmp_path, spectrum, args)
    assert cm.manifest["requires"]["aten_fallback_ops"] == ["aten::masked_select.default"]
    assert cm.manifest["inputs"][1]["dtype"] == "complex64"
    runner = kiln.load(path)
    for _ in range(2):
        fresh = (torch.randn(4, 30), torch.randn(4, 4, dtype=torch.complex64))
        _check(runner, spectrum, fresh, rtol=1e-5, atol=1e-5)
    with pytest.raises(kiln.errors.InputError, match="expected dtype complex64, got float32"):
        runner(torch.randn(4, 30), torch.randn(4, 4))
    with pytest.raises(kiln.errors.UnsupportedError, match="complex values"):
        _compile(tmp_path, spectrum, args, aten_fallback=False)


def take_first(x, n):
    k = n.item()
    torch._check(k >= 1)
    torch._check(k <= 8)
    return x[:k] * 2, torch.ones(k, 3) + x.sum()


def test_item_as_a_size_runs_natively_and_is_range_checked(tmp_path):
    cm, path = _compile(tmp_path, take_first, (torch.randn(8, 3), torch.tensor(3)))
    assert cm.manifest["requires"]["libtorch"] is False  # read by kiln itself
    runner = kiln.load(path)
    for k in (1, 5, 8):
        _check(runner, take_first, (torch.randn(8, 3), torch.tensor(k)), rtol=1e-5, atol=1e-5)
    with pytest.raises(kiln.errors.KilnError, match=r"\.item\(\) is 9, outside \[1, 8\]"):
        runner(torch.randn(8, 3), torch.tensor(9))
    _check(runner, take_first, (torch.randn(8, 3), torch.tensor(2)), rtol=1e-5, atol=1e-5)


def test_item_size_without_an_upper_bound_is_allocated_at_run_time(tmp_path):
    def fn(x, n):
        k = n.item()
        torch._check(k >= 1)
        return torch.ones(k) * x.sum()

    _, path = _compile(tmp_path, fn, (torch.randn(3), torch.tensor(2)))
    runner = kiln.load(path)
    for k in (1, 2, 500):  # tests/frontend/test_unbounded_sizes.py has more
        _check(runner, fn, (torch.randn(3), torch.tensor(k)), rtol=1e-5, atol=1e-5)


def sizes_from_an_item(x, c):
    n = c.item()
    torch._check(n >= 0)
    torch._check(n <= 10)
    return torch.ones(2 * n + 1) * x.sum(), x[: n + 1] * 3, torch.cat([x[:n], x[:n] * 2])


def test_sizes_derived_from_a_data_dependent_size(tmp_path):
    # 2*u0 + 1, u0 + 1 and 2*u0 (a cat of two u0 slices) as output sizes
    _, path = _compile(tmp_path, sizes_from_an_item, (torch.randn(20), torch.tensor(3)))
    runner = kiln.load(path)
    for n in (0, 3, 10):
        _check(runner, sizes_from_an_item, (torch.randn(20), torch.tensor(n)), rtol=1e-5,
               atol=1e-5)


def test_wrong_result_dtypes_in_the_export_are_refused():
    """torch 2.11's export records unique's inverse and counts as float32 (eager: int64);
    kiln trusts the export's metadata, so a program carrying the wrong dtypes is refused by
    name instead of returning float outputs. Simulated here by retyping the results' meta
    (kiln.compile re-runs torch's decompositions, whose metadata is right on this torch)."""
    from kiln.errors import UnsupportedError
    from kiln.frontend.fallback import check_result_dtypes

    class M(torch.nn.Module):
        def forward(self, x):
            return unique_parts(x)
    ep = torch.export.export(M(), (torch.randint(0, 5, (12,)).float(),))
    node = next(n for n in ep.graph.nodes if n.target is torch.ops.aten.unique_dim.default)
    vals = node.meta["val"]
    schema = node.target._schema
    check_result_dtypes(node, schema, list(vals))  # as exported here: right
    wrong = [vals[0], vals[1].to(torch.float32), vals[2].to(torch.float32)]
    with pytest.raises(UnsupportedError, match=r"unique_dim .*result 1 is torch.float32, but "
                                               r"the op returns torch.int64"):
        check_result_dtypes(node, schema, wrong)
