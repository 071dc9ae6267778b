"""Generated code: inner loops vectorise (checked with the compiler's vectorisation report),
the Python printer runs the same kernels and matches eager, calls carry source comments, and
kernels are cached by content."""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest
import torch

import kiln
from kiln.targets.cpu.build import toolchain


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(256)
        self.fc = torch.nn.Linear(256, 256)

    def forward(self, x):
        y = self.ln(x)
        z = torch.softmax(y * 0.5 + x, -1)
        return torch.nn.functional.gelu(self.fc(z + y)), z.sum(-1)


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = Chain().eval()
    return model, kiln.compile(model, (torch.randn(64, 256),))


def test_every_simd_loop_vectorises(compiled, tmp_path):
    _, c = compiled
    for name, text in c.sources.items():
        if not name.startswith("kernels_"):
            continue
        src = tmp_path / name
        src.write_text(text)
        lines = text.splitlines()
        simd = [(k + 1, _loop_end(lines, k + 1)) for k, line in enumerate(lines)
                if "#pragma omp simd" in line]
        assert simd, "no vectorisable loop was generated"
        tc = toolchain(kiln.Options(march="x86-64-v3"))  # the compile flags kiln uses
        flags = [*tc.cflags, *[f"-I{d}" for d in tc.include_dirs], "-fopt-info-vec-optimized",
                 "-c", str(src), "-o", str(tmp_path / "k.o")]
        report = subprocess.run(["c++", *flags], capture_output=True, text=True, check=True).stderr
        done = {int(m.group(1)) for m in re.finditer(rf"{name}:(\d+):\d+: optimized: loop "
                                                     "vectorized", report)}
        # GCC reports a vectorised loop at its pragma, header or a statement of its body
        missing = [lines[a].strip() for a, b in simd if not any(a <= n <= b for n in done)]
        assert not missing, f"not vectorised in {name}: {missing}\n{report}"


def _loop_end(lines: list[str], header: int) -> int:
    """1-based line of the brace closing the loop whose header is line `header` + 1."""
    depth = 0
    for k in range(header, len(lines)):
        depth += lines[k].count("{") - lines[k].count("}")
        if depth <= 0 and k > header:
            return k + 1
    return len(lines)


def test_fusion_keeps_norm_and_softmax_in_one_kernel(compiled):
    _, c = compiled
    kernels = [k for k in c.manifest["kernels"] if k["kind"] == "cpp"]
    fused = [k for k in kernels if any("layer_norm" in op for op in k["source_ops"])]
    assert len(fused) == 1 and any("softmax" in op for op in fused[0]["source_ops"])
    assert len(kernels) <= 3


def test_calls_are_commented_and_named_after_nodes(compiled):
    _, c = compiled
    lines = c.sources["model.cpp"].splitlines()
    for k, line in enumerate(lines):
        if re.match(r"\s*k\d+_\w+\(", line) or "kr::gemm<" in line:
            assert lines[k - 1].strip().startswith("//") and "<-" in lines[k - 1], line
    assert "gelu" in " ".join(k["name"] for k in c.manifest["kernels"])


def test_python_printer_runs_the_same_kernels(compiled, tmp_path):
    model, c = compiled
    path = tmp_path / "model.py"
    path.write_text(c.sources["model.py"])
    spec = importlib.util.spec_from_file_location("kiln_generated_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    weights = {k: v.contiguous() for k, v in c.built.weights.items()}
    runner = mod.Model(c.library, weights)
    x = torch.randn(64, 256)
    got = runner(x)
    with torch.no_grad():
        want = model(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="input 0 \\(x\\)"):
        runner(torch.randn(64, 256, dtype=torch.float64))


def test_build_cache_hits_on_recompile(tmp_path):
    opts = kiln.Options(cache_dir=str(tmp_path))
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    first = kiln.compile(m, (torch.randn(2, 8),), options=opts)
    second = kiln.compile(m, (torch.randn(2, 8),), options=opts)
    assert first.library == second.library
    assert second.report["stages"]["compile"] < first.report["stages"]["compile"]


def test_unsupported_op_is_a_clear_error():
    class Zeta(torch.nn.Module):  # not lowered by kiln; the ATen fallback is off
        def forward(self, x):
            return torch.special.zeta(x, 2.0)

    with pytest.raises(kiln.errors.UnsupportedError, match="zeta"):
        kiln.compile(Zeta(), (torch.rand(4, 4) + 1,), options=kiln.Options(aten_fallback=False))


def test_fused_intermediates_live_in_per_thread_rows(compiled):
    """The layer norm output and the softmax input are consumed only inside their fused kernel:
    they become stack rows, not arena buffers."""
    _, c = compiled
    text = "".join(v for k, v in c.sources.items() if k.startswith("kernels_"))
    assert re.search(r"row_\w*layer_norm\[", text)
    assert not any("layer_norm" in b["name"] for b in c.manifest["plan"]["buffers"])
