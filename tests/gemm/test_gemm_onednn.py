"""oneDNN's matmul as a CPU GEMM backend (kiln/targets/cpu/dnnl_gemm.py, kiln_dnnl.h Matmul):
every epilogue kind it carries (bias, relu, gelu erf / tanh, silu, sigmoid, tanh, residual
add, broadcast scale, constants, a row subtracted, none) against float64 eager at ragged
sizes (M 1, 7, 128; N 101; K 77), forced with cpu_gemm_backends=("onednn",), run at 1 and 2
threads; an epilogue with no oneDNN form stays kiln's; the manifest needs libdnnl only when a
GEMM uses it and default options never choose it; the timing driver agrees with kiln's GEMM.
Skipped without libdnnl (onednn-cpu-gomp), except the option checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import UnsupportedError
from kiln.ir import loop as L
from kiln.targets.cpu import dnnl_gemm
from kiln.toolchain.onednn import find_library

K, N = 77, 101  # odd; N no multiple of any vector width
MS = (1, 7, 128)

needs_dnnl = pytest.mark.skipif(find_library() is None,
                                reason="oneDNN (onednn-cpu-gomp) is not installed")


class Epilogues(nn.Module):
    """One GEMM per epilogue kind, on inputs of M 1, 7 and 128 (x1, x7, x128: [M, K]; xt:
    [K, 7], read transposed); r*: [M, N] residuals."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fcs = nn.ModuleList(nn.Linear(K, N) for _ in range(11))
        self.nobias = nn.Linear(K, N, bias=False)
        self.scale = nn.Parameter(torch.ones(N))
        self.shift = nn.Parameter(torch.ones(N))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x1, x7, x128, xt, r1, r7, r128):
        f = self.fcs
        gelu = nn.functional.gelu
        return (torch.relu(f[0](x1)),
                gelu(f[1](x7)),
                gelu(f[2](xt.t()), approximate="tanh"),           # A strided
                nn.functional.silu(f[3](x7)),
                torch.tanh(f[4](x1)) + r1,                     # activation, then residual
                (f[5](x128) + r128) * self.scale,              # residual, broadcast scale
                f[6](x7) * 0.5 - 1.0,                          # eltwise linear
                torch.sigmoid(f[7](x128)),
                f[8](x1) - self.shift,                         # a row subtracted
                f[9](x128),                                    # bias only
                self.nobias(x7) + r7,                          # no bias: a residual first
                torch.exp(f[10](x7)))                          # no oneDNN form: kiln's


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.rand((m, K), generator=g) * 4 - 2 for m in MS]
    xt = torch.rand((K, 7), generator=g) * 4 - 2
    rs = [torch.rand((m, N), generator=g) * 4 - 2 for m in MS]
    return (*xs, xt, *rs)


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    model = Epilogues().eval()
    opts = kiln.Options(cpu_gemm_backends=("onednn",))
    return model, kiln.compile(model, _inputs(), options=opts)


@needs_dnnl
@pytest.mark.parametrize("threads", [1, 2])
def test_forced_values(forced, threads):
    model, compiled = forced
    runner = compiled.load()
    runner.num_threads = threads
    for seed in (2, 3):
        x = _inputs(seed)
        with torch.no_grad():
            ref = model.double()(*(t.double() for t in x))
            model.float()
        out = runner(*x)
        assert len(out) == len(ref)
        for k, (o, r) in enumerate(zip(out, ref)):
            assert o.dtype == torch.float32 and o.shape == r.shape, k
            torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-4, msg=f"output {k}")


@needs_dnnl
def test_forced_choices_and_manifest(forced):
    _, compiled = forced
    gemms = compiled.built.gemms
    by_src = {s.name: s for s in compiled.built.steps if isinstance(s, L.Gemm)}
    on = {n for n, c in gemms.items() if c.backend.value == "onednn"}
    assert len(on) == 11, {n: c.backend.value for n, c in gemms.items()}
    off = [n for n in gemms if n not in on]
    assert len(off) == 1 and any("exp" in s for s in by_src[off[0]].source)
    kinds = {tuple(o.kind for o in gemms[n].config.ops) for n in on}
    e = dnnl_gemm.ELTWISE
    b = dnnl_gemm.BINARY
    for want in [(e["relu"],), (e["gelu_erf"],), (e["gelu_tanh"],), (e["swish"],),
                 (e["tanh"], b[("add", "full")]), (b[("add", "full")], b[("mul", "row")]),
                 (e["linear"], e["linear"]), (e["sigmoid"],), (b[("sub", "row")],), ()]:
        assert want in kinds, (want, kinds)
    # the weights stay unpacked (stored once, as the model holds them)
    assert all(not by_src[n].packed_b for n in on)
    src = compiled.sources["model.cpp"]
    assert "kl::dnnl::Matmul" in src and '#include "kiln_dnnl.h"' in src
    libs = compiled.manifest["requires"]["shared_libraries"]
    assert any("libdnnl" in x for x in libs)


@needs_dnnl
def test_default_options_never_choose_onednn(forced):
    model = nn.Sequential(nn.Linear(K, N), nn.GELU()).eval()
    compiled = kiln.compile(model, (torch.randn(7, K),), options=kiln.Options())
    assert all(c.backend.value != "onednn" for c in compiled.built.gemms.values())
    assert not any("libdnnl" in x for x in compiled.manifest["requires"]["shared_libraries"])
    assert "kiln_dnnl.h" not in compiled.sources["model.cpp"]
    # ("kiln",) never, even with max_autotune (its GEMMs all candidates when forced)
    _, f = forced
    steps, gemms = list(f.built.steps), dict(f.built.gemms)
    opts = kiln.Options(cpu_gemm_backends=("kiln",), max_autotune=True)
    assert dnnl_gemm.choose(steps, gemms, {"w"}, opts, None, "cpu") == (gemms, {})


@needs_dnnl
def test_driver_agrees_and_times(forced):
    """The max_autotune driver (kiln's packed GEMM with the package's epilogue code vs oneDNN)
    builds, finds the two equal and times both."""
    from kiln.gemm.cpu import packed_configs
    from kiln.targets.cpu.build import toolchain
    _, compiled = forced
    opts = kiln.Options()
    gemms = compiled.built.gemms
    steps = {s.name: s for s in compiled.built.steps if isinstance(s, L.Gemm)}
    tanh_res = next(n for n, c in gemms.items() if c.backend.value == "onednn"
                    and len(c.config.ops) == 2 and c.config.ops[0].kind == 6)
    g = steps[tanh_res]
    lib = str(find_library()[0])
    for kcfg in (packed_configs(opts.march)[0],):  # (BlasConfig(), CppConfig(6, 2) work too)
        src = dnnl_gemm.driver_source(g, gemms[tanh_res].config, kcfg, opts.march, lib)
        exe = dnnl_gemm.build_executable(toolchain(opts), src, "gemm_dnnl", "test driver",
                                         libs=("-ldl",))
        r = dnnl_gemm.run_driver(exe, opts, seconds=0.01)
        assert r.get("kiln_s", 0) > 0 and r.get("onednn_s", 0) > 0, (kcfg, r)


def test_options():
    assert kiln.Options().cpu_gemm_backends == ("kiln", "onednn")
    assert kiln.Options(cpu_gemm_backends=["onednn"]).cpu_gemm_backends == ("onednn",)
    for bad in ((), ("blas",), "onednn"):
        with pytest.raises(ValueError, match="cpu_gemm_backends"):
            kiln.Options(cpu_gemm_backends=bad)
    with pytest.raises(ValueError, match="gemm_backends"):  # chosen only through cpu_gemm_...
        kiln.Options(gemm_backends=("onednn",))


def test_forced_without_library_is_an_error(monkeypatch):
    monkeypatch.setattr(dnnl_gemm, "find_library", lambda: None)
    opts = kiln.Options(cpu_gemm_backends=("onednn",))
    with pytest.raises(UnsupportedError, match="onednn-cpu-gomp"):
        dnnl_gemm.choose([], {"x": None}, set(), opts, None, "cpu")
    # the default without the library: nothing to do, no error
    assert dnnl_gemm.choose([], {}, set(), kiln.Options(max_autotune=True), None, "cpu") == ({}, {})
