"""Portable packages (Options(march="portable")): the kernels and the GEMM file compiled once
per -march level of Options.cpu_levels, the loader running the best level the CPU has
(requires.cpu_levels; Runner.cpu_level, kiln_model_cpu_level). Checked natively (this CPU's
best level; lower levels by marking the levels above them as needing a feature this CPU
lacks), and from C under qemu-x86_64 emulating older CPUs (Haswell: x86-64-v3; qemu64:
baseline x86-64), each against eager."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

import kiln
from kiln.cli.main import main
from kiln.errors import KilnError
from kiln.gemm.configs import CppConfig
from kiln.gemm.cpu import vector_registers
from kiln.gemm.select import Choice
from kiln.package import read_package
from kiln.runtime import cpu_supports
from kiln.runtime.cbin import read_tensor_bin, write_tensor_bin
from kiln.targets.cpu.build import fit_gemms
from kiln.toolchain.cxx import CPU_FEATURES, cpu_features

LEVELS = ("x86-64-v4", "x86-64-v3", "x86-64")


class Net(torch.nn.Module):
    """A GEMM ("cpp": its tile is chosen for the widest level and refitted for narrower
    ones), fused pointwise kernels and row reductions."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 48)
        self.norm = torch.nn.LayerNorm(48)

    def forward(self, x):
        h = self.norm(torch.nn.functional.gelu(self.fc(x)))
        return torch.softmax(h, -1), h.exp().sum(0)


def _model():
    torch.manual_seed(0)
    return Net().eval()


def _portable(tmp_path, name="p.kiln", **kw):
    model = _model()
    x = torch.randn(32, 64)
    opts = kiln.Options(march="portable", gemm_backends=("cpp",), **kw)
    cm = kiln.compile(model, (x,), options=opts)
    return model, cm


def _best_here(levels=LEVELS) -> str:
    for lv in levels:
        if all(cpu_supports(f) for f in cpu_features("c++", (f"-march={lv}",))):
            return lv
    raise AssertionError("no level runs here")


def _check(model, out, x):
    with torch.no_grad():
        ref = model(x)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


def test_manifest_lists_each_level_with_its_library_and_features(tmp_path, capsys):
    model, cm = _portable(tmp_path)
    req = cm.manifest["requires"]
    levels = req["cpu_levels"]
    assert [lv["march"] for lv in levels] == list(LEVELS)
    assert [lv["library"] for lv in levels] == ["lib/model.x86-64-v4.so",
                                                "lib/model.x86-64-v3.so", "lib/model.so"]
    for lv in levels:
        assert lv["cpu_features"] == list(cpu_features("c++", (f"-march={lv['march']}",)))
    assert "avx512f" in levels[0]["cpu_features"] and "avx2" in levels[1]["cpu_features"]
    assert "avx2" not in levels[2]["cpu_features"]
    # lib/model.so (what a libkiln without level support loads) is the baseline build
    assert req["cpu_features"] == levels[2]["cpu_features"]
    assert cm.manifest["build"]["march"] == "portable"
    pkg = read_package(cm.save(tmp_path / "p.kiln"))
    libs = [pkg.read(lv["library"]) for lv in levels]
    assert len(set(libs)) == 3  # three different builds
    # kiln inspect: every level, and the one this machine's loader picks
    assert main(["inspect", "--json", str(tmp_path / "p.kiln")]) == 0
    cpu = json.loads(capsys.readouterr().out)["cpu"]
    assert [lv["march"] for lv in cpu["levels"]] == list(LEVELS)
    assert cpu["picked_here"] == _best_here() and cpu["march"] == "portable"
    assert main(["inspect", str(tmp_path / "p.kiln")]) == 0
    text = capsys.readouterr().out
    assert f"-march={_best_here()} lib/" in text and "picked here" in text, text


def test_runs_the_best_level_of_this_cpu_and_matches_eager(tmp_path):
    model, cm = _portable(tmp_path)
    runner = kiln.load(cm.save(tmp_path / "p.kiln"))
    assert runner.cpu_level == _best_here()
    for rows in (32,):
        x = torch.randn(rows, 64)
        _check(model, runner(x), x)


@pytest.mark.parametrize("skip", [1, 2])
def test_each_lower_level_runs_when_the_ones_above_are_unavailable(tmp_path, skip):
    """The first `skip` levels marked as needing a feature this CPU lacks: the loader passes
    them over and the next level's code (its own kernels and GEMM tile) matches eager."""
    missing = [f for f in CPU_FEATURES.values() if cpu_supports(f) is False]
    if not missing:
        pytest.skip("this CPU has every feature kiln knows")
    model, cm = _portable(tmp_path)
    for lv in cm.manifest["requires"]["cpu_levels"][:skip]:
        lv["cpu_features"].append(missing[0])
    runner = kiln.load(cm.save(tmp_path / "p.kiln"))
    assert runner.cpu_level == _best_here(LEVELS[skip:])
    x = torch.randn(32, 64)
    _check(model, runner(x), x)


def test_no_runnable_level_is_an_error_naming_each_levels_missing_features(tmp_path):
    missing = [f for f in CPU_FEATURES.values() if cpu_supports(f) is False]
    if not missing:
        pytest.skip("this CPU has every feature kiln knows")
    _, cm = _portable(tmp_path, cpu_levels=("x86-64-v3", "x86-64"))
    for lv in cm.manifest["requires"]["cpu_levels"]:
        lv["cpu_features"].append(missing[0])
    with pytest.raises(KilnError) as e:
        kiln.load(cm.save(tmp_path / "p.kiln"))
    msg = str(e.value)
    assert "no build this CPU can run" in msg, msg
    assert f"-march=x86-64-v3 lacks {missing[0]}" in msg and "-march=x86-64 lacks" in msg, msg


def test_a_non_portable_package_reports_its_one_build(tmp_path):
    cm = kiln.compile(lambda x: x.relu(), (torch.randn(4),),
                      options=kiln.Options(march="x86-64-v3"))
    assert "cpu_levels" not in cm.manifest["requires"]
    assert kiln.load(cm.save(tmp_path / "v3.kiln")).cpu_level == "x86-64-v3"


@pytest.mark.parametrize("levels", [(), ("x86-64", "x86-64"), ("native",), ("x86 64",),
                                    "x86-64", (3,)])
def test_bad_levels_are_refused(levels):
    with pytest.raises(ValueError, match="cpu_levels"):
        kiln.Options(march="portable", cpu_levels=levels)


def test_levels_round_trip_through_the_manifests_options():
    opts = kiln.Options(march="portable", cpu_levels=("x86-64-v3", "x86-64"))
    back = kiln.Options(**opts.to_json())
    assert back.cpu_levels == opts.cpu_levels and back.march == "portable"


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (Debian)")
def test_c_loader_picks_the_level_of_an_emulated_cpu(tmp_path, run_model_exe):
    """From C (examples/c/run_model.c -v): natively the best level, under qemu-x86_64 -cpu
    Haswell x86-64-v3 and under -cpu qemu64 the baseline; every run matches eager."""
    model, cm = _portable(tmp_path)
    path = cm.save(tmp_path / "p.kiln")
    x = torch.randn(32, 64)
    write_tensor_bin(str(tmp_path / "in0.bin"), x)
    cases = [([], _best_here()), (["qemu-x86_64", "-cpu", "Haswell"], "x86-64-v3"),
             (["qemu-x86_64", "-cpu", "qemu64"], "x86-64")]
    for prefix, want in cases:
        out = tmp_path / f"out_{want}_"
        proc = subprocess.run([*prefix, str(run_model_exe), "-v", "-o", str(out), str(path),
                               str(tmp_path / "in0.bin")], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (prefix, proc.stderr[-2000:])
        assert f"cpu level '{want}'" in proc.stderr, (prefix, proc.stderr[-2000:])
        _check(model, [read_tensor_bin(f"{out}{i}.bin") for i in range(2)], x)


def test_a_gemm_tile_too_wide_for_a_level_is_refitted():
    """A "cpp" tile chosen for AVX-512's 32 vector registers spills on AVX2's 16: the level's
    GEMM file gets the level's default tile (same K/N blocking); fitting tiles are kept."""
    wide, narrow = CppConfig(8, 3, 128), CppConfig(6, 2)
    gemms = {"mm0": Choice("cpp", wide), "mm1": Choice("cpp", narrow), "mm2": Choice("blas")}
    assert fit_gemms(gemms, "x86-64-v4") == gemms
    for level in ("x86-64-v3", "x86-64"):
        got = fit_gemms(gemms, level)
        cfg = got["mm0"].config
        assert cfg.mr * cfg.nv + cfg.nv + 1 <= vector_registers(level) and cfg.kc == 128
        assert "fitted" in got["mm0"].how
        assert got["mm1"] == gemms["mm1"] and got["mm2"] == gemms["mm2"]


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (Debian)")
def test_c_loader_refuses_a_cpu_below_every_level_by_name(tmp_path, run_model_exe):
    """Under qemu-x86_64 -cpu Nehalem (SSE4.2, no AVX), a package of x86-64-v4 and x86-64-v3
    only fails to load, naming what each level needs that the CPU lacks."""
    _, cm = _portable(tmp_path, cpu_levels=("x86-64-v4", "x86-64-v3"))
    path = cm.save(tmp_path / "p.kiln")
    write_tensor_bin(str(tmp_path / "in0.bin"), torch.randn(32, 64))
    proc = subprocess.run(["qemu-x86_64", "-cpu", "Nehalem", str(run_model_exe), "-o",
                           str(tmp_path / "out"), str(path), str(tmp_path / "in0.bin")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    err = proc.stderr
    assert "no build this CPU can run" in err, err
    assert "-march=x86-64-v4 lacks" in err and "avx512f" in err, err
    assert "-march=x86-64-v3 lacks" in err and "avx2" in err, err
