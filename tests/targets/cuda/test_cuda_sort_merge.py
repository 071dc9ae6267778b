"""CUDA sorts of 64-bit values, of rows over 4096 elements and of dims without a bound
(targets/cuda/sort.py: two `tl.sort` passes for 64-bit orders; the merge sort: tiles sorted by
`tl.sort`, then stable merge passes through scratch buffers, one kernel launched a pass), and
the order statistics built on them (topk with a large k, kthvalue, median).

Without a GPU: Triton's interpreter runs the kernels through the Python runner against eager
on the CPU (test_cuda_sort_cov.py's `check_outputs`: stable sorts bit for bit, indices exactly;
indices eager leaves unspecified among ties at an equal element). The merge sort is made to
start at row bounds over 64 with 64-element tiles here (`small_tiles`, set before the build), so
short rows take several merge passes in the interpreter; the kernels are the ones printed for
full tiles but for those numbers. With a GPU (`-m gpu`): full tiles, rows of 1 to 20000,
every dtype, static and unbounded dims, against eager's CPU (bit for bit) and eager's CUDA
(values; NaNs given without the sign bit, as test_cuda_sort_cov.py says)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

import kiln
from kiln.frontend import aten_library
from kiln.targets.cuda import sort as cuda_sort
from tests.difftest import Fn
from test_cuda_sort_cov import OPTS, check_outputs, make, special

WIDE = (torch.float64, torch.int64)
FEW = (torch.float64, torch.int64, torch.float32, torch.bfloat16, torch.bool)  # interpreter
EVERY = (torch.float64, torch.int64, torch.float32, torch.float16, torch.bfloat16, torch.int32,
         torch.int16, torch.int8, torch.uint8, torch.bool)


def make_wide(dt, shape, g, spec: bool = True) -> torch.Tensor:
    """test_cuda_sort_cov's `make`, and for 64-bit dtypes values whose order is decided by
    the low 32 bits (equal high halves): int64 multiples of 2^32 plus small offsets (with its
    min and max), float64 1 + k * 2^-40."""
    if shape[1] < 2 and dt != torch.bool:  # (make's extremes need two columns)
        x = torch.randint(0, 5, shape, generator=g).to(dt)
    else:
        x = make(dt, shape, g, spec)
    if dt == torch.int64:
        hi = torch.randint(-3, 3, shape, generator=g) << 32
        x = hi + torch.randint(-2, 3, shape, generator=g) * ((1 << 31) + 7)
        x.view(-1)[0], x.view(-1)[-1] = torch.iinfo(dt).min, torch.iinfo(dt).max
    elif dt == torch.float64 and shape[0] > 6:
        x[6, :] = 1 + torch.randint(0, 4, (shape[1],), generator=g).double() * 2.0 ** -40
    return x


def sorts_of(x, k=None):
    """Sorts and order statistics of x [r, n] (`s_`: exact indices; `u_`: unspecified among
    ties, test_cuda_sort_cov's U_DIMS); topk and kthvalue of `k` (None: half the row)."""
    out = {"s_asc": tuple(torch.sort(x, dim=1, stable=True)),
           "s_desc": tuple(torch.sort(x, dim=1, descending=True, stable=True)),
           "s_argsort": torch.argsort(x[:, ::2], dim=-1, descending=True, stable=True),
           "u_sort": tuple(torch.sort(x, 1))}
    if x.dtype != torch.bool:
        k = k or max(1, x.shape[1] // 2)
        out |= {"u_topk": tuple(torch.topk(x, min(3, k), 1)),
                "u_topk_big": tuple(torch.topk(x, k, 1, largest=False)),
                "u_kth": tuple(torch.kthvalue(x, k, 1)),
                "u_med": tuple(torch.median(x, 1))}
    return out


def per_dtype(*xs, k=None):
    out = {}
    for x in xs:
        name = str(x.dtype).split(".")[1]
        out.update({f"{key}:{name}": v for key, v in sorts_of(x, k).items()})
    return out


def per_dtype_dyn(*xs):
    """per_dtype with k = 1 (for a dynamic row length)."""
    return per_dtype(*xs, k=1)


def outer(x):
    """A strided operand: x [n, 2] (strides (8, 1)) sorted along dim 0, and x.t()'s rows."""
    return {"s_outer:float32": tuple(torch.sort(x, dim=0, stable=True)),
            "s_rows:float32": tuple(torch.sort(x.t(), dim=1, descending=True, stable=True))}


def few(*xs):
    """The sorts, topk and median of xs [r, n] (a dim without a bound: 20 kernels a call)."""
    out = {}
    for x in xs:
        name = str(x.dtype).split(".")[1]
        out |= {f"s_asc:{name}": tuple(torch.sort(x, dim=1, stable=True)),
                f"s_desc:{name}": tuple(torch.sort(x, dim=1, descending=True, stable=True)),
                f"u_topk:{name}": tuple(torch.topk(x, 3, 1)),
                f"u_med:{name}": tuple(torch.median(x, 1))}
    return out



FNS = {"per_dtype": per_dtype, "per_dtype_dyn": per_dtype_dyn, "outer": outer, "few": few}

_INTERP = textwrap.dedent("""
    import pickle, sys, torch
    sys.path.insert(0, sys.argv[2])
    import test_cuda_sort_cov as cov
    from test_cuda_sort_merge import FNS
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    with open(sys.argv[1], "rb") as f:
        cases = pickle.load(f)
    for name, prog, kernels, module, weights, calls in cases:
        mod = import_triton_module(module)
        for args in calls:
            got = run_program(prog, kernels, mod, weights, list(args))
            cov.check_outputs(got, FNS[name], args, name)
            print(name, [tuple(a.shape) for a in args], "checked", flush=True)
    print("ALL OK")
""")


@pytest.fixture
def small_tiles(monkeypatch):
    """The merge sort for row bounds over 64 (not 4096), with 64-element tiles."""
    monkeypatch.setattr(aten_library, "SORT_MAX_ROW", 64)
    monkeypatch.setattr(cuda_sort, "MAX_ROW", 64)
    monkeypatch.setattr(cuda_sort, "TILE", 64)
    monkeypatch.setattr(cuda_sort, "MERGE_BLOCK", 32)


def _interpret(tmp_path, cases):
    from test_cuda_dds import interpret_builds

    for name, cm, _ in cases:
        assert cm.manifest["requires"]["aten_fallback_ops"] == [], name
    return interpret_builds(tmp_path, _INTERP, cases)


def _compile(fn, args, dyn=None):
    ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
    return kiln.compile(ep, device="cuda", options=OPTS)


def test_wide_values_one_tile_in_interpreter(tmp_path):
    """float64 / int64 rows of one tile (two `tl.sort` passes): special values, equal high
    halves, int64's min and max, ties."""
    g = torch.Generator().manual_seed(0)
    args = tuple(make_wide(dt, (8, 11), g) for dt in WIDE)
    cm = _compile(per_dtype, args)
    src = cm.sources["kernels_triton.py"]
    assert "key & 0xffff  # the sorted columns" in src and "_merge0" not in src
    calls = [args, tuple(make_wide(dt, (8, 11), g, spec=False) for dt in WIDE)]
    out = _interpret(tmp_path, [("per_dtype", cm, calls)])
    assert out.count("checked") == 2


def test_merge_sort_in_interpreter(tmp_path, small_tiles):
    """The merge sort with 64-element tiles (`small_tiles`): float64 and float32 (special
    values) over a dim bounded by 300, rows of 65 and 200 elements (two tiles, four: two
    passes), a strided operand."""
    g = torch.Generator().manual_seed(1)
    dts = (torch.float64, torch.float32)
    args = tuple(make_wide(dt, (7, 70), g) for dt in dts)
    cm = _compile(few, args, ({1: Dim("n", min=3, max=300)},) * 2)
    assert _launches(cm) == ["tiles", "merge", "next", "merge", "next", "merge"]  # 64 << 3
    calls = [tuple(make_wide(dt, (7, c), g) for dt in dts) for c in (65, 200)]
    x = special(torch.randn(8, 150, generator=g), g).t().contiguous()[:, :2]  # (stride 8)
    cm_outer = _compile(outer, (x,), ({0: Dim("m", min=3, max=300)},))
    out = _interpret(tmp_path, [("few", cm, calls), ("outer", cm_outer, [(x,)])])
    assert out.count("checked") == 3


@pytest.mark.slow  # (about five minutes in the interpreter)
def test_merge_sort_every_op_in_interpreter(tmp_path, small_tiles):
    """The merge sort with 64-element tiles: five dtypes (int64's extremes, equal high
    halves, bool), every sort and order statistic, rows of 3, 65 and 200; topk / kthvalue
    with k = 100 of 200."""
    g = torch.Generator().manual_seed(1)
    args = tuple(make_wide(dt, (8, 70), g) for dt in FEW)
    n = Dim("n", min=3, max=300)  # (torch specializes a length of 1 or 2 here)
    cm = _compile(per_dtype_dyn, args, ({1: n},) * len(FEW))
    calls = [tuple(make_wide(dt, (8, c), g, spec=c > 8) for dt in FEW)
             for c in (3, 65, 200)]
    static = (make_wide(torch.float32, (8, 200), g),)
    cm_static = _compile(per_dtype, static)  # (topk, kthvalue of k = 100)
    out = _interpret(tmp_path, [("per_dtype_dyn", cm, calls), ("per_dtype", cm_static, [static])])
    assert out.count("checked") == 4


def _launches(cm) -> list[str]:
    """The kernels the first sort call of `cm` launches, without the call's name."""
    from test_cuda_dds import triton_kernels_of

    call = next(s for s in cm.built.steps if getattr(s, "routine", None) in ("sort", "topk"))
    base = cuda_sort.sort_kernel_name(call)
    return [k.removeprefix(base + "_") for k in
            cuda_sort.sort_kernel_names(call, triton_kernels_of(cm))]


def test_unbounded_dim_passes():
    """A dim without a bound: one merge kernel, launched once a pass for rows of up to 2^31
    elements (a pass counter in scratch, moved on by `_next`); a pass finds nothing to merge
    where the row is one run. A static long row: the passes it needs."""
    x = torch.randn(3, 10)
    cm = _compile(lambda x: tuple(torch.sort(x, 1)), (x,), ({1: Dim("n", min=2)},))
    assert _launches(cm) == ["tiles", "merge"] + ["next", "merge"] * 18
    src = cm.sources["kernels_triton.py"]
    assert src.count("@triton.jit\ndef sort_") == 3
    assert "cm = (c < s0) & (s0 > w)" in src
    cm = _compile(lambda x: tuple(torch.sort(x, 1)), (torch.randn(2, 10000),))
    assert _launches(cm) == ["tiles", "merge", "next", "merge"]


# -- on a GPU ---------------------------------------------------------------------------------

def _gpu_check(fn, cm, calls, tmp_path, what):
    assert cm.manifest["requires"]["aten_fallback_ops"] == []
    runner = kiln.load(cm.save(tmp_path / "s.kiln"), device="cuda:0")
    for call in calls:
        got = pytree.tree_leaves(runner(*[a.cuda() for a in call]))
        shapes = [tuple(a.shape) for a in call][:1]
        check_outputs(got, fn, call, f"{what} {shapes}", device="cpu")
        d = check_outputs(got, fn, call, f"{what} {shapes}", device="cuda", exact=False)
        print(f"{what} {shapes}: indices unlike eager CUDA's: {d}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("r,n", [(5, 1), (8, 4097), (8, 10000), (300, 700)])
def test_gpu_static_rows_match_eager(r, n, tmp_path):
    """Every dtype, static rows: one element, just past a tile, 10000 (two merge passes),
    many rows of 700 (one tile)."""
    g = torch.Generator().manual_seed(n)
    calls = [tuple(make_wide(dt, (r, n), g, spec=n > 8) for dt in EVERY)]
    calls.append(tuple(make_wide(dt, (r, n), g, spec=False) for dt in EVERY))
    _gpu_check(per_dtype, _compile(per_dtype, calls[0]), calls, tmp_path, "static")




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_unbounded_rows_match_eager(tmp_path):
    """float64 and int16 over a dim without a bound (20 kernels a sort): rows of 9 to 20000
    (no merge pass to three), and a strided operand."""
    g = torch.Generator().manual_seed(7)
    dts = (torch.float64, torch.int16)
    dyn = ({1: Dim("n", min=3)},) * len(dts)
    cm = _compile(few, tuple(make_wide(dt, (8, 9), g) for dt in dts), dyn)
    calls = [tuple(make_wide(dt, (8, n), g) for dt in dts) for n in (9, 4096, 8193, 20000)]
    _gpu_check(few, cm, calls, tmp_path, "unbounded")
    x = special(torch.randn(8, 9000, generator=g), g).t().contiguous()[:, :2]
    _gpu_check(outer, _compile(outer, (x,), ({0: Dim("m", min=3)},)), [(x,)], tmp_path,
               "outer")
