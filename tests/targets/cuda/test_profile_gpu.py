"""`kiln profile` on a CUDA package (GPU only): every Triton kernel of the package is timed on
the device (CUPTI), with graph replays on and off, and the library GEMM kernels are listed
under their own names; on a machine without a GPU the command refuses with a clear error."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import kiln
from kiln.cli.profile import profile_package
from kiln.errors import UnsupportedError
from kiln.options import Options


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)
        self.norm = torch.nn.LayerNorm(256)

    def forward(self, x):
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def _package(tmp_path, graphs: bool):
    ep = torch.export.export(Block().eval(), (torch.randn(64, 256),))
    cm = kiln.compile(ep, device="cuda", options=Options(cuda_graphs=graphs,
                                                          cuda_archs=(90,)))
    return cm, cm.save(tmp_path / f"block_{graphs}.kiln")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_cuda_profile_without_gpu_is_refused(tmp_path):
    _, path = _package(tmp_path, graphs=True)
    with pytest.raises(UnsupportedError, match="needs a GPU"):
        profile_package(path, repeat=2, warmup=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_profile_times_every_kernel(tmp_path, graphs):
    cm, path = _package(tmp_path, graphs)
    prof = profile_package(path, repeat=5, warmup=2)
    assert prof["device"] == "cuda"
    triton = {k["name"] for k in cm.manifest["kernels"] if k["kind"] == "triton"}
    timed = {s["name"]: s for s in prof["steps"]}
    assert triton <= set(timed), f"kernels not seen by the profiler: {triton - set(timed)}"
    for name in triton:
        assert timed[name]["median_s"] > 0 and timed[name]["source_ops"]
    assert set(timed) - triton, "the two GEMMs (library or template kernels) are missing"
    assert 0 < prof["device_total_median_s"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_report_has_a_device_time_for_every_kernel(tmp_path):
    """`kiln report` on a CUDA package: the HTML page lists every Triton kernel with its
    device time from the profiling run (CUPTI), the GEMMs and the memory timeline."""
    cm, path = _package(tmp_path, True)
    out = subprocess.run([sys.executable, "-m", "kiln.cli.main", "report", str(path), "-o",
                          str(tmp_path / "r.html"), "--repeat", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "r.html").read_text()
    for k in cm.manifest["kernels"]:
        if k["kind"] == "triton":
            row = re.search(rf"<code>{re.escape(k['name'])}</code>.*?</tr>", page, re.S)
            assert row and re.search(r'<td class="num">[\d,.]+</td>', row.group(0)), k["name"]
    assert '<table class="gemms">' in page and "<svg" in page
