"""The template's autotuning candidates are the kernels a package would contain, profiled
with the GEMM's absorbed epilogue (kiln/gemm/printed.py), and unfused candidates are
charged the epilogue's own kernel (kiln/gemm/gpu.py `profile`). No GPU needed: the printed
kernels run in Triton's interpreter (a subprocess), the profiling child is replaced by a fake
that prints the protocol's lines."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.gemm import gpu  # noqa: E402
from kiln.gemm.configs import BlasConfig, CutlassConfig, TritonConfig  # noqa: E402
from kiln.gemm import printed as PR  # noqa: E402
from kiln.targets.cuda.gemm_candidates import build as build_candidates  # noqa: E402
from kiln.gemm.problem import problem_of  # noqa: E402
from kiln.gemm.select import choose_gemms  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.options import GemmBackend, Options  # noqa: E402
from kiln.gemm.fuse import epilogue_member  # noqa: E402
from tests.difftest import run_interpreted  # noqa: E402

CONFIGS = {c.name: c for c in (TritonConfig(32, 32, 32, 8, 2, 4),
                                TritonConfig(16, 64, 32, 8, 2, 4))}


class Lin(torch.nn.Module):
    """bias + gelu + a scaled residual after a linear; a batched matmul with relu."""

    def __init__(self, k=40, n=48):
        super().__init__()
        self.lin = torch.nn.Linear(k, n)

    def forward(self, x, r, y):
        return torch.nn.functional.gelu(self.lin(x)) + 0.5 * r, torch.bmm(y, y.mT).relu()


def _gemms(tmp_path, dtype=torch.float32, k=40, n=48, m=33):
    """(steps, buffers, env, outputs) of the CUDA program before GEMM fusion (cuBLAS picked,
    so every GEMM and its epilogue are separate steps)."""
    torch.manual_seed(0)
    mod = Lin(k, n).to(dtype)
    args = (torch.randn(m, k, dtype=dtype), torch.randn(m, n, dtype=dtype),
            torch.randn(3, 7, 24, dtype=dtype))
    ep = torch.export.export(mod, args)
    b = kiln.compile(ep, device="cuda", options=Options(cuda_archs=(90,), cache_dir=str(
        tmp_path), gemm_backends=("blas",))).built
    keep = set(b.loop.outputs)
    env = {s.name: s.example for s in b.graph.symbols}
    return b.steps, L.all_buffers(b.loop), env, keep, b.graph.symbols


def test_printed_candidates_are_the_package_kernels_with_their_epilogue(tmp_path):
    steps, bufs, env, keep, _ = _gemms(tmp_path)
    i = next(j for j, s in enumerate(steps) if isinstance(s, L.Gemm) and not s.batch)
    g, epi = steps[i], epilogue_member(steps, i, keep)
    assert epi is not None
    p = build_candidates(g, epi, bufs, env, CONFIGS)
    assert set(p.kernels) == set(CONFIGS)
    for j, k in enumerate(p.kernels.values()):
        assert k.name == f"gemm_{g.name}__{j}" and f"def {k.name}(" in p.module
        assert f"epilogue {epi.name}" in k.source and "tl.erf" in k.source
    assert p.epilogue_kernel is not None and f"def epilogue_{epi.name}(" in p.module
    # the buffers of the GEMM, its epilogue's reads and result; nothing else of the program
    assert {g.a.buf, g.b.buf, g.name, epi.name} <= set(p.buffers)
    assert set(p.buffers) <= set(bufs)
    back = PR.read(PR.write(p, tmp_path / "p.pkl"))
    assert back.module == p.module and back.kernels.keys() == p.kernels.keys()


def test_epilogue_key_ignores_buffer_names(tmp_path):
    keys = []
    for k, n in ((40, 48), (24, 48)):
        steps, bufs, env, keep, _ = _gemms(tmp_path / str(k), k=k, n=n)
        i = next(j for j, s in enumerate(steps) if isinstance(s, L.Gemm) and not s.batch)
        keys.append(PR.epilogue_key(epilogue_member(steps, i, keep)))
    assert keys[0] == keys[1] and keys[0].startswith("pw:")
    steps, bufs, env, keep, _ = _gemms(tmp_path / "bmm")
    i = next(j for j, s in enumerate(steps) if isinstance(s, L.Gemm) and s.batch)
    assert PR.epilogue_key(epilogue_member(steps, i, keep)) != keys[0]  # relu, not gelu


_CHILD = textwrap.dedent("""
    import sys
    from kiln.gemm.printed import Bench, read
    p = read(sys.argv[1])
    b = Bench(p, device="cpu")
    for name in p.kernels:
        err, tol = b.check(name), b.tolerance()
        print("cand", name, err, tol)
        assert err <= tol, (name, err, tol)
    b.epilogue()
    # a kernel that stores a wrong result is caught by the check
    name = next(iter(p.kernels))
    k = p.kernels[name]
    bad = k.source.replace(", mask=mask)\\n", " * 1.25, mask=mask)\\n")
    assert bad != k.source
    from kiln.targets.cuda.wrapper_py import import_triton_module
    b.module = import_triton_module(p.module.replace(k.source, bad))
    err = b.check(name)
    print("bad", err, b.tolerance())
    assert err > b.tolerance()
    print("ALL OK")
""")


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.float16, marks=pytest.mark.slow)])
@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_printed_candidates_checked_against_product_and_epilogue(tmp_path, dtype):
    """In Triton's interpreter: both configs of the linear (bias, gelu, residual) and of the
    batched matmul (relu, batch loop) meet the tolerance; a wrong store does not."""
    steps, bufs, env, keep, _ = _gemms(tmp_path, dtype)
    paths = []
    for i, g in enumerate(steps):
        if isinstance(g, L.Gemm):
            p = build_candidates(g, epilogue_member(steps, i, keep), bufs, env, CONFIGS)
            paths.append(PR.write(p, tmp_path / f"{g.name}.pkl"))
    assert len(paths) == 2
    for path in paths:
        run_interpreted(_CHILD, str(path))


def test_gemm_buffers_cover_strided_operands(tmp_path):
    steps, _, env, _, _ = _gemms(tmp_path)
    g = next(s for s in steps if isinstance(s, L.Gemm) and s.batch)  # y @ y.mT: one buffer
    bufs = PR.gemm_buffers(g, env)
    assert set(bufs) == {g.a.buf, g.name} and g.a.buf == g.b.buf
    assert int(bufs[g.a.buf].numel) == 3 * 7 * 24 and int(bufs[g.name].numel) == 3 * 7 * 7
    p = build_candidates(g, None, bufs, env, CONFIGS)
    assert p.epilogue_kernel is None and len(p.kernels) == 2


class _Fake:
    def __init__(self, lines):
        self.stdout, self.stderr, self.returncode = "\n".join(lines) + "\n", "", 0


def test_unfused_candidates_are_charged_the_epilogue_kernel(tmp_path, monkeypatch):
    lines = [f"KILN_PROFILE {PR.EPILOGUE} 3e-06 0 1", "KILN_PROFILE blas 1e-05 0 1",
             "KILN_PROFILE t1 1.2e-05 0 1", "KILN_PROFILE c1 1e-05 0 1",
             "KILN_PROFILE c2 1.1e-05 0 1"]
    cands = [gpu.Candidate("blas", GemmBackend.BLAS, BlasConfig()),
             gpu.Candidate("t1", GemmBackend.TRITON, TritonConfig(32, 32, 32)),
             gpu.Candidate("c1", GemmBackend.CUTLASS, CutlassConfig("c1")),
             gpu.Candidate("c2", GemmBackend.CUTLASS, CutlassConfig("c2", "k"), "/x.so",
                           {"operands": [["col", "float16"]], "out": "float16"})]
    # the child reads back what the parent hands over
    assert [gpu.Candidate.from_json(json.loads(json.dumps(c.to_json()))) for c in cands] == \
        cands
    steps, bufs, env, keep, syms = _gemms(tmp_path)
    g = next(s for s in steps if isinstance(s, L.Gemm) and not s.batch)
    problem = problem_of(g, {s.name: (s.min, s.max) for s in syms})
    # (patched after the compile, which runs processes of its own: subprocess is one module)
    monkeypatch.setattr(gpu.subprocess, "run", lambda *a, **k: _Fake(lines))
    results, dropped = gpu.profile(problem, (0, 33, 48, 40), cands, 10.0, None)
    got = {n: s for n, _, _, s in results}
    assert not dropped
    assert got == pytest.approx({"blas": 13e-6, "t1": 12e-6, "c1": 13e-6, "c2": 11e-6})


def test_choice_problem_names_the_templates_epilogue(tmp_path):
    """With the template allowed, a GEMM's problem (its cache key) includes the epilogue it
    was profiled with; with cuBLAS alone it is the plain GEMM's."""
    steps, bufs, env, keep, syms = _gemms(tmp_path)
    opts = Options(cuda_archs=(90,), cache_dir=str(tmp_path), gemm_backends=("blas", "triton"))
    both = choose_gemms(steps, syms, opts, "cuda", outputs=keep, buffers=bufs)
    assert all("+pw:" in c.problem for c in both.values()), both
    blas = choose_gemms(steps, syms, Options(cuda_archs=(90,), cache_dir=str(tmp_path),
                                             gemm_backends=("blas",)),
                        "cuda", outputs=keep, buffers=bufs)
    assert not any("+" in c.problem for c in blas.values())


def test_epilogue_alone_when_the_template_is_not_a_candidate(tmp_path):
    """Without template configs (e.g. gemm_backends=("blas", "cutlass")) the record still
    holds the GEMM's operands and the epilogue kernel, whose time the unfused candidates are
    charged."""
    steps, bufs, env, keep, _ = _gemms(tmp_path)
    i = next(j for j, s in enumerate(steps) if isinstance(s, L.Gemm) and not s.batch)
    g, epi = steps[i], epilogue_member(steps, i, keep)
    p = build_candidates(g, epi, bufs, env, {})
    assert not p.kernels and p.epilogue_kernel is not None
    assert {g.a.buf, g.b.buf, g.name, epi.name} <= set(p.buffers)
