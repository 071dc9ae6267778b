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


@pytest.mark.parametrize("e", [32, 80, 128])
def test_bool_mask_shapes_and_empty_rows(e, tmp_path):
    model = Sdpa("bool")
    g = torch.Generator().manual_seed(e)
    lq, s = Dim("L", min=1, max=600), Dim("S", min=1, max=600)
    args = (*_qkv(g, 2, 3, 9, 7, e, torch.float32), _mask(g, (2, 1, 9, 7), (2,)))
    c, runner = _compile(model, args, tmp_path, f"bool{e}",
                         dynamic_shapes=({2: lq}, {2: s}, {2: s}, {2: lq, 3: s}))
    assert len(_attention_steps(c)) == 1
    for seed, (lq_, s_) in enumerate([(9, 7), (1, 1), (5, 1), (67, 130), (131, 65),
                                      (197, 197)]):
        b = 2
        g = torch.Generator().manual_seed(100 * e + seed)
        empty = tuple(r for r in (0, lq_ // 2, lq_ - 1) if r < lq_)
        a = (*_qkv(g, b, 3, lq_, s_, e, torch.float32), _mask(g, (b, 1, lq_, s_), empty))
        got = runner(*a)
        _check(got, model, a, torch.float32)
        assert torch.equal(got[:, :, list(empty)], torch.zeros_like(got[:, :, list(empty)]))


@pytest.mark.parametrize("causal", [False, True])
def test_float_mask_and_causal(causal, tmp_path):
    model = Sdpa("float", causal=causal, scale=0.3 if causal else None)
    g = torch.Generator().manual_seed(1)
    lq, s = Dim("L", min=1, max=600), Dim("S", min=1, max=600)
    args = (*_qkv(g, 2, 2, 11, 13, 64, torch.float32), _mask(g, (11, 13), (3,)))
    c, runner = _compile(model, args, tmp_path, f"float{causal}",
                         dynamic_shapes=({2: lq}, {2: s}, {2: s}, {0: lq, 1: s}))
    assert len(_attention_steps(c)) == 1
    for seed, (lq_, s_) in enumerate([(11, 13), (1, 1), (2, 300), (4, 4), (64, 64),
                                      (130, 70), (70, 130), (512, 512)]):
        g = torch.Generator().manual_seed(10 + seed)
        empty = (lq_ // 3,) if lq_ > 1 else ()
        a = (*_qkv(g, 2, 2, lq_, s_, 64, torch.float32), _mask(g, (lq_, s_), empty))
        _check(runner(*a), model, a, torch.float32)


@pytest.mark.parametrize("e", [64, 80])
def test_causal_without_mask(e, tmp_path):
    model = Sdpa(causal=True)
    g = torch.Generator().manual_seed(2)
    lq, s = Dim("L", min=1, max=600), Dim("S", min=1, max=600)
    args = _qkv(g, 1, 4, 20, 20, e, torch.float32)
    c, runner = _compile(model, args, tmp_path, f"causal{e}",
                         dynamic_shapes=({2: lq}, {2: s}, {2: s}))
    assert [dict(s.attrs)["causal"] for s in _attention_steps(c)] == [True]
    for seed, (lq_, s_) in enumerate([(20, 20), (1, 9), (9, 1), (49, 49), (128, 128),
                                      (197, 197), (100, 300), (300, 100)]):
        a = _qkv(torch.Generator().manual_seed(20 + seed), 1, 4, lq_, s_, e, torch.float32)
        _check(runner(*a), model, a, torch.float32)


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


@pytest.mark.parametrize("causal", [False, True])
def test_qkv_projection_split_into_heads(causal, tmp_path):
    torch.manual_seed(5)
    model = FusedQkv(4 * 80, 4, causal).eval()
    x = torch.randn(2, 19, 4 * 80)
    c, runner = _compile(model, (x,), tmp_path, f"qkv{causal}",
                         dynamic_shapes=({1: Dim("T", min=2, max=600)},))
    assert len(_attention_steps(c)) == 1
    with torch.no_grad():
        for t in (19, 2, 128, 197):
            xi = torch.randn(2, t, 4 * 80)
            got = runner(xi)
            want64 = copy.deepcopy(model).double()(xi.double())
            torch.testing.assert_close(got.double(), want64, rtol=2e-5, atol=2e-5)


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


@pytest.mark.parametrize("e", [64, 40])
def test_decode_rows_without_mask(e, tmp_path):
    """Up to 4 query rows, no mask (the row path's unmasked branch: scores 4 keys at a time
    summed by a shuffle tree where E is a multiple of the vector, the row's maximum without
    the mask pass): S below, at and past a vector / a key block, odd S; a NaN query row stays
    NaN and leaves the others alone."""
    model = Sdpa()
    g = torch.Generator().manual_seed(30 + e)
    lq, s = Dim("L", min=1, max=600), Dim("S", min=1, max=600)
    args = _qkv(g, 2, 3, 2, 9, e, torch.float32)
    c, runner = _compile(model, args, tmp_path, f"decode{e}",
                         dynamic_shapes=({2: lq}, {2: s}, {2: s}))
    assert len(_attention_steps(c)) == 1
    for seed, (lq_, s_) in enumerate([(1, 1), (1, 3), (1, 16), (1, 37), (2, 64), (3, 130),
                                      (4, 513), (1, 128)]):
        a = _qkv(torch.Generator().manual_seed(40 + seed), 2, 3, lq_, s_, e, torch.float32)
        _check(runner(*a), model, a, torch.float32)
    q, k, v = _qkv(torch.Generator().manual_seed(50), 2, 3, 1, 70, e, torch.float32)
    q[1, 2, 0, 5] = float("nan")
    got, want = runner(q, k, v), model(q, k, v)
    assert torch.isnan(got[1, 2]).all() and not torch.isnan(got[0]).any()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=2e-5, atol=2e-5)


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
@pytest.mark.parametrize("e", [64, 72])
def test_bfloat16_keys_and_values_read_in_place(march, e, tmp_path):
    """A bf16 KV cache: kiln_attention.h reads bf16 k / v as stored (no float32 copy), for the
    decode row path (L <= 4, a bool mask whose dropped keys are skipped: no dot product, no
    value row read, so a NaN value there changes nothing; grouped queries) and the packed path
    (L > 4); head size 72 is no multiple of the vector width."""
    model = Sdpa("bool", gqa=True)
    g = torch.Generator().manual_seed(8)
    lq, s = Dim("L", min=1, max=600), Dim("S", min=1, max=600)
    args = (*_qkv(g, 1, 8, 3, 9, e, torch.bfloat16, hk=2), _mask(g, (1, 1, 3, 9), (1,)))
    c = kiln.compile(model, args, dynamic_shapes=({2: lq}, {2: s}, {2: s}, {2: lq, 3: s}),
                     options=kiln.Options(march=march))
    runner = kiln.load(c.save(tmp_path / f"bf16kv_{march}_{e}.kiln"))
    assert [dict(x.attrs).get("group") for x in _attention_steps(c)] == [4]
    assert _kv_types(c) == ["kr::bfloat16", "kr::bfloat16"]
    for seed, (lq_, s_) in enumerate([(1, 1), (1, 130), (2, 7), (4, 67), (5, 33), (40, 100)]):
        g = torch.Generator().manual_seed(80 + seed)
        a = (*_qkv(g, 1, 8, lq_, s_, e, torch.bfloat16, hk=2),
             _mask(g, (1, 1, lq_, s_), (0,) if lq_ > 1 else ()))
        a[3][..., : s_ // 2] &= torch.rand(s_ // 2, generator=g) > 0.8  # runs of dropped keys
        got = runner(*a)
        assert got.dtype == torch.bfloat16
        _check(got, model, a, torch.bfloat16)
        dropped = (~a[3][0, 0]).all(0).nonzero()
        if lq_ <= 4 and len(dropped):  # the row path reads no value row of a dropped key
            v = a[2].clone()
            v[:, :, dropped[0, 0]] = float("nan")
            torch.testing.assert_close(runner(a[0], a[1], v, a[3]), got, rtol=0, atol=0)
