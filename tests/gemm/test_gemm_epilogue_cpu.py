"""CPU GEMM epilogues (kiln/gemm/fuse_cpu.py, kr::gemm_cpp_packed / kr::gemm_split's `epi`):
bias, relu, gelu (erf and tanh), silu, tanh, a residual add, a broadcast scale and a chain of
them fused into the GEMM that produces their input, against eager (float64 references) at
M = 1 ... 200, N and K that are no multiple of the vector width, with a transposed A (a strided
operand), a batched matmul of two activations (no constant B: the gemm_split path), for the
packed "cpp" kernel, the unpacked one and BLAS (which applies the epilogue after its call),
at 1, 2 and 3 threads; float32 and float64 fused, bfloat16 correct (its epilogue rounds to
bfloat16, another dtype than the GEMM's: not fused); consumers that must stay separate
(a second reader, a transposed read, a program output read again) are not fused; the
generated C++ names the fused ops; the Python wrapper (model.py) applies the epilogue too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln
from kiln.cli.profile import _load_wrapper
from kiln.ir import loop as L
from kiln.package.reader import read_package
from tests.difftest import Cases, Checker, case_name, rand

M_SIZES = (1, 2, 13, 64, 200)  # 7: the example size the package is compiled at
K, N = 77, 101  # odd: no multiple of any vector width


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Epilogues(nn.Module):
    """One GEMM per epilogue kind; x: [M, K], xt: [K, M] (A read transposed), r: [M, N]."""

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        g = _gen(0)
        self.fcs = nn.ModuleList(nn.Linear(K, N, dtype=dtype) for _ in range(8))
        self.scale = nn.Parameter(torch.ones(N, dtype=dtype))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.2)

    def forward(self, x, xt, r):
        f = self.fcs
        return (torch.relu(f[0](x)),
                nn.functional.gelu(f[1](x)),
                nn.functional.gelu(f[2](xt.t()), approximate="tanh"),
                nn.functional.silu(f[3](x)),
                torch.tanh(f[4](x)) + r,                       # activation then residual
                (f[5](x) + r) * self.scale,                    # residual, broadcast scale
                f[6](x) * 0.5 - 1.0,
                f[7](x))                                       # bias only


def _inputs(m: int, dtype=torch.float32):
    return (rand((m, K), dtype, low=-2, high=2), rand((m, K), dtype, low=-2, high=2).t(),
            rand((m, N), dtype, low=-2, high=2))


def _dyn(hi=256):
    m = torch.export.Dim("m", min=1, max=hi)
    return ({0: m}, {1: m}, {0: m})


def _fused(compiled) -> dict[str, L.Compute]:
    return {s.name: s.epilogue for s in compiled.built.steps
            if isinstance(s, L.Gemm) and s.epilogue is not None}


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    return Checker(tmp_path_factory.mktemp("epilogue"))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("backends,dtype", [
    (("cpp",), torch.float32), (("blas",), torch.float32),
    pytest.param(("cpp", "blas"), torch.float32, marks=SLOW),
    pytest.param(("cpp",), torch.float64, marks=SLOW),
    pytest.param(("blas",), torch.float64, marks=SLOW)])
def test_epilogues_vs_eager(check, backends, dtype):
    torch.manual_seed(0)
    opts = kiln.Options(gemm_backends=backends)
    compiled = check(Epilogues(dtype), _inputs(7, dtype), dynamic_shapes=_dyn(), options=opts,
                     more=[_inputs(m, dtype) for m in M_SIZES])
    fused = _fused(compiled)
    assert len(fused) == 8, fused
    src = compiled.built.sources["gemm.cpp"]
    assert src.count("static inline void epi_rows_") == 8
    if backends == ("cpp",):  # every GEMM on the packed kernel, its epilogue inside
        assert src.count("// epilogue fused: ") == 8, src
    if backends == ("blas",):  # BLAS, then the epilogue over the result
        assert compiled.built.sources["model.cpp"].count("epi_") >= 8


def test_generated_code_names_the_fused_ops():
    compiled = kiln.compile(Epilogues().eval(), _inputs(7), dynamic_shapes=_dyn(),
                            options=kiln.Options(gemm_backends=("cpp",)))
    src = compiled.built.sources["gemm.cpp"]
    for name, epi in _fused(compiled).items():
        assert f"// epilogue of gemm {name}, fused into it: {epi.name} <- " in src
        assert f'extern "C" int gemm_{name}(' in src
    # the fused members are gone from the kernels: no erf / tanh pass over a GEMM result left
    kernels = "".join(v for k, v in compiled.built.sources.items() if k.startswith("kernels"))
    assert "kr::erf" not in kernels and "tanh" not in kernels


def test_fusion_off_keeps_separate_kernels(check):
    compiled = check(Epilogues(), _inputs(7), dynamic_shapes=_dyn(),
                     options=kiln.Options(cpu_gemm_epilogue=False),
                     more=[_inputs(m) for m in (1, 64)])
    assert not _fused(compiled)


class Batched(nn.Module):
    """Batched matmuls of two activations (B not constant: gemm_split) with epilogues, one
    over a [b, m, n] result read back as [b*m, n]."""

    def forward(self, a, b, r):
        y = torch.relu(torch.bmm(a, b) + r)
        z = torch.sigmoid(torch.matmul(a, b).reshape(-1, b.shape[-1])) * 2.0
        return y, z


@pytest.mark.parametrize("backends,bmn", [
    (("cpp",), (3, 1, 33)), (("blas",), (2, 50, 101)), (("cpp",), (4, 130, 17)),
    pytest.param(("cpp",), (2, 50, 101), marks=SLOW),
    pytest.param(("blas",), (4, 130, 17), marks=SLOW)])
def test_batched_activations(check, backends, bmn):
    nb, m, n = bmn
    args = (rand((nb, m, 45), low=-2, high=2), rand((nb, 45, n), low=-2, high=2),
            rand((nb, m, n), low=-2, high=2))
    compiled = check(Batched(), args, options=kiln.Options(gemm_backends=backends))
    assert len(_fused(compiled)) == 2


class NotFusible(nn.Module):
    """GEMM results that must be stored: read by two kernels, read transposed, a program
    output read again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(K, N), nn.Linear(K, N), nn.Linear(K, N)

    def forward(self, x):
        y = self.a(x)
        u = torch.relu(y).sum(-1)
        v = torch.softmax(y, -1)               # a second reader (a row reduction)
        w = self.b(x).t().contiguous() + 1.0   # read at another element
        z = self.c(x)
        return u, v, w, z, z * 2.0             # an output read again


def test_not_fusible_stay_correct(check):
    check(NotFusible(), (rand((7, K), low=-2, high=2),),
          more=[(rand((m, K), low=-2, high=2),) for m in (1, 64)],
          dynamic_shapes=({0: torch.export.Dim("m", min=1, max=256)},))


def test_bfloat16_correct(check):
    torch.manual_seed(2)
    model = Epilogues(torch.bfloat16)
    tol = {"atol": 0.06, "rtol": 0.03}
    check(model, _inputs(7, torch.bfloat16), dynamic_shapes=_dyn(), ref="f64r", tol=tol,
          more=[_inputs(m, torch.bfloat16) for m in (1, 64)])


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_threads_1_2_3(tmp_path):
    # N = 101: 4 panels of 32 (AVX-512) or 7 of 16: M = 1 splits the panels over the threads,
    # M = 389 (33 row blocks of 12) splits rows when the panels are too few to go round
    model = Epilogues().eval()
    path = kiln.compile(model, _inputs(7), dynamic_shapes=_dyn(512),
                        options=kiln.Options(num_threads=3)).save(tmp_path / "m.kiln")
    for m in (1, 389):
        args = _inputs(m)
        with torch.no_grad():
            want = model.double()(*[a.double() for a in args])
            model.float()
        for t in (1, 2, 3):
            with kiln.load(path, num_threads=t) as r:
                for g, w in zip(r(*args), want):
                    err = (g.double() - w).abs().max().item()
                    assert err <= 1e-4 * (1 + w.abs().max().item()), (m, t, err)


def test_python_wrapper_applies_epilogues(tmp_path):
    model = Epilogues().eval()
    args = _inputs(13)
    path = kiln.compile(model, args).save(tmp_path / "m.kiln")
    with torch.no_grad():
        want = model(*args)
    module, runner = _load_wrapper(read_package(path), Path(tmp_path))
    got = runner(*[a.contiguous() for a in args])
    for g, w in zip(got, want):
        assert math.isclose((g - w).abs().max().item(), 0.0, abs_tol=1e-4)


class _RowRes(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(48, 24)

    def forward(self, x, r):
        return torch.relu(r + self.l(x)) * 2


ROWS = [(1, 1), (1,), (2, 1), (1, 3)]


def test_epilogue_of_rows_with_size1_dims(tmp_path):
    """A [1, 1, C] consumer (a decode step's hidden state) reads the GEMM's [1, C] result at
    i0 + i1 + i2 (the size-1 dims' variables are 0): fused (gemm/fuse.py `epilogue_of`), and
    the package matches eager on fresh inputs. The leading dims of ROWS are the cases of one
    difftest.Cases program (each its own model and inputs, drawn as a package of its own drew
    them: torch.manual_seed(0), the model, the example, two runs); a failure names the case."""
    mods, example, runs = {}, [], [[], []]
    for rows in ROWS:
        torch.manual_seed(0)
        m = _RowRes().eval()
        mods[case_name(rows)] = (m, 2)
        example += [torch.randn(*rows, 48), torch.randn(*rows, 24)]
        for run in runs:
            run += [torch.randn(*rows, 48), torch.randn(*rows, 24)]
    model = Cases(mods).eval()
    cm = kiln.compile(torch.export.export(model, tuple(example)))
    kinds = [k["kind"] for k in cm.manifest["kernels"]]
    assert kinds == ["blas_gemm"] * len(ROWS), cm.manifest["kernels"]
    run = cm.load(tmp_path / "m.kiln")
    for args in runs:
        got, want = run(*args), model(*args)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, k=k: f"rows {k}: {m}")
