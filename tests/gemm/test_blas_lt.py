"""cuBLASLt algorithms as "blas" candidates (kiln/gemm/blaslt.py, kc::lt_blas_gemm in
kiln_cuda_rt.h). Without a GPU: the candidates of a problem (cuBLAS's own choice, then
blaslt_0..7 with config {"algo": i}; none for float64), the heuristic unchanged, the profiling
helper library built with kiln's toolchain, and a cache entry choosing an algorithm that
reaches the package (manifest config, the wrapper's cuBLASLt call, host-compiled) while an
old {} "blas" entry keeps calling cuBLAS. On the GPU (marked `gpu`): packages with
max_autotune and gemm_backends=("blas",) for mm / addmm / bmm in fp16, bf16, fp32, nn and nt
layouts, odd sizes and a dynamic M against eager, with the blaslt candidates profiled; a
forced index beyond what the heuristic offers still runs (result 0); the helper's every
algorithm against the float32 product."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.gemm import blaslt, gpu  # noqa: E402
from kiln.gemm import cache as acache  # noqa: E402
from kiln.gemm.configs import BlasConfig, BlasLtConfig  # noqa: E402
from kiln.gemm.problem import GemmProblem, problem_of  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.options import Options  # noqa: E402


class BMM(torch.nn.Module):
    def __init__(self, nt):
        super().__init__()
        self.nt = nt

    def forward(self, a, b):
        return torch.bmm(a, b.transpose(1, 2) if self.nt else b)


@pytest.fixture(scope="module")
def helper_opts(tmp_path_factory):
    return Options(cache_dir=str(tmp_path_factory.mktemp("blaslt_cache")))


def test_candidates_include_cublaslt_algorithms(helper_opts, tmp_path):
    p = GemmProblem("float16", (), 64, 96, 40, "n", "t", 8)
    cands, dropped = gpu.candidates(p, ["blas"], (1, 64, 96, 40), helper_opts, tmp_path)
    assert not dropped
    assert [c.name for c in cands] == ["blas"] + [f"blaslt_{i}" for i in range(blaslt.ALGOS)]
    assert cands[0] == gpu.Candidate("blas", "blas", BlasConfig())
    for i, c in enumerate(cands[1:]):
        assert c.backend == "blas" and c.config == BlasLtConfig(i) and Path(c.so).is_file()
    # float64: cuBLAS only (cuBLASLt's float path here is f16 / bf16 / f32)
    p64 = GemmProblem("float64", (), 8, 8, 8, "n", "n", 8)
    cands, _ = gpu.candidates(p64, ["blas"], (1, 8, 8, 8), helper_opts, tmp_path)
    assert [c.name for c in cands] == ["blas"]
    # without measurements the choice is cuBLAS's own, as before
    assert gpu.heuristic(p, ["blas", "triton"], (1, 64, 96, 40), helper_opts) == \
        ("blas", BlasConfig())


def test_helper_library_builds_and_exports(helper_opts):
    so = blaslt.build_helper(helper_opts)
    lib = ctypes.CDLL(str(so))  # nothing of CUDA is opened before the first call
    assert lib.kiln_lt_run and lib.kiln_lt_algos
    assert "#include \"kiln_cuda_rt.h\"" in blaslt.HELPER and "kc::lt_blas_gemm<T>" in \
        blaslt.HELPER


def _gemm_problems(built):
    ranges = {s.name: (s.min, s.max) for s in built.graph.symbols}
    return [(g, problem_of(g, ranges)) for g in built.steps if isinstance(g, L.Gemm)]


def test_cache_entry_with_algo_reaches_package(tmp_path):
    """A "blas" choice with {"algo": 2} (as max_autotune records it) is linked as a
    cuBLASLt call with index 2; an old {} entry keeps kc::gemm; the wrapper compiles."""
    from tests.difftest import assert_host_compiles

    class Two(torch.nn.Module):
        def forward(self, x, w, a, b):
            return x @ w.t(), torch.bmm(a, b)
    m = torch.export.Dim("m", min=1, max=300)
    args = (torch.randn(37, 24).half(), torch.randn(20, 24).half(), torch.randn(3, 5, 8),
            torch.randn(3, 8, 6))
    ep = torch.export.export(Two(), args, dynamic_shapes={"x": {0: m}, "w": None, "a": None,
                                                          "b": None})
    opts = Options(cuda_archs=(90,), gemm_backends=("blas",), cache_dir=str(tmp_path))
    first = kiln.compile(ep, device="cuda", options=opts)
    assert "kc::lt_blas_gemm" not in first.sources["model_cuda.cpp"]  # heuristic: cuBLAS
    assert not [x for x in first.manifest["requires"]["shared_libraries"] if "cublasLt" in x]
    (mm, p_mm), (bmm, p_bmm) = _gemm_problems(first.built)
    dev = gpu.device_id(90)
    acache.store(tmp_path, p_mm, dev, {
        "winner": {"backend": "blas", "config": {"algo": 2}},
        "results": [["blas", "blas", {}, 3e-5], ["blaslt_0", "blas", {"algo": 0}, 2.5e-5],
                    ["blaslt_2", "blas", {"algo": 2}, 2e-5]]})
    acache.store(tmp_path, p_bmm, dev, {  # an entry from before cuBLASLt candidates
        "winner": {"backend": "blas", "config": {}}, "results": [["blas", "blas", {}, 1e-5]]})
    cm = kiln.compile(ep, device="cuda", options=opts)
    got = {k["name"]: k["gemm"] for k in cm.manifest["kernels"] if "gemm" in k}
    assert got[mm.name]["config"] == {"algo": 2} and got[mm.name]["how"] == "cache"
    assert got[mm.name]["timings"]["blas"][0] == ["blaslt_2", 2e-5]
    assert got[bmm.name]["config"] == {} and got[bmm.name]["how"] == "cache"
    assert [x for x in cm.manifest["requires"]["shared_libraries"] if "cublasLt" in x]
    cpp = cm.sources["model_cuda.cpp"]
    assert f"kc::lt_blas_gemm<kc::f16>(e, self->lt, self->blas, stream, \"{mm.name}\", 2," in cpp
    assert "&self->blaslt_plan[0]" in cpp and "kc::LtGemmPlan blaslt_plan[1];" in cpp
    assert f"kc::gemm<float>(e, self->blas, stream, \"{bmm.name}\"" in cpp
    assert "kc::blaslt().create(&self->lt)" in cpp
    assert_host_compiles(tmp_path, cpp)


# -- on the GPU ---------------------------------------------------------------------------

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}


def _run_pkg(tmp_path, ep, calls, dtype, **kw):
    opts = Options(gemm_backends=("blas",), cache_dir=str(tmp_path / "cache"), **kw)
    cm = kiln.compile(ep, device="cuda", options=opts)
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    for args, want in calls:
        got = runner(*args)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for x, y in zip(got, want):
            tol = TOL[dtype] * max(1.0, float(y.abs().max()) ** 0.5)
            torch.testing.assert_close(x.float(), y.float(), rtol=TOL[dtype], atol=tol)
    return cm


class Three(torch.nn.Module):
    """mm, addmm and bmm in one package, each with its right operand read in place in the
    "nn" or "nt" layout (`w`, `b` inputs transposed inside; the addmm weight a parameter)."""

    def __init__(self, k, n, nt, dtype):
        super().__init__()
        self.nt = nt
        shape = (n, k) if nt else (k, n)
        self.w2 = torch.nn.Parameter(torch.randn(*shape, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.randn(n, dtype=dtype))

    def forward(self, x, w, a, b):
        def t(v):
            return v.transpose(-1, -2) if self.nt else v
        return x @ t(w), torch.addmm(self.bias, x, t(self.w2)), torch.bmm(a, t(b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("layout", ["nn", "nt"])
def test_package_blaslt_profiled(tmp_path, dtype, layout):
    """max_autotune with gemm_backends=("blas",) on mm / addmm / bmm: cuBLAS and the
    cuBLASLt algorithms are profiled (the heuristic's first always timed, every other index
    timed or dropped with a reason, none wrong), and the package runs the winners over a
    dynamic M (odd sizes) against eager."""
    _cuda()
    torch.manual_seed(0)
    k, n = 72, 40
    dev = dict(device="cuda", dtype=dtype)
    nt = layout == "nt"
    mod = Three(k, n, nt, dtype).cuda()
    wshape = (n, k) if nt else (k, n)
    w, b = torch.randn(*wshape, **dev), torch.randn(3, *wshape, **dev)
    m = torch.export.Dim("m", min=1, max=512)
    ep = torch.export.export(mod, (torch.randn(37, k, **dev), w, torch.randn(3, 37, k, **dev), b),
                             dynamic_shapes={"x": {0: m}, "w": None, "a": {1: m}, "b": None})
    calls = []
    with torch.no_grad():
        for r in (1, 37, 301):
            args = (torch.randn(r, k, **dev), w, torch.randn(3, r, k, **dev), b)
            calls.append((args, mod(*args)))
        cm = _run_pkg(tmp_path, ep, calls, dtype, max_autotune=True)
    g = [k_["gemm"] for k_ in cm.manifest["kernels"] if "gemm" in k_]
    assert len(g) == 3 and all(c["how"] == "profiled" and c["backend"] == "blas" for c in g), g
    # (mm and addmm may share a problem: the bias stays a kernel of its own under "blas")
    entries = {e["problem"]: e for e in (json.loads(p.read_text()) for p in
                                         (tmp_path / "cache" / "autotune").glob("*.json"))}
    for c in g:
        assert set(c["config"]) <= {"algo"}, c
        assert not [d for d in c["dropped"] if "wrong answer" in d[1]], c["dropped"]
        timed = {r[0] for r in entries[c["problem"]]["results"]}
        assert "blas" in timed and "blaslt_0" in timed, timed  # the heuristic's first runs
        # every other index is timed or dropped (beyond what the heuristic offers)
        seen = timed | {d[0] for d in c["dropped"]}
        assert {f"blaslt_{i}" for i in range(blaslt.ALGOS)} <= seen, (c, seen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_forced_algo_beyond_heuristic_falls_back(tmp_path, dtype):
    """A cache entry naming algorithm 50 (more than the heuristic offers): the package runs
    the heuristic's first result and matches eager, over a dynamic M and a batch."""
    _cuda()
    torch.manual_seed(1)
    dev = dict(device="cuda", dtype=dtype)
    mod = BMM(True)
    ex = (torch.randn(2, 33, 48, **dev), torch.randn(2, 24, 48, **dev))
    m = torch.export.Dim("m", min=1, max=256)
    ep = torch.export.export(mod, ex, dynamic_shapes={"a": {1: m}, "b": None})
    opts = Options(gemm_backends=("blas",), cache_dir=str(tmp_path / "cache"))
    built = kiln.compile(ep, device="cuda", options=opts).built
    (g, problem), = _gemm_problems(built)
    from kiln.toolchain.cuda import default_archs
    acache.store(tmp_path / "cache", problem, gpu.device_id(default_archs()[0]), {
        "winner": {"backend": "blas", "config": {"algo": 50}},
        "results": [["blaslt_50", "blas", {"algo": 50}, 1e-6], ["blas", "blas", {}, 1e-5]]})
    b = torch.randn(2, 24, 48, **dev)
    calls = [((a, b), mod(a, b)) for a in (torch.randn(2, r, 48, **dev) for r in (1, 33, 255, 33))]
    cm = _run_pkg(tmp_path, ep, calls, dtype)
    assert "kc::lt_blas_gemm" in cm.sources["model_cuda.cpp"] and ", 50," in \
        cm.sources["model_cuda.cpp"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_helper_every_algorithm_matches(helper_opts, dtype):
    """The profiling helper: each index the heuristic offers computes the product (batched,
    A transposed), the count is the same for every index, and index 60 runs result 0."""
    _cuda()
    so = str(blaslt.build_helper(helper_opts))
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(2, 96, 200, device="cuda", dtype=dt, generator=g).transpose(1, 2)
    b = torch.randn(2, 96, 136, device="cuda", dtype=dt, generator=g)
    want = torch.matmul(a.float(), b.float())
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    tol = (1e-4 if dt == torch.float32 else 2e-2) * 96 ** 0.5 * 4
    counts = set()
    for algo in list(range(blaslt.ALGOS)) + [60]:
        c = torch.zeros(2, 200, 136, device="cuda", dtype=dt)
        run, count = blaslt.runner(so, algo, dtype, a, b, c, ws)
        run()
        torch.cuda.synchronize()
        counts.add(count())
        err = float((c.float() - want).abs().max())
        assert err <= tol, (algo, err)
    assert len(counts) == 1 and counts.pop() >= 1
