"""Autotuning that never loses: with max_autotune, the CPU build also builds the package with
the heuristic's GEMM choices (kiln/targets/cpu/never_lose.py), kiln.compile times both end to
end, interleaved (kiln/runtime/ab_time.py), keeps the faster and records both timings and the
choice (report["gemm_check"], manifest build.gemm_check).

The keep-the-faster logic is checked with a fake clock; the wiring with fake "profiled"
choices that differ from the heuristic's (profiling itself is slow: the last test, marked
slow, runs it for real)."""

from __future__ import annotations

import itertools
import statistics

import pytest
import torch

import kiln
import kiln.api
from kiln.errors import KilnError
from kiln.gemm import choose_gemms
from kiln.gemm.configs import BlasConfig, CppConfig
from kiln.gemm.select import Choice
from kiln.options import GemmBackend
from kiln.runtime import cpu_supports
from kiln.runtime.ab_time import ABResult, time_ab
from kiln.targets.cpu import build as cpu_build

# -- the decision, with a fake clock -------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def runner(self, costs):
        """A callable whose calls take the next of `costs` (cycled) fake seconds."""
        it = itertools.cycle(costs)

        def run():
            self.now += next(it)
        return run


@pytest.mark.parametrize("a_costs,b_costs,faster", [
    ([3.0], [2.0], "b"), ([2.0], [3.0], "a"), ([2.0], [2.0], "a"),
    # medians, not means: A has rare slow outliers but is faster on most calls
    ([1.0, 1.0, 1.0, 50.0], [2.0], "a"),
])
def test_time_ab_keeps_the_lower_median(a_costs, b_costs, faster):
    clock = FakeClock()
    res = time_ab(clock.runner(a_costs), clock.runner(b_costs), clock=clock, warmup=1,
                  min_rounds=8, max_rounds=8, budget_s=0.0)
    assert res.rounds == 8 and res.faster == faster
    # one warm-up call, then 8 timed ones, each side's costs cycling
    assert res.a_s == statistics.median((a_costs * 9)[1:9])
    assert res.b_s == statistics.median((b_costs * 9)[1:9])


def test_time_ab_medians_are_exact_and_rounds_follow_the_budget():
    clock = FakeClock()
    res = time_ab(clock.runner([3.0]), clock.runner([2.0]), clock=clock, warmup=0,
                  min_rounds=2, max_rounds=100, budget_s=49.0)
    assert (res.a_s, res.b_s) == (3.0, 2.0)
    assert res.rounds == 10  # 5 s per round: the budget is reached after 10 rounds
    assert res.to_json() == {"a_ms": 3000.0, "b_ms": 2000.0, "rounds": 10}
    assert ABResult(1.0, 1.0, 1).faster == "a"


@pytest.mark.parametrize("a,b,margin,wins", [(0.97, 1.0, 0.02, True), (0.99, 1.0, 0.02, False),
                                             (1.0, 1.0, 0.0, False), (0.5, 1.0, 0.49, True),
                                             (1.2, 1.0, 0.02, False)])
def test_a_replaces_b_only_when_faster_by_more_than_the_margin(a, b, margin, wins):
    assert ABResult(a, b, 10).a_wins(margin) is wins


def test_time_ab_alternates_the_order():
    order = []
    time_ab(lambda: order.append("a"), lambda: order.append("b"), warmup=0, min_rounds=4,
            max_rounds=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_time_ab_refuses_bad_round_counts():
    with pytest.raises(ValueError, match="min_rounds"):
        time_ab(lambda: None, lambda: None, min_rounds=5, max_rounds=2)


# -- the wiring, with fake "profiled" choices ----------------------------------------------


def _other(c: Choice) -> Choice:
    """A choice the heuristic did not make for the GEMM."""
    if c.backend is GemmBackend.BLAS:
        return Choice(GemmBackend.CPP, CppConfig(4, 2, 128), "profiled", c.problem)
    return Choice(GemmBackend.BLAS, BlasConfig(), "profiled", c.problem)


@pytest.fixture
def fake_profile(monkeypatch):
    """max_autotune "profiles" by taking, for every GEMM, another choice than the
    heuristic's (or the same one with same=True)."""
    mode = {"same": False}

    def fake(steps, symbols, opts, device, tc=None, **kw):
        real = choose_gemms(steps, symbols, opts, device, None, cached=False)
        if not opts.max_autotune or mode["same"]:
            return real
        return {n: _other(c) for n, c in real.items()}

    monkeypatch.setattr(cpu_build, "choose_gemms", fake)
    return mode


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(48, 96)
        self.b = torch.nn.Linear(96, 24)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).softmax(-1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One build cache for the module's builds (objects are shared by content hash)."""
    return str(tmp_path_factory.mktemp("never_lose_cache"))


def _compile(cache):
    torch.manual_seed(0)
    m = Mlp().eval()
    x = torch.randn(40, 48)
    # kiln's own GEMM choices only (no oneDNN candidates where libdnnl is installed)
    opts = kiln.Options(max_autotune=True, cache_dir=cache, cpu_gemm_backends=("kiln",))
    cm = kiln.compile(m, (x,), options=opts)
    return m, cm


def _how(cm) -> set[str]:
    return {k["gemm"]["how"] for k in cm.manifest["kernels"] if "gemm" in k}


def test_both_packages_are_timed_the_faster_kept_and_recorded(tmp_path, cache, fake_profile):
    m, cm = _compile(cache)
    check = cm.report["gemm_check"]
    assert check["tuned_ms"] > 0 and check["default_ms"] > 0 and check["rounds"] >= 10
    # the tuned package only when faster by more than the margin (else a tie: the default)
    tuned_wins = check["tuned_ms"] < check["default_ms"] * (1 - check["margin"])
    assert check["kept"] == ("tuned" if tuned_wins else "default")
    assert len(check["differing_gemms"]) == 2
    assert cm.manifest["build"]["gemm_check"] == check
    assert "never_lose" in cm.report["stages"] and "default_variant" in cm.report["stages"]
    assert _how(cm) == ({"heuristic"} if check["kept"] == "default" else {"profiled"})
    runner = cm.load(tmp_path / "m.kiln")
    for rows in (40,):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(runner(x), m(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("winner", ["tuned", "default"])
def test_the_package_written_is_the_one_timed_faster(tmp_path, cache, fake_profile,
                                                     monkeypatch, winner):
    fast, slow = 1e-3, 1.1e-3  # 10 %: beyond the margin
    res = ABResult(fast, slow, 10) if winner == "tuned" else ABResult(slow, fast, 10)
    monkeypatch.setattr(kiln.api, "time_ab", lambda a, b, **kw: (a(), b(), res)[2])
    m, cm = _compile(cache)
    check = cm.report["gemm_check"]
    assert check["kept"] == winner and check["tuned_ms"] == res.a_s * 1e3
    assert _how(cm) == ({"profiled"} if winner == "tuned" else {"heuristic"})
    # the library and sources are the kept build's: cpp GEMMs in gemm.cpp only where cpp won
    # (the file also holds fused epilogues, which BLAS GEMMs call after the BLAS call)
    has_cpp = any(k["kind"] == "cpp_gemm" for k in cm.manifest["kernels"])
    assert ("kr::gemm_cpp" in cm.sources.get("gemm.cpp", "")) == has_cpp
    x = torch.randn(40, 48)
    torch.testing.assert_close(cm.load(tmp_path / "m.kiln")(x), m(x), rtol=1e-4, atol=1e-5)


def test_no_check_when_tuning_agrees_with_the_heuristic(cache, fake_profile):
    fake_profile["same"] = True
    _, cm = _compile(cache)
    assert "gemm_check" not in cm.report and "gemm_check" not in cm.manifest["build"]
    assert "never_lose" not in cm.report["stages"]


@pytest.mark.slow  # profiles every candidate of every GEMM (about a minute here)
def test_real_max_autotune_never_loses_and_matches_eager(tmp_path):
    cache = str(tmp_path / "c")
    m, cm = _compile(cache)
    check = cm.report.get("gemm_check")
    if check is not None:
        assert check["kept"] in ("tuned", "default")
        best = min(check["tuned_ms"], check["default_ms"])
        assert check[f"{check['kept']}_ms"] == best
    x = torch.randn(40, 48)
    torch.testing.assert_close(cm.load(tmp_path / "m.kiln")(x), m(x), rtol=1e-4, atol=1e-5)


def test_a_package_this_machine_cannot_run_is_kept_untimed(tmp_path, cache, fake_profile,
                                                           monkeypatch):
    """Code for another CPU (the loader refuses it here): nothing to time, the tuned package
    is kept and the report says why."""
    def refuse(path, device="cpu"):
        raise KilnError("kiln_model_load: this CPU lacks avx512f")
    monkeypatch.setattr(kiln.api, "load", refuse)
    _, cm = _compile(cache)
    assert cm.report["gemm_check"]["kept"] == "tuned"
    assert "avx512f" in cm.report["gemm_check"]["skipped"]
    assert _how(cm) == {"profiled"}


@pytest.mark.slow  # two variants of two levels: about a minute on the loaded 2-core box
def test_portable_packages_are_checked_level_by_level(tmp_path, cache, fake_profile):
    """march="portable": both variants carry every level; the kept one's levels are its own
    libraries (the GEMM file and wrapper differ between the variants)."""
    torch.manual_seed(0)
    m = Mlp().eval()
    x = torch.randn(40, 48)
    opts = kiln.Options(max_autotune=True, cache_dir=cache, march="portable",
                        cpu_levels=("x86-64-v3", "x86-64"))
    cm = kiln.compile(m, (x,), options=opts)
    check = cm.report["gemm_check"]
    assert check["kept"] in ("tuned", "default") and len(check["differing_gemms"]) == 2
    levels = cm.manifest["requires"]["cpu_levels"]
    assert [lv["march"] for lv in levels] == ["x86-64-v3", "x86-64"]
    assert cm.built.library == cm.built.cpu_levels[-1].library
    runner = cm.load(tmp_path / "p.kiln")
    v3_here = all(cpu_supports(f) for f in levels[0]["cpu_features"])
    assert runner.cpu_level == ("x86-64-v3" if v3_here else "x86-64")
    torch.testing.assert_close(runner(x), m(x), rtol=1e-4, atol=1e-5)
