"""masked_scatter (and x[mask] = v with one value per selected element) and embedding_bag on
CUDA without ATen (issue 16: both went to the ATen fallback on CUDA): Triton kernels
(targets/cuda/bag_mask.py), masked_scatter placing each true element by the inclusive count of
the mask before it (a scan: targets/cuda/scan.py).

Without a GPU: the programs compile for sm_90 with no ATen op, and their Triton kernels run in
Triton's interpreter through the Python runner against eager (CPU): masked_scatter exactly for
every stored dtype (self, mask and source transposed, a mask broadcast over self, source longer
than the selection, x[mask] = v over rows); embedding_bag sum / mean / max with and without
include_last_offset, per_sample_weights, padding_idx, empty bags, int32 and int64 indices,
transposed weights: max exactly, sum and mean within a few ulps of float64 math (times the
bag's magnitude); dynamic sizes; an index out of range and a short source are errors. With a
GPU (`-m gpu`): a 50k x 128 table with 4k bags, masks of 1M elements."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim
from torch.utils import _pytree as pytree

import kiln
from kiln.options import Options
from tests.difftest import Fn

OPTS = Options(cuda_archs=(90,), autotune=False, cuda_graphs=False)
MASK_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
BAG_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# a few ulps of each dtype, relative (the accumulator's rounding and the output's)
EPS = {torch.float32: 2.4e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 2.3e-16}


# -- masked_scatter ---------------------------------------------------------------------------

def masks(m, mt, mrow, *xs):
    """For each dtype's (x [R, C], xt [C, R], s [S >= R * C], s2 [C + 1, R]): masked_scatter
    with a mask of x's shape, of xt.t() (self and mask transposed), a mask broadcast over rows
    [C], a transposed source, a 0-d self; x.index_put((mrow,), v) with one row of v per
    selected row, setting and accumulating."""
    out = {}
    for k in range(0, len(xs), 4):
        x, xt, s, s2 = xs[k:k + 4]
        d = str(x.dtype).split(".")[-1]
        out[f"{d}_ms"] = x.masked_scatter(m, s)
        out[f"{d}_t"] = xt.t().masked_scatter(mt.t(), s)
        out[f"{d}_bc"] = x.masked_scatter(m[0], s2.t())
        out[f"{d}_rows"] = x.index_put((mrow,), s[:x.shape[1] * 3].reshape(3, x.shape[1]))
        out[f"{d}_0d"] = x[1, 2].masked_scatter(m[1, 2], s[1:])
        out[f"{d}_acc"] = x.index_put((mrow,), s[:x.shape[1] * 3].reshape(3, x.shape[1]).flip(0),
                                      accumulate=True)
    return out


def _vals(dt, g, *shape):
    if dt == torch.bool:
        return torch.rand(*shape, generator=g) < 0.5
    if dt.is_floating_point:
        return torch.randn(*shape, generator=g).to(dt)
    lo, hi = (0, 200) if dt == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=g).to(dt)


def _mask_inputs(g, R, C, dts=MASK_DTYPES, rows=3, p=0.5):
    m = torch.rand(R, C, generator=g) < p
    mt = torch.rand(C, R, generator=g) < p
    mrow = torch.zeros(R, dtype=torch.bool)
    mrow[torch.randperm(R, generator=g)[:rows]] = True
    xs = []
    for dt in dts:
        xs += [_vals(dt, g, R, C), _vals(dt, g, C, R), _vals(dt, g, R * C + 5),
               _vals(dt, g, C + 1, R)]
    return (m, mt, mrow, *xs)


# -- embedding_bag ----------------------------------------------------------------------------

def bags(w, wt, idx, off, off_last, psw, idx32, off32):
    """w [N, D], wt [D, N] (w's transpose read through .t()), idx [n] in [0, N), off [B]
    (non-decreasing from 0, repeats: empty bags), off_last [B + 1] (the last n), psw [n];
    idx32 / off32 the int32 indices and offsets; 2-D indices (bags of 3, offsets a constant)."""
    return {
        "sum": F.embedding_bag(idx, w, off, mode="sum"),
        "mean": F.embedding_bag(idx, w, off, mode="mean"),
        "max": F.embedding_bag(idx, w, off, mode="max"),
        "psw": F.embedding_bag(idx, w, off, mode="sum", per_sample_weights=psw),
        "last": F.embedding_bag(idx, w, off_last, mode="mean", include_last_offset=True),
        "pad_sum": F.embedding_bag(idx, wt.t(), off, mode="sum", padding_idx=1),
        "pad_mean": F.embedding_bag(idx, w, off_last, mode="mean", padding_idx=1,
                                         include_last_offset=True),
        "pad_max": F.embedding_bag(idx32, w, off32, mode="max", padding_idx=1),
        "i32": F.embedding_bag(idx32, wt.t(), off32, mode="sum", per_sample_weights=psw),
        "2d_mean": F.embedding_bag(idx[:12].view(4, 3), w, mode="mean"),  # (constant offsets)
    }


def _bag_inputs(dt, g, N, D, n, B):
    w = torch.randn(N, D, generator=g).to(dt)
    wt = torch.randn(D, N, generator=g).to(dt)
    idx = torch.randint(0, N, (n,), generator=g)
    idx[::5] = 1  # padding_idx 1, often
    cut = torch.sort(torch.randint(0, n + 1, (B - 1,), generator=g)).values
    off = torch.cat([torch.zeros(1, dtype=torch.int64), cut])
    off[min(2, B - 1)] = off[min(1, B - 1)]  # an empty bag
    off = off.clamp(max=max(0, n - 20))  # the last bag: 20 rows or more (several row blocks)
    off_last = torch.cat([off, torch.tensor([n])])
    psw = torch.rand(n, generator=g).to(dt)
    return w, wt, idx, off, off_last, psw, idx.int(), off.int()


def _longest(idx, off) -> int:
    ends = torch.cat([off[1:], torch.tensor([idx.numel()])])
    return int((ends - off).max()) if off.numel() else 0


def check_bags(got, fn, args, what="", interpreted=False):
    """Kiln's bags against eager (CPU): max exactly (the NaN pattern too), sum / mean within
    2x eager's own distance from float64 math plus EPS of the dtype times (the longest bag +
    2) times the float64 sum of the magnitudes."""
    want = fn(*args)
    keys = list(want)  # (the outputs in the dict's order)
    wide = [a.double() if a.is_floating_point() else a for a in args]
    ref = fn(*wide)
    mag = fn(*[a.abs() if a.is_floating_point() else a for a in wide])
    n = max(_longest(args[2], args[3]), _longest(args[2], args[4][:-1]))
    got = dict(zip(keys, got, strict=True))
    for k in keys:
        g, w = got[k].cpu(), want[k]
        where = f"{what} {k} ({w.dtype}, {tuple(w.shape)})"
        assert g.dtype == w.dtype and g.shape == w.shape, where
        assert torch.equal(g.isnan(), w.isnan()), where
        if k.endswith("max"):
            assert torch.equal(g.nan_to_num(0), w.nan_to_num(0)), (where, g, w)
            continue
        gd, wd, rd, ad = g.double(), w.double(), ref[k], mag[k]
        bound = 2 * (wd - rd).abs() + EPS[w.dtype] * (n + 2) * (1 + ad)
        bad = (gd - rd).abs() > bound
        assert not bool(bad.any()), (where, gd[bad][:4].tolist(), rd[bad][:4].tolist())


def check_masks(got, fn, args, what="", interpreted=False):
    """Exactly, but for the sums of x[mask] += v in 16-bit floats in Triton's interpreter,
    whose float32 -> bfloat16 / float16 stores truncate (the device rounds to nearest, as
    eager): there one unit in the last place."""
    want = fn(*args)
    for k, g in zip(list(want), got, strict=True):
        w = want[k]
        g = g.cpu()
        where = f"{what} {k} ({w.dtype}, {tuple(w.shape)})"
        assert g.dtype == w.dtype and g.shape == w.shape, where
        same = (g == w) | (g.isnan() & w.isnan()) if w.is_floating_point() else g == w
        if interpreted and k.endswith("_acc") and w.dtype in (torch.float16, torch.bfloat16):
            ulp = torch.finfo(w.dtype).eps * w.double().abs().clamp(min=1e-30)
            same = same | ((g.double() - w.double()).abs() <= ulp)
        assert bool(same.all()), (where, (~same).nonzero()[:4].tolist(), g[~same][:4].tolist(),
                                  w[~same][:4].tolist())


# -- builds ----------------------------------------------------------------------------------

def _case(name, g):
    """(fn, example args, dynamic shapes, fresh inputs to check, checker name) of build
    `name`."""
    if name == "masks":
        return (masks, _mask_inputs(g, 6, 5), None,
                [_mask_inputs(g, 6, 5), _mask_inputs(g, 6, 5, p=0.9)], "check_masks")
    if name == "masks_dyn":  # R and C at run time, a bool and a float32 self
        dts = (torch.float32, torch.bool)
        R, C = Dim("R", min=4, max=4096), Dim("C", min=3, max=100)
        dyn = ({0: R, 1: C}, {0: C, 1: R}, {0: R}) + ({0: R, 1: C}, {0: C, 1: R}, None,
                                                        {0: C + 1, 1: R}) * len(dts)
        big = [_mask_inputs(g, 9, 40, dts)]
        # source long enough for the largest run: R * C + 5 elements of the example
        fix = []
        for a in big + [_mask_inputs(g, 5, 3, dts)]:
            a = list(a)
            for k in range(3 + 2, len(a), 4):
                a[k] = _vals(a[k].dtype, g, 9 * 40 + 5)
            fix.append(tuple(a))
        ex = list(_mask_inputs(g, 6, 5, dts))
        for k in range(3 + 2, len(ex), 4):
            ex[k] = _vals(ex[k].dtype, g, 9 * 40 + 5)
        return masks, tuple(ex), dyn, fix, "check_masks"
    if name == "bags_dyn":  # the number of indices and of bags at run time
        n, B = Dim("n", min=12, max=200000), Dim("B", min=3, max=10000)
        dyn = (None, None, {0: n}, {0: B}, {0: B + 1}, {0: n}, {0: n}, {0: B})
        return (bags, _bag_inputs(torch.float32, g, 20, 7, 30, 6), dyn,
                [_bag_inputs(torch.float32, g, 20, 7, 12, 3),
                 _bag_inputs(torch.float32, g, 20, 7, 300, 40)], "check_bags")
    dt = getattr(torch, name)
    args = _bag_inputs(dt, g, 20, 7, 30, 6)
    special = list(_bag_inputs(dt, g, 20, 7, 30, 6))
    special[0] = special[0].clone()
    special[0][3, 2] = float("nan")
    special[0][4, 1] = float("-inf")
    special[2] = special[2].clone()
    special[2][0] = special[2][-1] = 3  # NaN in the first row of bag 0, the last of the last
    special[6] = special[2].int()
    return bags, args, None, [args, tuple(special)], "check_bags"


_compiled: dict = {}


def _build(name, fn, args, dyn=None):
    if name not in _compiled:
        ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
        _compiled[name] = kiln.compile(ep, device="cuda", options=OPTS)
    return _compiled[name]


_INTERP = textwrap.dedent("""
    import pickle, sys, torch
    sys.path.insert(0, sys.argv[2])
    import test_cuda_bag_mask as T
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    with open(sys.argv[1], "rb") as f:
        cases = pickle.load(f)

    def raises(prog, kernels, mod, weights, args, what):
        try:
            run_program(prog, kernels, mod, weights, list(args))
        except IndexError as e:
            assert "out of range" in str(e), e
        else:
            raise AssertionError("no error for " + what)

    for name, prog, kernels, module, weights, calls, check in cases:
        mod = import_triton_module(module)
        fn = T.masks if name.startswith("masks") else T.bags
        for args in calls:
            got = run_program(prog, kernels, mod, weights, list(args))
            getattr(T, check)(got, fn, args, name, interpreted=True)
        bad = list(calls[0])
        if name == "masks":  # x[mrow] = v selecting more rows than v has: a short source
            bad[2] = torch.ones_like(bad[2])
            try:
                run_program(prog, kernels, mod, weights, bad)
            except IndexError as e:
                assert "selects more elements than source has" in str(e), e
            else:
                raise AssertionError("no error for a short source")
        elif name == "float32":  # an index out of range, offsets out of order
            bad[2] = bad[2].clone()
            bad[2][4] = 20
            raises(prog, kernels, mod, weights, bad, "an index out of range")
            bad = list(calls[0])
            bad[3] = bad[3].flip(0)
            raises(prog, kernels, mod, weights, bad, "offsets out of order")
        print(name, "checked", flush=True)
    print("ALL OK")
""")


def _interpret(tmp_path, which):
    from test_cuda_dds import interpret_builds

    g = torch.Generator().manual_seed(1)
    cases = []
    for name in which:
        fn, args, dyn, calls, check = _case(name, g)
        cm = _build(name, fn, args, dyn)
        assert cm.manifest["requires"]["aten_fallback_ops"] == [], name
        assert not cm.manifest["requires"].get("aten_fallback_why"), name
        assert cm.manifest["requires"]["libtorch"] is False, name
        cases.append((name, cm, calls, check))
    interpret_builds(tmp_path, _INTERP, cases, timeout=900)


def test_cuda_masked_scatter_in_interpreter(tmp_path):
    """Every stored dtype, in the default suite."""
    _interpret(tmp_path, ["masks"])


def test_cuda_embedding_bag_in_interpreter(tmp_path):
    _interpret(tmp_path, ["float32", "bfloat16"])


@pytest.mark.slow  # CUDA builds and Triton's interpreter
def test_cuda_bag_mask_more_in_interpreter(tmp_path):
    _interpret(tmp_path, ["float16", "float64", "bags_dyn", "masks_dyn"])


# -- on a GPU ---------------------------------------------------------------------------------

def _runner(fn, args, tmp_path, name, dyn=None):
    ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
    cm = kiln.compile(ep, device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == [], name
    assert not cm.manifest["requires"].get("aten_fallback_why"), name
    return kiln.load(cm.save(tmp_path / f"{name}.kiln"), device="cuda:0")


def _run(runner, args):
    return pytree.tree_leaves(runner(*[a.cuda() for a in args]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dt", BAG_DTYPES, ids=str)
def test_gpu_embedding_bag_matches_eager(dt, tmp_path):
    """A 50k x 128 table, 4k bags of about 30 indices (some empty); an index out of range is
    an error (reported by the next run: kiln_cuda_rt.h `index_status`), then the model is
    usable."""
    g = torch.Generator().manual_seed(11)
    args = _bag_inputs(dt, g, 50000, 128, 120000, 4096)
    runner = _runner(bags, args, tmp_path, "bags")
    special = list(_bag_inputs(dt, g, 50000, 128, 120000, 4096))
    special[0][special[2][:50]] = float("nan")
    for call in (args, tuple(special)):
        check_bags(_run(runner, call), bags, call, str(dt))
    bad = list(args)
    bad[2] = bad[2].clone()
    bad[2][777] = 50000
    with pytest.raises(Exception, match="out of range"):
        _run(runner, bad)
        _run(runner, args)
    check_bags(_run(runner, args), bags, args, str(dt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_embedding_bag_dynamic_sizes(tmp_path):
    g = torch.Generator().manual_seed(12)
    fn, args, dyn, calls, _ = _case("bags_dyn", g)
    runner = _runner(fn, args, tmp_path, "bags_dyn", dyn)
    for call in (*calls, _bag_inputs(torch.float32, g, 20, 7, 90000, 9000)):
        check_bags(_run(runner, call), fn, call, "dyn")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_masked_scatter_matches_eager(tmp_path):
    """Masks of 1M elements (the multi-block scan of the mask), every stored dtype, exactly;
    then dynamic sizes up to 4096 x 100 and a short source (an error)."""
    g = torch.Generator().manual_seed(13)
    args = _mask_inputs(g, 1000, 1000)
    runner = _runner(masks, args, tmp_path, "masks")
    for call in (args, _mask_inputs(g, 1000, 1000, p=0.97)):
        check_masks(_run(runner, call), masks, call, "1M")
    fn, ex, dyn, calls, _ = _case("masks_dyn", g)
    runner = _runner(fn, ex, tmp_path, "masks_dyn", dyn)
    dts = (torch.float32, torch.bool)
    for call in calls:
        check_masks(_run(runner, call), fn, call, "dyn")
    big = list(_mask_inputs(g, 4096, 100, dts, p=0.0005))  # (about 205 selected of 365)
    for k in range(3 + 2, len(big), 4):
        big[k] = _vals(big[k].dtype, g, 9 * 40 + 5)
    check_masks(_run(runner, big), fn, big, "dyn 4096 x 100")
    big[0] = torch.ones_like(big[0])  # 409,600 selected, 365 source elements
    with pytest.raises(Exception, match="out of range"):
        _run(runner, big)
        _run(runner, calls[0])
