"""Complex arithmetic in kiln's own kernels (issue 16, item 5): complex64 / complex128 ops are
real arithmetic on the parts (frontend/aten_complex.py), so these packages call no ATen.

Differential: each package is compiled once (static cases merged with difftest.Cases) and run
on fresh inputs; complex64 results are compared with eager's complex128 result on the same
values, complex128 with eager complex128. Special values (inf / nan parts, zeros, signed
zeros, huge and tiny parts) are judged per element against numpy's complex128 math (C99's
csqrt / clog, Smith's division) or eager's own answer, as docs/coverage.md's dtype sweep
does. Ops kiln does not compute still go to the ATen fallback."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from difftest import Cases, Fn, case_name, gen, layout_input

import kiln

C64, C128 = torch.complex64, torch.complex128
OPTS_CUDA = kiln.Options(cuda_archs=(90,), autotune=False, cuda_graphs=False)
REAL = {C64: torch.float32, C128: torch.float64}
TOL = {C64: {"rtol": 2e-5, "atol": 2e-5}, C128: {"rtol": 1e-11, "atol": 1e-11}}


class Strided(torch.nn.Module):
    """Runs `inner` on strided views (difftest.layout_input) of all its tensor inputs."""

    def __init__(self, inner: torch.nn.Module, kind: str) -> None:
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, *args):
        return self.inner(*[layout_input(a, self.kind) for a in args])


def elementwise(a, b, r):
    """Every complex op kiln computes itself, on complex a, b and real r (same dtype family)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex -> real casts warn in eager
        to_real = a.to(r.dtype)
    return {
        "add": a + b, "sub": a - b, "mul": a * b, "div": a / b, "neg": -a,
        "conj": a.conj(), "conj_physical": torch.conj_physical(a),
        "resolve_conj": (a.conj() * 1).resolve_conj(), "reciprocal": torch.reciprocal(b),
        "exp": torch.exp(a), "log": torch.log(b), "sqrt": torch.sqrt(a), "abs": a.abs(),
        "abs2": a.abs() ** 2, "angle": a.angle(), "sgn": torch.sgn(a), "real": a.real,
        "imag": b.imag, "polar": torch.polar(r.abs(), r), "complex": torch.complex(r, r * 2),
        "view_as_real": torch.view_as_real(a), "view_as_complex":
            torch.view_as_complex(torch.stack([r, r + 1], -1)),
        "to_wider": a.to(C128), "to_narrower": b.to(C64), "to_real": to_real,
        "to_bool": (a * (r > 0)).to(torch.bool),
        "to_bool_imag": torch.complex(r * 0, torch.relu(r)).to(torch.bool),
        "from_real": r.to(a.dtype),
        "mixed_mul": a * r, "mixed_add": r + b, "mixed_div": a / r, "scalar_mul": a * 2j,
        "scalar_add": a + (1.5 - 0.5j), "scalar_rsub": 3 - a, "scalar_div": b / (2 + 1j),
        "where": torch.where(r > 0, a, b), "sum": a.sum(0), "sum_all": b.sum(),
        "mean": a.mean(-1, keepdim=True),
        "chain": (torch.exp(a * b) / (a + 1j)).conj() * a.abs() + torch.sqrt(b) - a.real,
    }


def _inputs(dt, shape, g, b_shape=None):
    a = torch.randn(shape, dtype=dt, generator=g)
    b = torch.randn(b_shape or shape, dtype=dt, generator=g)
    r = torch.randn(shape, dtype=REAL[dt], generator=g)
    return a, b, r


def arith(a, b, r):
    """A few ops on other layouts and broadcast operands."""
    return {"add": a + b, "mul": a * b, "div": a / b, "exp": torch.exp(a), "sqrt": b.sqrt(),
            "log": torch.log(a), "angle": b.angle(), "abs": a.abs(), "mixed": a * r + 1j,
            "sum": (a * b).sum(-1), "mean": a.mean(0),
            "view_as_real": torch.view_as_real(a * b), "conj": (a - b).conj()}


# (dtype, shape, layout, b's shape, function): every op on a transposed complex64 case; the
# main ones on complex128 and on stepped and broadcast operands (test_special_values runs
# every op on both dtypes too)
CASES = [(C64, (7, 13), "t", None, elementwise), (C128, (6, 11), "contig", None, arith),
         (C64, (5, 9), "step", None, arith), (C64, (3, 1, 5), "contig", (5,), arith)]


def _case_inputs(dt, shape, kind, b_shape, fn, run):
    """Inputs of one case: contiguous tensors whose views (layout `kind`) have `shape`
    (broadcast b: contiguous)."""
    g = gen("complex_native", dt, shape, kind, run)
    n = {"contig": shape, "t": shape[:-2] + shape[::-1][:2], "step": shape[:-1] +
         (2 * shape[-1],)}[kind]
    a, b, r = _inputs(dt, n, g, b_shape if b_shape else n)
    return a, b, r


def _reference(fn, args):
    """eager's complex128 (float64) result on the same values."""
    wide = [a.to(C128) if a.is_complex() else a.double() for a in args]
    with torch.no_grad():
        return fn(*wide)


def _compare(got, want, ref, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype} {tuple(got.shape)} != eager {want.dtype} {tuple(want.shape)}")
    if want.dtype == torch.bool:
        assert torch.equal(got, want), what
        return
    dt = want.dtype if want.is_complex() else {torch.float32: C64, torch.float64: C128}[
        want.dtype]
    torch.testing.assert_close(got.resolve_conj().to(ref.dtype), ref.resolve_conj(),
                               equal_nan=True, msg=lambda m: f"{what}:\n{m}", **TOL[dt])


@pytest.fixture(scope="module")
def elementwise_package(tmp_path_factory):
    cases = {}
    for dt, shape, kind, b_shape, fn in CASES:
        cases[case_name(str(dt)[6:], shape, kind, b_shape or "")] = (Strided(Fn(fn), kind), 3)
    model = Cases(cases)
    args = [x for c in CASES for x in _case_inputs(*c, run=0)]
    compiled = kiln.compile(model, tuple(args))
    return compiled, compiled.load(tmp_path_factory.mktemp("cplx") / "m.kiln"), model


@pytest.mark.parametrize("run", [0, 1])
def test_elementwise_ops_match_eager(elementwise_package, run):
    compiled, runner, model = elementwise_package
    args = [x for c in CASES for x in _case_inputs(*c, run=run)]
    got = runner(*args)
    with torch.no_grad():
        want = model(*args)
    i = 0
    for name, mod in model.mods.items():
        ref = _reference(mod, args[i:i + 3])
        i += 3
        for k, w in ref.items():
            _compare(got[f"{name}__{k}"], want[f"{name}__{k}"], w, f"{name} {k} (run {run})")


def test_elementwise_package_calls_no_aten(elementwise_package):
    compiled, _, _ = elementwise_package
    req = compiled.manifest["requires"]
    assert req["aten_fallback_ops"] == [] and req["libtorch"] is False


# -- rotary embeddings (Llama / Meta style) --------------------------------------------------

def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Rope(torch.nn.Module):
    """Meta's Llama attention prologue: q / k projections, rotary embeddings from a complex64
    buffer (`freqs_cis`) or computed in forward (`polar`), as the reference code does."""

    def __init__(self, dim=32, heads=4, seq=6, buffer=True):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wk = torch.nn.Linear(dim, dim, bias=False)
        self.buffer = buffer
        if buffer:
            self.register_buffer("freqs_cis", precompute_freqs_cis(self.hd, seq))

    def forward(self, x, angles):
        b, s, _ = x.shape
        xq = self.wq(x).view(b, s, self.heads, self.hd)
        xk = self.wk(x).view(b, s, self.heads, self.hd)
        f = self.freqs_cis[:s] if self.buffer else torch.polar(torch.ones_like(angles), angles)
        q, k = apply_rotary_emb(xq, xk, f)
        return {"q": q, "k": k, "scores": (q.transpose(1, 2) @ k.transpose(1, 2).mT)}


def test_rotary_embeddings_run_without_aten(tmp_path):
    torch.manual_seed(0)
    mods = {"buffer": Rope(buffer=True), "polar": Rope(buffer=False)}
    model = Cases({k: (m, 2) for k, m in mods.items()}).eval()

    def args(run):
        g = gen("rope", run)
        return [t for _ in mods for t in (torch.randn(2, 6, 32, generator=g),
                                          torch.randn(6, 4, generator=g))]

    compiled = kiln.compile(model, tuple(args(0)))
    req = compiled.manifest["requires"]
    assert req["aten_fallback_ops"] == [] and req["libtorch"] is False
    runner = compiled.load(tmp_path / "rope.kiln")
    for run in (0, 1):
        a = args(run)
        got = runner(*a)
        with torch.no_grad():
            want = model(*a)
            want64 = Cases({k: (_F64Rope(m), 2) for k, m in mods.items()})(
                *[t.double() for t in a])
        for k, w in want.items():
            assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
            torch.testing.assert_close(got[k].double(), want64[k], rtol=1e-4, atol=1e-4,
                                       msg=lambda m, k=k: f"{k}: {m}")


class _F64Rope(torch.nn.Module):
    """The float64 twin of a Rope (complex128 rotations) for the reference."""

    def __init__(self, m: Rope):
        super().__init__()
        self.m = m

    def forward(self, x, angles):
        m = self.m
        b, s, _ = x.shape
        xq = torch.nn.functional.linear(x, m.wq.weight.double()).view(b, s, m.heads, m.hd)
        xk = torch.nn.functional.linear(x, m.wk.weight.double()).view(b, s, m.heads, m.hd)
        f = m.freqs_cis[:s].to(C128) if m.buffer else torch.polar(torch.ones_like(angles),
                                                                  angles)
        cq = torch.view_as_complex(xq.reshape(b, s, m.heads, -1, 2))
        ck = torch.view_as_complex(xk.reshape(b, s, m.heads, -1, 2))
        f = f.view(1, s, 1, -1)
        q = torch.view_as_real(cq * f).flatten(3)
        k = torch.view_as_real(ck * f).flatten(3)
        return {"q": q, "k": k, "scores": q.transpose(1, 2) @ k.transpose(1, 2).mT}


# -- special values ---------------------------------------------------------------------------

# parts of the special values: zeros, ordinary, infinities, NaN, huge and tiny (whose
# squares stay finite and nonzero in the dtype), subnormal
PARTS = {C64: [0.0, -0.0, 1.0, -2.5, math.inf, -math.inf, math.nan, 1e18, -1e-18, 3e-39],
         C128: [0.0, -0.0, 1.0, -2.5, math.inf, -math.inf, math.nan, 1e150, -1e-150, 5e-320]}


def _special_grid(dt):
    vals = torch.tensor([complex(x, y) for x in PARTS[dt] for y in PARTS[dt]], dtype=C128)
    return vals.to(dt)


def specials(a, b):
    return {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b, "neg": -a,
            "conj": torch.conj_physical(a), "reciprocal": torch.reciprocal(a),
            "exp": torch.exp(a), "log": torch.log(a), "sqrt": torch.sqrt(a), "abs": a.abs(),
            "angle": a.angle(), "sgn": torch.sgn(a)}


def _numpy_specials(a: np.ndarray, b: np.ndarray) -> dict:
    with np.errstate(all="ignore"):
        h = np.abs(a)
        sgn = np.where(h == 0, 0, a / np.where(h == 0, 1, h))
        sgn = np.where(np.isnan(h), complex(math.nan, math.nan), sgn)
        return {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b, "neg": -a,
                "conj": np.conj(a), "reciprocal": np.divide(1, a), "exp": np.exp(a),
                "log": np.log(a), "sqrt": np.sqrt(a), "abs": h, "angle": np.angle(a),
                "sgn": sgn}


def _same(g: torch.Tensor, w: torch.Tensor, rtol: float) -> torch.Tensor:
    """Per element: equal part by part (NaN == NaN, zeros with their sign), or finite and
    close as complex numbers (|g - w| <= rtol |w|: a part that cancels to 0 in one and to a
    rounding error of the other's magnitude in the other is close)."""
    parts = (lambda t: torch.view_as_real(t).unbind(-1)) if g.is_complex() else (
        lambda t: (t,))
    eq = torch.ones(g.shape, dtype=torch.bool)
    for x, y in zip(parts(g), parts(w)):
        eq &= ((x == y) & ((x != 0) | (torch.signbit(x) == torch.signbit(y)))) | (
            x.isnan() & y.isnan())
    g64, w64 = g.to(C128 if g.is_complex() else torch.float64), w.to(
        C128 if w.is_complex() else torch.float64)
    finite = torch.isfinite(g64) & torch.isfinite(w64)
    close = finite & ((g64 - w64).abs() <= rtol * w64.abs() + 1e-300)
    return eq | close


@pytest.mark.parametrize("dt", [C64, C128], ids=["complex64", "complex128"])
def test_special_values(tmp_path, dt):
    """Every pair of special parts (a over 100 values x b over 100 values): each element
    equals numpy's complex128 math rounded to the dtype, or eager's own result."""
    grid = _special_grid(dt)
    a, b = grid[:, None].expand(100, 100).contiguous(), grid[None, :].expand(100, 100)
    b = b.contiguous()
    fn = Fn(specials)
    compiled = kiln.compile(fn, (a, b))
    assert compiled.manifest["requires"]["aten_fallback_ops"] == []
    got = compiled.load(tmp_path / "sp.kiln")(a, b)
    with torch.no_grad():
        eager = specials(a, b)
    ref = _numpy_specials(a.to(C128).numpy(), b.to(C128).numpy())
    rtol = 4e-6 if dt == C64 else 1e-13
    for k, w in eager.items():
        g = got[k]
        assert g.dtype == w.dtype, k
        r = torch.from_numpy(np.asarray(ref[k])).to(w.dtype)
        ok = _same(g, r, rtol) | _same(g, w.resolve_conj(), rtol)
        if not bool(ok.all()):
            bad = (~ok).nonzero()[:6].tolist()
            raise AssertionError(f"{k} ({dt}): " + "; ".join(
                f"{a[i, j].item()} , {b[i, j].item()} -> {g[i, j].item()} (numpy "
                f"{r[i, j].item()}, eager {w[i, j].item()})" for i, j in bad))


# -- what still goes to ATen -------------------------------------------------------------------

def test_ops_kiln_does_not_compute_still_use_the_fallback(tmp_path):
    """Complex ops without a kiln formula (masked_select; a scatter_reduce product until
    session 14, now kiln's: test_scatter_prod_cov.py) are ATen fallback calls, with eager's
    answer; the native ops around them stay kiln's."""
    def fn(a, b):
        return {"msel": torch.masked_select(a * b, a.real > 0).sum() + b}
    g = gen("complex_fallback")
    a, b = (torch.randn(4, 600, dtype=C64, generator=g) for _ in range(2))
    compiled = kiln.compile(Fn(fn), (a, b))
    ops = compiled.manifest["requires"]["aten_fallback_ops"]
    assert ops == ["aten::masked_select.default"], ops
    assert "aten::add.Tensor" not in ops and "aten::mul.Tensor" not in ops  # kiln's own
    got = compiled.load(tmp_path / "fb.kiln")(a, b)
    want = fn(a, b)
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-5)


# -- CUDA: the same lowering in Triton kernels, run by Triton's interpreter --------------------

def cuda_program(xq, ang, a, b, r):
    """RoPE and complex arithmetic without libdevice calls the interpreter lacks (hypot)."""
    f = torch.polar(torch.ones_like(ang), ang)
    q = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    z = a / b + a.conj() * 2j - b.reciprocal() + torch.exp(a) - (-a)
    return {"rope": torch.view_as_real(q * f).flatten(3), "z": z, "parts": z.real + z.imag,
            "sum": a.sum(0) + a.mean(1, keepdim=True)[0], "cast": a.to(C128), "mixed": a * r}


def cuda_args(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 4, 8, generator=g), torch.randn(4, 4, generator=g),
            torch.randn(3, 4, dtype=C64, generator=g), torch.randn(3, 4, dtype=C64, generator=g),
            torch.randn(3, 4, generator=g))


_CUDA_INTERP = """
import sys, torch, kiln
from torch.utils import _pytree as pytree
sys.path.insert(0, sys.argv[1])
from test_complex_native import cuda_program, cuda_args, OPTS_CUDA, Fn
from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
from kiln.targets.cuda.build import triton_kernels
b = kiln.compile(torch.export.export(Fn(cuda_program), cuda_args(0)), device="cuda",
                 options=OPTS_CUDA).built
mod = import_triton_module(b.sources["kernels_triton.py"])
ks = {k.name: k for k in triton_kernels(b.steps, {x.name: x for x in b.loop.buffers}, {})}
args = cuda_args(1)
outs = run_program(b.program, ks, mod, b.weights, list(args))
want = pytree.tree_leaves(cuda_program(*args))
for o, w in zip(outs, want, strict=True):
    torch.testing.assert_close(o.reshape(w.shape), w, rtol=1e-5, atol=1e-5)
print("ALL OK")
"""


@pytest.mark.slow  # a CUDA build (cubins) and Triton's interpreter: ~30 s on 2 cores
def test_cuda_kernels_compute_on_parts_in_interpreter():
    import os
    import pathlib
    import subprocess
    import sys
    pytest.importorskip("triton")
    cm = kiln.compile(torch.export.export(Fn(cuda_program), cuda_args(0)), device="cuda",
                      options=OPTS_CUDA)  # (the interpreter cannot build cubins: built here)
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    assert ".to(tl.float32, bitcast=True)" in cm.sources["kernels_triton.py"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _CUDA_INTERP, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


def gpu_program(xq, ang, a, b, r):
    """cuda_program plus what needs libdevice on a real GPU (hypot, atan2, log, sqrt)."""
    out = cuda_program(xq, ang, a, b, r)
    out.update(abs=a.abs(), angle=torch.angle(b), log=torch.log(a), sqrt=torch.sqrt(b),
               sgn=torch.sgn(a))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_package_computes_complex_on_the_gpu(tmp_path):
    from torch.utils import _pytree as pytree

    args = [x.cuda() for x in cuda_args(0)]
    cm = kiln.compile(torch.export.export(Fn(gpu_program), tuple(args)), device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    runner = cm.load(tmp_path / "c.kiln", device="cuda:0")
    for seed in (1, 2):
        args = [x.cuda() for x in cuda_args(seed)]
        got = pytree.tree_leaves(runner(*args))
        want = pytree.tree_leaves(gpu_program(*[x.double() if not x.is_complex() else
                                                x.to(torch.complex128) for x in args]))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.reshape(w.shape).cpu().to(w.dtype), w.cpu(),
                                       rtol=1e-5, atol=1e-5)
