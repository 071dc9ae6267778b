"""oneDNN as a backend of the CPU direct convolution (Options.cpu_conv_backends,
kiln/targets/cpu/dnnl.py, include/kiln_dnnl.h) against torch eager with float64 references:
the direct convolution's cases (3x3 stride 1 / 2, 1x1, depthwise, the NCHW stem, padding,
dilation, rectangular kernels; bias, batch norm, relu / relu6 / silu, residual epilogues), a
chain that stays in NCHWc across oneDNN and kiln convolutions, two threads; the autotuner's
per-shape choice (slow: it builds the timing driver); the package's record of libdnnl, a clear
error when a machine lacks it; packages built without oneDNN never need it.

Needs oneDNN's libdnnl.so.3 from a wheel (pip install onednn-cpu-gomp, the `perf` extra);
without it the tests that run oneDNN skip, naming the wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from torch import nn

import kiln
from difftest import Checker, gen, rand
from kiln.errors import UnsupportedError
from kiln.targets.cpu import dnnl
from kiln.toolchain import onednn
from test_conv_direct import CASES, TOL, ConvBlock

F32 = torch.float32
FOUND = onednn.find_library()
needs_onednn = pytest.mark.skipif(
    FOUND is None, reason="oneDNN is not installed (no wheel ships libdnnl.so.3): "
    "pip install onednn-cpu-gomp")
FORCED = kiln.Options(cpu_conv_backends=("onednn",))


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("conv_onednn"))


def _counts(compiled) -> tuple[int, int]:
    """(kiln_conv.h calls, oneDNN calls) in the wrapper."""
    src = compiled.sources["model.cpp"]
    return src.count("kl::conv2d_nchwc("), src.count("_nchwc.run(e,")


def _requires(path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read("manifest.json"))["requires"]["shared_libraries"]


# the cases of the default suite (one per layout, stride, dilation and epilogue kind); the
# others of test_conv_direct.py's CASES run with -m slow
FAST = {"3x3_s1_p1", "3x3_s2_p1", "7x7_s2_p3_stem", "1x1_s2", "dw3x3_s2", "3x3_d2",
        "dw3x3_d2", "5x3_rect_p0", "3x3_bias_silu", "3x3_bn_residual_relu"}


@needs_onednn
@pytest.mark.parametrize(("cfg", "cin", "hw"), [
    pytest.param(*c[1:], id=c[0], marks=() if c[0] in FAST else pytest.mark.slow)
    for c in CASES])
def test_onednn_matches_eager(check, cfg, cin, hw):
    m = ConvBlock(cin, seed=2, **cfg)
    g = gen("conv_onednn", str(cfg))
    x = rand((2, cin, *hw), F32, g, -2, 2)
    compiled = check(m, [x], tol=TOL, options=FORCED,
                     more=[(rand((2, cin, *hw), F32, g, -2, 2),)])
    assert _counts(compiled) == (0, 1 + bool(cfg.get("residual")))
    assert '#include "kiln_dnnl.h"' in compiled.sources["model.cpp"]


class Chain(nn.Module):
    """stem -> 3x3 + residual -> depthwise relu6 -> 1x1 with groups of sizes that are not a
    multiple of the channel block: every layout kiln_dnnl.h describes, back to back."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.stem = nn.Conv2d(3, 20, 3, 2, 1)
        self.c2 = nn.Conv2d(20, 20, 3, 1, 1)
        self.dw = nn.Conv2d(20, 20, 3, 2, 1, groups=20)
        self.pw = nn.Conv2d(20, 36, 1, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = torch.relu(self.c2(y) + y)
        y = torch.clamp(self.dw(y), 0, 6)
        return self.pw(y)


@needs_onednn
@pytest.mark.parametrize("threads", [1, 2])
def test_chain_in_nchwc(check, threads):
    g = gen("conv_onednn_chain", threads)
    x = rand((3, 3, 19, 17), F32, g, -2, 2)
    opts = kiln.Options(cpu_conv_backends=("onednn",), num_threads=threads)
    compiled = check(Chain(), [x], tol=TOL, options=opts,
                     more=[(rand((3, 3, 19, 17), F32, g, -2, 2),)])
    assert _counts(compiled) == (0, 4)


def test_default_package_never_needs_onednn(check, tmp_path):
    """Without max_autotune (and with ("direct",)) no convolution goes to oneDNN: the package
    neither includes kiln_dnnl.h nor records libdnnl."""
    x = torch.randn(1, 3, 12, 12)
    for opts in (kiln.Options(), kiln.Options(cpu_conv_backends=("direct",), max_autotune=True)):
        compiled = kiln.compile(Chain().eval(), (x,), options=opts)
        assert _counts(compiled) == (2, 0)  # the depthwise -> 1x1: a block without an expand
        assert compiled.sources["model.cpp"].count("kl::conv2d_block_nchwc(") == 1
        assert "kiln_dnnl.h" not in compiled.sources["model.cpp"]
        compiled.save(tmp_path / "m.kiln")
        assert not any("libdnnl" in s for s in _requires(tmp_path / "m.kiln"))


def test_options_checked():
    with pytest.raises(ValueError, match="cpu_conv_backends"):
        kiln.Options(cpu_conv_backends=("mkl",))
    with pytest.raises(ValueError, match="cpu_conv_backends"):
        kiln.Options(cpu_conv_backends=())
    assert kiln.Options(cpu_conv_backends=["direct"]).cpu_conv_backends == ("direct",)


def test_forced_without_onednn_is_refused(monkeypatch):
    monkeypatch.setattr(dnnl, "find_library", lambda: None)
    with pytest.raises(UnsupportedError, match="onednn-cpu-gomp"):
        kiln.compile(Chain().eval(), (torch.randn(1, 3, 12, 12),), options=FORCED)


LOAD_WITHOUT = """
import sys, torch
import kiln.runtime.loader as ld
ld.preload_dnnl = lambda: None  # a machine without the wheel
try:
    kiln_runner = ld.Runner(sys.argv[1])
except Exception as e:
    print(type(e).__name__, e)
"""


@needs_onednn
def test_package_records_onednn_and_fails_clearly_without_it(tmp_path, monkeypatch):
    """The manifest names libdnnl.so.3; a machine without it (neither preloaded from a wheel
    nor at the build machine's path) gets kiln's error naming the library and the wheel."""
    link = tmp_path / "libdnnl.so.3"
    link.symlink_to(FOUND[0])
    monkeypatch.setattr(dnnl, "find_library", lambda: (link, FOUND[1]))
    x = torch.randn(1, 3, 12, 12)
    compiled = kiln.compile(Chain().eval(), (x,), options=FORCED)
    pkg = tmp_path / "m.kiln"
    compiled.save(pkg)
    assert any("libdnnl.so.3" in s for s in _requires(pkg))
    with torch.no_grad():
        torch.testing.assert_close(compiled.load(tmp_path / "m2.kiln")(x), Chain().eval()(x),
                                   rtol=1e-4, atol=1e-4)
    link.unlink()
    env = {**os.environ, "LD_LIBRARY_PATH": ""}
    out = subprocess.run([sys.executable, "-c", LOAD_WITHOUT, str(pkg)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert "libdnnl.so.3" in out.stdout and "onednn-cpu-gomp" in out.stdout, (out.stdout,
                                                                               out.stderr)
    assert out.returncode == 0, out.stderr


@needs_onednn
@pytest.mark.slow
def test_autotuner_keeps_the_faster_per_shape(check, tmp_path):
    """max_autotune with both backends: each convolution shape timed kiln vs oneDNN (the
    driver checks they agree), the result cached per shape; the package is right either way
    and calls oneDNN exactly for the shapes where it measured faster."""
    g = gen("conv_onednn_tune")
    x = rand((1, 3, 19, 17), F32, g, -2, 2)
    opts = kiln.Options(max_autotune=True, cache_dir=str(tmp_path / "cache"), num_threads=1)
    compiled = check(Chain(), [x], tol=TOL, options=opts)
    entries = [json.loads(p.read_text())
               for p in (tmp_path / "cache" / "autotune").glob("conv_dnnl_*.json")]
    assert len(entries) == 4
    won = sum(e["result"]["backend"] == "onednn" for e in entries)
    for e in entries:
        r = e["result"]
        assert r["kiln_s"] > 0 and r["onednn_s"] > 0
        assert r["backend"] == ("onednn" if r["onednn_s"] < dnnl.MARGIN * r["kiln_s"]
                                else "direct")
    assert _counts(compiled) == (4 - won, won)


THREADS = """
import os, sys, torch
import kiln.runtime as kr
x = torch.randn(3, 3, 19, 17)
before = len(os.listdir("/proc/self/task"))
r = kr.load(sys.argv[1], num_threads=int(sys.argv[2]))
for _ in range(3):
    r(x)
print(len(os.listdir("/proc/self/task")) - before)
"""


@needs_onednn
@pytest.mark.parametrize("threads", [1, 2])
def test_thread_budget(tmp_path, threads):
    """A run of budget N gives oneDNN N threads, the caller among them: at 1 thread OpenMP
    starts none (the weight reorder at load runs on the caller too), at N at most N - 1,
    which sleep while kiln's pool works (as its workers do while oneDNN runs). Counted against
    the same model on kiln's own convolution (whose pool has its N - 1 workers)."""
    extra = {}
    for name in ("direct", "onednn"):
        pkg = tmp_path / f"{name}.kiln"
        kiln.compile(Chain().eval(), (torch.randn(3, 3, 19, 17),),
                     options=kiln.Options(cpu_conv_backends=(name,))).save(pkg)
        out = subprocess.run([sys.executable, "-c", THREADS, str(pkg), str(threads)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        extra[name] = int(out.stdout.split()[-1])
    assert extra["onednn"] <= extra["direct"] + threads - 1, extra
