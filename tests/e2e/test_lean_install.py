"""`pip install kiln` is the CPU set-up: kiln's own requirements hold no Triton, CUDA or
CUTLASS (those are `kiln[cuda]`, matplotlib `kiln[report]`, everything `kiln[dev]`), and
with those packages absent (blocked in a subprocess) a CPU model compiles, runs and is
inspected, while a CUDA build and a drawing fail with the extra to install."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_ONLY = ("triton", "nvidia-cutlass", "cutlass", "cuda", "nvidia-", "cupy", "pycuda")


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_requirements_split():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _names(project["dependencies"])
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    assert not any(n.startswith(GPU_ONLY) for n in base), base
    assert "matplotlib" not in base
    assert {"triton", "nvidia-cutlass"} <= extras["cuda"]
    assert extras["report"] == {"matplotlib"}
    assert extras["cuda"] | extras["report"] <= extras["dev"]  # the dev set-up stays whole


_BLOCKED = r"""
import sys
for name in ("triton", "cutlass", "cutlass_library", "matplotlib", "nvidia"):
    sys.modules[name] = None  # import fails; importlib.util.find_spec says absent
import tempfile, torch, kiln
from kiln.cli.main import main
from kiln.errors import UnsupportedError
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
p = tempfile.mktemp(suffix=".kiln")
kiln.compile(m, (torch.randn(3, 8),)).save(p)
x = torch.randn(3, 8)
torch.testing.assert_close(kiln.load(p)(x), m(x), rtol=1e-5, atol=1e-5)
print("inspect", main(["inspect", p, "--json"]))
print("png", main(["inspect", p, "--png", p + ".png"]))
try:
    kiln.compile(m, (torch.randn(3, 8),), device="cuda")
except UnsupportedError as e:
    print("cuda refused:", e)
print("loaded:", sorted(n for n in ("triton", "cutlass", "matplotlib")
                        if sys.modules.get(n) is not None))
"""


def test_cpu_works_without_the_gpu_and_report_extras():
    out = subprocess.run([sys.executable, "-c", _BLOCKED], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "inspect 0" in out.stdout and "png 2" in out.stdout
    assert "pip install 'kiln[report]'" in out.stderr  # the drawing names its extra
    assert re.search(r"cuda refused: .*Triton.*pip install 'kiln\[cuda\]'", out.stdout)
    assert "loaded: []" in out.stdout
