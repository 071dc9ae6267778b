"""Differential tests of reductions: sum/mean/prod/amax/amin/any/all over single, multiple and
all dims (keepdim both ways), argmax/argmin, var/std (correction 0 and 1), softmax and
log_softmax on every dim."""

from __future__ import annotations

import pytest
import torch

from difftest import Cases, Checker, Fn, Layout, case_name, dim, gen, layout_shape, rand

F32, F64, I64, I32, BOOL = torch.float32, torch.float64, torch.int64, torch.int32, torch.bool
DIMS = [0, 1, 2, -1, (0, 2), (1, 2), (0, 1, 2)]


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("ops_reductions"))


def _ids(v) -> str:
    return str(v).replace(" ", "").removeprefix("torch.")


def sums(x):
    out = {"sum_all": x.sum(), "mean_all": x.mean(), "prod_all": (1 + 0.01 * x).prod(),
           "var_all": x.var(), "std_all_c0": x.std(correction=0)}
    for d in DIMS:
        for keep in (False, True):
            k = f"{d}{'_keep' if keep else ''}"
            out[f"sum{k}"] = x.sum(d, keepdim=keep)
            out[f"mean{k}"] = x.mean(d, keepdim=keep)
    for d, keep in ((1, False), (-1, True), ((0, 2), False), ((1, 2), True)):
        out[f"var{d}{'_keep' if keep else ''}"] = x.var(d, keepdim=keep)
    for d in (0, (0, 1)):
        out[f"var_c0_{d}"] = x.var(d, correction=0)
        out[f"std_keep{d}"] = x.std(d, keepdim=True)
        out[f"std_c0_{d}"] = x.std(d, correction=0)
    for d in (0, -1):
        out[f"prod{d}"] = (1 + 0.1 * x).prod(d, keepdim=bool(d))
    return out


def extrema(x):
    out = {"amax_all": x.amax(), "amin_all": x.amin(), "max_all": x.max(), "min_all": x.min(),
           "argmax_all": x.argmax(), "argmin_all_keep": x.argmin(keepdim=True),
           "any_all": (x > 1).any(), "all_all": (x > -3).all()}
    for d in DIMS:
        k = str(d)
        out[f"amax{k}"] = x.amax(d)
        out[f"amin_keep{k}"] = x.amin(d, keepdim=True)
        out[f"any{k}"] = (x > 1).any(d)
        out[f"all_keep{k}"] = (x > -1).all(d, keepdim=True)
    for d in (0, 1, 2, -1):
        out[f"argmax{d}"] = x.argmax(d)
        out[f"argmin_keep{d}"] = x.argmin(d, keepdim=True)
    out["max_values1"], out["max_indices1"] = x.max(1)
    out["min_keep-1"] = x.min(-1, keepdim=True)
    return out


CASES = [((4, 6, 10), "contig", F32), ((1, 1, 1), "contig", F32), ((3, 1, 7), "contig", F32),
         ((20, 33, 31), "contig", F32), ((4, 6, 10), "t", F32), ((5, 3, 8), "step", F32),
         ((4, 6, 10), "perm", F64)]


def check_cases(check: Checker, fn, key: str, cases) -> None:
    """`fn` at each (shape, layout, dtype) of `cases` (input seeded by `key` and the case), all
    in one difftest.Cases program (one package; each case its own static shapes, kernels and
    per-dtype tolerance; outputs named "<case>__<output>")."""
    mods, args = {}, []
    for shape, layout, dtype in cases:
        mods[case_name(shape, layout, _ids(dtype))] = (Layout(Fn(fn), layout), 1)
        args.append(rand(layout_shape(shape, layout), dtype, gen(key, shape, layout, dtype)))
    assert len(mods) == len(cases)
    check(Cases(mods), args)


def test_sum_mean_prod_var(check):
    """`sums` at each case of CASES, in one program."""
    check_cases(check, sums, "sums", CASES)


def test_extrema_and_arg(check):
    """`extrema` at each case of CASES, in one program."""
    check_cases(check, extrema, "extrema", CASES)


def int_reductions(i):
    out = {"sum_all": i.sum(), "prod_all": (i % 3 - 1).prod(), "any": (i > 10).any(1),
           "all": (i != 0).all(), "sum_f64": i.sum(1, dtype=F64), "mean": i.float().mean(0)}
    for d in (0, 1, -1, (0, 1)):
        out[f"sum{d}"] = i.sum(d)
        out[f"amax{d}"] = i.amax(d)
        out[f"amin_keep{d}"] = i.amin(d, keepdim=True)
    for d in (0, 1):  # small value range: many ties, torch returns the first index
        out[f"argmax{d}"] = (i % 3).argmax(d)
        out[f"argmin{d}"] = (i % 3).argmin(d, keepdim=True)
    return out


INT_REDUCTIONS = [((7, 13), I64), ((7, 13), I32), ((1, 1), I64), ((3, 5), torch.int8),
                  ((150, 80), I32)]


def test_integer_reductions(check):
    """`int_reductions` at each (shape, dtype) of INT_REDUCTIONS, in one program."""
    check(Cases({case_name(shape, _ids(dtype)): (Fn(int_reductions), 1)
                 for shape, dtype in INT_REDUCTIONS}),
          [rand(shape, dtype, gen("int-red", shape, dtype)) for shape, dtype in INT_REDUCTIONS])


def test_long_reductions(check):
    """Reduced dims of 20k elements (inner and outer): vectorised and parallel paths."""
    g = gen("long")
    a, b = rand((3, 20000), F32, g), rand((20000, 3), F32, g)
    check(Fn(lambda a, b: {
        "sum1": a.sum(1), "amax1": a.amax(1), "argmax1": a.argmax(1), "var1": a.var(1),
        "var_offset": (a + 1000).var(1), "sum_offset": (a + 1000).sum(1), "sum0": b.sum(0),
        "argmin0": b.argmin(0), "mean_all": a.mean(), "prod1": (1 + 1e-3 * a).prod(1),
        "softmax1": a.softmax(1), "log_softmax0": b.log_softmax(0), "any1": (a > 4).any(1),
        "t_sum": b.t().sum(1)}), (a, b))


def test_bool_reductions(check):
    b = rand((6, 9), BOOL, gen("bool-red"))
    check(Fn(lambda b: {"any0": b.any(0), "all1": b.all(1), "any_all": b.any(), "all": b.all(),
                        "sum": b.sum(1), "sum_all": b.sum(), "amax": b.amax(0),
                        "any_keep": b.any(1, keepdim=True)}), (b,))


def test_reductions_with_nan_and_inf(check):
    x = rand((6, 9), F32, gen("nan-red"))
    x[1, 3] = float("nan")
    x[4, :] = float("-inf")
    x[2, 2] = float("inf")
    check(Fn(lambda x: {"amax0": x.amax(0), "amax1": x.amax(1), "amin1": x.amin(1),
                        "argmax1": x.argmax(1), "argmin0": x.argmin(0), "sum1": x.sum(1),
                        "max1": x.max(1)[0], "softmax1": x.softmax(1)}), (x,))


# -- softmax ----------------------------------------------------------------------------------
def softmaxes(x):
    out = {}
    for d in range(-x.dim(), x.dim()):
        out[f"softmax{d}"] = torch.softmax(x, d)
        out[f"log_softmax{d}"] = torch.log_softmax(x, d)
    out["softmax_large"] = torch.softmax(x * 60, -1)
    out["log_softmax_large"] = torch.log_softmax(x * 60, 0)
    out["softmax_masked"] = torch.softmax(x.masked_fill(x < -0.5, float("-inf")), -1)
    out["softmax_of_t"] = torch.softmax(x.transpose(0, -1), -1)
    return out


SOFTMAX_CASES = [((4, 6, 10), "contig", F32), ((1, 1, 1), "contig", F32),
                 ((3, 1, 7), "contig", F32), ((8, 40, 50), "contig", F32),
                 ((4, 6, 10), "t", F32), ((7, 13), "step", F32), ((5, 9), "contig", F64),
                 ((2, 3, 4, 5), "perm", F32)]


def test_softmax_every_dim(check):
    """`softmaxes` at each case of SOFTMAX_CASES, in one program."""
    check_cases(check, softmaxes, "softmax", SOFTMAX_CASES)


def test_softmax_fully_masked_row(check):
    x = rand((4, 5), F32, gen("masked-row"))
    x[2] = float("-inf")  # torch gives NaN for a row that is all -inf
    check(Fn(lambda x: {"softmax": x.softmax(-1), "log_softmax": x.log_softmax(-1)}), (x,))


# -- dynamic shapes ---------------------------------------------------------------------------
def test_dynamic_reductions(check):
    n = dim("n", 1, 4096)
    fn = Fn(lambda x: {
        "sum0": x.sum(0), "mean0": x.mean(0), "mean_all": x.mean(), "sum1_keep": x.sum(1, True),
        "var0": x.var(0), "std0_c0": x.std(0, correction=0), "amax0": x.amax(0),
        "argmax0": x.argmax(0), "argmin1": x.argmin(1), "softmax0": x.softmax(0),
        "log_softmax1": x.log_softmax(1), "any0": (x > 2).any(0), "prod1": (1 + 0.1 * x).prod(1),
        "t_sum": x.t().sum(1)})
    xs = [rand((k, 6), F32, gen("dyn-red", k)) for k in (5, 1, 123, 4096)]
    check(fn, (xs[0],), more=[(x,) for x in xs[1:]], dynamic_shapes=({0: n},))
