"""GEMM autotuning (kiln/autotune) and the "cpp" GEMM backend: every GEMM kind through
kiln.compile + kiln.load against eager on fresh inputs under each CPU backend, profiling in
child processes (a crashing, hanging or wrong candidate is dropped), the on-disk cache, the
heuristic, and what `kiln inspect` shows."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import kiln
from kiln.gemm import cache as acache
from kiln.gemm import cpu
from kiln.gemm.problem import GemmProblem
from kiln.gemm.profile import run_candidate
from kiln.errors import UnsupportedError
from tests.difftest import Checker, Fn, dim, gen, rand


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    return Checker(tmp_path_factory.mktemp("autotune"))


class Linear(torch.nn.Module):
    def __init__(self, k, n, act=None, dtype=torch.float32):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, dtype=dtype)
        self.act = act

    def forward(self, x):
        y = self.lin(x)
        return self.act(y) if self.act else y


def _all_kinds(a, b, c, d, e, f, p, q, bias, x1, w1):
    """Every GEMM kind and operand layout at once (one compile per backend and dtype)."""
    return {"mm_row": a[:1] @ b[:, :7], "mm": a @ b, "mm_bt": c @ d.t(), "mm_at": c.t() @ e,
            "bmm": torch.bmm(f, p), "sliced": a[:, 1:] @ b[:-1], "skinny": q @ b,
            "addmm": torch.addmm(bias, x1, w1)}


def _kind_args(dtype, g):
    shapes = [(37, 53), (53, 71), (9, 40), (33, 40), (9, 19), (3, 13, 17), (3, 17, 21),
              (2, 53), (25,), (6, 31), (31, 25)]
    return [rand(s, dtype, g) for s in shapes]


@pytest.mark.parametrize("backend,dtype", [("cpp", torch.float32), ("cpp", torch.float64),
                                           ("blas", torch.float32)])
def test_gemm_kinds_each_backend(check, dtype, backend):
    g = gen("autotune", dtype, backend)
    opts = kiln.Options(gemm_backends=(backend,))
    compiled = check(Fn(_all_kinds), _kind_args(dtype, g), options=opts,
                     more=[_kind_args(dtype, g)])
    backends = {k["kind"] for k in compiled.manifest["kernels"] if k["kind"].endswith("_gemm")}
    assert backends == {f"{backend}_gemm"}


class _Block(torch.nn.Module):
    """Linear + each epilogue, a conv + residual, through the "cpp" backend."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(48, 70)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x, img, res):
        y = self.lin(x)
        return {"plain": y, "relu": torch.relu(y), "gelu": torch.nn.functional.gelu(y),
                "conv_residual": self.conv(img) + res}


def test_epilogues_and_conv_cpp(check):
    g = gen("block")

    def args():
        return [rand((11, 48), torch.float32, g), rand((2, 3, 9, 10), torch.float32, g),
                rand((2, 8, 9, 10), torch.float32, g)]
    check(_Block(), args(), options=kiln.Options(gemm_backends=("cpp",)), more=[args()])


def test_dynamic_rows_cpp(check):
    g = gen("dyn")
    m = Linear(24, 40, torch.relu)
    x = rand((9, 24), torch.float32, g)
    compiled = check(m, [x], dynamic_shapes=({0: dim("rows", 1, 500)},),
                     options=kiln.Options(gemm_backends=("cpp",)),
                     more=[[rand((1, 24), torch.float32, g)], [rand((457, 24), torch.float32, g)]])
    gemm = next(k["gemm"] for k in compiled.manifest["kernels"] if "gemm" in k)
    assert "[1..500]" in gemm["problem"]


def test_options_validate_backends():
    with pytest.raises(ValueError, match="gemm_backends"):
        kiln.Options(gemm_backends=("mkl",))
    with pytest.raises(ValueError, match="gemm_backends"):
        kiln.Options(gemm_backends=())


def test_no_backend_for_device(check):
    m = Fn(lambda a, b: a @ b, "mm")
    with pytest.raises(UnsupportedError, match="no GEMM backend for device 'cpu'"):
        kiln.compile(m, (torch.randn(3, 4), torch.randn(4, 5)),
                     options=kiln.Options(gemm_backends=("cutlass", "triton")))


def test_heuristic():
    small = GemmProblem("float32", (), 5, 64, 64, "n", "n", 16)
    big = GemmProblem("float32", (), 512, 512, 512, "n", "n", 16)
    assert cpu.heuristic(small, ("blas", "cpp"), "native")[0] == "cpp"
    skinny = GemmProblem("float32", (), 4, 1024, 1024, "t", "n", 16)
    assert cpu.heuristic(skinny, ("blas", "cpp"), "native")[0] == "cpp"
    linear = GemmProblem("float32", (), 5, 64, 64, "n", "t", 16)
    assert cpu.heuristic(linear, ("blas", "cpp"), "native")[0] == "blas"
    assert cpu.heuristic(big, ("blas", "cpp"), "native")[0] == "blas"
    assert cpu.heuristic(big, ("cpp",), "native")[0] == "cpp"
    assert cpu.heuristic(small, ("blas",), "native")[0] == "blas"


def test_cpp_configs_fit_registers():
    for march in ("haswell", "skylake-avx512", ""):
        regs = cpu.vector_registers(march)
        for c in cpu.cpp_configs(march):
            assert c.mr * c.nv + c.nv + 1 <= regs
    assert cpu.vector_registers("skylake-avx512") == 32
    assert cpu.vector_registers("haswell") == 16


def test_problem_key_and_cache_round_trip(tmp_path):
    p = GemmProblem("float32", (2,), (1, 64), 30, 40, "n", "t", 4, "")
    assert p.key("cpu:x") != p.key("cpu:y")
    assert p.key("cpu:x") != GemmProblem("float64", (2,), (1, 64), 30, 40, "n", "t", 4).key(
        "cpu:x")
    assert p.key("cpu:x") != GemmProblem("float32", (2,), (1, 64), 30, 40, "n", "n", 4).key(
        "cpu:x")
    assert acache.load(tmp_path, p, "cpu:x") is None
    entry = {"winner": {"backend": "cpp", "config": {"mr": 6}}, "results": [["b", "blas", {}, 1.0]]}
    path = acache.store(tmp_path, p, "cpu:x", entry)
    got = acache.load(tmp_path, p, "cpu:x")
    assert got["winner"] == entry["winner"] and got["results"] == entry["results"]
    assert acache.load(tmp_path, p, "cpu:y") is None
    path.write_text("{not json")
    assert acache.load(tmp_path, p, "cpu:x") is None


def test_config_json_round_trip():
    """Each backend's config type writes the JSON manifests and the cache held before the
    types (dicts with these keys) and reads it back; older entries load too."""
    from kiln.gemm.configs import (BlasConfig, BlasLtConfig, CppConfig, CutlassConfig,
                                   TritonConfig, config_from_json)
    from kiln.gemm.select import Choice
    from kiln.options import GEMM_BACKENDS, GemmBackend
    cases = [("blas", BlasConfig(), {}), ("blas", BlasLtConfig(3), {"algo": 3}),
             ("cpp", CppConfig(6, 2), {"mr": 6, "nv": 2, "kc": 256, "nc": 1024}),
             ("triton", TritonConfig(64, 128, 32, 8, 4, 4),
              {"name": "triton_64x128x32_g8_s4_w4", "block_m": 64, "block_n": 128,
               "block_k": 32, "group_m": 8, "num_stages": 4, "num_warps": 4}),
             ("triton", TritonConfig(128, 128, 64, 8, 5, 8, True),
              {"name": "triton_128x128x64_g8_s5_w8_tma", "block_m": 128, "block_n": 128,
               "block_k": 64, "group_m": 8, "num_stages": 5, "num_warps": 8, "tma": True}),
             ("cutlass", CutlassConfig("k1"), {"name": "k1"}),
             ("cutlass", CutlassConfig("k1", "evt relu(acc)"),
              {"name": "k1", "evt": "evt relu(acc)"})]
    for backend, cfg, js in cases:
        assert cfg.to_json() == js and cfg.backend == backend
        assert config_from_json(backend, json.loads(json.dumps(js))) == cfg
        c = Choice(backend, cfg, "cache", "p")
        assert c.backend is GemmBackend(backend)
        assert json.loads(json.dumps(c.to_json()))["config"] == js
        assert json.loads(json.dumps(c.to_json()))["backend"] == backend
    # an entry without the optional template fields: the printer's defaults
    assert config_from_json("triton", {"block_m": 16, "block_n": 64, "block_k": 256}) == \
        TritonConfig(16, 64, 256, 8, 3, 4)
    with pytest.raises(TypeError):
        Choice("cpp", BlasConfig())
    assert GEMM_BACKENDS == ("blas", "cpp", "triton", "cutlass")
    # every backend but oneDNN's (chosen through Options.cpu_gemm_backends) is accepted
    assert [b for b in GemmBackend if b is not GemmBackend.ONEDNN] == list(GEMM_BACKENDS)
    assert f"{GemmBackend.CPP}" == "cpp"


def test_profiler_drops_bad_candidates():
    py = sys.executable
    ok = run_candidate([py, "-c", "print('KILN_PROFILE 1e-3 0 1e-6')"], 30)
    assert ok.seconds == pytest.approx(1e-3)
    crash = run_candidate([py, "-c", "import os; os.abort()"], 30)
    assert crash.seconds is None and "crash (signal" in crash.reason
    hang = run_candidate([py, "-c", "import time; time.sleep(30)"], 0.5)
    assert hang.seconds is None and "hang" in hang.reason
    wrong = run_candidate([py, "-c", "print('KILN_PROFILE 1e-3 5 1e-6')"], 30)
    assert wrong.seconds is None and "wrong answer" in wrong.reason
    nan = run_candidate([py, "-c", "print('KILN_PROFILE 1e-3 nan 1e-6')"], 30)
    assert nan.seconds is None and "wrong answer" in nan.reason
    silent = run_candidate([py, "-c", "pass"], 30)
    assert silent.seconds is None and "no result" in silent.reason


@pytest.mark.slow  # builds the benchmark driver (12 tiles at -O3) and profiles 13 candidates
def test_max_autotune_profiles_caches_and_inspect_shows(tmp_path, capsys):
    g = gen("tune")
    m = Linear(32, 24, torch.relu)
    x = rand((4, 32), torch.float32, g)
    cache = tmp_path / "cache"
    tuned = kiln.compile(m.eval(), (x,), options=kiln.Options(max_autotune=True,
                                                               cache_dir=str(cache)))
    gemm = next(k["gemm"] for k in tuned.manifest["kernels"] if "gemm" in k)
    assert gemm["how"] == "profiled"
    assert set(gemm["timings"]) == {"blas", "cpp"}
    assert all(s > 0 for runs in gemm["timings"].values() for _, s in runs)
    assert not gemm["dropped"]
    assert len(list((cache / "autotune").glob("*.json"))) == 1
    out = tuned.load(tmp_path / "t.kiln")(x)
    torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-4)
    again = kiln.compile(m.eval(), (x,), options=kiln.Options(cache_dir=str(cache)))
    g2 = next(k["gemm"] for k in again.manifest["kernels"] if "gemm" in k)
    assert g2["how"] == "cache" and g2["backend"] == gemm["backend"]
    assert g2["config"] == gemm["config"]
    only_blas = kiln.compile(m.eval(), (x,), options=kiln.Options(cache_dir=str(cache),
                                                                   gemm_backends=("blas",)))
    g3 = next(k["gemm"] for k in only_blas.manifest["kernels"] if "gemm" in k)
    assert g3["how"] == "cache" and g3["backend"] == "blas"
    from kiln.cli.main import main
    assert main(["inspect", str(tmp_path / "t.kiln")]) == 0
    text = capsys.readouterr().out
    assert "GEMMs (autotuning)" in text and "profiled" in text
    assert main(["inspect", "--json", str(tmp_path / "t.kiln")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["gemms"][0]["how"] == "profiled"
