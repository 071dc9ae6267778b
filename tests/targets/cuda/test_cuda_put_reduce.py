"""Accumulating scatters on CUDA without ATen (issue 16: index_put(accumulate=True), index_add,
scatter_add, scatter(reduce=...), scatter_reduce sum / prod / mean / amax / amin went to the
ATen fallback on CUDA): Triton kernels with atomics (targets/cuda/put_reduce.py), plain
scatter through put.py.

Without a GPU: the programs compile for sm_90 with no ATen op, and their Triton kernels run in
Triton's interpreter through the Python runner against eager (CPU): integers and bools exactly
(sums and products wrap, means floor), floats with eager's NaN / inf pattern and within twice
eager's own distance from float64 math plus a tolerance that grows with the number of
duplicates of a place (the updates of one place combine in no fixed order, rounded to the
dtype at each one): duplicates along every dim, self / index / src transposed, src larger
than the index, negative indices (index_put), a dynamic size; an index out of range is an
error. With a GPU (`-m gpu`): the packages against eager on the device, at sizes where many
updates of one place race, every dtype."""

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
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
# a few ulps of each dtype, relative
EPS = {torch.float32: 2.4e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 2.3e-16}


def scatters(x, i0, i1, src, ip, vp, ia, perm):
    """x [R, C]; i0 [r, C] in [0, R) (duplicates down dim 0); i1 [R, c] in [0, C); src
    [r + 2, C + 1], larger than both indices (its leading part read; R <= r + 2, c <= C + 1);
    ip [k] in [-R, R) (index_put wraps); vp [k, C]; ia [m] in [0, C) (m <= C + 1); perm
    [R, C] a permutation of each row (plain scatter: one update a place). Bool: no mean
    (eager has none)."""
    out = {"add0": x.scatter_add(0, i0, src), "add1": torch.scatter_add(x, 1, i1, src),
           "add_r": x.scatter(0, i0, src, reduce="add"),
           "sum_ns": x.scatter_reduce(1, i1, src, "sum", include_self=False),
           "amax": x.scatter_reduce(0, i0, src, "amax"),
           "amax_ns": x.scatter_reduce(1, i1, src, "amax", include_self=False),
           "amin": x.scatter_reduce(1, i1, src, "amin"),
           "amin_ns": x.scatter_reduce(0, i0, src, "amin", include_self=False),
           "prod_ns": x.scatter_reduce(0, i0, src, "prod", include_self=False),
           "ip": x.index_put((ip,), vp, accumulate=True),
           "ip2": x.index_put((ip, ia[:1]), vp[:, 0], accumulate=True),
           "ia": x.index_add(1, ia, src[:x.shape[0], :ia.shape[0]]),
           "t": x.t().scatter_add(1, i0.t(), src.t()),
           "t_amax": x.t().scatter_reduce(0, i1.t(), src.t(), "amax", include_self=False),
           "set": x.scatter(1, perm, src[:x.shape[0]])}
    if x.dtype != torch.bool:
        out["mean"] = x.scatter_reduce(0, i0, src, "mean")
        out["mean_ns"] = x.scatter_reduce(1, i1, src, "mean", include_self=False)
        out["mul"] = x.scatter(1, i1, src, reduce="multiply")
        out["ia2"] = x.index_add(0, ip % x.shape[0], vp, alpha=2)
    return out


def _inputs(dt, g, R=5, C=6, r=4, c=3, k=8, m=7, special=False, big=False):
    lo, hi = (0, 4) if dt == torch.uint8 else (-3, 4)
    if dt == torch.bool:
        def vals(*s):
            return torch.rand(*s, generator=g) < 0.5
    elif dt.is_floating_point:
        def vals(*s):
            return (torch.randn(*s, generator=g) * (0.5 if big else 1.5)).to(dt)
    else:
        def vals(*s):
            return torch.randint(lo, hi, s, generator=g).to(dt)
    x, src, vp = vals(R, C), vals(r + 2, C + 1), vals(k, C)
    if big and dt.is_floating_point:  # products of many factors near 1 stay finite
        src = (1 + (src.float() - src.float().mean()) * 0.01).to(dt)
    if special and dt.is_floating_point:
        x[0, 0], x[1, 1] = math.nan, math.inf
        src[0, 2], src[1, 3], src[2, 3], src[0, 4] = math.nan, math.inf, -math.inf, -math.inf
        vp[0, 1], vp[1, 2] = math.nan, math.inf
    i0 = torch.randint(0, R, (r, C), generator=g)
    i1 = torch.randint(0, C, (R, c), generator=g)
    ip = torch.randint(-R, R, (k,), generator=g)
    ia = torch.randint(0, C, (m,), generator=g)
    perm = torch.stack([torch.randperm(C, generator=g) for _ in range(R)])
    return x, i0, i1, src, ip, vp, ia, perm


def _duplicates(args) -> int:
    """The most updates one place takes (of any index operand)."""
    return max(int(torch.unique(t, return_counts=True)[1].max()) for t in args[1:]
               if t.dtype == torch.int64 and t.numel())


def check_outputs(got, fn, args, what="", device="cpu"):
    """Kiln's outputs `got` against eager on `device`: exact for integers and bools and for
    the NaN / inf pattern; floats within 2x eager's distance from float64 math plus EPS of
    the dtype times (duplicates + 2) times the float64 result of the magnitudes (fn of |args|:
    the size of the terms a sum or product combined)."""
    def run(xs):
        return [t.cpu() for t in pytree.tree_leaves(fn(*[a.to(device) for a in xs]))]

    want = run(args)
    wide = [a.double() if a.is_floating_point() else a for a in args]
    ref = run(wide)
    mag = run([a.abs() if a.is_floating_point() else a for a in wide])
    k = _duplicates(args) + 2
    assert len(got) == len(want), what
    for j, (g, w, r, a) in enumerate(zip(got, want, ref, mag, strict=True)):
        g = g.cpu().reshape(w.shape)
        where = f"{what} output {j} ({w.dtype}, {tuple(w.shape)})"
        assert g.dtype == w.dtype, where
        if not w.is_floating_point():
            assert torch.equal(g, w), f"{where}: {(g != w).nonzero()[:5].tolist()}"
            continue
        nan = g.isnan() != w.isnan()
        assert not bool(nan.any()), f"{where}: NaN at {nan.nonzero()[:5].tolist()}"
        inf = w.isinf()
        assert torch.equal(g.isinf(), inf) and torch.equal(g[inf], w[inf]), where
        fin = torch.isfinite(w) & torch.isfinite(r)
        gd, wd, rd, ad = (t.double()[fin] for t in (g, w, r, a))
        bound = 2 * (wd - rd).abs() + EPS[w.dtype] * k * (1 + ad.abs().nan_to_num(0, 0, 0))
        bad = (gd - rd).abs() > bound
        assert not bool(bad.any()), (where, gd[bad][:4].tolist(), rd[bad][:4].tolist())


def dyn_scatters(x, i1, src, ip, vp):
    """A dynamic row length (x [5, n], src [7, n + 1]) and update count (ip [k], vp [k, n])."""
    return {"add1": x.scatter_add(1, i1, src), "mean": x.scatter_reduce(1, i1, src, "mean"),
            "amax": x.scatter_reduce(1, i1, src, "amax", include_self=False),
            "ip": x.index_put((ip,), vp, accumulate=True)}


def _dyn_inputs(g, n, k, special=False):
    x, _, i1, _, ip, vp, *_ = _inputs(torch.float32, g, C=n, k=k, special=special)
    src = torch.randn(7, n + 1, generator=g)
    return x, i1, src, ip, vp


_compiled: dict = {}


def _build(name, fn, args, dyn=None):
    if name not in _compiled:
        ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
        _compiled[name] = kiln.compile(ep, device="cuda", options=OPTS)
    return _compiled[name]


def _case(name, g):
    """(fn, example args, dynamic shapes, fresh inputs to check) of build `name`."""
    if name == "dyn":
        n, k = Dim("n", min=3, max=4096), Dim("k", min=2, max=4096)
        dyn = ({1: n}, None, {1: n + 1}, {0: k}, {0: k, 1: n})
        return (dyn_scatters, _dyn_inputs(g, 6, 8), dyn,
                [_dyn_inputs(g, 40, 3), _dyn_inputs(g, 9, 300, special=True)])
    dt = getattr(torch, name)
    calls = [_inputs(dt, g), _inputs(dt, g, special=True)]
    return scatters, _inputs(dt, g), None, calls


_INTERP = textwrap.dedent("""
    import pickle, sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_cuda_put_reduce import check_outputs, dyn_scatters, scatters
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    with open(sys.argv[1], "rb") as f:
        cases = pickle.load(f)
    for name, prog, kernels, module, weights, calls in cases:
        mod = import_triton_module(module)
        fn = dyn_scatters if name == "dyn" else scatters
        for args in calls:
            got = run_program(prog, kernels, mod, weights, list(args))
            check_outputs(got, fn, args, name)
        if name == "float32":  # an index out of range: the run's index status, an error
            bad = list(calls[0])
            bad[1] = bad[1].clone()
            bad[1][1, 2] = 5
            try:
                run_program(prog, kernels, mod, weights, bad)
            except IndexError as e:
                assert "out of range" in str(e), e
            else:
                raise AssertionError("no error for an index out of range")
        print(name, "checked", flush=True)
    print("ALL OK")
""")


def _interpret(tmp_path, which):
    from test_cuda_dds import interpret_builds

    g = torch.Generator().manual_seed(1)
    cases = []
    for name in which:
        fn, args, dyn, calls = _case(name, g)
        cm = _build(name, fn, args, dyn)
        assert cm.manifest["requires"]["aten_fallback_ops"] == [], name
        assert cm.manifest["requires"]["libtorch"] is False, name
        cases.append((name, cm, calls))
    interpret_builds(tmp_path, _INTERP, cases, timeout=900)


def test_cuda_scatter_reduce_in_interpreter(tmp_path):
    """float32 (native atomic sums, CAS loops for the rest) and int32 (native sums and
    extremes), in the default suite."""
    _interpret(tmp_path, ["float32", "int32"])


@pytest.mark.slow  # CUDA builds and Triton's interpreter
def test_cuda_scatter_reduce_16bit_floats_in_interpreter(tmp_path):
    _interpret(tmp_path, ["float16", "bfloat16", "float64", "dyn"])


@pytest.mark.slow  # CUDA builds and Triton's interpreter
def test_cuda_scatter_reduce_ints_in_interpreter(tmp_path):
    _interpret(tmp_path, ["int64", "int16", "int8", "uint8", "bool"])


def test_put_reduce_kernels_shape():
    """The kernels (no build): which atomics each dtype and mode takes, the kernels of mean
    and of include_self=False in launch order, the 16-bit CAS on the aligned word."""
    import sympy

    from kiln.ir import dtypes
    from kiln.ir import loop as L
    from kiln.targets.cuda.put_reduce import print_put_reduce_kernels, put_reduce_kernel_names

    one, n = sympy.Integer(1), sympy.Symbol("s0")

    def call(dt, mode, include_self=True, routine="put"):
        bufs = {"x": L.Buffer("x", dt, (4, n), "input"), "v": L.Buffer("v", dt, (3, n), "input"),
                "i": L.Buffer("i", dtypes.int64, (3, n), "input"),
                "o": L.Buffer("o", dt, (4, n), "temp"),
                "o_count": L.Buffer("o_count", dtypes.int64, (4, n), "temp")}
        outs = ("o", "o_count") if routine == "put_mean" else ("o",)
        args = (L.LibArg("x", sympy.Integer(0), (4, n), (n, one)),
                L.LibArg("v", sympy.Integer(0), (3, n), (one, 3)),  # transposed values
                L.LibArg("i", sympy.Integer(0), (3, n), (n, one)))
        c = L.Extern(routine, outs, args, (("mode", mode), ("include_self", include_self),
                                           ("wrap", False), ("dims", (-1, 1))), ("sr",))
        ks = print_put_reduce_kernels(c, bufs)
        assert [k.name for k in ks] == put_reduce_kernel_names(c)
        return {k.name: k.source for k in ks}

    src = call(dtypes.float32, 1)
    assert list(src) == ["put_copy_o", "put_o"] and "tl.atomic_add(buf_o" in src["put_o"]
    assert "c0 >= 4" in src["put_o"] and "kiln_status" in src["put_o"]
    src = call(dtypes.float32, 4, include_self=False)  # amax: CAS on the bits, NaN kept
    assert list(src) == ["put_copy_o", "put_init_o", "put_o"]
    assert "tl.atomic_cas(" in src["put_o"] and "(cur != cur) | (vc != vc)" in src["put_o"]
    assert "float('-inf')" in src["put_init_o"]
    assert "tl.atomic_max(" in call(dtypes.int64, 4)["put_o"]
    src = call(dtypes.float16, 3, False, "put_mean")
    assert list(src) == ["put_copy_o", "put_count_o", "put_init_o", "put_o", "put_div_o"]
    assert "w = off // 2" in src["put_o"] and "tl.atomic_add(buf_o_count" in src["put_o"]
    assert "c > 0" in src["put_div_o"]
    assert "_kl_floordiv_i" in call(dtypes.int8, 3, True, "put_mean")["put_div_o"]
    assert "_kl_bf16_bits(nv)" in call(dtypes.bfloat16, 1)["put_o"]
    assert "w = off // 4" in call(dtypes.bool_, 5)["put_o"]


# -- on a GPU ---------------------------------------------------------------------------------

def _gpu_inputs(dt, g, special=False):
    # many updates of each place: 4,000 rows scattered into 50 (about 80 a place), 30,000
    # index_put rows into 50 (about 600 a place)
    return _inputs(dt, g, R=50, C=300, r=4000, c=250, k=30000, m=301, special=special,
                   big=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dt", FLOATS + INTS, ids=str)
def test_gpu_scatter_reduce_matches_eager(dt, tmp_path):
    g = torch.Generator().manual_seed(5)
    args = _gpu_inputs(dt, g)
    cm = kiln.compile(torch.export.export(Fn(scatters), args), device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == [], dt
    runner = kiln.load(cm.save(tmp_path / "s.kiln"), device="cuda:0")
    # integers and bools against eager's CPU kernels: integer results do not depend on the
    # order, and eager's CUDA bool sum is not a logical or (gpuAtomicAdd(bool*) stores the
    # update: the last one wins) while its CPU one is, as kiln's
    device = "cuda" if dt.is_floating_point else "cpu"
    for call in (args, _gpu_inputs(dt, g, special=True)):
        got = pytree.tree_leaves(runner(*[a.cuda() for a in call]))
        check_outputs(got, scatters, call, str(dt), device=device)
    bad = list(args)
    bad[1] = bad[1].clone()
    bad[1][3, 7] = 50  # an index out of range: an error, never a write past the output
    with pytest.raises(Exception, match="out of range"):
        # reported by the bad run's own status copy at the start of the next run (CUDA runs
        # are asynchronous: kiln_cuda_rt.h `index_status`)
        runner(*[a.cuda() for a in bad])
        runner(*[a.cuda() for a in args])
    got = pytree.tree_leaves(runner(*[a.cuda() for a in args]))  # usable after the error
    check_outputs(got, scatters, args, str(dt), device=device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_scatter_reduce_dynamic_sizes(tmp_path):
    g = torch.Generator().manual_seed(6)
    fn, args, dyn, calls = _case("dyn", g)
    cm = kiln.compile(torch.export.export(Fn(fn), args, dynamic_shapes=(dyn,)), device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    runner = kiln.load(cm.save(tmp_path / "d.kiln"), device="cuda:0")
    for call in (*calls, _dyn_inputs(g, 3000, 4000, special=True)):
        got = pytree.tree_leaves(runner(*[a.cuda() for a in call]))
        check_outputs(got, fn, call, "dyn", device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_index_put_mask_beside_index_tensors(tmp_path):
    """x[m, i] = v on CUDA: the mask's coordinates (kiln's nonzero) broadcast with the index
    tensor, no ATen; a true count that neither matches nor is 1 is a clear error."""
    def mask_beside_index(x, m, i, v, m2, j, w):  # (tests/ops/test_ops_library.py's)
        y = x.clone()
        y[m, i] = v
        z = torch.ops.aten.index_put(x, [torch.arange(4).unsqueeze(1), m2, j], w, True)
        return {"set": y, "acc": z, "one_per_row": x.index_put((m, i[:1]), v[:1, :1])}

    g = torch.Generator().manual_seed(7)
    x, v, w = torch.randn(4, 3, 4, generator=g), torch.randn(3, 1, generator=g), \
        torch.randn(4, 2, generator=g)
    m, m2 = torch.tensor([True, False, True, True]), torch.tensor([True, False, True])
    i, j = torch.tensor([0, 2, 1]), torch.tensor([1, -1])
    args = (x, m, i, v, m2, j, w)
    cm = kiln.compile(torch.export.export(Fn(mask_beside_index), args), device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    one = torch.tensor([False, False, True, False])
    for call in (args, (x, one, *args[2:])):
        got = pytree.tree_leaves(runner(*[a.cuda() for a in call]))
        want = pytree.tree_leaves(mask_beside_index(*call))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b)
    with pytest.raises(Exception, match="mask_true_count"):
        runner(*[a.cuda() for a in (x, torch.ones(4, dtype=torch.bool), *args[2:])])
