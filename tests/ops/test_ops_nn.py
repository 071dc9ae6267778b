"""Differential tests of nn ops: layer_norm, batch_norm (eval), group_norm, linear, matmul
(2D/3D/4D, broadcast batch), bmm, addmm, conv2d, max/avg/adaptive pooling and attention
(F.scaled_dot_product_attention, causal and with explicit masks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from difftest import Cases, Checker, Fn, Layout, case_name, dim, gen, layout_shape, rand

F32, F64 = torch.float32, torch.float64


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("ops_nn"))


def _ids(v) -> str:
    return str(v).replace(" ", "").removeprefix("torch.")


def init(module: nn.Module, key, dtype=F32) -> nn.Module:
    """Random parameters and buffers (batch-norm variances kept positive), in `dtype`."""
    g = gen("init", key)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_floating_point():
                v = rand(t.shape, F64, g)
                t.copy_(v.abs() + 0.5 if name.endswith("running_var") else v)
    return module.to(dtype).eval()


class Dict(nn.Module):
    """Applies every submodule to the (same) input; returns {name: output}."""

    def __init__(self, **mods: nn.Module) -> None:
        super().__init__()
        self.mods = nn.ModuleDict(mods)

    def forward(self, x):
        return {k: m(x) for k, m in self.mods.items()}


# -- normalisation ----------------------------------------------------------------------------
def norms(c: int, w: int) -> nn.Module:
    return Dict(
        ln=nn.LayerNorm(w), ln_plain=nn.LayerNorm(w, elementwise_affine=False),
        ln_no_bias=nn.LayerNorm(w, bias=False), ln_2d=nn.LayerNorm((c, w), eps=1e-3),
        ln_2d_plain=Fn(lambda x: F.layer_norm(x, x.shape[-2:])),
        bn=nn.BatchNorm1d(c), bn_plain=nn.BatchNorm1d(c, affine=False),
        gn=nn.GroupNorm(2, c), gn_plain=nn.GroupNorm(c // 2, c, affine=False),
        gn_one_group=nn.GroupNorm(1, c), ln_relu=nn.Sequential(nn.LayerNorm(w), nn.ReLU()))


# The (shape, layout) cases of both dtypes are one program (difftest.Cases): one package.
NORMS_3D = {F32: [((3, 4, 10), "contig"), ((1, 4, 1), "contig"), ((5, 6, 7), "t"),
                  ((64, 8, 33), "contig"), ((3, 4, 10), "step")],
            F64: [((3, 4, 10), "contig")]}


def test_norms_3d(check):
    """Every (dtype, shape, layout) case of NORMS_3D in one program, each with its own
    weights; outputs named by their case (the dtype first)."""
    cases, args = {}, []
    for dtype, shape, layout in [(d, s, k) for d in (F32, F64) for s, k in NORMS_3D[d]]:
        n, c, w = shape
        args.append(rand(layout_shape(shape, layout), dtype, gen("norms", shape, layout)) * 3 + 1)
        cases[case_name(_ids(dtype), shape, layout)] = (
            Layout(init(norms(c, w), (shape, layout), dtype), layout), 1)
    check(Cases(cases), args)


def test_norms_4d_and_2d(check):
    g = gen("norms4d")
    bn2d = nn.Sequential(nn.BatchNorm2d(6), nn.ReLU())
    mods = Dict(bn2d=bn2d, bn2d_plain=nn.BatchNorm2d(6, affine=False), gn=nn.GroupNorm(3, 6),
                ln_3=nn.LayerNorm((6, 5, 7)), gn_plain=nn.GroupNorm(2, 6, affine=False))
    check(init(mods, "4d"), (rand((2, 6, 5, 7), F32, g) * 2 - 1,))
    flat = Dict(bn1d=nn.BatchNorm1d(9), ln=nn.LayerNorm(9))
    check(init(flat, "2d"), (rand((4, 9), F32, g),))


# -- linear / matmul ---------------------------------------------------------------------------
class Matmuls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.lin_nb = nn.Linear(13, 7), nn.Linear(13, 5, bias=False)

    def forward(self, a, b, c, d):
        # a [5, 13], b [13, 6], c [2, 5, 13], d [2, 3, 13, 6]
        return {
            "linear": self.lin(a), "linear_3d": self.lin(c), "linear_nobias": self.lin_nb(c),
            "linear_t": self.lin(b.t()), "mm": a @ b, "mm_tt": b.t() @ a.t(),
            "mm_strided": a[:, ::2] @ b[::2], "mv": a @ b[:, 0], "vm": b[:, 1] @ b,
            "bmm": torch.bmm(c, c.transpose(1, 2)), "matmul_3d_2d": c @ b,
            "matmul_4d": d.transpose(2, 3) @ d, "matmul_bcast": c.unsqueeze(1) @ d,
            "matmul_bcast_2": d[:1].transpose(2, 3) @ d[:, :1],
            "addmm": torch.addmm(b[0], a, b), "addmm_ab": torch.addmm(b[:5], a, b, beta=0.5,
                                                                      alpha=2.0),
            "linear_relu": torch.relu(self.lin(a)) * 2, "matmul_sum": (a @ b).sum(0),
            "outer_k1": a[:, :1] @ b[:1], "m1_n1": a[:1] @ b[:, :1], "row_vec": a[2:3] @ b,
            "bmm_batch1": torch.bmm(c[:1], c[:1].mT), "matmul_0d": a[0] @ b[:, 0],
        }


def test_matmuls(check):
    """float32 and float64 in one program (each its own module and inputs)."""
    cases, args = {}, []
    for dtype in (F32, F64):
        g = gen("matmul", dtype)
        args += [rand(s, dtype, g) for s in [(5, 13), (13, 6), (2, 5, 13), (2, 3, 13, 6)]]
        cases[_ids(dtype)] = (init(Matmuls(), "mm", dtype), 4)
    check(Cases(cases), args)


def test_matmul_large(check):
    g = gen("matmul-large")
    a, b = rand((130, 97), F32, g), rand((97, 120), F32, g)
    check(Fn(lambda a, b: {"mm": a @ b, "mm_t": (b.t() @ a.t()).relu(), "bmm": torch.bmm(
        a.view(10, 13, 97), b.t().reshape(10, 12, 97).transpose(1, 2))}), (a, b))


# -- convolution -------------------------------------------------------------------------------
def convs(c: int) -> nn.Module:
    return Dict(
        k3=nn.Conv2d(c, 6, 3), k3_s2_p1=nn.Conv2d(c, 6, 3, stride=2, padding=1),
        k3_d2_p2=nn.Conv2d(c, 5, 3, padding=2, dilation=2),
        groups2=nn.Conv2d(c, 6, 3, padding=1, groups=2),
        depthwise=nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False),
        depthwise_x2=nn.Conv2d(c, 2 * c, 3, stride=2, groups=c),
        pw=nn.Conv2d(c, 8, 1), pw_nobias=nn.Conv2d(c, 3, 1, bias=False),
        pw_s2=nn.Conv2d(c, 3, 1, stride=2), rect=nn.Conv2d(c, 3, (1, 3), stride=(2, 1),
                                                          padding=(0, 1)),
        k5_nobias=nn.Conv2d(c, 2, 5, padding=2, bias=False),
        conv_relu=nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 1)))


CONV2D = {F32: [((2, 4, 9, 11), "contig"), ((1, 4, 5, 5), "contig"), ((2, 4, 40, 70), "contig"),
                ((2, 4, 9, 11), "t"), ((1, 4, 8, 7), "neg")],
          F64: [((2, 4, 9, 11), "contig")]}


def test_conv2d(check):
    """Every (dtype, shape, layout) case of CONV2D in one program, each with its own weights."""
    cases, args = {}, []
    for dtype, shape, layout in [(d, s, k) for d in (F32, F64) for s, k in CONV2D[d]]:
        args.append(rand(layout_shape(shape, layout), dtype, gen("conv", shape, layout)))
        cases[case_name(_ids(dtype), shape, layout)] = (
            Layout(init(convs(shape[1]), ("conv", shape, layout), dtype), layout), 1)
    check(Cases(cases), args)


# -- pooling -----------------------------------------------------------------------------------
def pools(x):
    h, w = x.shape[-2:]
    return {
        "max2": F.max_pool2d(x, 2), "max3_s2_p1": F.max_pool2d(x, 3, 2, 1),
        "max3_s2_ceil": F.max_pool2d(x, 3, 2, ceil_mode=True),
        "max3_s2_p1_ceil": F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
        "max_rect_dil": F.max_pool2d(x, (2, 3), (1, 2), (1, 1), dilation=(2, 1)),
        "avg2": F.avg_pool2d(x, 2), "avg3_s2_p1": F.avg_pool2d(x, 3, 2, 1),
        "avg3_s2_p1_nopad": F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
        "avg3_s1_p1_nopad": F.avg_pool2d(x, 3, 1, 1, count_include_pad=False),
        "avg_divisor": F.avg_pool2d(x, 2, divisor_override=3),
        "adaptive_1": F.adaptive_avg_pool2d(x, 1),
        "adaptive_same": F.adaptive_avg_pool2d(x, (h, w)),
        "adaptive_half": F.adaptive_avg_pool2d(x, (h // 2, w // 2)),
        "adaptive_rows": F.adaptive_avg_pool2d(x, (1, w)),
        "max_then_relu": F.max_pool2d(torch.relu(x - 0.5), 2) * 2,
    }


POOLING = {F32: [((2, 3, 12, 10), "contig"), ((1, 1, 4, 4), "contig"), ((2, 8, 48, 40), "contig"),
                 ((2, 3, 12, 10), "t"), ((1, 2, 8, 6), "step")],
           F64: [((2, 3, 12, 10), "contig")]}


def test_pooling(check):
    """Every (dtype, shape, layout) case of POOLING in one program."""
    cases, args = {}, []
    for dtype, shape, layout in [(d, s, k) for d in (F32, F64) for s, k in POOLING[d]]:
        args.append(rand(layout_shape(shape, layout), dtype, gen("pool", shape, layout)))
        cases[case_name(_ids(dtype), shape, layout)] = (Layout(Fn(pools), layout), 1)
    check(Cases(cases), args)


def test_max_pool_padding_never_wins(check):
    g = gen("pool-neg")
    x = -rand((1, 2, 5, 5), F32, g).abs() - 1  # all negative: padding must never win the max
    i, u = rand((2, 3, 6, 7), torch.int64, g, -9, -1), rand((1, 2, 5, 5), torch.uint8, g, 0, 9)
    check(Fn(lambda x, i, u: {
        "p1": F.max_pool2d(x, 3, 2, 1), "ceil": F.max_pool2d(x, 2, 2, 0, 1, True),
        "int64_p1": F.max_pool2d(i, 3, 2, 1), "int64_ceil": F.max_pool2d(i, 2, 2, 1, 1, True),
        "uint8_p1": F.max_pool2d(u, 3, 1, 1)}), (x, i, u))


# -- attention ---------------------------------------------------------------------------------
def attention(q, k, v):
    t, s = q.shape[-2], k.shape[-2]
    causal = torch.ones(t, s, dtype=torch.bool).tril()
    additive = torch.zeros(t, s).masked_fill(~causal, float("-inf")).to(q.dtype)
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    return {
        "sdpa_causal": F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa_bool_mask": F.scaled_dot_product_attention(q, k, v, attn_mask=causal),
        "sdpa_float_mask": F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        "sdpa_plain": F.scaled_dot_product_attention(q, k, v),
        "sdpa_scale": F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
        "manual": torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v,
    }


ATTENTION = {F32: [(2, 3, 7, 8), (1, 1, 1, 4), (2, 4, 64, 16)], F64: [(1, 2, 5, 8)]}


def test_attention(check):
    """Every (dtype, shape) case of ATTENTION in one program."""
    cases, args = {}, []
    for dtype, shape in [(d, s) for d in (F32, F64) for s in ATTENTION[d]]:
        g = gen("attn", shape, dtype)
        args += [rand(shape, dtype, g) for _ in range(3)]
        cases[case_name(_ids(dtype), shape)] = (Fn(attention), 3)
    check(Cases(cases), args)


class HeadsFromProjection(nn.Module):
    """q/k/v sliced out of one projection and split into heads: strided attention operands."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.proj(x).view(b, t, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, 16)


def test_attention_heads_from_projection(check):
    check(init(HeadsFromProjection(), "qkv"), (rand((2, 9, 16), F32, gen("mha")),))


# -- dynamic shapes ---------------------------------------------------------------------------
class LinearNormAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = self.ln(self.lin(x))
        q = h.view(1, 1, -1, 8)
        return {"linear_ln": h, "attn": F.scaled_dot_product_attention(q, q, q, is_causal=True),
                "softmax_t": torch.softmax(h.t(), -1), "mm": h.t() @ h}


def test_dynamic_linear_norm_attention(check):
    n = dim("n", 1, 512)
    xs = [rand((k, 8), F32, gen("dyn-nn", k)) for k in (6, 1, 33, 512)]
    check(init(LinearNormAttention(), "dyn-lna"), (xs[0],), more=[(x,) for x in xs[1:]],
          dynamic_shapes=({0: n},))


def test_dynamic_conv_pool(check):
    b, h, w = dim("b", 1, 16), dim("h", 4, 64), dim("w", 4, 64)
    mods = init(Dict(conv=nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()),
                     pool=nn.MaxPool2d(2), avg=nn.AvgPool2d(3, 1, 1), gn=nn.GroupNorm(3, 3),
                     max_s2=nn.MaxPool2d(3, 2, 1), avg_nopad=nn.AvgPool2d(3, 2, 1, False, False),
                     bn=nn.BatchNorm2d(3), gap=nn.AdaptiveAvgPool2d(1)), "dyn-conv")
    xs = [rand(s, F32, gen("dyn-conv", s)) for s in [(2, 3, 8, 6), (1, 3, 4, 4), (5, 3, 31, 17),
                                                      (16, 3, 9, 64)]]
    check(mods, (xs[0],), more=[(x,) for x in xs[1:]], dynamic_shapes=({0: b, 2: h, 3: w},))


# -- norms returning their statistics; batch norm from batch statistics -----------------------
def norm_stats(x, w, b):
    """x [N, C, L]: the (out, mean, rstd) results of the native norms, used directly."""
    aten = torch.ops.aten
    c = x.shape[1]
    xc = x.contiguous()  # eager's native_group_norm takes contiguous inputs only
    out = {
        "ln": aten.native_layer_norm(x, [x.shape[-1]], w[:x.shape[-1]], b[:x.shape[-1]], 1e-5),
        "ln_2": aten.native_layer_norm(x, list(x.shape[1:]), None, None, 1e-3),
        "gn": aten.native_group_norm(xc, w[:c], b[:c], x.shape[0], c, x.shape[2], 2, 1e-5),
        "gn_plain": aten.native_group_norm(xc, None, None, x.shape[0], c, x.shape[2], 1, 1e-4),
        "bn_batch": aten._native_batch_norm_legit(x, w[:c], b[:c], True, 0.1, 1e-5),
        "bn_batch_plain": aten._native_batch_norm_legit(x, None, None, True, 0.1, 1e-3),
        "bn_module": F.batch_norm(x, None, None, w[:c], b[:c], training=True),
        "instance": F.instance_norm(x),
    }
    ln_out, mean, rstd = out["ln"]
    out["stats_math"] = (ln_out * rstd + mean).sum(-1)
    return out


NORM_STATS = {F32: [((3, 4, 10), "contig"), ((2, 6, 7), "t"), ((2, 2, 2), "contig")],
              F64: [((5, 4, 33), "contig")]}


def test_norm_statistics_results(check):
    """Every (dtype, shape, layout) case of NORM_STATS in one program."""
    cases, args = {}, []
    for dtype, shape, layout in [(d, s, k) for d in (F32, F64) for s, k in NORM_STATS[d]]:
        g = gen("norm-stats", shape, layout, dtype)
        x = rand(layout_shape(shape, layout), dtype, g) * 2 + 0.5
        args += [x, rand((64,), dtype, g), rand((64,), dtype, g)]
        cases[case_name(_ids(dtype), shape, layout)] = (Layout(Fn(norm_stats), layout), 3)
    check(Cases(cases), args)


class _BatchNormStats(nn.Module):
    """Training-mode batch norms that also return their running statistics after the update."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(5)
        self.bn_plain = nn.BatchNorm1d(5, affine=False, momentum=0.3)
        self.bn_nostats = nn.BatchNorm1d(5, track_running_stats=False)

    def forward(self, x):
        return {"bn": self.bn(x), "bn_plain": self.bn_plain(x), "nostats": self.bn_nostats(x),
                "mean": self.bn.running_mean.clone(), "var": self.bn.running_var.clone(),
                "var_plain": self.bn_plain.running_var.clone(),
                "batches": self.bn.num_batches_tracked.clone()}


def test_batch_norm_training_updates_running_stats(tmp_path):
    """Batch statistics normalise; running statistics update like eager, run after run (a
    buffer mutation), with and without affine parameters and running statistics."""
    import kiln
    eager = init(_BatchNormStats(), "bn-train").train()
    other = init(_BatchNormStats(), "bn-train").train()
    g = gen("bn-train-x")
    runner = kiln.compile(other, (rand((8, 5, 3), F32, g),)).load(tmp_path / "bn.kiln")
    for _ in range(3):
        x = rand((8, 5, 3), F32, g) * 2 + 1
        got, want = runner(x), eager(x)
        for k in want:
            torch.testing.assert_close(got[k], want[k].detach(), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, k=k: f"{k}: {m}")
