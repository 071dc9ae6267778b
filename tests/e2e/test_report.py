"""`kiln profile`, `kiln report` / `inspect --html` and `inspect --png`: per-kernel times for
every kernel the manifest lists, a self-contained HTML page that loads in headless Chromium
without console messages and holds the kernel table, the GEMM choices and the memory timeline,
and the compile report agreeing with `inspect` on the kernel count."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln

pytest.importorskip("matplotlib")

from kiln.cli.profile import profile_package  # noqa: E402
from kiln.cli.report import render_report  # noqa: E402

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium"
                                        if Path("/usr/bin/chromium").exists() else None)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.fc = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, ids):
        return self.norm(torch.nn.functional.gelu(self.fc(self.emb(ids)))).sum(1)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    compiled = kiln.compile(_Model().eval(), (torch.randint(0, 50, (4, 16)),))
    path = tmp_path_factory.mktemp("report") / "m.kiln"
    compiled.save(path)
    return path, compiled


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_profile_times_every_kernel(package):
    path, compiled = package
    prof = profile_package(path, repeat=3, warmup=1)
    names = [k["name"] for k in compiled.manifest["kernels"]]
    assert [s["name"] for s in prof["steps"]] == names
    assert all(s["median_s"] > 0 for s in prof["steps"])
    assert prof["package_run_median_s"] > 0 and prof["device"] == "cpu"
    gemm = [s for s in prof["steps"] if s["kind"].endswith("_gemm")]
    assert gemm and all(s["timed_as"] == "package (C++ hooks)" for s in prof["steps"])


def test_compile_report_and_inspect_agree_on_kernels(package):
    path, compiled = package
    out = _cli("inspect", path, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kernels"] == compiled.report["kernels"] == len(
        compiled.manifest["kernels"])
    assert compiled.report["kernels"] == (compiled.report["fused_kernels"]
                                          + compiled.report["extern_calls"])


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_report_html_is_self_contained(package, tmp_path):
    path, compiled = package
    out = _cli("report", path, "-o", tmp_path / "r.html", "--repeat", "2")
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "r.html").read_text()
    for k in compiled.manifest["kernels"]:
        assert f"<code>{k['name']}</code>" in page
    assert '<table class="kernels">' in page and '<table class="gemms">' in page
    assert "<svg" in page and "lower bound" in page and "arena (peak)" in page
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page)  # nothing external
    assert "<script" not in page
    rows = re.findall(r'<td class="num">([\d,.]+)</td>', page)
    assert len(rows) == len(compiled.manifest["kernels"])  # a time for every kernel
    html_only = tmp_path / "i.html"
    assert _cli("inspect", path, "--html", html_only).returncode == 0
    assert '<table class="kernels">' in html_only.read_text()


def test_inspect_png_alone(package, tmp_path):
    path, _ = package
    out = _cli("inspect", path, "--png", tmp_path / "t.png")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _chromium(page: Path) -> tuple[str, list[str]]:
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                          "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    return out.stdout, [line for line in out.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_report_renders_in_headless_chromium(package, tmp_path):
    path, compiled = package
    page = tmp_path / "r.html"
    page.write_text(render_report(path, compiled.manifest,
                                  profile_package(path, repeat=2, warmup=1)))
    dom, console = _chromium(page)
    assert console == []
    assert '<table class="kernels">' in dom and "<svg" in dom
    assert all(k["name"] in dom for k in compiled.manifest["kernels"])
    bad = tmp_path / "bad.html"  # the console check can fail
    bad.write_text("<html><body><script>console.error('broken')</script></body></html>")
    assert any("broken" in line for line in _chromium(bad)[1])
