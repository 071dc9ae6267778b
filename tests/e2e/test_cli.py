"""The `kiln` command: `--help` without importing torch, `compile` with per-stage progress and
no third-party warning leaking, the compile report and `inspect` agreeing on the kernel count,
`profile` printing a time per kernel, and `demo` reporting a speed-up measured on interleaved
pairs after warm-up."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def _kiln(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=600, **kw)


def test_help_does_not_import_torch():
    code = ("import sys\nfrom kiln.cli.main import build_parser\n"
            "try:\n    build_parser().parse_args(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'kiln.api' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False"
    for sub in ("compile", "run", "inspect", "profile", "report", "demo", "fuzz"):
        assert sub in out.stdout


def test_public_names_still_import():
    code = ("import kiln\nfrom kiln import compile, load, Options, CompiledModel, errors\n"
            "print(kiln.api.compile is compile, kiln.Options is Options)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "True True", out.stderr


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pkg = tmp_path_factory.mktemp("cli") / "mlp.kiln"
    out = _kiln("compile", "zoo:mlp", "-o", pkg, "--option", "num_threads=2")
    return pkg, out


def test_compile_output_is_clean_and_counts_agree(compiled):
    pkg, out = compiled
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr  # FutureWarning / UserWarning leaks
    m = re.search(r"kernels\s+(\d+) \((\d+) generated, (\d+) GEMM/library calls\)", out.stdout)
    assert m, out.stdout
    total, fused, calls = map(int, m.groups())
    assert total == fused + calls
    inspect = _kiln("inspect", pkg, "--json")
    assert json.loads(inspect.stdout)["kernels"] == total


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_profile_lists_every_kernel(compiled):
    pkg, _ = compiled
    out = _kiln("profile", pkg, "--repeat", "3", "--json")
    assert out.returncode == 0, out.stderr
    prof = json.loads(out.stdout)
    manifest = json.loads(_kiln("inspect", pkg, "--manifest").stdout)
    assert [s["name"] for s in prof["steps"]] == [k["name"] for k in manifest["kernels"]]
    table = _kiln("profile", pkg, "--repeat", "2")
    assert "per-step times" in table.stdout and "package run: median" in table.stdout


def test_compile_progress_callback_sees_every_stage():
    import torch

    import kiln
    from kiln.pipeline import target_of

    seen = []
    kiln.compile(torch.nn.Linear(4, 3), (torch.randn(2, 4),),
                 progress=lambda name, k, n: seen.append((name, k, n)))
    stages = [s.name for s in target_of("cpu").stages]
    n = len(stages)
    assert seen == [(s, k, n) for k, s in enumerate(stages)] + [("done", n, n)]


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_demo_reports_interleaved_speed_up():
    out = _kiln("demo", "--repeat", "10")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"speed-up over eager\s+[\d.]+x \(median of 10 interleaved pairs after "
                     r"warm-up", out.stdout), out.stdout
