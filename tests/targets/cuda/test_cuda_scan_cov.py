"""Scans and nonzero on CUDA without ATen (issue 16: cumsum, cumprod, logcumsumexp, cummax,
cummin and nonzero went to the ATen fallback on CUDA): Triton kernels (targets/cuda/scan.py),
a row walked in tiles with a carry, any dim (permuted last by lowering), any length.

Without a GPU: the programs compile for sm_90 with no ATen op, and their Triton kernels run in
Triton's interpreter through the Python runner against eager: integer and bool scans (cumsum /
cumprod to int64) and cummax / cummin values and indices exactly (ties and NaN: the later
element, as eager's CPU and CUDA kernels); floating scans (float32, float16, bfloat16, float64)
within twice eager's own distance from float64 math plus a few ulps of the dtype, with eager's
inf / NaN pattern; rows longer than a tile (several tiles in order), scans over outer and
middle dims, transposed operands, a dynamic scanned dim; nonzero / argwhere / nonzero(as_tuple)
/ masked_select / x[mask] of masks over several tiles, empty and full. With a GPU (`-m gpu`):
the packages against eager on the device at sizes up to a million elements a row."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

import kiln
from kiln.options import Options
from tests.difftest import Fn

OPTS = Options(cuda_archs=(90,), autotune=False, cuda_graphs=False)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool)
# a few ulps of each dtype, relative (finite values)
EPS = {torch.float32: 4e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-13,
       torch.complex64: 4e-6, torch.complex128: 1e-13}


def float_scans(x, y, z, w):
    """x [r, n] (n above one tile), y [m, c] (m above one outer-dim tile), z [a, b, c], w
    [r, n] factors near 1."""
    out = {"cs1": torch.cumsum(x, 1), "cs0": torch.cumsum(y, 0), "cs_t": torch.cumsum(y.t(), 1),
           "cs_mid": torch.cumsum(z, 1), "cp": torch.cumprod(w, 1),
           "cp0": torch.cumprod(w[:, :40].t(), 0), "lse1": torch.logcumsumexp(x, 1),
           "lse0": torch.logcumsumexp(y, 0), "cmax": tuple(torch.cummax(x, 1)),
           "cmin0": tuple(torch.cummin(y, 0)), "cmax_mid": tuple(torch.cummax(z, 1)),
           "cs64": torch.cumsum(x, 1, dtype=torch.float64),
           "cs16": torch.cumsum(y, 0, dtype=torch.float16)}
    return out


def float_scans_ref(x, y, z, w):
    """float_scans' reference in float64 math (its inputs float64). `cs16` asks for float16
    arithmetic: eager's CUDA scan rounds its running sum to float16 at every step, while kiln
    (and eager's CPU scan) accumulate in float32 and round each output; so its reference is
    the float64 sum of y rounded to float16 first, not eager's float16 arithmetic."""
    out = float_scans(x, y, z, w)
    out["cs16"] = torch.cumsum(y.to(torch.float16).double(), 0)
    return out


def int_scans(x, y):
    """x [r, n] (n above one tile), y [m, c]; bool / int sums and products are int64."""
    out = {"cs1": torch.cumsum(x, 1), "cs0": torch.cumsum(y, 0), "cs_t": torch.cumsum(y.t(), 1),
           "cp": torch.cumprod(y, 0), "cmax": tuple(torch.cummax(x, 1)),
           "cmin0": tuple(torch.cummin(y, 0))}
    if x.dtype == torch.int32:
        out["cs8"] = torch.cumsum(x, 1, dtype=torch.int8)  # wrapping in the output's type
        out["csf"] = torch.cumsum(y, 0, dtype=torch.float32)
    return out


def nonzeros(m, x, b):
    return {"nz": torch.nonzero(m), "aw": torch.argwhere(x < 0),
            "tup": torch.nonzero(b, as_tuple=True), "ms": torch.masked_select(x, x > 0.3),
            "inner": x[:, b[:3] > 0], "rows": x[x[:, 0, 0] > 0].sum(0),
            "used": torch.nonzero(x > 1).sum(0) * 2 + 1}


def long_scans(x, i, b):
    """Few rows longer than 2 chunks (the multi-block scan: targets/cuda/scan.py
    `_print_scan_blocks`), the last chunk partial."""
    return {"cs": torch.cumsum(x, 1), "lse": torch.logcumsumexp(x, 1),
            "cmax": tuple(torch.cummax(x, 1)), "cmin0": tuple(torch.cummin(x.t(), 0)),
            "ci": torch.cumsum(i, 0), "cp": torch.cumprod(i[:, :1] % 3 - 1, 0),
            "cmb": tuple(torch.cummax(b, 1)), "csb": torch.cumsum(b, 1, dtype=torch.int32),
            "nz": torch.nonzero(b), "ms": torch.masked_select(x, x > 2)}


def _long_inputs(g, n=5000, special=False):
    x = torch.randn(2, n, generator=g)
    if special:
        x[0, 100], x[0, 3000], x[1, 2047], x[1, 2048] = math.nan, math.inf, -math.inf, math.nan
        x[1, 4000:] = 0.5  # ties across chunks
    return (x, torch.randint(-9, 9, (n, 2), generator=g).to(torch.int32),
            torch.rand(3, n, generator=g) < 0.01)


def cscatter(x, i0, i1, src):
    """Complex scatter products (CUDA: targets/cuda/scan.py `print_cput_kernel`)."""
    return {"m0": x.scatter(0, i0, src, reduce="multiply"),
            "p1": x.scatter_reduce(1, i1, src, "prod", include_self=False),
            "p0": x.scatter_reduce(0, i0, src, "prod"),
            "p_t": x.t().scatter_reduce(1, i0.t(), src[:4, :6].t(), "prod",
                                        include_self=False)}


def _cscatter_inputs(dt, g, special=False):
    x = torch.randn(5, 6, dtype=dt, generator=g)
    i0 = torch.randint(0, 5, (4, 6), generator=g)  # duplicates: products in update order
    i1 = torch.randint(0, 6, (5, 3), generator=g)
    src = torch.randn(6, 7, dtype=dt, generator=g)
    if special:
        src[1, 1], src[2, 0] = complex(math.inf, 0), complex(0, math.nan)
        src[0, 2], x[3, 3] = complex(math.inf, -math.inf), complex(0, 0)
    return x, i0, i1, src


def _special(x: torch.Tensor) -> torch.Tensor:
    """inf / -inf / NaN / +-0 at the start, middle and end of some rows, and ties."""
    x = x.clone()
    inf, nan = math.inf, math.nan
    x[0, 0], x[0, 5], x[0, -1] = nan, inf, -inf
    x[1, 3], x[1, 9] = inf, -inf
    x[2, 2], x[2, 7], x[2, 8] = nan, nan, 0.0
    x[3, :] = torch.round(x[3, :].float()).to(x.dtype)  # many ties
    x[4, 0], x[4, 1] = -inf, -inf
    if x.shape[0] > 5:
        x[5, 4], x[5, 6] = -0.0, 0.0
    return x


def _float_inputs(dt, g, n=1100, m=40, special=False):
    x = torch.randn(6, n, generator=g).to(dt) * 2
    y = torch.randn(m, 5, generator=g).to(dt)
    z = torch.randn(3, 19, 4, generator=g).to(dt)
    w = (1 + torch.randn(6, n, generator=g) * 0.02).to(dt)
    if special:
        x, y = _special(x), _special(y.t().contiguous()).t().contiguous()
        w = _special(w)
    return x, y, z, w


def _int_inputs(dt, g, n=1100, m=40):
    if dt == torch.bool:
        return (torch.rand(4, n, generator=g) > 0.6, torch.rand(m, 5, generator=g) > 0.3)
    lo, hi = (0, 4) if dt == torch.uint8 else (-3, 4)
    return (torch.randint(lo, hi, (4, n), generator=g).to(dt),
            torch.randint(lo, hi, (m, 5), generator=g).to(dt))


def _nz_inputs(g, p=0.4):
    m = torch.rand(40, 60, generator=g) < p  # 2400 elements: three tiles
    x = torch.randn(7, 3, 5, generator=g)
    b = torch.randint(0, 3, (1100,), generator=g).to(torch.int32)
    return m, x, b


_compiled: dict = {}


def _build(name, fn, args, dyn=None, options=OPTS):
    key = (name, options)
    if key not in _compiled:
        ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
        _compiled[key] = kiln.compile(ep, device="cuda", options=options)
    return _compiled[key]


def _builds():
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in FLOATS:
        out[f"float_{dt}"] = (float_scans, _float_inputs(dt, g), None)
    for dt in INTS:
        out[f"int_{dt}"] = (int_scans, _int_inputs(dt, g), None)
    out["nonzero"] = (nonzeros, _nz_inputs(g), None)
    out["long"] = (long_scans, _long_inputs(g), None)
    for dt in (torch.complex64, torch.complex128):
        out[f"cput_{dt}"] = (cscatter, _cscatter_inputs(dt, g), None)
    out["float_dyn"] = (float_scans, _float_inputs(torch.float32, g, n=50, m=20),
                        ({1: Dim("n", min=41, max=4096)}, {0: Dim("m", min=2, max=4096)}, None,
                         {1: Dim("n", min=41, max=4096)}))
    out["nonzero_dyn"] = (nonzeros, _nz_inputs(g),
                          ({0: Dim("r", min=2, max=4096)}, None, None))
    return out


def _cases(builds, which):
    for name in which:
        fn, args, dyn = builds[name]
        yield name, _build(name, fn, args, dyn)


@pytest.mark.slow  # CUDA builds (Triton kernels and cubins for sm_90)
def test_cuda_scans_and_nonzero_build_without_aten():
    builds = _builds()
    for name, cm in _cases(builds, builds):
        assert cm.manifest["requires"]["aten_fallback_ops"] == [], name
        assert cm.manifest["requires"]["libtorch"] is False, name
        src = cm.sources["kernels_triton.py"]
        routines = {s.routine for s in cm.built.steps if hasattr(s, "routine")}
        if name.startswith("cput_"):
            assert "def cput_" in src and "tl.fma(" in src and "put" in routines, name
            continue
        assert "tl.associative_scan(" in src, name
        assert routines & {"scan", "scan_extreme", "nonzero"}, (name, routines)


def _inputs_for(name, g):
    """Fresh inputs for the interpreter / the GPU: special values for floats, other sizes for
    the dynamic builds, empty and full masks for nonzero."""
    if name.startswith("float_torch"):
        dt = getattr(torch, name.split(".")[1])
        return [_float_inputs(dt, g), _float_inputs(dt, g, special=True)]
    if name.startswith("int_"):
        dt = getattr(torch, name.split(".")[1])
        return [_int_inputs(dt, g)]
    if name == "float_dyn":
        return [_float_inputs(torch.float32, g, n=n, m=m, special=sp)
                for n, m, sp in ((41, 2, False), (1500, 70, True))]
    if name == "long":
        return [_long_inputs(g), _long_inputs(g, special=True)]
    if name.startswith("cput_"):
        dt = getattr(torch, name.split(".")[1])
        return [_cscatter_inputs(dt, g), _cscatter_inputs(dt, g, special=True)]
    if name == "nonzero":
        return [_nz_inputs(g, p) for p in (0.0, 0.4, 1.0)]
    return [(torch.rand(r, 60, generator=g) < 0.5, *_nz_inputs(g)[1:]) for r in (2, 3, 90)]


def check_outputs(got, fn, args, what="", device="cpu"):
    """Kiln's outputs `got` against eager on `device`: exact for integers, bools, indices and
    NaN / inf patterns; floats within 2x eager's distance from float64 math plus EPS of the
    dtype (relative to the output's largest magnitude: cumulative sums cancel)."""
    def run(xs):
        out = fn(*[a.to(device) for a in xs])
        return [t.cpu() for t in pytree.tree_leaves(out)]
    want = run(args)
    ref_fn = float_scans_ref if fn is float_scans else fn
    ref = [t.cpu() for t in pytree.tree_leaves(ref_fn(*[
        (a.double() if a.is_floating_point() else a).to(device) for a in args]))]
    assert len(got) == len(want), what
    for k, (g, w, r) in enumerate(zip(got, want, ref, strict=True)):
        g = g.cpu().reshape(w.shape)
        where = f"{what} output {k} ({w.dtype}, {tuple(w.shape)})"
        assert g.dtype == w.dtype, where
        if w.is_complex():  # each part as a float
            g, w, r = (torch.view_as_real(t) for t in (g, w, r))
        if not w.is_floating_point():
            assert torch.equal(g, w), f"{where}: {(g != w).nonzero()[:5].tolist()}"
            continue
        nan = g.isnan() != w.isnan()
        assert not bool(nan.any()), f"{where}: NaN at {nan.nonzero()[:5].tolist()}"
        inf = w.isinf()
        assert torch.equal(g.isinf(), inf) and torch.equal(g[inf], w[inf]), where
        fin = torch.isfinite(w)
        if not bool(fin.any()):
            continue
        r = r.to(torch.float64)[fin]
        gd, wd = g.double()[fin], w.double()[fin]
        bound = 2 * (wd - r).abs() + EPS[w.dtype] * (1 + float(r.abs().max()))
        bad = (gd - r).abs() > bound
        assert not bool(bad.any()), (where, gd[bad][:4].tolist(), r[bad][:4].tolist())


_INTERP = textwrap.dedent("""
    import pickle, sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_cuda_scan_cov import (check_outputs, cscatter, float_scans, int_scans,
                                    long_scans, nonzeros)
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    fns = {"float": float_scans, "int": int_scans, "nonzero": nonzeros, "cput": cscatter,
           "long": long_scans}
    with open(sys.argv[1], "rb") as f:
        cases = pickle.load(f)
    for name, prog, kernels, module, weights, calls in cases:
        mod = import_triton_module(module)
        fn = fns[name.split("_")[0]]
        for args in calls:
            got = run_program(prog, kernels, mod, weights, list(args))
            check_outputs(got, fn, args, name)
        print(name, "checked", flush=True)
    print("ALL OK")
""")


def _interpret(tmp_path, which):
    from test_cuda_dds import interpret_builds

    builds = _builds()
    g = torch.Generator().manual_seed(1)
    cases = []
    for name, cm in _cases(builds, which):
        cases.append((name, cm, _inputs_for(name, g)))
    interpret_builds(tmp_path, _INTERP, cases)


@pytest.mark.slow  # CUDA builds and Triton's interpreter
def test_cuda_float_scans_in_interpreter(tmp_path):
    _interpret(tmp_path, [f"float_{dt}" for dt in FLOATS] + ["float_dyn"])


@pytest.mark.slow  # CUDA builds and Triton's interpreter
def test_cuda_multi_block_scans_in_interpreter(tmp_path):
    from test_cuda_dds import triton_kernels_of

    cm = _build("long", *_builds()["long"][:2])
    names = set(triton_kernels_of(cm))
    assert {n for n in names if n.endswith(("_local", "_carry", "_fix"))}, names
    _interpret(tmp_path, ["long"])


@pytest.mark.slow  # CUDA builds and Triton's interpreter
def test_cuda_complex_scatter_products_in_interpreter(tmp_path):
    _interpret(tmp_path, ["cput_torch.complex64", "cput_torch.complex128"])


@pytest.mark.slow  # CUDA builds and Triton's interpreter
def test_cuda_int_scans_and_nonzero_in_interpreter(tmp_path):
    _interpret(tmp_path, [f"int_{dt}" for dt in INTS] + ["nonzero", "nonzero_dyn"])


def test_scan_kernel_walks_a_row_in_tiles():
    """The kernel's shape (no build): a tile loop over the dynamic length with a carry, the
    combine of eager's rules, a strided operand read through its strides."""
    import sympy

    from kiln.ir import dtypes
    from kiln.ir import loop as L
    from kiln.targets.cuda.scan import (print_nonzero_kernel, print_scan_kernel,
                                        print_scan_kernels)

    n = sympy.Symbol("s0")
    bufs = {"x": L.Buffer("x", dtypes.float16, (n, 5), "input"),
            "y": L.Buffer("y", dtypes.float16, (5, n), "temp"),
            "i": L.Buffer("i", dtypes.int64, (5, n), "temp")}
    one, five = sympy.Integer(1), sympy.Integer(5)
    arg = L.LibArg("x", sympy.Integer(0), (five, n), (one, five))
    k = print_scan_kernel(L.Extern("scan", ("y",), (arg,), (("kind", 2),), ("lse",)), bufs,
                          {"s0": 3000})
    assert "for r0 in range(0, s0, RBLOCK):" in k.source
    assert "tl.associative_scan(v, 1, _kl_lse)" in k.source and "r * 5" in k.source
    assert "tl.float32" in k.source and ".to(tl.float16)" in k.source  # float32 math, stored half
    assert ("size", "s0") in k.params and k.rows == 5
    k = print_scan_kernel(L.Extern("scan_extreme", ("y", "i"), (arg,), (("is_max", True),),
                                   ("cummax",)), bufs, {"s0": 3000})
    assert "_kl_cummax" in k.source and "buf_i" in k.source
    # few long rows: the multi-block scan (three kernels) where the output can carry partial
    # results; a float16 output keeps the one-kernel form
    bufs["y32"] = L.Buffer("y32", dtypes.float32, (5, n), "temp")
    call = L.Extern("scan", ("y32",), (arg,), (("kind", 0),), ("cumsum",))
    ks = print_scan_kernels(call, bufs, {"s0": 100000})
    assert [k.name for k in ks] == ["scan_y32_local", "scan_y32_carry", "scan_y32_fix"]
    assert "// 2048)" in ks[0].source and "FloorDiv" in str(ks[0].rows)
    assert len(print_scan_kernels(call, bufs, {"s0": 3000})) == 1  # short rows
    half = L.Extern("scan", ("y",), (arg,), (("kind", 0),), ("cumsum",))
    assert len(print_scan_kernels(half, bufs, {"s0": 100000})) == 1
    m = L.Buffer("m", dtypes.bool_, (n, 5), "input")
    c = L.Buffer("c", dtypes.int64, (), "temp")
    o = L.Buffer("o", dtypes.int64, (sympy.Symbol("u0"), 2), "temp")
    marg = L.LibArg("m", sympy.Integer(0), (n, five), (five, one))
    carg = L.LibArg("c", sympy.Integer(0), (), ())
    k = print_nonzero_kernel(L.Extern("nonzero", ("o",), (marg, carg), (), ("nz",)),
                             {"m": m, "c": c, "o": o})
    assert k.status and "carry != want" in k.source and "pos < want" in k.source


# -- on a GPU ---------------------------------------------------------------------------------

def _gpu_cases():
    g = torch.Generator().manual_seed(3)
    out = []
    for dt in FLOATS:
        out.append((f"gpu_float_{dt}", float_scans, _float_inputs(dt, g, n=200000, m=5000),
                    [_float_inputs(dt, g, n=200000, m=5000, special=True)]))
    for dt in INTS:
        out.append((f"gpu_int_{dt}", int_scans, _int_inputs(dt, g, n=300000, m=20000),
                    [_int_inputs(dt, g, n=300000, m=20000)]))
    big = (torch.rand(1000, 1000, generator=g) < 0.3, torch.randn(70, 3, 50, generator=g),
           torch.randint(0, 3, (1 << 20,), generator=g).to(torch.int32))
    out.append(("gpu_nonzero", nonzeros, big, [big, (big[0] & False, *big[1:]),
                                                (big[0] | True, *big[1:])]))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", range(len(FLOATS) + len(INTS) + 1))
def test_gpu_scans_match_eager(k, tmp_path):
    name, fn, args, calls = _gpu_cases()[k]
    cm = kiln.compile(torch.export.export(Fn(fn), args), device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == [], name
    runner = kiln.load(cm.save(tmp_path / f"{name}.kiln"), device="cuda:0")
    for call in (args, *calls):
        got = pytree.tree_leaves(runner(*[a.cuda() for a in call]))
        check_outputs(got, fn, call, name, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dt", (torch.complex64, torch.complex128), ids=("c64", "c128"))
def test_gpu_complex_scatter_products_match_eager_cpu(dt, tmp_path):
    """Against eager on the CPU (eager's CUDA scatter products of complex values were not
    implemented in the torch versions we know of: pytorch/pytorch#121965)."""
    g = torch.Generator().manual_seed(4)
    args = _cscatter_inputs(dt, g)
    cm = kiln.compile(torch.export.export(Fn(cscatter), args), device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    runner = kiln.load(cm.save(tmp_path / "cput.kiln"), device="cuda:0")
    for call in (args, _cscatter_inputs(dt, g, special=True)):
        got = pytree.tree_leaves(runner(*[a.cuda() for a in call]))
        check_outputs(got, cscatter, call, str(dt), device="cpu")
