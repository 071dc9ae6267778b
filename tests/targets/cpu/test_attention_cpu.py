"""The CPU target's fused attention (kiln_attention.h, the `attention` Extern) against eager
scaled_dot_product_attention in float64: shapes with L != S, S = 1, odd sizes, head sizes 32 /
64 / 80 / 128; bool masks with fully masked rows (zeros, as eager), float masks (with -inf),
causal (top-left aligned, also with L != S); grouped-query attention (enable_gqa and the
repeat_kv pattern passes/gqa_attention.py folds); q / k / v split out of a QKV projection, and
read in place as transposed slices of one packed tensor (values with a strided last dim); up to
4 query rows (the unpacked row path) and more; bfloat16 (computed in float32). Each package
takes several shapes through dynamic dims, and each test checks that the fused step ran."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir import loop as L

Dim = torch.export.Dim
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _attention_steps(compiled) -> list:
    return [s for s in L.flat_steps(compiled.built.steps)
            if isinstance(s, L.Extern) and s.routine == "attention"]


def _compile(model, args, tmp_path, name, dynamic_shapes=None, fused=True):
    c = kiln.compile(model, args, dynamic_shapes=dynamic_shapes,
                     options=kiln.Options(fused_attention=fused))
    return c, kiln.load(c.save(tmp_path / f"{name}.kiln"))


def _check(got, model, args, dt):
    want = model(*args)
    want64 = model(*(a.double() if a.is_floating_point() else a for a in args))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all() == torch.isfinite(want).all()
    tol = TOL[dt]
    torch.testing.assert_close(got.double(), want64, rtol=tol, atol=tol, equal_nan=True)


class Sdpa(torch.nn.Module):
    def __init__(self, mask: str = "none", causal: bool = False, gqa: bool = False,
                 scale: float | None = None) -> None:
        super().__init__()
        self.mask, self.causal, self.gqa, self.scale = mask, causal, gqa, scale

    def forward(self, q, k, v, m=None):
        if self.mask == "float":  # bool -> 0 / -inf plus a finite bias
            m = torch.where(m, torch.cos(torch.arange(m.shape[-1], dtype=q.dtype)),
                            float("-inf"))
        extra = {"enable_gqa": True} if self.gqa else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=self.causal,
                                              scale=self.scale, **extra)


def _qkv(g, b, h, lq, s, e, dt, hk=None, ev=None):
    hk = h if hk is None else hk
    q = torch.randn(b, h, lq, e, generator=g)
    k = torch.randn(b, hk, s, e, generator=g)
    v = torch.randn(b, hk, s, e if ev is None else ev, generator=g)
    return q.to(dt), k.to(dt), v.to(dt)


def _mask(g, shape, empty_rows=()):
    m = torch.rand(*shape, generator=g) > 0.3
    for r in empty_rows:
        m[..., r, :] = False
    return m


class Each(torch.nn.Module):
    """Several attention programs in one package (one C++ compile and link): case k is
    `models[k]` on its own `arity` inputs, in order; the outputs are a tuple, one per case.
    Each case keeps its own inputs, dynamic dims and attention call."""

    def __init__(self, models: list, arity: int) -> None:
        super().__init__()
        self.models, self.arity = torch.nn.ModuleList(models), arity

    def forward(self, *args):
        n = self.arity
        return tuple(m(*args[k * n:(k + 1) * n]) for k, m in enumerate(self.models))


def _compile_each(models, per_case, tmp_path, name, dyn):
    """`per_case`: each case's example inputs; `dyn(k)`: case k's dynamic shapes (its own
    Dims)."""
    model = Each(models, len(per_case[0]))
    flat = tuple(t for a in per_case for t in a)
    shapes = (tuple(d for k in range(len(per_case)) for d in dyn(k)),)
    return _compile(model, flat, tmp_path, name, dynamic_shapes=shapes)


def _run_each(runner, models, per_case, dt, names):
    """Runs the package on every case's inputs at once; checks each case's output against
    its own model (a failure names the case); the outputs."""
    outs = runner(*(t for a in per_case for t in a))
    for got, model, a, name in zip(outs, models, per_case, names):
        try:
            _check(got, model, a, dt)
        except AssertionError as err:
            shapes = [tuple(t.shape) for t in a]
            raise AssertionError(f"case {name} at {shapes}: {err}") from err
    return outs


def _dims(k, *names):
    return [Dim(f"{n}{k}", min=1, max=600) for n in names]


BOOL_E = (32, 80, 128)


def test_bool_mask_shapes_and_empty_rows(tmp_path):
    """Head sizes 32, 80 and 128: one package, one attention call each (its own inputs and
    dynamic L / S, drawn as a package of its own drew them)."""
    models = [Sdpa("bool") for _ in BOOL_E]
    per_case = []
    for e in BOOL_E:
        g = torch.Generator().manual_seed(e)
        per_case.append((*_qkv(g, 2, 3, 9, 7, e, torch.float32), _mask(g, (2, 1, 9, 7), (2,))))

    def dyn(k):
        lq, s = _dims(k, "L", "S")
        return ({2: lq}, {2: s}, {2: s}, {2: lq, 3: s})

    c, runner = _compile_each(models, per_case, tmp_path, "bool", dyn)
    assert len(_attention_steps(c)) == len(BOOL_E)
    for seed, (lq_, s_) in enumerate([(9, 7), (1, 1), (5, 1), (67, 130), (131, 65),
                                      (197, 197)]):
        b = 2
        empty = tuple(r for r in (0, lq_ // 2, lq_ - 1) if r < lq_)
        per_case = []
        for e in BOOL_E:
            g = torch.Generator().manual_seed(100 * e + seed)
            per_case.append((*_qkv(g, b, 3, lq_, s_, e, torch.float32),
                             _mask(g, (b, 1, lq_, s_), empty)))
        outs = _run_each(runner, models, per_case, torch.float32, BOOL_E)
        for e, got in zip(BOOL_E, outs):
            assert torch.equal(got[:, :, list(empty)],
                               torch.zeros_like(got[:, :, list(empty)])), (e, lq_, s_)


def test_float_mask_and_causal(tmp_path):
    """A float mask without and with causal (scale 0.3): two attention calls of one
    package, each its own inputs (the same draws as a package of its own) and L / S."""
    causals = (False, True)
    models = [Sdpa("float", causal=c, scale=0.3 if c else None) for c in causals]
    per_case = []
    for _ in causals:
        g = torch.Generator().manual_seed(1)
        per_case.append((*_qkv(g, 2, 2, 11, 13, 64, torch.float32), _mask(g, (11, 13), (3,))))

    def dyn(k):
        lq, s = _dims(k, "L", "S")
        return ({2: lq}, {2: s}, {2: s}, {0: lq, 1: s})

    c, runner = _compile_each(models, per_case, tmp_path, "float", dyn)
    assert len(_attention_steps(c)) == len(causals)
    for seed, (lq_, s_) in enumerate([(11, 13), (1, 1), (2, 300), (4, 4), (64, 64),
                                      (130, 70), (70, 130), (512, 512)]):
        empty = (lq_ // 3,) if lq_ > 1 else ()
        per_case = []
        for _ in causals:
            g = torch.Generator().manual_seed(10 + seed)
            per_case.append((*_qkv(g, 2, 2, lq_, s_, 64, torch.float32),
                             _mask(g, (lq_, s_), empty)))
        _run_each(runner, models, per_case, torch.float32, [f"causal={c}" for c in causals])


CAUSAL_E = (64, 80)


def test_causal_without_mask(tmp_path):
    """Head sizes 64 and 80: two attention calls of one package (each its own inputs, drawn
    as a package of its own drew them, and L / S)."""
    models = [Sdpa(causal=True) for _ in CAUSAL_E]
    per_case = [_qkv(torch.Generator().manual_seed(2), 1, 4, 20, 20, e, torch.float32)
                for e in CAUSAL_E]

    def dyn(k):
        lq, s = _dims(k, "L", "S")
        return ({2: lq}, {2: s}, {2: s})

    c, runner = _compile_each(models, per_case, tmp_path, "causal", dyn)
    assert [dict(s.attrs)["causal"] for s in _attention_steps(c)] == [True] * len(CAUSAL_E)
    for seed, (lq_, s_) in enumerate([(20, 20), (1, 9), (9, 1), (49, 49), (128, 128),
                                      (197, 197), (100, 300), (300, 100)]):
        per_case = [_qkv(torch.Generator().manual_seed(20 + seed), 1, 4, lq_, s_, e,
                         torch.float32) for e in CAUSAL_E]
        _run_each(runner, models, per_case, torch.float32, CAUSAL_E)


def test_gqa_enable_gqa(tmp_path):
    model = Sdpa("bool", gqa=True)
    g = torch.Generator().manual_seed(3)
    lq, s = Dim("L", min=1, max=600), Dim("S", min=1, max=600)
    args = (*_qkv(g, 2, 6, 7, 9, 64, torch.float32, hk=2), _mask(g, (2, 1, 7, 9), (1,)))
    c, runner = _compile(model, args, tmp_path, "gqa",
                         dynamic_shapes=({2: lq}, {2: s}, {2: s}, {2: lq, 3: s}))
    assert [dict(s.attrs).get("group") for s in _attention_steps(c)] == [3]
    for seed, (lq_, s_) in enumerate([(7, 9), (1, 33), (3, 300), (4, 65), (5, 65),
                                      (65, 129)]):
        g = torch.Generator().manual_seed(30 + seed)
        a = (*_qkv(g, 2, 6, lq_, s_, 64, torch.float32, hk=2), _mask(g, (2, 1, lq_, s_), (0,)))
        _check(runner(*a), model, a, torch.float32)


class RepeatKv(torch.nn.Module):
    """Hugging Face's grouped-query attention: kv heads repeated before the call."""

    def forward(self, q, k, v, m):
        b, hk, s, e = k.shape
        g = q.shape[1] // hk
        k = k[:, :, None].expand(b, hk, g, s, e).reshape(b, hk * g, s, e)
        v = v[:, :, None].expand(b, hk, g, s, e).reshape(b, hk * g, s, e)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def test_gqa_repeat_kv_folded(tmp_path):
    model = RepeatKv()
    g = torch.Generator().manual_seed(4)
    a = (*_qkv(g, 1, 8, 33, 40, 32, torch.float32, hk=2), _mask(g, (1, 1, 33, 40), (5,)))
    c, runner = _compile(model, a, tmp_path, "repeat_kv")
    assert [dict(s.attrs).get("group") for s in _attention_steps(c)] == [4]
    _check(runner(*a), model, a, torch.float32)


class FusedQkv(torch.nn.Module):
    """q, k, v as transposed slices of one projection (strided views read in place)."""

    def __init__(self, d: int, h: int, causal: bool) -> None:
        super().__init__()
        self.h, self.causal = h, causal
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.h, d // self.h).transpose(1, 2) for y in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def test_qkv_projection_split_into_heads(tmp_path):
    """Not causal and causal: two models of one package, each with the weights and inputs a
    package of its own had (torch.manual_seed(5), the model, the example, the runs)."""
    causals, ts = (False, True), (19, 2, 128, 197)
    models, example, runs = [], [], []
    for causal in causals:
        torch.manual_seed(5)
        models.append(FusedQkv(4 * 80, 4, causal).eval())
        example.append((torch.randn(2, 19, 4 * 80),))
        runs.append([torch.randn(2, t, 4 * 80) for t in ts])
    c, runner = _compile_each(models, example, tmp_path, "qkv",
                              lambda k: ({1: Dim(f"T{k}", min=2, max=600)},))
    assert len(_attention_steps(c)) == len(causals)
    with torch.no_grad():
        for j, t in enumerate(ts):
            outs = runner(*(r[j] for r in runs))
            for causal, model, got, r in zip(causals, models, outs, runs):
                want64 = copy.deepcopy(model).double()(r[j].double())
                torch.testing.assert_close(got.double(), want64, rtol=2e-5, atol=2e-5,
                                           msg=lambda m, c=causal: f"causal={c}, T {t}: {m}")


class StridedOperands(torch.nn.Module):
    """q, k, v read in place with non-trivial strides: heads transposed out of one packed
    [B, L, 3, H, E] tensor (offsets 0, H E, 2 H E), values from a [B, H, E, S] layout (the
    last dim strided)."""

    def forward(self, qkv, vt):
        q, k, _ = qkv.unbind(2)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              vt.transpose(2, 3), is_causal=True)


def test_strided_operands_read_in_place(tmp_path):
    model = StridedOperands()
    g = torch.Generator().manual_seed(8)
    args = (torch.randn(2, 19, 3, 4, 80, generator=g), torch.randn(2, 4, 80, 19, generator=g))
    t = Dim("T", min=1, max=600)
    c, runner = _compile(model, args, tmp_path, "strided",
                         dynamic_shapes=({1: t}, {3: t}))
    (step,) = _attention_steps(c)
    q, k, v = step.args[:3]
    assert q.buf == k.buf == "qkv" and k.offset == 4 * 80 and v.buf == "vt"
    assert tuple(q.strides)[1:] == (80, 3 * 4 * 80, 1) and v.strides[2] == 1
    for seed, n in enumerate((19, 1, 3, 130)):  # 1 and 3 rows: the unpacked row path
        g = torch.Generator().manual_seed(80 + seed)
        a = (torch.randn(2, n, 3, 4, 80, generator=g), torch.randn(2, 4, 80, n, generator=g))
        _check(runner(*a), model, a, torch.float32)


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_bfloat16(mask, tmp_path):
    model = Sdpa(mask, causal=mask == "float")
    g = torch.Generator().manual_seed(6)
    lq, s = Dim("L", min=1, max=600), Dim("S", min=1, max=600)
    args = (*_qkv(g, 2, 2, 9, 9, 64, torch.bfloat16), _mask(g, (2, 1, 9, 9), (4,)))
    c, runner = _compile(model, args, tmp_path, f"bf16{mask}",
                         dynamic_shapes=({2: lq}, {2: s}, {2: s}, {2: lq, 3: s}))
    assert len(_attention_steps(c)) == 1
    for seed, (lq_, s_) in enumerate([(9, 9), (1, 5), (70, 129)]):
        g = torch.Generator().manual_seed(60 + seed)
        a = (*_qkv(g, 2, 2, lq_, s_, 64, torch.bfloat16), _mask(g, (2, 1, lq_, s_), (0,)))
        got = runner(*a)
        assert got.dtype == torch.bfloat16
        _check(got, model, a, torch.bfloat16)


def test_nan_scores_stay_nan_and_decomposed_path_agrees(tmp_path):
    model = Sdpa("bool")
    g = torch.Generator().manual_seed(7)
    a = (*_qkv(g, 1, 2, 70, 80, 32, torch.float32), _mask(g, (70, 80), (3,)))
    fused, rf = _compile(model, a, tmp_path, "nan_fused")
    decomposed, rd = _compile(model, a, tmp_path, "nan_dec", fused=False)
    assert len(_attention_steps(fused)) == 1 and not _attention_steps(decomposed)
    q = a[0].clone()
    q[0, 1, 2, 3] = float("nan")
    a = (q, *a[1:])
    got, other, want = rf(*a), rd(*a), model(*a)
    assert torch.isnan(want[0, 1, 2]).all()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isnan(other), torch.isnan(want))
    torch.testing.assert_close(got, want, equal_nan=True, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got, other, equal_nan=True, rtol=2e-5, atol=2e-5)
    assert torch.equal(got[:, :, 3], torch.zeros_like(got[:, :, 3]))


DECODE_E = (64, 40)


def test_decode_rows_without_mask(tmp_path):
    """Up to 4 query rows, no mask (the row path's unmasked branch: scores 4 keys at a time
    summed by a shuffle tree where E is a multiple of the vector, the row's maximum without
    the mask pass): S below, at and past a vector / a key block, odd S; a NaN query row stays
    NaN and leaves the others alone. Head sizes 64 and 40 are two attention calls of one
    package (each its own inputs, drawn as a package of its own drew them, and L / S)."""
    models = [Sdpa() for _ in DECODE_E]
    per_case = [_qkv(torch.Generator().manual_seed(30 + e), 2, 3, 2, 9, e, torch.float32)
                for e in DECODE_E]

    def dyn(k):
        lq, s = _dims(k, "L", "S")
        return ({2: lq}, {2: s}, {2: s})

    c, runner = _compile_each(models, per_case, tmp_path, "decode", dyn)
    assert len(_attention_steps(c)) == len(DECODE_E)
    for seed, (lq_, s_) in enumerate([(1, 1), (1, 3), (1, 16), (1, 37), (2, 64), (3, 130),
                                      (4, 513), (1, 128)]):
        per_case = [_qkv(torch.Generator().manual_seed(40 + seed), 2, 3, lq_, s_, e,
                         torch.float32) for e in DECODE_E]
        _run_each(runner, models, per_case, torch.float32, DECODE_E)
    per_case = []
    for e in DECODE_E:
        q, k, v = _qkv(torch.Generator().manual_seed(50), 2, 3, 1, 70, e, torch.float32)
        q[1, 2, 0, 5] = float("nan")
        per_case.append((q, k, v))
    outs = runner(*(t for a in per_case for t in a))
    for e, model, got, a in zip(DECODE_E, models, outs, per_case):
        want = model(*a)
        assert torch.isnan(got[1, 2]).all() and not torch.isnan(got[0]).any(), e
        torch.testing.assert_close(got, want, equal_nan=True, rtol=2e-5, atol=2e-5,
                                   msg=lambda m, e=e: f"head size {e}: {m}")


def _kv_types(compiled) -> list[str]:
    """The C++ element types of the k and v buffers each attention call reads."""
    src = compiled.sources["model.cpp"]
    out = []
    for line in src.splitlines():
        if "kl::attention(" in line:
            bufs = [a.split("+")[0].strip() for a in line.split("kl::view(")[1:]]
            for b in bufs[1:3]:
                decl = next(x for x in src.splitlines() if f"* {b} =" in x)
                out.append(decl.split("*")[0].split()[-1])
    return out


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_bfloat16_keys_and_values_read_in_place(march, tmp_path):
    """A bf16 KV cache: kiln_attention.h reads bf16 k / v as stored (no float32 copy), for the
    decode row path (L <= 4, a bool mask whose dropped keys are skipped: no dot product, no
    value row read, so a NaN value there changes nothing; grouped queries) and the packed path
    (L > 4); head size 72 is no multiple of the vector width. Head sizes 64 and 72 are two
    attention calls of one package (each its own inputs and dynamic L / S, drawn as a package
    of its own drew them); a failure names the head size."""
    sizes = (64, 72)
    one = Sdpa("bool", gqa=True)
    model = Each([Sdpa("bool", gqa=True) for _ in sizes], 4)
    args, dyn = (), ()
    for e in sizes:
        g = torch.Generator().manual_seed(8)
        args += (*_qkv(g, 1, 8, 3, 9, e, torch.bfloat16, hk=2), _mask(g, (1, 1, 3, 9), (1,)))
        lq, s = Dim(f"L{e}", min=1, max=600), Dim(f"S{e}", min=1, max=600)
        dyn += ({2: lq}, {2: s}, {2: s}, {2: lq, 3: s})
    c = kiln.compile(model, args, dynamic_shapes=(dyn,), options=kiln.Options(march=march))
    runner = kiln.load(c.save(tmp_path / f"bf16kv_{march}.kiln"))
    assert [dict(x.attrs).get("group") for x in _attention_steps(c)] == [4] * len(sizes)
    assert _kv_types(c) == ["kr::bfloat16", "kr::bfloat16"] * len(sizes)
    for seed, (lq_, s_) in enumerate([(1, 1), (1, 130), (2, 7), (4, 67), (5, 33), (40, 100)]):
        per_e = []
        for e in sizes:
            g = torch.Generator().manual_seed(80 + seed)
            a = (*_qkv(g, 1, 8, lq_, s_, e, torch.bfloat16, hk=2),
                 _mask(g, (1, 1, lq_, s_), (0,) if lq_ > 1 else ()))
            a[3][..., : s_ // 2] &= torch.rand(s_ // 2, generator=g) > 0.8  # runs of dropped keys
            per_e.append(a)
        flat = tuple(t for a in per_e for t in a)
        outs = runner(*flat)
        for i, (e, a) in enumerate(zip(sizes, per_e)):
            got = outs[i]
            assert got.dtype == torch.bfloat16, e
            try:
                _check(got, one, a, torch.bfloat16)
            except AssertionError as err:
                raise AssertionError(f"head size {e}, L {lq_}, S {s_}: {err}") from err
            dropped = (~a[3][0, 0]).all(0).nonzero()
            if lq_ <= 4 and len(dropped):  # the row path reads no value row of a dropped key
                v = a[2].clone()
                v[:, :, dropped[0, 0]] = float("nan")
                nan_args = list(flat)
                nan_args[4 * i + 2] = v  # case i's value input
                torch.testing.assert_close(runner(*nan_args)[i], got, rtol=0, atol=0,
                                           msg=lambda m, e=e: f"head size {e}: {m}")


@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])
def test_key_blocks_at_each_vector_width(march, tmp_path):
    """The packed path's key blocks (BN keys) and lane reductions (sum and maximum by shuffle
    trees) at W = 16, 8 and 4: keys over several blocks with a partial last one, a float mask
    with -inf (a fully masked row gives zeros), causal with L != S, and a NaN query value (its
    row NaN, the others exact)."""
    g = torch.Generator().manual_seed(17)
    models = [Sdpa("float"), Sdpa(causal=True), Sdpa()]
    per_case = [(*_qkv(g, 1, 2, 37, 300, 64, torch.float32), _mask(g, (37, 300), (5,))),
                (*_qkv(g, 2, 3, 70, 90, 48, torch.float32), torch.zeros(1)),
                (*_qkv(g, 1, 3, 45, 259, 32, torch.float32), torch.zeros(1))]
    per_case[2][0][0, 1, 4, 7] = float("nan")
    model = Each([_Drop(m) if k else m for k, m in enumerate(models)], 4)
    c = kiln.compile(model, tuple(t for a in per_case for t in a),
                     options=kiln.Options(march=march))
    runner = kiln.load(c.save(tmp_path / f"blocks_{march}.kiln"))
    assert len(_attention_steps(c)) == 3
    outs = runner(*(t for a in per_case for t in a))
    for k, (got, m, a) in enumerate(zip(outs, models, per_case)):
        _check(got, m, a if k == 0 else a[:3], torch.float32)
    assert torch.isnan(outs[2][0, 1, 4]).all() and not torch.isnan(outs[2][0, 0]).any()
    assert torch.equal(outs[0][:, :, 5], torch.zeros_like(outs[0][:, :, 5]))


class _Drop(torch.nn.Module):
    """`inner` on the first three inputs (the fourth is a placeholder)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, q, k, v, _unused):
        return self.inner(q, k, v)


def _ramped(g, b, h, lq, s, e, slope):
    """q, k, v whose scores q . k_j grow (slope > 0) or fall (slope < 0) along the keys by
    about `slope` a key, plus noise: the row maximum moves into every key block, or stays in
    the first."""
    q, k, v = _qkv(g, b, h, lq, s, e, torch.float32)
    u = torch.zeros(e)
    u[0] = 1.0
    q = q * 0.1 + u * 4.0
    k = k * 0.1 + u * (slope / 4.0) * torch.arange(s, dtype=torch.float32)[:, None]
    return q, k, v


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_partial_blocks_running_maximum_and_exp_range(march, tmp_path):
    """The packed path's partial last key block (only the vectors holding its keys are
    computed: 1, 2 or 3 vectors past the full passes, and fewer keys than one vector), the
    online softmax's rescaling (scores that grow along the keys move the maximum into every
    block; falling ones keep it in the first; the row sums stay vectors to the end) and exp
    over its range (scale 6: scores down to about -700, underflowing to 0, beside -inf and a
    float mask), each against eager in float64 over several lengths."""
    models = [Sdpa(), Sdpa(), Sdpa("float"), Sdpa(causal=True, scale=6.0)]

    def draw(seed, lq, s):
        g = torch.Generator().manual_seed(seed)
        return [(*_ramped(g, 1, 2, lq, s, 64, 0.05), torch.zeros(1)),
                (*_ramped(g, 2, 1, lq, s, 48, -0.05), torch.zeros(1)),
                (*_qkv(g, 1, 3, lq, s, 32, torch.float32), _mask(g, (lq, s), (2,))),
                (*_qkv(g, 1, 2, lq, s, 40, torch.float32), torch.zeros(1))]

    per_case = draw(40, 37, 148)

    def dyn(k):
        lq, s = _dims(k, "L", "S")
        return ({2: lq}, {2: s}, {2: s}, {0: lq, 1: s} if k == 2 else {})

    model = Each([m if k == 2 else _Drop(m) for k, m in enumerate(models)], 4)
    flat = tuple(t for a in per_case for t in a)
    shapes = (tuple(d for k in range(len(per_case)) for d in dyn(k)),)
    c = kiln.compile(model, flat, dynamic_shapes=shapes, options=kiln.Options(march=march))
    runner = kiln.load(c.save(tmp_path / f"partial_{march}.kiln"))
    assert len(_attention_steps(c)) == len(models)
    # S past whole blocks of 128 by 20 (2 vectors of 16), 69 (4 + 1), 44 (3), 3 (fewer than a
    # vector); S under a vector, and long rows of several blocks
    for seed, (lq, s) in enumerate([(37, 148), (50, 197), (9, 300), (12, 131), (7, 5),
                                    (130, 515), (197, 197)]):
        per_case = draw(41 + seed, lq, s)
        outs = runner(*(t for a in per_case for t in a))
        for k, (got, m, a) in enumerate(zip(outs, models, per_case)):
            try:
                _check(got, m, a if k == 2 else a[:3], torch.float32)
            except AssertionError as err:
                raise AssertionError(f"case {k} at L {lq}, S {s}: {err}") from err
        assert torch.equal(outs[2][:, :, 2], torch.zeros_like(outs[2][:, :, 2]))


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_probabilities_exact_scores(march, tmp_path):
    """Keys and values the identity and scale 1: every score is a query value exactly and the
    output row is softmax(q) itself, so the kernel's exp is checked to float32 accuracy
    (rtol 2e-6: a few ulp of exp plus the row sum's rounding), not behind the products'
    rounding. Queries of spread 30 and one of -1e4 reach the exp's underflow to 0; S 64 and
    200 (a partial block)."""
    model = Sdpa(scale=1.0)
    for s in (64, 200):
        g = torch.Generator().manual_seed(60 + s)
        # multiples of 1/64: score - maximum is exact in float32 (else its rounding, up to
        # |x| 2^-24, would be the error measured)
        q = torch.round(torch.randn(1, 2, 9, s, generator=g) * 30.0 * 64) / 64
        q[0, 0, 3, 5] = -1e4
        eye = torch.eye(s)[None, None].expand(1, 2, s, s).contiguous()
        args = (q, eye, eye)
        c = kiln.compile(model, args, options=kiln.Options(march=march))
        got = kiln.load(c.save(tmp_path / f"exact_{march}_{s}.kiln"))(*args)
        assert len(_attention_steps(c)) == 1
        want = torch.softmax(q.double(), dim=-1)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-30)


class _ConstMask(torch.nn.Module):
    """Attention under a mask computed from no input: `keep` all keys (Hugging Face's
    `arange(S) + 0 >= 0` for an encoder without a padding mask, or a float mask of zeros), or
    only the first 5 (`first5`); `input` derives it from an input instead."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v):
        lq, s = q.shape[2], k.shape[2]
        if self.kind == "keep":
            m = (torch.arange(s) + 0 >= 0)[None, None, None, :].expand(1, 1, lq, s)
        elif self.kind == "zeros":
            m = torch.zeros(lq, s, dtype=q.dtype)
        elif self.kind == "first5":
            m = (torch.arange(s) < 5)[None, None, None, :].expand(1, 1, lq, s)
        else:
            m = (k[:, :, :, 0] > -1.0)[:, :, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


@pytest.mark.parametrize("fused", [True, False])
def test_constant_masks_keeping_every_key_are_dropped(fused, tmp_path):
    """A mask computed from no input that keeps every key (bool all true, float all zeros) is
    dropped at import (frontend/aten_high.py _noop_mask): the fused step runs unmasked; a
    constant mask that drops keys, and a mask read from an input, stay. Each against eager in
    float64 at two lengths (L != S), fused and decomposed."""
    kinds = ("keep", "zeros", "first5", "input")
    want_mask = {"keep": 0, "zeros": 0, "first5": 1, "input": 1}  # MASK_KINDS: none, bool
    for kind in kinds:
        for lq, s in ((37, 197), (9, 6)):
            g = torch.Generator().manual_seed(90 + s)
            args = _qkv(g, 1, 3, lq, s, 64, torch.float32)
            model = _ConstMask(kind)
            c, runner = _compile(model, args, tmp_path, f"const_{kind}_{fused}_{s}",
                                 fused=fused)
            steps = _attention_steps(c)
            if fused:
                assert [dict(st.attrs)["mask"] for st in steps] == [want_mask[kind]], kind
            else:
                assert not steps
            try:
                _check(runner(*args), model, args, torch.float32)
            except AssertionError as err:
                raise AssertionError(f"{kind} at L {lq}, S {s}: {err}") from err
