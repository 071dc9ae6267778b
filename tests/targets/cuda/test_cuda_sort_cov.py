"""sort, argsort, msort, topk, kthvalue and median on CUDA without ATen (issue 16: they went to
the ATen fallback on CUDA): one Triton kernel a row block (targets/cuda/sort.py), int64 keys
of a value's 32-bit order and its column sorted by `tl.sort`, rows of at most 4096 elements
of at most 32 bits; kthvalue and median a stable sort and a select (median: NaN and its first
NaN's index where a row has one).

Without a GPU: the programs compile for sm_90 with no ATen op, and their Triton kernels run in
Triton's interpreter through the Python runner against eager on the CPU (`check_outputs`):
every value bit for bit (sorts; -0.0 and +0.0 where they are) or equal (order statistics: a
tie of -0.0 and +0.0 may pick either), NaN where eager has NaN; the indices of stable sorts
exactly (eager CPU's unstable float sort gives the same order: ties in index order, all NaNs
above +inf in index order); indices eager leaves unspecified among ties (unstable sort of
integers, topk, kthvalue, median) must point at an element equal to the value; a median row
with a NaN gives its first NaN's index (eager's CPU). Inputs: every dtype of 32 bits or fewer,
inf, -inf, NaN of both signs, -0.0 beside +0.0, many ties, sorted dims inner and outer,
strided views, a dynamic row length and row count. With a GPU (`-m gpu`): rows of up to 4096
against eager on the device. Sorts of 64-bit values, of rows over 4096 and of dims without a
bound stay on ATen (checked here)."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

import kiln
from kiln.errors import UnsupportedError
from kiln.options import Options
from tests.difftest import Fn

OPTS = Options(cuda_archs=(90,), autotune=False, cuda_graphs=False)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int16, torch.int8, torch.uint8)
DTYPES = (*FLOATS, *INTS, torch.bool)


def sorts(x):
    """Sorts of x [r, n] (every dtype). Keys: `s_` outputs have exact indices (stable sorts),
    `u_` outputs indices eager leaves unspecified among ties (see U_DIMS)."""
    return {"s_asc": tuple(torch.sort(x, dim=1, stable=True)),
            "s_desc": tuple(torch.sort(x, dim=1, descending=True, stable=True)),
            "s_outer": tuple(torch.sort(x, dim=0, stable=True)),
            "s_argsort": torch.argsort(x[:, ::2], dim=-1, descending=True, stable=True),
            "u_msort": torch.msort(x.t()),  # (unstable: zeros of either sign in any order)
            "u_sort": tuple(torch.sort(x, 1))}


def order_stats(x, whole: bool = True):
    """topk, kthvalue, median of x [r, n] (not bool: eager has none); `whole`: median() of
    all elements too (first: a median.dim before it used to name a node as it)."""
    out = {"u_med_all": torch.median(x)} if whole else {}
    return out | {"u_med": tuple(torch.median(x, 1)),
            "u_med0": tuple(torch.median(x, 0, keepdim=True)),
            "u_topk": tuple(torch.topk(x, 3, 1)),
            "u_topk_small": tuple(torch.topk(x[:, 1:], 4, 0, largest=False)),
            "u_kth": tuple(torch.kthvalue(x, 2, 1)),
            "u_kth0": tuple(torch.kthvalue(x.t(), 3, 1, keepdim=True))}


# `u_` output -> (the operand its indices index, dim, keepdim)
U_DIMS = {"u_sort": (lambda x: x, 1, True), "u_med": (lambda x: x, 1, False),
          "u_med0": (lambda x: x, 0, True), "u_topk": (lambda x: x, 1, True),
          "u_topk_small": (lambda x: x[:, 1:], 0, True), "u_kth": (lambda x: x, 1, False),
          "u_kth0": (lambda x: x.t(), 1, True),
          "u_topk_big": (lambda x: x, 1, True)}  # (test_cuda_sort_merge.py)


def all_dtypes(*xs):
    """Every dtype's sorts (and order statistics) in one program: xs in DTYPES order."""
    out = {}
    for x in xs:
        name = str(x.dtype).split(".")[1]
        out.update({f"{k}:{name}": v for k, v in sorts(x).items()})
        if x.dtype != torch.bool:  # (median() of all elements: one row of at most 4096)
            whole = x.numel() <= 4096
            out.update({f"{k}:{name}": v for k, v in order_stats(x, whole).items()})
    return out


def dynamic(x, y):
    """x [r, n] float32 and y [r, n] int32, r and n dynamic (n at most 300; median() of all
    elements left out: r * n may exceed a row's 4096)."""
    out = {f"{k}:f": v for k, v in sorts(x).items()}
    out.update({f"{k}:f": v for k, v in order_stats(x, whole=False).items()})
    out.update({f"{k}:i": v for k, v in sorts(y).items()})
    return out


def special(x: torch.Tensor, g) -> torch.Tensor:
    """inf / -inf / NaN of both signs / -0.0 beside +0.0 in some rows, a row of ties; float x
    [r, n], r >= 6."""
    x = x.clone()
    inf, nan = math.inf, math.nan
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    sign = -(1 << (8 * x.element_size() - 1))
    neg_nan = (torch.tensor(nan, dtype=x.dtype).view(bits) | sign).view(x.dtype)  # sign set
    n = x.shape[1]
    x[0, 0], x[0, n // 2], x[0, -1] = nan, inf, -inf
    x[1, 3], x[1, 1] = neg_nan, nan
    x[1, n - 2] = neg_nan
    x[2, :] = torch.where(torch.rand(n, generator=g) < 0.5, -0.0, 0.0).to(x.dtype)
    x[2, 1] = 1.0
    x[3, :] = torch.round(x[3, :].float() * 2).to(x.dtype)  # many ties
    x[4, ::3] = nan  # more NaNs than a median's half
    x[5, 2], x[5, 4], x[5, 7] = -0.0, 0.0, -0.0
    return x


def make(dt, shape, g, spec: bool = True) -> torch.Tensor:
    if dt == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dt.is_floating_point:
        x = (torch.randn(shape, generator=g) * 3).to(dt)
        return special(x, g) if spec else x
    lo, hi = (0, 7) if dt == torch.uint8 else (-4, 4)  # few values: many ties
    x = torch.randint(lo, hi, shape, generator=g).to(dt)
    if dt != torch.uint8:
        info = torch.iinfo(dt)
        x[0, 0], x[0, 1] = info.min, info.max
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal, or both NaN."""
    if a.is_floating_point():
        return (a == b) | (a.isnan() & b.isnan())
    return a == b


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) \
        if t.is_floating_point() else t


def _operand(key: str, args):
    """The input a `<output>:<dtype name>` key sorted (dynamic's: f / i)."""
    name = key.split(":")[1]
    if name in ("f", "i"):
        return args["fi".index(name)]
    return next(a for a in args if str(a.dtype).split(".")[1] == name)


def _plain_nan(a: torch.Tensor) -> torch.Tensor:
    """`a` with every NaN made a NaN without the sign bit."""
    return torch.where(a.isnan(), torch.nan, a) if a.is_floating_point() else a


def check_outputs(got, fn, args, what="", device="cpu", exact=True):
    """Kiln's outputs `got` (leaves of fn's dict) against eager on `device` (see the module
    doc). `exact`: stable sorts' values bit for bit and indices equal (else: values equal,
    the count of indices unlike eager's is added to the count returned). Returns the number
    of indices unlike eager's where those are unspecified (or not `exact`).
    Eager's CUDA sort does not order a NaN with the sign bit set among the largest values as
    eager's CPU does (and kiln on both targets): on the H100 (torch 2.11) only the test rows
    holding such NaNs differed from it, the rows with other NaNs matched, and kiln matched
    eager's CPU bit for bit. Against eager's CUDA, the NaNs are given without the sign bit."""
    if device != "cpu":
        args = [_plain_nan(a) for a in args]
    out = fn(*[a.to(device) for a in args])
    keys = [(k, part) for k, v in out.items() for part, _ in enumerate(pytree.tree_leaves(v))]
    want = [t.cpu() for t in pytree.tree_leaves(out)]
    assert len(got) == len(want), what
    got = [t.cpu().reshape(w.shape) for t, w in zip(got, want, strict=True)]
    differ = 0
    for k, ((key, part), g, w) in enumerate(zip(keys, got, want, strict=True)):
        where = f"{what} {key} output {part} ({w.dtype}, {tuple(w.shape)})"
        assert g.dtype == w.dtype, where
        base = key.split(":")[0]
        index = w.dtype == torch.int64 and (part == 1 or base == "s_argsort")
        if base.startswith("s_") and exact:
            assert torch.equal(_bits(g), _bits(w)), \
                f"{where}: {(_bits(g) != _bits(w)).nonzero()[:5].tolist()}"
            continue
        if not index:  # values: equal (an unspecified tie of -0.0 and +0.0 may pick either)
            bad = ~_same(g, w)
            assert not bool(bad.any()), f"{where}: {bad.nonzero()[:5].tolist()}"
            continue
        differ += int((g != w).sum())
        if base.startswith("s_"):  # (not exact: counted only)
            continue
        # an index eager leaves unspecified among ties: at an element equal to the value
        src_fn, dim, keep = U_DIMS[base]
        src = src_fn(_operand(key, args))
        idx = g if keep else g.unsqueeze(dim)
        assert bool(((idx >= 0) & (idx < src.shape[dim])).all()), where
        vals = got[k - 1] if keep else got[k - 1].unsqueeze(dim)
        assert bool(_same(torch.gather(src, dim, idx), vals).all()), where
        if base in ("u_med", "u_med0") and src.is_floating_point():  # a NaN row: first NaN
            first = src.isnan().to(torch.int8).argmax(dim, keepdim=True)
            nanrow = src.isnan().any(dim, keepdim=True)
            assert torch.equal(idx[nanrow], first[nanrow]), where
    return differ


_INTERP = textwrap.dedent("""
    import pickle, sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_cuda_sort_cov import all_dtypes, check_outputs, dynamic, long_rows
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    fns = {"all": all_dtypes, "dyn": dynamic, "dyn_long": dynamic, "long": long_rows}
    with open(sys.argv[1], "rb") as f:
        cases = pickle.load(f)
    for name, prog, kernels, module, weights, calls in cases:
        mod = import_triton_module(module)
        for args in calls:
            got = run_program(prog, kernels, mod, weights, list(args))
            differ = check_outputs(got, fns[name], args, name)
            print(name, [tuple(a.shape) for a in args], "checked; unspecified indices unlike"
                  " eager's:", differ, flush=True)
    print("ALL OK")
""")

_compiled: dict = {}


def _build(name):
    if name not in _compiled:
        g = torch.Generator().manual_seed(0)
        if name == "all":
            fn, args, dyn = all_dtypes, tuple(make(dt, (6, 9), g) for dt in DTYPES), None
        else:  # "dyn" / "dyn_long": (interpreter: few programs, short rows)
            r, n = Dim("r", min=6, max=16), Dim("n", min=8, max=40 if name == "dyn" else 300)
            fn, args = dynamic, (make(torch.float32, (6, 9), g), make(torch.int32, (6, 9), g))
            dyn = ({0: r, 1: n}, {0: r, 1: n})
        ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
        _compiled[name] = kiln.compile(ep, device="cuda", options=OPTS)
    return _compiled[name]


def _interpret(tmp_path, name, calls):
    from test_cuda_dds import interpret_builds

    cm = _build(name)
    assert cm.manifest["requires"]["aten_fallback_ops"] == [], name
    assert cm.manifest["requires"]["libtorch"] is False, name
    return interpret_builds(tmp_path, _INTERP, [(name, cm, calls)])


def test_cuda_sorts_every_dtype_in_interpreter(tmp_path):
    """Every dtype of 32 bits or fewer, special values, in one program: no ATen op, one sort
    kernel a call, eager's results in Triton's interpreter."""
    cm = _build("all")
    src = cm.sources["kernels_triton.py"]
    assert "tl.sort(key, 1)" in src and "0x7fffffff, o)  # every NaN above +inf" in src
    routines = [s.routine for s in cm.built.steps if hasattr(s, "routine")]
    assert routines.count("sort") + routines.count("topk") >= 40, routines
    g = torch.Generator().manual_seed(1)
    calls = [tuple(make(dt, (6, 9), g, spec=False) for dt in DTYPES),
             tuple(make(dt, (6, 9), g) for dt in DTYPES)]
    _interpret(tmp_path, "all", calls)


@pytest.mark.parametrize("name,sizes", [
    ("dyn", ((6, 8), (16, 40))),
    pytest.param("dyn_long", ((12, 300), (6, 129)), marks=pytest.mark.slow)])
def test_cuda_sorts_dynamic_sizes_in_interpreter(tmp_path, name, sizes):
    """Dynamic row length (bounded by its Dim: 40, or 300 when slow) and row count (at most
    16: also sorted along); lengths across the power-of-two tile."""
    g = torch.Generator().manual_seed(2)
    calls = [tuple(make(dt, (r, n), g) for dt in (torch.float32, torch.int32))
             for r, n in sizes]
    out = _interpret(tmp_path, name, calls)
    assert out.count("checked") == len(sizes)


def long_rows(*xs):
    """Sorts and topk of rows of 4096 (xs: float16, bfloat16, float32)."""
    return {f"{k}:{str(x.dtype).split('.')[1]}": v for x in xs for k, v in
            (("s_asc", tuple(torch.sort(x, dim=1, stable=True))),
             ("s_desc", tuple(torch.sort(x, dim=1, descending=True, stable=True))),
             ("u_topk", tuple(torch.topk(x, 3, 1))))}


@pytest.mark.slow  # 4096-element rows in Triton's interpreter
def test_cuda_sort_longest_row_in_interpreter(tmp_path):
    """Rows of exactly MAX_ROW (4096) elements, float16, bfloat16 and float32 with special
    values (the 16-bit keys sign-extended), through the runner."""
    from test_cuda_dds import interpret_builds

    g = torch.Generator().manual_seed(3)
    args = tuple(make(dt, (6, 4096), g) for dt in FLOATS)
    cm = kiln.compile(torch.export.export(Fn(long_rows), args), device="cuda", options=OPTS)
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    interpret_builds(tmp_path, _INTERP, [("long", cm, [args])])


def _fallback_ops(fn, args, dyn=None, why=None):
    """The package's ATen ops; `why`: a phrase the manifest's reason for them has."""
    ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
    req = kiln.compile(ep, device="cuda", options=OPTS).manifest["requires"]
    if why is not None:
        assert why in " ".join(req["aten_fallback_why"].values()), req
    return req["aten_fallback_ops"]


def test_sorts_kiln_leaves_to_aten_on_cuda():
    """Since the merge sort (s17cov): 64-bit values, rows over 4096 and a sorted dim without
    a bound are kiln's too (test_cuda_sort_merge.py runs them); a dtype the kernels do not
    sort still goes to ATen, the manifest saying why."""
    def sort1(x):
        return tuple(torch.sort(x, 1))
    x = torch.randn(3, 10)
    assert not _fallback_ops(sort1, (x.double(),))
    assert not _fallback_ops(sort1, (x.long(),))
    assert not _fallback_ops(sort1, (torch.randn(2, 4097),))
    assert not _fallback_ops(lambda x: tuple(torch.median(x, 1)), (torch.randn(2, 5000),))
    assert not _fallback_ops(lambda x: tuple(torch.topk(x, 2, 1)), (x,),
                             ({1: Dim("n", min=3)},))  # (no max)
    assert not _fallback_ops(sort1, (torch.randn(5000, 4096),))
    # (eager has no float8 sort, but export records one: ATen's, with the reason)
    assert _fallback_ops(sort1, (x.to(torch.float8_e4m3fn),), why="float8_e4m3fn values")


def test_median_with_nan_on_the_cpu():
    """The frontend's median (both targets): a row with a NaN gives NaN and its first NaN's
    index, as eager's CPU median; median() after median(dim) in one program."""
    def f(x):
        return tuple(torch.median(x, 1)), torch.median(x), tuple(torch.median(x, 0, True))
    g = torch.Generator().manual_seed(4)
    x = special(torch.randn(7, 10, generator=g), g)
    runner = kiln.compile(torch.export.export(Fn(f), (x,))).load()
    for call in (x, torch.randn(7, 10, generator=g)):
        got, want = pytree.tree_leaves(runner(call)), pytree.tree_leaves(f(call))
        for a, b in zip(got, want, strict=True):
            assert bool(_same(a, b).all()), (a, b)


def test_sort_key_bits():
    """The kernel's order lines (no build): 16-bit floats sign-extended before the flip,
    both zeros one key, NaN of any sign above +inf, a descending sort complemented."""
    from kiln.targets.cuda.sort import order_lines

    half = "\n".join(order_lines("bfloat16", False))
    assert "v.to(tl.int16, bitcast=True).to(tl.int32)" in half and "mag > 0x7f80" in half
    assert "0x7c00" in "\n".join(order_lines("float16", True)) and \
        "o = ~o" in "\n".join(order_lines("float16", True))
    assert "tl.int32, bitcast=True)\n" in "\n".join(order_lines("float32", False)) + "\n"
    assert order_lines("int8", False) == ["    o = v.to(tl.int32)"]
    assert "(o >> 63) & 0x7fffffffffffffff" in "\n".join(order_lines("float64", False))
    with pytest.raises(UnsupportedError, match="sortable"):
        order_lines("uint16", False)


# -- on a GPU ---------------------------------------------------------------------------------

def _gpu_calls(g, r, n):
    return [tuple(make(dt, (r, n), g, spec) for dt in DTYPES) for spec in (False, True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("r,n", [(6, 20), (300, 1000), (8, 4096), (2000, 100)])
def test_gpu_sorts_match_eager(r, n, tmp_path):
    """Against eager on the device (values, stable indices exactly; unspecified indices at
    equal elements) and eager on the CPU (the same checks); the count of unspecified indices
    unlike eager's is printed."""
    g = torch.Generator().manual_seed(5 + n)
    calls = _gpu_calls(g, r, n)
    cm = kiln.compile(torch.export.export(Fn(all_dtypes), calls[1]), device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    runner = kiln.load(cm.save(tmp_path / "sorts.kiln"), device="cuda:0")
    for call in calls:
        got = pytree.tree_leaves(runner(*[a.cuda() for a in call]))
        d_cpu = check_outputs(got, all_dtypes, call, f"[{r}, {n}]", device="cpu")
        d_cuda = check_outputs(got, all_dtypes, call, f"[{r}, {n}]", device="cuda",
                               exact=False)
        print(f"[{r}, {n}] indices unlike eager's: cpu {d_cpu} (unspecified ones), cuda "
              f"{d_cuda} (all)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sorts_dynamic_match_eager(tmp_path):
    g = torch.Generator().manual_seed(6)
    r, n = Dim("r", min=6, max=4096), Dim("n", min=8, max=4096)  # (both dims sorted along)
    args = (make(torch.float32, (6, 9), g), make(torch.int32, (6, 9), g))
    cm = kiln.compile(torch.export.export(Fn(dynamic), args,
                                          dynamic_shapes=(({0: r, 1: n}, {0: r, 1: n}),)),
                      device="cuda")
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    runner = kiln.load(cm.save(tmp_path / "dyn.kiln"), device="cuda:0")
    for rows, cols in ((6, 8), (1000, 129), (50, 4096), (4096, 40)):
        call = (make(torch.float32, (rows, cols), g), make(torch.int32, (rows, cols), g))
        got = pytree.tree_leaves(runner(*[a.cuda() for a in call]))
        check_outputs(got, dynamic, call, f"dyn [{rows}, {cols}]", device="cpu")
        check_outputs(got, dynamic, call, f"dyn [{rows}, {cols}]", device="cuda", exact=False)
