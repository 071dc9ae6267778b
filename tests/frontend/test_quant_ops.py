"""Quantized ops that exported programs carry (issue 16 class 6), rewritten into ATen ops by the
importer (kiln/frontend/quant_ops.py): FBGEMM's dynamic fp16 linear on an unpacked weight and
PT2E's Q/DQ ops (`quantized_decomposed::`, per tensor with numbers or tensors as parameters,
dynamic parameters from the input's range, per channel, per token), alone and in the patterns
export emits (dynamic int8 linear, static int8 conv). Compared with eager on fresh inputs at
several sizes of a dynamic batch: integer results exactly (ties of the rounding included),
dequantized values to float32 rounding, GEMMs to their summation order."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import kiln
from difftest import Fn

pytest.importorskip("torch.ao.quantization.fx._decomposed")
import torch.ao.quantization.fx._decomposed  # noqa: E402,F401 - registers quantized_decomposed

Q = torch.ops.quantized_decomposed
EPS = torch.finfo(torch.float32).eps


def _compile(tmp_path, fn, args, dyn=None):
    if not isinstance(fn, torch.nn.Module):  # Fn's forward takes *args
        fn, dyn = Fn(fn), (dyn,) if dyn is not None else None
    ep = torch.export.export(fn, args, dynamic_shapes=dyn)
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any(n.startswith("quantized") for n in names), names  # export kept the ops
    kiln.compile(ep, options=kiln.Options(num_threads=1)).save(tmp_path / "m.kiln")
    return kiln.load(tmp_path / "m.kiln")


def _same(got, want, rtol=1e-6, atol=1e-6):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype, g.shape, w.shape)
        if w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=f"output {k}")
        else:
            assert torch.equal(g, w), (k, (g != w).sum(), g[g != w][:8], w[g != w][:8])


def per_tensor(x):
    # numbers as parameters (uint8, asymmetric), then ties of the rounding (scale 0.25)
    q1 = Q.quantize_per_tensor(x, 0.05, 3, 0, 255, torch.uint8)
    d1 = Q.dequantize_per_tensor(q1, 0.05, 3, 0, 255, torch.uint8)
    q0 = Q.quantize_per_tensor(x, 0.25, -2, -128, 127, torch.int8)
    # dynamic: parameters from the input's range, as 1-element tensors
    s, z = Q.choose_qparams.tensor(x, -128, 127, EPS, torch.int8)
    q2 = Q.quantize_per_tensor.tensor(x, s, z, -128, 127, torch.int8)
    d2 = Q.dequantize_per_tensor.tensor(q2, s, z, -128, 127, torch.int8)
    ss, zs = Q.choose_qparams_symmetric.tensor(x, -128, 127, EPS, torch.int8)
    q3 = Q.quantize_per_tensor.tensor(x, ss, zs, -128, 127, torch.int8)
    su, zu = Q.choose_qparams_symmetric.tensor(x, 0, 255, EPS, torch.uint8)
    lo, hi = torch.tensor(-128), torch.tensor(127)
    q4 = Q.quantize_per_tensor.tensor2(x, s, z, lo, hi, torch.int8)
    d4 = Q.dequantize_per_tensor.tensor2(q4, s, z, lo, hi, torch.int8)
    # 16-bit inputs and outputs, float64 outputs
    q5 = Q.quantize_per_tensor(x.bfloat16(), 0.05, 0, -128, 127, torch.int8)
    d5 = Q.dequantize_per_tensor(q5, 0.05, 0, -128, 127, torch.int8, out_dtype=torch.bfloat16)
    d6 = Q.dequantize_per_tensor.tensor(q2, s, z, -128, 127, torch.int8, out_dtype=torch.float16)
    d7 = Q.dequantize_per_tensor(q1, 0.05, 3, 0, 255, torch.uint8, out_dtype=torch.float64)
    return q1, d1, q0, s, z, q2, d2, ss, zs, q3, su, zu, q4, d4, q5, d5, d6, d7


def _ties(n):
    x = torch.randn(n, 6) * 3
    x[0, :4] = torch.tensor([0.125, -0.375, 0.625, -0.875])  # x / 0.25 = k + 0.5: half to even
    return x


def test_per_tensor_ops_match_eager(tmp_path):
    runner = _compile(tmp_path, per_tensor, (_ties(5),), ({0: Dim("n", min=1, max=64)},))
    for n in (5, 1, 33):
        x = _ties(n)
        _same(runner(x), per_tensor(x))
    x = torch.zeros(3, 6)  # a zero range: the eps scale
    _same(runner(x), per_tensor(x))


def per_channel(w, s, z, v):
    q = Q.quantize_per_channel(w, s, z, 0, -128, 127, torch.int8)
    d = Q.dequantize_per_channel(q, s, z, 0, -128, 127, torch.int8)
    d16 = Q.dequantize_per_channel(q, s, None, 0, -128, 127, torch.int8, out_dtype=torch.bfloat16)
    s1 = torch.ones(v.shape[1], dtype=torch.float64) * 0.02  # float64 scales, axis 1 of 3-D
    z1 = torch.arange(v.shape[1]) - 1
    q1 = Q.quantize_per_channel(v, s1, z1, 1, 0, 255, torch.uint8)
    return q, d, d16, q1, Q.dequantize_per_channel(q1, s1, z1, 1, 0, 255, torch.uint8)


def test_per_channel_ops_match_eager(tmp_path):
    def args(n):
        w = torch.randn(n, 12)
        return w, w.abs().amax(1) / 127, torch.randint(-3, 4, (n,)), torch.randn(2, 4, n)

    c = Dim("c", min=1, max=64)
    runner = _compile(tmp_path, per_channel, args(8), ({0: c}, {0: c}, {0: c}, {2: c}))
    for n in (8, 1, 29):
        a = args(n)
        _same(runner(*a), per_channel(*a))


def per_token(x):
    s, z = Q.choose_qparams_per_token_asymmetric(x, torch.int8)
    q = Q.quantize_per_token(x, s, z, -128, 127, torch.int8)
    return s, z, q, Q.dequantize_per_token(q, s, z, -128, 127, torch.int8, torch.float32)


def test_per_token_ops_match_eager(tmp_path):
    runner = _compile(tmp_path, per_token, (torch.randn(2, 3, 16),),
                      ({1: Dim("t", min=1, max=64)},))
    for t in (3, 1, 40):
        x = torch.randn(2, t, 16) * 4 + 1
        _same(runner(x), per_token(x), rtol=1e-12, atol=1e-12)


class DynamicInt8Linear(torch.nn.Module):
    """What PT2E dynamic int8 quantization of a Linear exports: the activation quantized with
    parameters from its range, the weight stored int8 per output channel, both dequantized."""

    def __init__(self, k=32, n=24):
        super().__init__()
        w = torch.randn(n, k)
        scales = w.abs().amax(1) / 127
        self.register_buffer("wq", torch.clamp(torch.round(w / scales[:, None]), -127, 127)
                             .to(torch.int8))
        self.register_buffer("ws", scales)
        self.register_buffer("wz", torch.zeros(n, dtype=torch.int64))
        self.b = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        s, z = Q.choose_qparams.tensor(x, -128, 127, EPS, torch.int8)
        xq = Q.quantize_per_tensor.tensor(x, s, z, -128, 127, torch.int8)
        xd = Q.dequantize_per_tensor.tensor(xq, s, z, -128, 127, torch.int8)
        wd = Q.dequantize_per_channel(self.wq, self.ws, self.wz, 0, -127, 127, torch.int8)
        return torch.relu(torch.nn.functional.linear(xd, wd, self.b))


class StaticInt8Conv(torch.nn.Module):
    """Static quantization as PT2E's convert emits it: dq -> conv -> q -> dq around the op."""

    def __init__(self):
        super().__init__()
        w = torch.randn(8, 3, 3, 3)
        scales = w.abs().amax((1, 2, 3)) / 127
        self.register_buffer("wq", torch.round(w / scales[:, None, None, None]).to(torch.int8))
        self.register_buffer("ws", scales)
        self.register_buffer("wz", torch.zeros(8, dtype=torch.int64))

    def forward(self, x):
        xd = Q.dequantize_per_tensor(Q.quantize_per_tensor(x, 0.02, 128, 0, 255, torch.uint8),
                                     0.02, 128, 0, 255, torch.uint8)
        wd = Q.dequantize_per_channel(self.wq, self.ws, self.wz, 0, -127, 127, torch.int8)
        y = torch.nn.functional.conv2d(xd, wd, padding=1)
        yq = Q.quantize_per_tensor(y, 0.05, 0, -128, 127, torch.int8)
        return yq, Q.dequantize_per_tensor(yq, 0.05, 0, -128, 127, torch.int8)


@pytest.mark.parametrize("make", [DynamicInt8Linear, StaticInt8Conv])
def test_quantized_patterns_match_eager(tmp_path, make):
    torch.manual_seed(0)
    m = make()
    shape = (4, 32) if make is DynamicInt8Linear else (2, 3, 10, 10)
    runner = _compile(tmp_path, m, (torch.randn(shape),),
                      ({0: Dim("b", min=1, max=64)},))
    for b in (4, 1, 17):
        x = torch.randn(b, *shape[1:])
        got, want = runner(x), m(x)
        if make is StaticInt8Conv:  # the conv's sum order may move a value across a tie
            assert (got[0].int() - want[0].int()).abs().max() <= 1
            assert (got[0] != want[0]).float().mean() < 0.01
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0.05 + 1e-6)
        else:
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


class Fp16Linear(torch.nn.Module):
    def __init__(self, bias=True, big=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(24, 32) * (3e4 if big else 1))
        self.b = torch.nn.Parameter(torch.randn(24)) if bias else None

    def forward(self, x):
        return torch.ops.quantized.linear_dynamic_fp16_unpacked_weight(x, self.w, self.b)


@pytest.mark.parametrize("bias,big", [
    (True, False), pytest.param(False, False, marks=pytest.mark.slow), (True, True)],
    ids=["bias", "no_bias", "saturated"])
def test_dynamic_fp16_linear_matches_eager(tmp_path, bias, big):
    """The weight rounded to float16 (saturated at its range: `big` weights reach 1e5), the
    product in float32; a 3-D input with a dynamic batch."""
    torch.manual_seed(0)
    m = Fp16Linear(bias, big)
    runner = _compile(tmp_path, m, (torch.randn(2, 5, 32),), ({0: Dim("b", min=1, max=64)},))
    with torch.no_grad():
        for b in (2, 1, 9):
            x = torch.randn(b, 5, 32)
            want = m(x)
            got = runner(x)
            scale = float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)
            # not the float32 weight: the float16 rounding is visible
            exact = torch.nn.functional.linear(x, m.w, m.b)
            if not big:
                assert not torch.allclose(got, exact, rtol=0, atol=1e-7 * scale)
