"""bench/cpu_peers.py (issue 14): the report's arithmetic on made-up results, and a --quick run
on the 3x2 matmul program with the systems that are installed (ONNX Runtime and OpenVINO are
benchmark extras: skipped when absent), checking that the table is produced and that every
system's output matched eager. Also the zoo's mobilenet_v2 through kiln against float64 eager."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln
from bench import cpu_peers as cp
from kiln.models import get

ROOT = Path(__file__).resolve().parents[2]


def _row(model: str, **lat: float | str | None) -> dict:
    systems = {}
    for s, v in lat.items():
        if isinstance(v, str):
            systems[s] = {"error": v}
        elif v is not None:
            systems[s] = {"latency_s": abs(v), "matches": v > 0, "max_abs_err": 0.0}
    return {"model": model, "systems": systems, "loads": [1.0]}


def test_ratios_use_the_faster_matching_peer() -> None:
    rows = [_row("a", ort=2.0, openvino=4.0, aoti=8.0, kiln=1.0, kiln_autotune=1.0),
            # OpenVINO's output did not match eager (negative: matches=False): ORT is the peer
            _row("b", ort=8.0, openvino=-1.0, aoti=4.0, kiln=4.0, kiln_autotune=2.0),
            _row("c", ort="RuntimeError: boom", openvino=None, kiln=3.0)]
    r = cp.ratios(rows)
    per = r["per_model"]
    assert per["a"]["kiln/best_peer"] == pytest.approx(0.5)
    assert per["b"]["kiln/best_peer"] == pytest.approx(0.5)
    assert per["b"]["autotune/default"] == pytest.approx(0.5)
    assert per["c"]["kiln/best_peer"] is None and per["c"]["kiln/aoti"] is None
    assert r["geomean"]["kiln/best_peer"] == pytest.approx(0.5)
    assert r["geomean"]["kiln/aoti"] == pytest.approx((1 / 8 * 1.0) ** 0.5)
    md = cp.markdown(rows, list(cp.SYSTEMS), {"date": "d", "cpu": "cpu", "cores": 2,
                                              "threads": 2, "python": "3"},
                     "python bench/cpu_peers.py", "up", "up", [1.0, 2.0])
    line_b = next(ln for ln in md.splitlines() if ln.startswith("| b |"))
    assert "**MISMATCH**" in line_b and "0.50x" in line_b
    line_c = next(ln for ln in md.splitlines() if ln.startswith("| c |"))
    assert "error: RuntimeError: boom" in line_c


def _have(*mods: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in mods)


# about a minute on an idle 2-core machine (a dozen processes each importing torch, a kiln and
# an ONNX compile), several under load: slow
@pytest.mark.slow
def test_quick_run_on_a_tiny_program(tmp_path: Path) -> None:
    systems = ["eager", "kiln"]
    if _have("onnxruntime", "onnxscript"):
        systems.append("ort")
    if _have("openvino"):
        systems.append("openvino")
    out, md = tmp_path / "out.json", tmp_path / "B.md"
    md.write_text("# Benchmarks\n\nkept\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cpu_peers.py"), "--quick", "--rounds", "1",
         "--models", "matmul_3x2", "--systems", ",".join(systems), "--json", str(out),
         "--markdown", str(md)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    row = res["rows"][0]
    assert row["model"] == "matmul_3x2"
    for s in systems:
        r = row["systems"][s]
        assert "error" not in r, (s, r)
        assert r["matches"] and r["latency_s"] > 0 and r["peak_rss_bytes"] > 0, (s, r)
    assert row["systems"]["kiln"]["c_peak_rss_bytes"] > 0
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n")
    assert cp.BEGIN in text and cp.END in text and "| matmul_3x2 |" in text
    assert "Load: start" in text


def test_unknown_model_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_peers.py"), "--models",
                           "nope"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "unknown model or system: nope" in proc.stderr


@pytest.mark.slow  # a whole MobileNetV2 compile (about 20 s on a quiet 2-core box)
def test_zoo_mobilenet_v2_through_kiln(tmp_path: Path) -> None:
    spec = get("mobilenet_v2")
    runner = kiln.load(kiln.compile(spec.export()).save(tmp_path / "m.kiln"))
    ref = spec.module.double()
    for seed in (1, 2):
        (x,) = spec.make_inputs(seed)
        with torch.no_grad():
            want = ref(x.double())
        torch.testing.assert_close(runner(x).double(), want, rtol=1e-4, atol=1e-5)
