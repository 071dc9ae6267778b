"""Complex ops that left the ATen fallback in session 13 (issue 16): logical ops and `any`
(either part nonzero), var (of each part), constant pad, the moves (masked_scatter, gather,
index_select, index, repeat, squeeze, roll), scatters that set / sum / average and index_put
(each part), logcumsumexp (kiln_lib.h's complex scan: eager's loop in complex128), cumprod and
cumsum by doubling (static and dynamic sizes; CUDA's cumsum), prod over a dynamic size, and
torch.fft beyond 512 points (four-step factorisation, Bluestein's chirp-z) and on dynamic sizes
with an upper bound (frontend/aten_complex*.py). None of them calls ATen.

Each group is one compiled program (difftest.Cases) run on fresh inputs, complex64 against
eager's complex128 on the same values, complex128 against eager complex128 (bools, moves:
equal); ffts against numpy's complex128 (pocketfft): kiln's error at most 4x eager's plus 8
ulps (complex128: 1e-13 of the largest output)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from difftest import Cases, Fn, case_name, gen
from test_complex_native import OPTS_CUDA, Strided, _compare

import kiln

C64, C128 = torch.complex64, torch.complex128
REAL = {C64: torch.float32, C128: torch.float64}


def ops(a, b, r, z, idx, rows):
    """a, b, z complex (R, C) (z: inf + 0i at [0, 0]), r real (R, C), idx int64 (R, K) in
    [0, C) (distinct in a row: one write per place), rows int64 (2,) in [0, R)."""
    a0 = a * (r > 0)  # zeros in both parts
    k = idx.shape[1]
    return {
        "not": torch.logical_not(a0), "and": torch.logical_and(a0, b),
        "or": torch.logical_or(a0, r), "xor": torch.logical_xor(a0, b),
        "any": a0.any(), "any1": (a0 * (r > 1)).any(1), "any0": a0.any(0, keepdim=True),
        "var1": torch.var(a, 1), "var0": torch.var(a, 0, unbiased=False, keepdim=True),
        "var_c0": torch.var(b, correction=0),
        "pad": F.pad(a, (1, 2), value=1.5), "pad2": F.pad(b, (0, 1, 2, 0)),
        "pad_c": torch.constant_pad_nd(a, (1, 1), 2 - 1j),
        "mscatter": a.masked_scatter(r > 0, b), "gather": torch.gather(a, 1, idx),
        "isel": a.index_select(0, rows), "index": b[rows], "repeat": a.repeat(2, 1, 1),
        "squeeze": a[None].squeeze(), "roll": torch.roll(b, 1, 0),
        "scatter": torch.scatter(a, 1, idx, b[:, :k]),
        "scatter_v": torch.scatter(a, 1, idx, 2 - 1j),
        "scatter_add": torch.scatter_add(a, 1, idx, b[:, :k]),
        "sreduce_sum": torch.scatter_reduce(a, 1, idx, b[:, :k], "sum", include_self=False),
        "sreduce_mean": torch.scatter_reduce(a, 1, idx, b[:, :k], "mean"),
        "iput": torch.index_put(a, (rows,), b[:2]),
        "iput_acc": torch.index_put(a, (rows,), b[0], accumulate=True),
        "lcse": torch.logcumsumexp(a * 4, 1), "lcse0": torch.logcumsumexp(b, 0),
        # (z's: as parts, so that an infinite part and a close finite one compare)
        "cumprod": torch.view_as_real(z.cumprod(1)), "cumprod0": (a * 0.7).cumprod(0),
        "cumsum": torch.view_as_real(z.cumsum(1)),
        "prod": (a * 0.8).prod(1),
    }


CASES = [(C64, (5, 13), "t"), (C128, (6, 11), "step")]


def _reference(fn, args):
    """eager's complex128 (float64) result on the same values (index inputs as they are)."""
    wide = [a.to(C128) if a.is_complex() else a.double() if a.is_floating_point() else a
            for a in args]
    with torch.no_grad():
        return fn(*wide)


def _inputs(dt, shape, kind, run):
    g = gen("complex_scan", dt, shape, kind, run)
    n = {"contig": shape, "t": shape[::-1], "step": shape[:-1] + (2 * shape[-1],)}[kind]
    a, b, z = (torch.randn(n, dtype=dt, generator=g) for _ in range(3))
    r = torch.randn(n, dtype=REAL[dt], generator=g)
    z[0, 0] = complex(math.inf, 0.0)  # 1 * (inf + 0i) = inf + NaN i starts eager's cumprod
    idx = torch.stack([torch.randperm(shape[-1], generator=g)[:4] for _ in range(shape[0])])
    rows = torch.randperm(shape[0], generator=g)[:2]
    return a, b, r, z, idx, rows


class _Layout(torch.nn.Module):
    """Strided views of the four value inputs; the index inputs as they are."""

    def __init__(self, kind):
        super().__init__()
        self.inner = Strided(Fn(lambda a, b, r, z: (a, b, r, z)), kind)

    def forward(self, a, b, r, z, idx, rows):
        return ops(*self.inner(a, b, r, z), idx, rows)


def test_moves_scatters_and_scans_match_eager(tmp_path):
    model = Cases({case_name(str(dt)[6:], shape, kind): (_Layout(kind), 6)
                   for dt, shape, kind in CASES})
    args = [x for c in CASES for x in _inputs(*c, 0)]
    compiled = kiln.compile(model, tuple(args))
    assert compiled.manifest["requires"]["aten_fallback_ops"] == []
    runner = compiled.load(tmp_path / "scan.kiln")
    for run in (1, 2):
        args = [x for c in CASES for x in _inputs(*c, run)]
        got, want = runner(*args), model(*args)
        for i, (name, mod) in enumerate(model.mods.items()):
            ref = _reference(mod, args[6 * i:6 * i + 6])
            for k, w in ref.items():
                what = f"{name}__{k}"
                _compare(got[what], want[what], w, what)


# -- dynamic sizes: cumprod / cumsum / prod by doubling, fft by Bluestein ----------------------

def dynamic(x, r):
    return {"cumprod": x.cumprod(1), "cumsum": x.cumsum(1), "prod": x.prod(1),
            "prod_keep": (x * 0.9).prod(1, keepdim=True), "fft": torch.fft.fft(x),
            "ifft": torch.fft.ifft(x, norm="ortho"), "rfft": torch.fft.rfft(r),
            "fft2": torch.fft.fft2(x)}


def _numpy_dynamic(x, r):
    f = np.fft
    return {"fft": f.fft(x), "ifft": f.ifft(x, norm="ortho"), "rfft": f.rfft(r),
            "fft2": f.fft2(x)}


def _fft_close(g, w, r, dt, what):
    """kiln's error against numpy's at most 4x eager's plus 8 ulps (complex128: 1e-13), of
    the largest |output|."""
    assert g.dtype == w.dtype and g.shape == w.shape, what
    r = torch.from_numpy(np.asarray(r))
    scale = r.abs().max().item() or 1.0
    err = (g.to(r.dtype) - r).abs().max().item() / scale
    err_eager = (w.to(r.dtype) - r).abs().max().item() / scale
    bound = 1e-13 if dt == C128 else 4 * err_eager + 8 * torch.finfo(torch.float32).eps
    assert err <= bound, f"{what}: kiln {err:.3g}, eager {err_eager:.3g}"


@pytest.mark.parametrize("dt", [C64, pytest.param(C128, marks=pytest.mark.slow)],
                         ids=["complex64", "complex128"])
def test_dynamic_sizes(tmp_path, dt):
    """One package for every length 2 .. 40 of the last dim (export's Dim max 40: Bluestein's
    convolution of length 128), run at 3, 17 and 40."""
    g = gen("complex_dynamic", dt)
    x, r = torch.randn(3, 9, dtype=dt, generator=g), torch.randn(3, 9, dtype=REAL[dt], generator=g)
    n = Dim("n", max=40)
    ep = torch.export.export(Fn(dynamic), (x, r), dynamic_shapes=(({1: n}, {1: n}),))
    compiled = kiln.compile(ep)
    assert compiled.manifest["requires"]["aten_fallback_ops"] == []
    runner = compiled.load(tmp_path / "dyn.kiln")
    for size in (3, 17, 40):
        x = torch.randn(3, size, dtype=dt, generator=g)
        r = torch.randn(3, size, dtype=REAL[dt], generator=g)
        got, want = runner(x, r), dynamic(x, r)
        ref = _reference(Fn(dynamic), (x, r))
        num = _numpy_dynamic(x.to(C128).numpy(), r.double().numpy())
        for k, w in want.items():
            what = f"{size}: {k}"
            if k in num:
                _fft_close(got[k], w, num[k], dt, what)
            else:
                _compare(got[k], w, ref[k], what)


# -- torch.fft beyond 512 points ---------------------------------------------------------------

def long_ffts(x, r):
    """x (2, N) complex, r (2, N) real."""
    n = x.shape[-1]
    return {"fft": torch.fft.fft(x), "ifft": torch.fft.ifft(x, norm="ortho"),
            "rfft": torch.fft.rfft(r), "irfft": torch.fft.irfft(x, n=n),
            "irfft_long": torch.fft.irfft(x)}


def _numpy_long(x, r):
    f = np.fft
    n = x.shape[-1]
    return {"fft": f.fft(x), "ifft": f.ifft(x, norm="ortho"), "rfft": f.rfft(r),
            "irfft": f.irfft(x, n=n), "irfft_long": f.irfft(x)}


def _long_check(tmp_path, cases):
    model = Cases({case_name(str(dt)[6:], n): (Fn(long_ffts), 2) for dt, n in cases})

    def inputs(run):
        out = []
        for dt, n in cases:
            g = gen("complex_long_fft", dt, n, run)
            out += [torch.randn(2, n, dtype=dt, generator=g),
                    torch.randn(2, n, dtype=REAL[dt], generator=g)]
        return out

    compiled = kiln.compile(model, tuple(inputs(0)))
    assert compiled.manifest["requires"]["aten_fallback_ops"] == []
    runner = compiled.load(tmp_path / "fft.kiln")
    args = inputs(1)
    got, want = runner(*args), model(*args)
    for i, (dt, n) in enumerate(cases):
        x, r = args[2 * i:2 * i + 2]
        for k, ref in _numpy_long(x.to(C128).numpy(), r.double().numpy()).items():
            what = f"{case_name(str(dt)[6:], n)}__{k}"
            _fft_close(got[what], want[what], ref, dt, what)


@pytest.mark.slow  # ~40 s of CPU: the four-step and Bluestein programs compile many kernels
def test_long_ffts(tmp_path):
    """600 = 24 x 25 (four-step; irfft's 1198 = 2 x 599: Bluestein), 521 (a prime:
    Bluestein, a convolution of 2048 = 32 x 64)."""
    _long_check(tmp_path, [(C64, 600), (C128, 521)])


@pytest.mark.slow  # larger programs: a few minutes of compile on 2 cores
def test_longer_ffts(tmp_path):
    """4096 = 64 x 64, 1030 = 10 x 103, 1031 (prime), 2 x 3^7 = 4374 (four-step of
    four-steps)."""
    _long_check(tmp_path, [(C64, 4096), (C64, 1030), (C64, 1031), (C128, 4374)])


# -- CUDA: cumsum by doubling (no library routine there) -----------------------------------------

def cuda_scans(x):
    return {"cumsum": x.cumsum(1), "cumsum0": x.cumsum(0), "cumprod": x.cumprod(1),
            "fft": torch.fft.fft(x, n=600)}


@pytest.mark.slow  # CUDA builds (Triton kernels and cubins for sm_90)
def test_cuda_scans_build_without_aten():
    """CUDA programs (compiled here for sm_90, not run): complex cumsum without ATen, a long
    fft too; logcumsumexp by doubling since session 14 (tests/frontend/test_cuda_lcse_cov.py)."""
    pytest.importorskip("triton")
    x = torch.randn(4, 37, dtype=C64)
    cm = kiln.compile(torch.export.export(Fn(cuda_scans), (x,)), device="cuda",
                      options=OPTS_CUDA)
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    cm = kiln.compile(torch.export.export(Fn(lambda x: torch.logcumsumexp(x, 1)), (x,)),
                      device="cuda", options=OPTS_CUDA)
    assert cm.manifest["requires"]["aten_fallback_ops"] == []


_CUDA_INTERP = """
import sys, torch, kiln
from torch.utils import _pytree as pytree
sys.path.insert(0, sys.argv[1])
from test_complex_scan_fft import cuda_scans, OPTS_CUDA, Fn
from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
from kiln.targets.cuda.build import triton_kernels
g = torch.Generator().manual_seed(0)
x = torch.randn(4, 37, dtype=torch.complex64, generator=g)
b = kiln.compile(torch.export.export(Fn(cuda_scans), (x,)), device="cuda",
                 options=OPTS_CUDA).built
mod = import_triton_module(b.sources["kernels_triton.py"])
ks = {k.name: k for k in triton_kernels(b.steps, {x.name: x for x in b.loop.buffers}, {})}
x = torch.randn(4, 37, dtype=torch.complex64, generator=g)
outs = run_program(b.program, ks, mod, b.weights, [x])
want = pytree.tree_leaves(cuda_scans(x.to(torch.complex128)))
for o, w in zip(outs, want, strict=True):
    torch.testing.assert_close(o.reshape(w.shape).to(w.dtype), w, rtol=2e-5, atol=2e-5)
print("ALL OK")
"""


@pytest.mark.slow  # a CUDA build and Triton's interpreter
def test_cuda_scans_compute_in_interpreter():
    """The CUDA program's kernels (cumsum and cumprod by doubling, a 600-point fft) run by
    Triton's interpreter on the CPU, against eager complex128."""
    import pathlib

    from difftest import run_interpreted
    pytest.importorskip("triton")
    x = torch.randn(4, 37, dtype=C64)
    kiln.compile(torch.export.export(Fn(cuda_scans), (x,)), device="cuda", options=OPTS_CUDA)
    run_interpreted(_CUDA_INTERP, str(pathlib.Path(__file__).parent))


def test_interpreter_twin_of_the_complex_scan():
    """kiln/ir/interp.py's numpy twin of kiln_lib.h's complex logcumsumexp agrees with eager
    (infinities and NaN included): the Loop IR interpreter runs what the package runs."""
    from kiln.ir.interp import _lib_scan

    g = gen("complex_scan_twin")
    for dt in (C64, C128):
        x = torch.randn(4, 9, dtype=dt, generator=g) * 4
        x[0, 3] = complex(-math.inf, 0.0)
        x[1, 2] = complex(math.nan, 1.0)
        x[2, 4], x[2, 5] = complex(math.inf, 2.0), complex(math.inf, -1.0)
        (got,) = _lib_scan([(str(dt)[6:], x.shape)], {"kind": 2}, x.numpy())
        want = torch.logcumsumexp(x, 1)
        torch.testing.assert_close(torch.from_numpy(got), want, equal_nan=True,
                                   rtol=1e-6 if dt == C64 else 1e-12, atol=1e-6)
