"""Counts inside long compile stages (kiln.compile's `detail`, Build.progress): the C++ files
of the build counted up to their number, the GEMM candidates of max_autotune per GEMM, the
Triton kernels of a CUDA build; `kiln compile` draws them on a terminal and prints no
progress when its output is piped."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import kiln
from kiln.gemm import select
from kiln.gemm.profile import Measured


def _model():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _runs(events, stage):
    """The (what, done, total) a stage reported, in order."""
    return [(w, d, t) for s, w, d, t in events if s == stage]


def _counted_up(runs) -> bool:
    """Each `what` counts from 0 up to its total, never down."""
    by: dict[str, list] = {}
    for w, d, t in runs:
        by.setdefault(w, []).append((d, t))
    return all(seq[0][0] == 0 and seq[-1][0] == seq[-1][1] and
               all(a[0] <= b[0] and b[0] <= b[1] for a, b in zip(seq, seq[1:]))
               for seq in by.values())


def test_cpp_files_counted(tmp_path):
    events = []
    c = kiln.compile(_model(), (torch.randn(16, 64),),
                     options=kiln.Options(cache_dir=str(tmp_path)),
                     detail=lambda *e: events.append(e))
    runs = _runs(events, "compile")
    n_files = sum(name.endswith(".cpp") for name in c.built.sources)
    assert runs and {w for w, _, _ in runs} == {"C++ files built"}
    assert runs[-1] == ("C++ files built", n_files, n_files) and _counted_up(runs)
    assert {s for s, *_ in events} == {"compile"}  # max_autotune off: nothing else is long


@pytest.mark.slow  # times real GEMM candidates (~26 s); the terminal-drawing test covers the counts
def test_gemm_candidates_counted_per_gemm(tmp_path, monkeypatch):
    timed = []

    def fake(cmd, timeout_s, env=None):  # no child processes: the counting is under test
        timed.append(cmd[1])
        return Measured(1e-3 / (1 + int(cmd[1])))

    monkeypatch.setattr(select, "run_candidate", fake)
    events = []
    kiln.compile(_model(), (torch.randn(16, 64),),
                 options=kiln.Options(max_autotune=True, cache_dir=str(tmp_path)),
                 detail=lambda *e: events.append(e))
    runs = _runs(events, "gemm_autotune")
    whats = list(dict.fromkeys(w for w, _, _ in runs))
    assert [w.split(" (")[0] for w in whats] == ["GEMM 1/2", "GEMM 2/2"]
    assert _counted_up(runs)
    finals = [(d, t) for w, d, t in runs if d == t]
    assert sum(t for _, t in finals) == len(timed)  # every candidate timed was counted


@pytest.mark.slow
def test_triton_kernels_counted(tmp_path):
    pytest.importorskip("triton")
    events = []
    kiln.compile(_model(), (torch.randn(16, 64),), device="cuda",
                 options=kiln.Options(cache_dir=str(tmp_path)),
                 detail=lambda *e: events.append(e))
    runs = _runs(events, "cubins")
    assert runs and runs[-1][0] == "Triton kernels built" and runs[-1][1] == runs[-1][2] > 0
    assert _counted_up(runs)


def _kiln_compile(tmp_path, tty: bool) -> str:
    cmd = [sys.executable, "-m", "kiln.cli.main", "compile", "zoo:mlp", "-o",
           str(tmp_path / "m.kiln"), "--option", f"cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "COLUMNS": "160"}
    if not tty:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout + out.stderr
    # a pseudo-terminal: rich draws the progress display there
    out = subprocess.run(["script", "-qec", shlex.join(cmd), "/dev/null"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout
    return out.stdout


@pytest.mark.slow  # two cold-cache CLI compiles (about 30 s on a quiet 2-core box)
@pytest.mark.skipif(shutil.which("script") is None, reason="no script(1) for a pseudo-terminal")
def test_cli_draws_counts_on_a_terminal_only(tmp_path):
    shown = _kiln_compile(tmp_path / "tty", tty=True)  # a fresh cache: the build takes seconds
    assert "compile: C++ files built" in shown and "compiling: " in shown
    piped = _kiln_compile(tmp_path / "pipe", tty=False)
    assert "C++ files built" not in piped and "compiling" not in piped
    assert "wrote" in piped and "kernels" in piped
