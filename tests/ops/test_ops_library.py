"""Differential tests of the ops computed by kiln runtime routines (Loop IR `Extern`,
kiln_lib.h): sort / argsort / topk / kthvalue / median, scans, scatters, index_put (and
index_add / index_copy / index_fill through it), masked_scatter and embedding_bag; their run-time
index errors; and the Loop IR interpreter's numpy twins of the same routines."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from difftest import Cases, Checker, Fn, Layout, case_name, compare, gen, rand
from kiln.errors import KilnError
from kiln.frontend.export import import_program
from kiln.ir import loop as L
from kiln.ir.interp import InterpError, run_loop
from kiln.lowering import lower
from kiln.passes.dce import dce

F32, F64, I64, I32, BOOL = torch.float32, torch.float64, torch.int64, torch.int32, torch.bool


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("ops_library"))


def slow(*values):
    """Parameters that only the slow suite runs (the default suite keeps one float and one int
    dtype per op family)."""
    return [pytest.param(v, marks=pytest.mark.slow) for v in values]


def _ids(v) -> str:
    if isinstance(v, tuple):
        return "-".join(map(_ids, v))
    return str(v).replace(" ", "").removeprefix("torch.")


def check_cases(check: Checker, cases: dict) -> None:
    """`cases`: name -> (module, [its args at run 0, at run 1, ...]), the same number of runs
    each; all checked as one difftest.Cases program (one package, each case its own static
    shapes, kernels and per-dtype tolerance; outputs named "<name>__<output>")."""
    runs = {len(r) for _, r in cases.values()}
    assert len(runs) == 1, runs
    mods = {case_name(k): (m, len(r[0])) for k, (m, r) in cases.items()}
    args = [[a for _, r in cases.values() for a in r[j]] for j in range(runs.pop())]
    check(Cases(mods), args[0], more=args[1:])


def distinct(shape, dtype, key) -> torch.Tensor:
    """Values without ties (so every sort order and index is well defined)."""
    n = int(np.prod(shape))
    perm = torch.randperm(n, generator=gen("distinct", key, shape)).view(shape)
    return (perm - n // 2).to(dtype) * (0.5 if dtype.is_floating_point else 1)


def ties(shape, dtype, key) -> torch.Tensor:
    """Few distinct values: many ties."""
    if dtype == BOOL:
        return rand(shape, BOOL, gen("ties", key))
    return torch.randint(-2, 3, shape, generator=gen("ties", key, shape)).to(dtype)


def _interp(fn, args):
    """Outputs of the Loop IR interpreter (numpy) for `fn` at `args`."""
    ep = torch.export.export(Fn(fn), tuple(args))
    imp = import_program(ep)
    graph = dce(imp.graph)
    prog = lower(graph)
    feeds = {i.name: a.numpy() for i, a in zip(graph.user_inputs, args)}
    feeds.update({k: v.numpy() for k, v in imp.weights.items()})
    return prog, run_loop(prog, feeds, {})


# -- sorting -----------------------------------------------------------------------------------
def sorting(x):
    """x [4, 5, 6] without ties."""
    return {
        "sort0": tuple(torch.sort(x, 0)), "sort_desc": tuple(torch.sort(x, -1, descending=True)),
        "sort_t": tuple(torch.sort(x.transpose(0, 2), 1)), "argsort": torch.argsort(x, 1),
        "argsort_desc": torch.argsort(x[:, ::2], -1, descending=True),
        "topk": tuple(torch.topk(x, 2, 1)),
        "topk_small": tuple(torch.topk(x, 3, -1, largest=False)),
        "topk_all": tuple(torch.topk(x, 4, 0)), "kth": tuple(torch.kthvalue(x, 2, 0)),
        "kth_keep": tuple(torch.kthvalue(x, 6, 2, keepdim=True)),
        "median": tuple(torch.median(x, 1)), "median_keep": tuple(torch.median(x, 0, True)),
        "median_all": torch.median(x), "sorted_plus": torch.sort(x * 2 + 1, 1).values - 1,
    }


@pytest.mark.parametrize("dtypes", [(F32, I64), *slow((F64, I32))], ids=_ids)
def test_sorting(check, dtypes):
    """`sorting` at each of `dtypes`, in one program (check_cases)."""
    check_cases(check, {_ids(dt): (Fn(sorting), [(distinct((4, 5, 6), dt, "sorting"),),
                                                 (distinct((4, 5, 6), dt, "sorting2"),)])
                        for dt in dtypes})


def stable(x):
    return {"asc": tuple(torch.sort(x, dim=1, stable=True)),
            "desc": tuple(torch.sort(x, dim=0, descending=True, stable=True)),
            "last_desc": tuple(torch.sort(x, dim=-1, descending=True, stable=True))}


@pytest.mark.parametrize("dtypes", [(F32, BOOL), *slow((I64,))], ids=_ids)
def test_stable_sort_keeps_tie_order(check, dtypes):
    check_cases(check, {_ids(dt): (Fn(stable), [(ties((6, 40), dt, "stable"),),
                                                (ties((6, 40), dt, "st2"),)])
                        for dt in dtypes})


def test_sort_nan_is_largest(check):
    x = rand((5, 9), F32, gen("nan"))
    x[x > 0.8] = float("nan")
    x[0, :] = float("nan")
    check(Fn(stable), (x,))


@pytest.mark.parametrize("layout", ["t", *slow("step")])
def test_sorting_strided_inputs(check, layout):
    fn = Layout(Fn(lambda x: {"sort": tuple(torch.sort(x, 0)), "topk": tuple(torch.topk(x, 2)),
                              "cumsum": torch.cumsum(x, 0), "cummax": tuple(torch.cummax(x, 1))}),
                layout)
    check(fn, (distinct((6, 14), F32, layout),))


def test_sort_reads_strided_operands_without_a_copy(check):
    compiled = check(Fn(lambda x: torch.sort(x.transpose(0, 1)[:, 1:], 0).values),
                     (distinct((5, 7), F32, "nocopy"),))
    loop = compiled.built.loop
    src = compiled.sources["model.cpp"]
    assert "kl::sort(" in src and "<- sort" in src
    ext = [n for n in loop.nodes if isinstance(n, L.Extern)]
    assert len(ext) == 1 and ext[0].args[0].buf == loop.inputs[0]
    # the input is read in place; only the graph output (dim 0 back in front) is a copy
    assert [n.name for n in loop.nodes if not isinstance(n, L.Extern)] == ["out0_sort_0"]


# -- scans -------------------------------------------------------------------------------------
def scans(x):
    out = {"cumsum0": torch.cumsum(x, 0), "cumsum_last": torch.cumsum(x, -1),
           "cumsum_t": torch.cumsum(x.transpose(0, 1), 2), "cumprod": torch.cumprod(x, 1),
           "cummax": tuple(torch.cummax(x, 1)), "cummin": tuple(torch.cummin(x, 0)),
           "cumsum_f64": torch.cumsum(x, 1, dtype=torch.float64)}
    if x.is_floating_point():
        out["logcumsumexp"] = torch.logcumsumexp(x, 2)
    return out


@pytest.mark.parametrize("dtypes", [(F32, I64), *slow((F64, I32))], ids=_ids)
def test_scans(check, dtypes):
    cases = {}
    for dtype in dtypes:
        x = ties((3, 7, 5), dtype, "scan") if not dtype.is_floating_point else \
            rand((3, 7, 5), dtype, gen("scan"))
        cases[_ids(dtype)] = (Fn(scans), [(x,), (x.flip(0),)])
    check_cases(check, cases)


def test_scan_dtype_promotion(check):
    fn = Fn(lambda b, i: {"bool": torch.cumsum(b, 1), "int32": torch.cumsum(i, 0),
                          "int32_prod": torch.cumprod(i, 1), "bool_max": tuple(torch.cummax(i, 1))})
    check(fn, (ties((4, 9), BOOL, "b"), ties((4, 9), I32, "i")))


def test_scans_nan_and_zero_size(check):
    x = rand((4, 8), F32, gen("scan-nan"))
    x[1, 3] = float("nan")
    x[2, 0] = float("-inf")
    z = torch.zeros(0, 5)
    check_cases(check, {  # one program
        "nan": (Fn(lambda x: {"cummax": tuple(torch.cummax(x, 1)),
                              "cummin": tuple(torch.cummin(x, 1)),
                              "lse": torch.logcumsumexp(x, 1), "cumsum": torch.cumsum(x, 1)}),
                [(x,)]),
        "zero_size": (Fn(lambda z: {"cumsum": torch.cumsum(z, 0), "sort": tuple(torch.sort(z, 1)),
                                    "cummax": tuple(torch.cummax(z, 0))}), [(z,)])})


# -- scatters ----------------------------------------------------------------------------------
def scatters(x, i0, i1, src):
    """x [5, 6]; i0 [4, 6] in [0, 5) and i1 [5, 3] in [0, 6), both with duplicates; src [6, 7]."""
    out = {"scatter0": x.scatter(0, i0, src), "scatter1": x.scatter(1, i1, src),
           "scatter_value": x.scatter(1, i1, 3), "scatter_add": x.scatter_add(0, i0, src),
           "scatter_radd": x.scatter(1, i1, src, reduce="add"),
           "scatter_rmul": x.scatter(0, i0, src, reduce="multiply")}
    for red in ("sum", "prod", "mean", "amax", "amin"):
        for inc in (True, False):
            out[f"{red}_{inc}"] = x.scatter_reduce(0, i0, src, red, include_self=inc)
    out["mean_t"] = x.t().scatter_reduce(1, i0.t(), src.t(), "mean", include_self=False)
    return out


@pytest.mark.parametrize("dtypes", [(F32, I64), *slow((F64, I32))], ids=_ids)
def test_scatters(check, dtypes):
    def args(dtype, key):
        return (ties((5, 6), dtype, ("x", key)) if not dtype.is_floating_point else
                rand((5, 6), dtype, gen("x", key)),
                torch.randint(0, 5, (4, 6), generator=gen("i0", key)),
                torch.randint(0, 6, (5, 3), generator=gen("i1", key)),
                ties((6, 7), dtype, ("s", key)) + (0.25 if dtype.is_floating_point else 0))
    check_cases(check, {_ids(dt): (Fn(scatters), [args(dt, 0), args(dt, 1)]) for dt in dtypes})


def puts(x, i, j, v):
    """x [5, 6, 7]; i [4] in [-5, 5) with duplicates; j [3, 1] in [-6, 6); v [4, 6, 7]."""
    y = x.clone()
    y[i] = v
    z = x.clone()
    z[:, j % 6, 2] = 1
    return {
        "put": x.index_put((i,), v), "put_acc": x.index_put((i,), v, accumulate=True),
        "put_bcast": x.index_put((i,), v[0, 0]), "put2": x.index_put((j % 5, i.abs()), v[0, 0]),
        "put_nonadj": torch.ops.aten.index_put(x, [i, None, i.abs()], v[:, :, 0], True),
        "put_mid": torch.ops.aten.index_put(x, [None, j], v[:3, :1].reshape(3, 1, 7), False),
        "setitem": y, "setitem_scalar": z,
        "index_add": x.index_add(1, i.abs(), v.permute(1, 0, 2)[:5], alpha=2),
        "index_copy": x.index_copy(0, torch.tensor([3, 0]), v[:2]),
        "index_fill": x.index_fill(2, i.abs(), -1.5 if x.is_floating_point() else -1),
    }


@pytest.mark.parametrize("dtypes", [(F32, I64), *slow((F64,))], ids=_ids)
def test_index_put(check, dtypes):
    def args(dtype, key):
        x = rand((5, 6, 7), dtype, gen("x", key)) if dtype.is_floating_point else \
            ties((5, 6, 7), dtype, ("x", key))
        i = torch.tensor([1, -2, 1, 4]) if key == 0 else torch.randint(-5, 5, (4,),
                                                                     generator=gen("i", key))
        j = torch.randint(-6, 6, (3, 1), generator=gen("j", key))
        v = rand((4, 6, 7), dtype, gen("v", key)) if dtype.is_floating_point else \
            ties((4, 6, 7), dtype, ("v", key))
        return x, i, j, v
    check_cases(check, {_ids(dt): (Fn(puts), [args(dt, 0), args(dt, 1)]) for dt in dtypes})


def test_masked_scatter(check):
    fn = Fn(lambda x, m, s: {"full": x.masked_scatter(m, s), "bcast": x.masked_scatter(m[0], s),
                             "t": x.t().masked_scatter(m.t(), s)})
    x, s = rand((4, 5), F32, gen("ms-x")), rand((30,), F32, gen("ms-s"))
    check(fn, (x, rand((4, 5), BOOL, gen("ms-m")), s),
          more=[(x, torch.ones(4, 5, dtype=BOOL), s), (x, torch.zeros(4, 5, dtype=BOOL), s)])


# -- embedding_bag ------------------------------------------------------------------------------
def bags(w, ids, offsets, psw):
    out = {m: F.embedding_bag(ids, w, offsets, mode=m) for m in ("sum", "mean", "max")}
    # include_last_offset: offsets end with len(ids) (torch's contract)
    last = torch.cat([offsets, torch.full((1,), ids.numel(), dtype=offsets.dtype)])
    out["last"] = F.embedding_bag(ids, w, last, mode="mean", include_last_offset=True)
    out["last_max"] = F.embedding_bag(ids, w, last, mode="max", include_last_offset=True)
    out["weighted"] = F.embedding_bag(ids, w, offsets, mode="sum", per_sample_weights=psw)
    out["padding"] = F.embedding_bag(ids, w, offsets, mode="mean", padding_idx=3)
    out["2d"] = F.embedding_bag(ids[:8].view(4, 2), w, mode="max")
    return out


def test_embedding_bag(check):
    """`bags` at (float32 table, int64 ids) and (float64, int32), in one program."""
    cases = {}
    for dtype, idt in [(F32, I64), (F64, I32)]:
        w = rand((10, 6), dtype, gen("bag-w", dtype))
        ids = torch.tensor([3, 1, 3, 9, 0, 3, 5, 5, 2, 7], dtype=idt)
        offs = torch.tensor([0, 2, 2, 7], dtype=idt)  # bag 1 is empty
        psw = rand((10,), dtype, gen("bag-p"))
        wn = w.clone()
        wn[3, 1] = wn[5, 2] = float("nan")  # max: a NaN counts only as a bag's first row
        cases[_ids((dtype, idt))] = (Fn(bags), [
            (w, ids, offs, psw), (w, ids.flip(0), torch.tensor([0, 0, 5, 10], dtype=idt), psw),
            (wn, ids, offs, psw), (wn, ids.flip(0), offs, psw)])
    check_cases(check, cases)


def test_embedding_bag_module(check):
    m = torch.nn.EmbeddingBag(12, 5, mode="max")
    ids = torch.randint(0, 12, (3, 4), generator=gen("bag-m"))
    check(m, (ids,))


# -- errors ------------------------------------------------------------------------------------
def test_index_out_of_range_is_a_clear_error(check):
    fn = Fn(lambda x, i, s: {"scatter": x.scatter_add(0, i, s), "put": x.index_put((i[0],), s[0],
                                                                              accumulate=True)})
    x, s = rand((4, 5), F32, gen("oor-x")), rand((2, 5), F32, gen("oor-s"))
    _, runner = check.compile(fn, (x, torch.zeros(2, 5, dtype=I64), s))
    for bad in (4, -5, 100):
        i = torch.zeros(2, 5, dtype=I64)
        i[0, 3] = bad
        with pytest.raises((RuntimeError, IndexError)):
            fn(x, i, s)
        with pytest.raises(KilnError, match="index out of range"):
            runner(x, i, s)
    i = torch.tensor([[0, 3, 1, -1, 2], [1, 1, 1, 1, 1]])  # -1 wraps for index_put only
    i_ok = i.clone()
    i_ok[0, 3] = 3
    got, want = runner(x, i_ok, s), fn(x, i_ok, s)
    compare(got, want)


def test_embedding_bag_index_out_of_range(check):
    fn = Fn(lambda w, ids, offs: F.embedding_bag(ids, w, offs))
    w = rand((6, 3), F32, gen("bag-oor"))
    _, runner = check.compile(fn, (w, torch.tensor([0, 1, 2]), torch.tensor([0, 1])))
    with pytest.raises(KilnError, match="index out of range"):
        runner(w, torch.tensor([0, 6, 2]), torch.tensor([0, 1]))
    with pytest.raises(KilnError, match="offsets"):
        runner(w, torch.tensor([0, 1, 2]), torch.tensor([2, 1]))


def test_masked_scatter_short_source_is_an_error(check):
    fn = Fn(lambda x, m, s: x.masked_scatter(m, s))
    x = rand((3, 4), F32, gen("ms-short"))
    _, runner = check.compile(fn, (x, torch.zeros(3, 4, dtype=BOOL), torch.ones(5)))
    with pytest.raises(KilnError, match="more elements than source"):
        runner(x, torch.ones(3, 4, dtype=BOOL), torch.ones(5))


# -- the interpreter's numpy twins agree with eager --------------------------------------------
@pytest.mark.parametrize("case", ["sorting", "stable", "scans", "scatters", "puts", "bags"])
def test_interpreter_agrees(case):
    if case == "sorting":
        fn, args = sorting, (distinct((4, 5, 6), F32, "interp"),)
    elif case == "stable":
        fn, args = stable, (ties((5, 12), F32, "interp"),)
    elif case == "scans":
        fn, args = scans, (rand((3, 7, 5), F64, gen("interp-scan")),)
    elif case == "scatters":
        fn, args = scatters, (rand((5, 6), F64, gen("ix")),
                              torch.randint(0, 5, (4, 6), generator=gen("i0")),
                              torch.randint(0, 6, (5, 3), generator=gen("i1")),
                              ties((6, 7), F64, "is") + 0.25)
    elif case == "puts":
        fn, args = puts, (rand((5, 6, 7), F64, gen("px")), torch.tensor([1, -2, 1, 4]),
                          torch.tensor([[2], [-1], [0]]), rand((4, 6, 7), F64, gen("pv")))
    else:
        fn, args = bags, (rand((10, 6), F64, gen("bw")), torch.tensor([3, 1, 3, 9, 0, 3, 5, 5,
                                                                       2, 7]),
                          torch.tensor([0, 2, 2, 7]), rand((10,), F64, gen("bp")))
    prog, got = _interp(fn, args)
    assert any(isinstance(n, L.Extern) for n in prog.nodes)
    want = fn(*args)
    from torch.utils import _pytree as pytree
    leaves, spec = pytree.tree_flatten(want)
    compare(pytree.tree_unflatten([torch.from_numpy(np.array(g)) for g in got], spec),
            want)


def test_interpreter_index_error():
    fn = Fn(lambda x, i, s: x.scatter(0, i, s))
    x, s = rand((3, 4), F64, gen("ie")), rand((2, 4), F64, gen("ie-s"))
    ep = torch.export.export(fn, (x, torch.zeros(2, 4, dtype=I64), s))
    imp = import_program(ep)
    prog = lower(dce(imp.graph))
    names = [i.name for i in imp.graph.user_inputs]
    bad = torch.full((2, 4), 3)
    with pytest.raises(InterpError, match="out of range"):
        run_loop(prog, dict(zip(names, [x.numpy(), bad.numpy(), s.numpy()])), {})


# -- dynamic shapes ----------------------------------------------------------------------------
def test_dynamic_sizes(check):
    """Operand sizes and strides are symbolic: one package serves every size in the range."""
    fn = Fn(lambda x, i: {"sort": tuple(torch.sort(x, 0, descending=True)),
                          "cumsum": torch.cumsum(x.t(), 1), "topk": tuple(torch.topk(x, 2, 1)),
                          "scatter": x.scatter_add(0, i, x), "put": x.index_put((i[:, 0],), x[:1],
                                                                               accumulate=True)})
    n = torch.export.Dim("n", min=2, max=64)

    def args(rows):
        return (distinct((rows, 5), F32, ("dyn", rows)),
                torch.randint(0, rows, (rows, 5), generator=gen("dyn-i", rows)))
    check(fn, args(6), more=[args(2), args(33)], dynamic_shapes=({0: n}, {0: n}))


class Cache(torch.nn.Module):
    """A KV-cache-like buffer updated in place by index_copy_ / index_put_ at given positions."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 3))
        self.register_buffer("hits", torch.zeros(8))

    def forward(self, pos, v):
        self.cache.index_copy_(0, pos, v)
        self.hits.index_put_((pos,), torch.ones(pos.shape[0]), accumulate=True)
        return self.cache.sum(1) + self.hits


def test_state_updates_through_index_copy(check):
    """The updated state persists across runs, as eager's buffers do."""
    eager = Cache()
    _, runner = check.compile(Cache(), (torch.tensor([0, 1]), torch.ones(2, 3)))
    for k, pos in enumerate(([2, 5], [5, 0], [7, 7])):
        v = rand((2, 3), F32, gen("cache", k))
        want = eager(torch.tensor(pos), v)
        torch.testing.assert_close(runner(torch.tensor(pos), v), want)


def ties_order(a, b):
    """Sorts and topk without `stable`: torch leaves ties in the order its selection algorithm
    does, and kiln leaves them in the same order."""
    return {"sort": tuple(torch.sort(a, 1)), "sort_desc0": tuple(torch.sort(a, 0, descending=True)),
            "sort_long": tuple(torch.sort(b, -1)), "topk_small_k": tuple(torch.topk(b, 3, 1)),
            "topk_large_k": tuple(torch.topk(a, 30, 1, largest=False)),
            "topk_unsorted": tuple(torch.topk(a, 25, 1, sorted=False)),
            "argsort": torch.argsort(b, 1, descending=True)}


@pytest.mark.parametrize("dtype", [F32, *slow(I64)], ids=_ids)
def test_unstable_sort_and_topk_tie_order_matches_torch(check, dtype):
    def args(key):
        return ties((6, 50), dtype, ("a", key)), ties((4, 400), dtype, ("b", key))
    check(Fn(ties_order), args(0), more=[args(1)])


def test_index_put_boolean_mask(check):
    """x[mask] = v with v the same for every selected element: no data-dependent size."""
    def fn(x, m, m2, v):
        y = x.clone()
        y[m] = v
        z = x.clone()
        z[:, m2] = 2.5
        return {"rows": y, "scalar": z, "acc": x.index_put((m,), v, accumulate=True),
                "t": x.t().index_put((m2,), v[:1, None])}
    x = rand((5, 6), F32, gen("mask-x"))
    check(Fn(fn), (x, rand((5,), BOOL, gen("m1")), rand((6,), BOOL, gen("m2")),
                   rand((6,), F32, gen("mask-v"))),
          more=[(x, torch.ones(5, dtype=BOOL), torch.zeros(6, dtype=BOOL), x[0])])


def mask_beside_index(x, m, i, v, m2, j, w):
    """x[m, i] = v: the bool mask's true coordinates broadcast with the index tensor (torch's
    data-dependent count); a 2-d mask between a broadcast index pair, accumulating."""
    y = x.clone()
    y[m, i] = v
    z = torch.ops.aten.index_put(x, [torch.arange(x.shape[0]).unsqueeze(1), m2, j], w, True)
    return {"set": y, "acc": z, "one_per_row": x.index_put((m, i[:1]), v[:1, :1])}


def test_index_put_mask_beside_index_tensors(check):
    g = gen("mask-idx")
    x = rand((4, 3, 4), F32, g)
    m = torch.tensor([True, False, True, True])
    m2 = torch.zeros(3, dtype=BOOL)
    m2[[0, 2]] = True
    i, j = torch.tensor([0, 2, 1]), torch.tensor([1, -1])
    v, w = rand((3, 1), F32, g), rand((4, 2), F32, g)
    one = torch.tensor([False, False, True, False])  # one true element broadcasts to i's 3
    check(Fn(mask_beside_index), (x, m, i, v, m2, j, w),
          more=[(x, one, i, v, m2, j, w), (x, m, i.flip(0), -v, m2.flip(0), j.flip(0), w)])


@pytest.mark.parametrize("count", [0, 2, 4])
def test_index_put_mask_count_must_match_the_index(check, count):
    """A mask whose true count neither matches the other indices' size nor is 1 is torch's
    "shape mismatch": a clear error naming the count, never a read past the coordinates."""
    g = gen("mask-idx-bad")
    x, i, v = rand((4, 3), F32, g), torch.tensor([0, 2, 1]), rand((3,), F32, g)
    m = torch.tensor([True, False, True, True])
    _, runner = check.compile(Fn(lambda x, m, i, v: x.index_put((m, i), v)), (x, m, i, v))
    bad = torch.arange(4) < count
    with pytest.raises(KilnError, match=f"mask_true_count.*is {count}, outside \\[3, 3\\]"):
        runner(x, bad, i, v)
    with pytest.raises((IndexError, RuntimeError), match="shape mismatch"):
        x.index_put((bad, i), v)


def test_large_scatters_run_in_parallel_slices(check):
    """Above 65536 updates `put` runs disjoint slices in parallel: same answer, duplicates
    included (sums add in order). (Eager's index_put without accumulate runs in parallel at
    this size too, so its answer for duplicate rows is not defined: `put_set` has none.)"""
    fn = Fn(lambda x, i, r: {"scatter": x.scatter(0, i, x * 2), "scatter_add": x.scatter_add(
        1, i.t(), x), "put": x.index_put((r,), x[:40], accumulate=True),
        "put_set": x.index_put((torch.arange(40) * 7 - 100,), x[:40])})
    x = rand((300, 300), F32, gen("large-x"))
    i = torch.randint(0, 300, (300, 300), generator=gen("large-i"))
    r = torch.randint(-300, 300, (40,), generator=gen("large-r"))
    check(fn, (x, i, r))
