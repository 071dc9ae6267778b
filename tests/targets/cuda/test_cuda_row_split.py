"""Pointwise CUDA kernels of few rows split each row into chunks (kiln/targets/cuda/kernel.py
`row_split`): a 1-d tensor is a single row, and used to run on one program walking all of it.

Without a GPU: the printed kernels (a 2**20-element vector gets about a thousand programs; wide
enough rows and reductions are not split), and the split kernels run in Triton's interpreter
through the Python runner against eager: 1-d static and dynamic sizes (a size below one chunk,
sizes not a multiple of the chunk), a few wide rows with two outputs and a broadcast operand, a
transposed input. With a GPU (`-m gpu`): the same programs at larger sizes."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.export import Dim

import kiln
from kiln.ir.sym import evaluate
from kiln.options import Options
from tests.targets.cuda.test_cuda_dds import interpret_builds, triton_kernels_of

triton = pytest.importorskip("triton")

OPTS = Options(cuda_archs=(90,), autotune=False, cuda_graphs=False)


class Vec(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2 - x.sin()


class Rows(torch.nn.Module):
    """Two outputs of the same rows (one kernel of two members), a broadcast operand."""

    def forward(self, x, y):
        return x.sin() * y, torch.exp(-x.abs()) + y


class Transposed(torch.nn.Module):
    def forward(self, x):
        return (x.t() * 3).contiguous().reshape(-1) + 1


def _build(mod, args, dynamic=None):
    ep = torch.export.export(mod, args, dynamic_shapes=dynamic)
    return kiln.compile(ep, device="cuda", options=OPTS)


def _programs(cm, hints) -> list[int]:
    return [-(-max(1, evaluate(k.rows, hints)) // k.config.xblock)
            for k in triton_kernels_of(cm).values() if k.tiles is None]


def test_a_long_vector_runs_on_many_programs():
    n = 1 << 20
    cm = _build(Vec(), (torch.randn(n),))
    src = cm.built.sources["kernels_triton.py"]
    assert "xsplit" in src
    (progs,) = _programs(cm, {})
    assert progs >= 1000, progs


def test_rows_enough_and_reductions_are_not_split():
    cm = _build(Vec(), (torch.randn(1024, 1024),))
    assert "xsplit" not in cm.built.sources["kernels_triton.py"]
    cm = _build(torch.nn.Softmax(-1), (torch.randn(2, 1 << 16),))
    assert "xsplit" not in cm.built.sources["kernels_triton.py"]


_INTERP = textwrap.dedent("""
    import pickle, sys, torch
    sys.path.insert(0, sys.argv[2])
    import test_cuda_row_split as T
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    with open(sys.argv[1], "rb") as f:
        cases = pickle.load(f)
    bad = []
    for name, prog, kernels, module, weights, calls in cases:
        mod = import_triton_module(module)
        assert "xsplit" in module, name
        m = getattr(T, name)()
        for args in calls:
            got = run_program(prog, kernels, mod, weights, list(args))
            want = m(*args)
            want = want if isinstance(want, tuple) else (want,)
            for g, w in zip(got, want):
                if g.shape != w.shape or not torch.allclose(g, w, rtol=1e-6, atol=1e-6):
                    bad.append(f"{name} {[tuple(a.shape) for a in args]}: max diff "
                               f"{(g - w).abs().max() if g.shape == w.shape else g.shape}")
        print(name, "checked", flush=True)
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
    sys.exit(1 if bad else 0)
""")


def _cases(scale: int = 1):
    g = torch.Generator().manual_seed(5)

    def r(*s):
        return torch.randn(*s, generator=g)

    n = Dim("n", min=2, max=1 << 22)
    vec = _build(Vec(), (r(70001 * scale),), ({0: n},))
    vec_calls = [(r(70001 * scale),), (r(3),), (r(1025),), (r(100003 * scale),)]
    rows = _build(Rows(), (r(3, 40000 * scale), r(40000 * scale)))
    rows_calls = [(r(3, 40000 * scale), r(40000 * scale))]
    tr = _build(Transposed(), (r(30000 * scale, 2),))
    tr_calls = [(r(30000 * scale, 2),)]
    return [("Vec", vec, vec_calls), ("Rows", rows, rows_calls), ("Transposed", tr, tr_calls)]


def test_split_kernels_match_eager_in_interpreter(tmp_path):
    interpret_builds(tmp_path, _INTERP, _cases())


@pytest.mark.gpu
def test_gpu_split_kernels_match_eager(tmp_path):
    for name, cm, calls in _cases(scale=16):
        runner = kiln.load(cm.save(tmp_path / f"{name}.kiln"), device="cuda")
        m = globals()[name]()
        for args in calls:
            got = runner(*[a.cuda() for a in args])
            got = got if isinstance(got, tuple) else (got,)
            want = m(*[a.cuda() for a in args])
            want = want if isinstance(want, tuple) else (want,)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
