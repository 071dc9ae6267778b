"""unique (sorted, return_inverse, return_counts) and unique_consecutive, flat and over a dim,
without ATen (issue 16: they went to the ATen fallback on CUDA, and on the CPU): kiln's stable
sort (over a dim: one per column of the rows), an adjacent compare, nonzero's compaction to the
data-dependent length, a scan and a scatter for the inverse, the next run start for the counts
(frontend/aten_unique.py).

Eager's CUDA unique radix-sorts the values (cub): a NaN with the sign bit set comes before
-inf, larger payloads outward; its CPU unique puts every NaN after +inf. -0.0 and +0.0 are one
value in both (the run keeps the bits of its first element in the input), and every NaN is a
value of its own. `cuda_unique` spells eager's CUDA algorithm (UniqueCub.cu) with torch's CPU
ops: on inputs without sign-bit NaNs it equals eager's CPU unique (checked here too), and on
the GPU (`-m gpu`) kiln is checked against eager's CUDA kernels themselves.

Without a GPU: the programs compile for sm_90 with no ATen op (but unique_consecutive of floating
values: ATen's on CUDA, as it kept other bits than eager's CUDA kernel for some run on an H100
in session 18), and their Triton kernels run in
Triton's interpreter through the Python runner: bit for bit (values, inverse, counts) for
float32 with -0.0 / +0.0 / inf / NaNs of both signs and payloads, int64 with its extremes,
bool, bfloat16, a dynamic size with an empty input and a single element, a transposed input.
The CPU package of the same program is checked against eager's CPU unique. Over a dim (no NaN:
eager's row order has no place for one), interpreter and CPU package against eager by value.
With a GPU: every dtype eager's CUDA unique takes, 1M elements (the merge sort's rows), a
dynamic size; over a dim, up to 20000 rows."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

import kiln
from kiln.options import Options
from tests.difftest import Fn

OPTS = Options(cuda_archs=(90,), autotune=False, cuda_graphs=False)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool)
# unique_consecutive of floating values stays ATen's on CUDA (frontend/aten_unique.py
# `CUDA_CONSECUTIVE_ATEN`: eager's CUDA kernel kept other bits than kiln for a run on an H100)
CONSECUTIVE_ATEN = ["aten::unique_consecutive.default"]
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def uniques(x):
    """Every form: unique with inverse and counts, unique alone, unique_consecutive with
    inverse and counts, unique_consecutive alone."""
    v, i, c = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    u = torch.unique(x)
    cv, ci, cc = torch.unique_consecutive(x, return_inverse=True, return_counts=True)
    return v, i, c, u, cv, ci, cc, torch.unique_consecutive(x)


def _order(x):
    """int64 keys ordering x.flatten() as eager's CUDA radix sort does (cub: a float's bits
    with the bits below the sign flipped for negatives, -0.0 as +0.0, NaNs included)."""
    f = x.reshape(-1)
    if f.dtype not in _BITS:
        return f.to(torch.int64)
    b = f.view(_BITS[f.dtype]).to(torch.int64)
    b = torch.where(f == 0, torch.zeros_like(b), b)
    width = f.element_size() * 8
    low = (1 << (width - 1)) - 1
    return torch.where(b < 0, b ^ low, b)


def cuda_unique(x, consecutive=False):
    """Eager's CUDA unique (UniqueCub.cu) with CPU ops: a stable radix order (`_order`), run
    starts where adjacent values differ (!=: a NaN differs from itself), the first element of
    each run, its inverse scattered back through the sort's permutation, the runs' lengths."""
    f = x.reshape(-1)
    perm = torch.arange(f.numel()) if consecutive else torch.sort(_order(x), stable=True)[1]
    s = f[perm]
    first = torch.ones(f.numel(), dtype=torch.bool)
    first[1:] = s[1:] != s[:-1]
    starts = first.nonzero()[:, 0]
    inv = torch.empty(f.numel(), dtype=torch.int64)
    inv[perm] = first.long().cumsum(0) - 1
    ends = torch.cat([starts[1:], torch.tensor([f.numel()])])
    return s[starts], inv.reshape(x.shape), ends - starts


def expected(x):
    v, i, c = cuda_unique(x)
    cv, ci, cc = cuda_unique(x, consecutive=True)
    return [v, i, c, v, cv, ci, cc, cv]


def _bits(t):
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


def check(got, x, what):
    """Bit for bit: values (a NaN's sign and payload too), inverse indices and counts."""
    want = expected(x)
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        g = g.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, g.shape, w.shape)
        assert torch.equal(_bits(g), _bits(w)), (what, k, g, w)


def check_model(x):
    """`cuda_unique` is eager: on inputs without NaNs it equals eager's CPU kernels (by value:
    eager's CPU sort is not stable, so which zero's sign a run of zeros keeps is its own)."""
    assert not torch.isnan(x).any()
    for g, w in zip(expected(x), uniques(x)):
        assert torch.equal(g, w)


def check_cpu(got, x, what):
    """The CPU package against eager's CPU unique, which sorts unstably: its NaNs (all after
    +inf) come in no fixed order among themselves, so there the values must be the same NaNs
    (bits) and the inverse must give back each element of x; other values by value (a run of
    zeros keeps the sign of whichever zero eager's sort put first; kiln's sort is stable, so
    its NaNs and zeros keep x's order); the rest bit for bit."""
    want = uniques(x)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.shape, b.shape)
        if k in (0, 3) and a.dtype.is_floating_point:
            nan = torch.isnan(b)
            assert torch.equal(torch.isnan(a), nan), (what, k)
            assert torch.equal(a[~nan], b[~nan]), (what, k, a, b)
            assert torch.equal(_bits(a[nan]).sort()[0], _bits(b[nan]).sort()[0]), (what, k)
        elif k == 1 and x.dtype.is_floating_point:
            back = got[0][a]
            nan = torch.isnan(x)
            assert torch.equal(_bits(back[nan]), _bits(x[nan])), (what, k)
            assert torch.equal(back[~nan], x[~nan]), (what, k)
        else:
            assert torch.equal(_bits(a), _bits(b)), (what, k, a, b)


def values(dt, g, n, special=True):
    """n values of dt with many repeats; floats with +-0.0, +-inf and NaNs of both signs and
    two payloads; int64 with its extremes."""
    if dt == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if dt.is_floating_point:
        x = torch.randint(-4, 5, (n,), generator=g).to(dt) / 2
        if special and n:
            pool = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")]).to(dt)
            at = torch.randint(0, n, (max(n // 4, 5),), generator=g)
            x[at] = pool[torch.randint(0, 5, at.shape, generator=g)]
            b = x.view(_BITS[dt])
            nan = torch.isnan(x).nonzero()[:, 0]
            b[nan[::3]] |= torch.tensor(-1, dtype=b.dtype) << (b.element_size() * 8 - 1)
            b[nan[1::3]] ^= 1  # another payload
        return x
    info = torch.iinfo(dt)
    x = torch.randint(max(info.min, -5), min(info.max, 6), (n,), generator=g).to(dt)
    if dt == torch.int64 and n >= 2:
        x[:2] = torch.tensor([info.min, info.max])
    return x


def _build(fn, args, dyn=None, device="cuda"):
    ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
    return kiln.compile(ep, device=device, options=OPTS if device == "cuda" else None)


def dims(x, y, z):
    """unique over a dim: x [N, 3] int64 rows (dim 0) with inverse and counts, then
    unique_consecutive over dim 0; y [2, N] float32 (dim 1: columns of 2); z [N, 2] bool."""
    out = list(torch.unique(x, dim=0, return_inverse=True, return_counts=True))
    out += torch.unique_consecutive(x, dim=0, return_inverse=True, return_counts=True)
    out += torch.unique(y, dim=1, return_inverse=True, return_counts=True)
    out += torch.unique(z, dim=0, return_inverse=True, return_counts=True)
    return out


def dim_inputs(g, n):
    """Rows with repeats (and repeated neighbours), floats with +-0.0 and +-inf (no NaN:
    eager orders rows with `<`, which gives a NaN no place)."""
    x = torch.randint(-2, 2, (n, 3), generator=g)
    x[n // 2:n // 2 + 2] = x[0]
    y = (torch.randint(-2, 3, (2, n), generator=g) / 2).float()
    y[0, ::3] = float("inf")
    y[1, 1::4] = -0.0
    z = torch.rand(n, 2, generator=g) < 0.5
    return x, y, z


def check_dims(got, args, what):
    """Against eager (on the inputs' device) by value (which of two rows equal up to a zero's
    sign eager keeps depends on its unstable sort), dtypes and shapes exactly."""
    want = dims(*args)
    assert len(got) == len(want), what
    for k, (a, b) in enumerate(zip(got, want)):
        a, b = a.cpu(), b.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.shape, b.shape)
        assert torch.equal(a, b), (what, k, a, b)


_INTERP = textwrap.dedent("""
    import pickle, sys
    sys.path.insert(0, sys.argv[2])
    import test_cuda_unique as T
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    with open(sys.argv[1], "rb") as f:
        cases = pickle.load(f)
    for name, prog, kernels, module, weights, calls in cases:
        mod = import_triton_module(module)
        for args in calls:
            got = run_program(prog, kernels, mod, weights, list(args))
            if name == "dims":
                T.check_dims(got, args, name)
                continue
            k = len(got) // len(args)
            for j, x in enumerate(args):
                T.check(got[j * k:(j + 1) * k], x, f"{name} input {j} {tuple(x.shape)}")
        print(name, "checked", flush=True)
    print("ALL OK")
""")


def several(*xs):
    """uniques of each input, one after another."""
    return [r for x in xs for r in uniques(x)]


def test_cuda_unique_in_interpreter(tmp_path):
    """float32 (special values, a transposed [5, 8] input), int64, bool, bfloat16; a dynamic
    length (1, 0 and 37 elements); the CPU package of the static program against eager."""
    from test_cuda_dds import interpret_builds

    g = torch.Generator().manual_seed(1)
    dts = (torch.float32, torch.int64, torch.bool, torch.bfloat16)

    def make():
        return tuple(values(dt, g, 40).reshape(8, 5).t() if dt == torch.float32 else
                     values(dt, g, 40) for dt in dts)

    args = make()
    cm = _build(several, args)
    assert cm.manifest["requires"]["aten_fallback_ops"] == CONSECUTIVE_ATEN
    dyn_x = values(torch.float32, g, 6)
    dcm = _build(uniques, (dyn_x,), ({0: Dim("n", min=0, max=100)},))
    assert dcm.manifest["requires"]["aten_fallback_ops"] == CONSECUTIVE_ATEN
    dyn_calls = [(values(torch.float32, g, n),) for n in (1, 0, 37)]
    d_args = dim_inputs(g, 9)
    n = Dim("n", min=1, max=64)
    dims_cm = _build(dims, d_args, ({0: n}, {1: n}, {0: n}))
    assert dims_cm.manifest["requires"]["aten_fallback_ops"] == []
    dim_calls = [dim_inputs(g, k) for k in (9, 1, 40)]
    interpret_builds(tmp_path, _INTERP, [("static", cm, [args, make()]),
                                         ("dynamic", dcm, dyn_calls), ("dims", dims_cm, dim_calls)])
    dcpu = _build(dims, d_args, ({0: n}, {1: n}, {0: n}), device="cpu")
    assert dcpu.manifest["requires"]["aten_fallback_ops"] == []
    drun = kiln.load(dcpu.save(tmp_path / "dims_cpu.kiln"))
    for call in dim_calls:
        check_dims(drun(*call), call, "dims cpu")
    ccm = _build(several, args, device="cpu")  # the CPU package: eager's CPU order of NaNs
    assert ccm.manifest["requires"]["aten_fallback_ops"] == []
    runner = kiln.load(ccm.save(tmp_path / "cpu.kiln"))
    for call in (args, make()):
        got = runner(*call)
        for j, x in enumerate(call):
            check_cpu(got[8 * j:8 * j + 8], x, f"cpu input {j}")
    y = values(torch.float32, g, 200)
    check_model(torch.where(torch.isnan(y), -float("inf"), y))


def test_unique_refusals(tmp_path):
    """unique over a dim whose rows have more than DIM_MAX_COLUMNS elements or a length known
    only at run time, and over a dim that may be empty: clear errors without the ATen fallback
    (with it, ATen computes them)."""
    from kiln.errors import UnsupportedError

    opts = Options(cuda_archs=(90,), autotune=False, cuda_graphs=False, aten_fallback=False)
    cases = [(lambda x: torch.unique_consecutive(x, dim=1), torch.randint(0, 3, (17, 5)), None,
              "rows of 17 elements"),
             (lambda x: torch.unique(x, dim=1), torch.randint(0, 3, (4, 5)),
              ({0: Dim("r", min=1, max=8)},), "rows of s"),
             (lambda x: torch.unique(x, dim=0), torch.randint(0, 3, (4, 5)),
              ({0: Dim("n", min=0, max=8)},), "may be 0")]
    for fn, x, dyn, why in cases:
        ep = torch.export.export(Fn(fn), (x,), dynamic_shapes=dyn and (dyn,))
        with pytest.raises(UnsupportedError, match=why):
            kiln.compile(ep, device="cuda", options=opts)
    # torch 2.13 records unique_consecutive over dim -1 of [5, 4] as [5, u, 5, 4] (eager: [5,
    # u]): refused by name, never compiled with that shape
    x = torch.randint(0, 3, (5, 4))
    fn = Fn(lambda x: torch.unique_consecutive(x, dim=-1))
    ep = torch.export.export(fn, (x,))
    node = next(n for n in ep.graph.nodes if "unique" in str(n.target))
    if len(node.meta["val"][0].shape) != 2:
        with pytest.raises(UnsupportedError, match="records wrong metadata"):
            kiln.compile(ep, device="cuda", options=opts)
    else:  # (a torch whose metadata is right)
        cm = kiln.compile(ep)
        assert cm.manifest["requires"]["aten_fallback_ops"] == []
        got = kiln.load(cm.save(tmp_path / "neg.kiln"))(x)
        assert torch.equal(got, fn(x))


# -- on a GPU ---------------------------------------------------------------------------------

def _runner(fn, args, tmp_path, name, dyn=None):
    ep = torch.export.export(Fn(fn), args, dynamic_shapes=dyn and (dyn,))
    cm = kiln.compile(ep, device="cuda")
    floats = any(a.dtype.is_floating_point for a in args)
    assert cm.manifest["requires"]["aten_fallback_ops"] == (CONSECUTIVE_ATEN if floats else []), \
        name
    return kiln.load(cm.save(tmp_path / f"{name}.kiln"), device="cuda:0")


def _check_gpu(got, x, what):
    """Against eager's CUDA kernels on the device, bit for bit (and against `cuda_unique`)."""
    xc = x.cuda()
    want = uniques(xc)
    got = [t.cpu() for t in pytree.tree_leaves(got)]
    for k, (a, b) in enumerate(zip(got, want)):
        b = b.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.shape, b.shape)
        assert torch.equal(_bits(a), _bits(b)), (what, k, a, b)
    check(got, x, what)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_gpu_unique_matches_eager(dt, tmp_path):
    """3000 elements (one sort tile) and a dynamic length up to 2M (the merge sort)."""
    g = torch.Generator().manual_seed(21)
    x = values(dt, g, 3000)
    runner = _runner(uniques, (x,), tmp_path, "static")
    for call in (x, values(dt, g, 3000)):
        _check_gpu(runner(call.cuda()), call, f"{dt} static")
    dyn = _runner(uniques, (values(dt, g, 5000),), tmp_path, "dyn",
                  ({0: Dim("n", min=0, max=1 << 21)},))
    for n in (0, 1, 4097, 1 << 20):
        call = values(dt, g, n)
        _check_gpu(dyn(call.cuda()), call, f"{dt} n={n}")


def _retyped(fn, x):
    """The export of fn(x) with unique's inverse and counts recorded as x's dtype, as torch
    2.11's export records them (frontend/fallback.py `RESULT_DTYPES`)."""
    ep = torch.export.export(Fn(fn), (x,))
    for node in ep.graph.nodes:
        if node.target is torch.ops.aten._unique2.default:
            v = node.meta["val"]
            node.meta["val"] = (v[0], v[1].to(x.dtype), v[2].to(x.dtype))
    return ep


def test_wrong_result_dtypes_in_the_export():
    """Exported inverse / counts typed as the input (torch 2.11): returned as int64 (eager's
    dtype, which kiln computes); a program reading them as the wrong dtype is refused. (The
    importer as it is, without import_program's decomposition, which would re-run torch's
    metadata.)"""
    from kiln.errors import UnsupportedError
    from kiln.frontend.export import _import

    def import_program(ep, aten_fallback, library_routines):
        return _import(ep, True, aten_fallback, 0, library_routines, False)

    x = torch.randint(0, 5, (12,)).float()
    ep = _retyped(lambda x: torch.unique(x, return_inverse=True, return_counts=True), x)
    for routines in (True, False):
        g = import_program(ep, aten_fallback=False, library_routines=routines).graph
        types = {n.name: n.type for n in g.nodes}
        assert [types[o].dtype.name for o in g.outputs] == ["float32", "int64", "int64"]
    ep = _retyped(lambda x: torch.unique(x, return_counts=True)[1] + 1, x)
    with pytest.raises(UnsupportedError, match="records wrong metadata for unique"):
        import_program(ep, aten_fallback=False, library_routines=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_unique_dim_matches_eager(tmp_path):
    """Over a dim, against eager's CUDA kernels: 3000 rows (one sort tile per column) and
    20000 (the merge sort)."""
    g = torch.Generator().manual_seed(22)
    n = Dim("n", min=1, max=1 << 16)
    runner = _runner(dims, dim_inputs(g, 50), tmp_path, "dims", ({0: n}, {1: n}, {0: n}))
    for k in (1, 3000, 20000):
        call = tuple(a.cuda() for a in dim_inputs(g, k))
        check_dims(runner(*call), call, f"dims n={k}")
