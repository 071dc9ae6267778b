"""Quantized ops that exported programs carry (issue 16 class 6), rewritten into ATen ops kiln
compiles (registered with the other rewrites of ops outside ATen, `custom_ops.REWRITES`, and
applied by the importer's decomposition step).

- `quantized::linear_dynamic_fp16_unpacked_weight(X, weight, bias)`: FBGEMM's dynamic fp16
  linear on a plain (unpacked) weight: the weight saturated to float16's range and rounded to
  float16 (what packing does), the product computed in float32 on float32 activations, bias
  added in float32.
- the Q/DQ ops of PT2E quantization, `quantized_decomposed::*` (what export emits for static
  and dynamic int8 / uint8 quantization, per tensor, per channel and per token):
  `quantize_per_tensor` / `dequantize_per_tensor` (scale and zero point as numbers, or as
  1-element tensors: `.tensor`, `.tensor2`), `choose_qparams(.tensor)` and
  `choose_qparams_symmetric(.tensor)` (dynamic quantization: parameters from the input's range),
  `quantize_per_channel` / `dequantize_per_channel`, `choose_qparams_per_token_asymmetric`,
  `quantize_per_token` / `dequantize_per_token`.

Each rewrite computes what torch's reference implementation of the op computes
(torch/ao/quantization/fx/_decomposed.py), element for element: where that implementation
reads a 1-element scale or zero point as a Python number (`.item()`, which would make a
data-dependent value here), the rewrite keeps a tensor and applies the rounding a Python
number gets (a float scale is a double, cast to float32 where it meets float32 values;
16-bit outputs are computed in float32 and rounded per op as eager does). Integer results
then flow into kiln's integer GEMMs and pointwise code like any other int8 tensor.
"""

from __future__ import annotations

import torch

_F32 = torch.float32


def _number(v, dtype: torch.dtype):
    """A scale or zero point given as a number or a 1-element tensor, as a 0-d `dtype` tensor
    (or the number itself)."""
    return v.reshape(()).to(dtype) if isinstance(v, torch.Tensor) else v


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(_F32) if x.dtype in (torch.float16, torch.bfloat16) else x


# -- per tensor ------------------------------------------------------------------------------


def quantize_per_tensor(input, scale, zero_point, quant_min, quant_max, dtype):
    x = _as_float32(input)
    if isinstance(scale, torch.Tensor):  # 1.0 / scale in double, then float32 (a Python float)
        inv = (1.0 / scale.reshape(()).to(torch.float64)).to(_F32)
    else:
        inv = 1.0 / scale
    zp = _number(zero_point, _F32)
    return torch.clamp(torch.round(x * inv) + zp, quant_min, quant_max).to(dtype)


def dequantize_per_tensor(input, scale, zero_point, quant_min, quant_max, dtype, *,
                          out_dtype=None):
    # eager: (input.to(out) - zero_point) * scale with Python numbers: each op in float32 (in
    # double for float64 outputs; 16-bit ones rounded after each op), the numbers cast to it
    out = out_dtype or _F32
    math = torch.float64 if out == torch.float64 else _F32
    zp, s = _number(zero_point, math), _number(scale, math)
    y = (input.to(math) - zp).to(out)
    return (y.to(math) * s).to(out)


def _qparams(input, qmin: int, qmax: int, eps: float, dtype, symmetric: bool):
    """torch.ao's determine_qparams for a per-tensor (affine or symmetric) scheme, on the
    input's range: (scale float64 [1], zero point int64 [1])."""
    min_val, max_val = torch.aminmax(input)
    min_neg = torch.min(min_val, torch.zeros_like(min_val))
    max_pos = torch.max(max_val, torch.zeros_like(max_val))
    eps_t = torch.full((1,), eps, dtype=_F32, device=input.device)
    if symmetric:
        max_pos = torch.max(-min_neg, max_pos)
        scale = torch.max(max_pos / (float(qmax - qmin) / 2), eps_t)
        zp = torch.full((1,), 128 if dtype in (torch.uint8, torch.quint8) else 0,
                        dtype=torch.int64, device=input.device)
    else:
        scale = torch.max((max_pos - min_neg) / float(qmax - qmin), eps_t)
        zp = torch.clamp(qmin - torch.round(min_neg / scale).to(torch.int), qmin, qmax)
    return scale.to(torch.float64), zp.to(torch.int64)


def choose_qparams(input, qmin, qmax, eps, dtype):
    return _qparams(input, qmin, qmax, eps, dtype, symmetric=False)


def choose_qparams_symmetric(input, qmin, qmax, eps, dtype):
    return _qparams(input, qmin, qmax, eps, dtype, symmetric=True)


# -- per channel and per token (torch's reference is tensor code: the same ops) ---------------


def _axis_first(x: torch.Tensor, axis: int):
    order = list(range(x.dim()))
    order[axis], order[0] = 0, axis
    return x.permute(order), order


def quantize_per_channel(input, scales, zero_points, axis, quant_min, quant_max, dtype):
    x, order = _axis_first(_as_float32(input), axis)
    shape = [scales.shape[0]] + [1] * (x.dim() - 1)
    res = torch.clamp(torch.round(x * (1.0 / scales.view(shape))) + zero_points.view(shape),
                      quant_min, quant_max)
    return res.permute(order).to(dtype)


def dequantize_per_channel(input, scales, zero_points, axis, quant_min, quant_max, dtype, *,
                           out_dtype=None):
    x, order = _axis_first(input, axis)
    shape = [scales.shape[0]] + [1] * (x.dim() - 1)
    if zero_points is not None:
        res = (x - zero_points.view(shape)) * scales.view(shape)
    else:
        res = x * scales.view(shape)
    return res.to(out_dtype or _F32).permute(order)


def choose_qparams_per_token_asymmetric(input, dtype):
    qmin, qmax = -128, 127
    min_val = torch.amin(input, dim=-1, keepdim=True)
    max_val = torch.amax(input, dim=-1, keepdim=True)
    min_neg = torch.min(min_val, torch.zeros_like(min_val))
    max_pos = torch.max(max_val, torch.zeros_like(max_val))
    scale = ((max_pos - min_neg) / float(qmax - qmin)).clamp(min=torch.finfo(_F32).eps)
    lo, hi = min_neg / scale, max_pos / scale
    zp = torch.where((qmin + lo) + (qmax + hi) > 0, qmin - lo, qmax - hi)
    return scale.to(torch.float64), torch.clamp(zp, qmin, qmax).round().to(torch.int64)


def quantize_per_token(input, scales, zero_points, quant_min, quant_max, dtype):
    return input.mul(1.0 / scales).add(zero_points).round().clamp(quant_min, quant_max).to(dtype)


def dequantize_per_token(input, scales, zero_points, quant_min, quant_max, dtype,
                         output_dtype=_F32):
    return ((input - zero_points) * scales).to(output_dtype)


# -- FBGEMM's dynamic fp16 linear -------------------------------------------------------------

_FP16_MAX = 65504.0


def linear_dynamic_fp16_unpacked_weight(X, weight, bias):
    w = weight.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).to(_F32)
    y = torch.matmul(X.to(_F32), w.t())
    return y + bias if bias is not None else y


# op name (str(OpOverload)) -> rewrite
REWRITES = {
    "quantized.linear_dynamic_fp16_unpacked_weight.default": linear_dynamic_fp16_unpacked_weight,
    "quantized_decomposed.quantize_per_tensor.default": quantize_per_tensor,
    "quantized_decomposed.quantize_per_tensor.tensor": quantize_per_tensor,
    "quantized_decomposed.quantize_per_tensor.tensor2": quantize_per_tensor,  # bounds: tensors
    "quantized_decomposed.dequantize_per_tensor.default": dequantize_per_tensor,
    "quantized_decomposed.dequantize_per_tensor.tensor": dequantize_per_tensor,
    "quantized_decomposed.dequantize_per_tensor.tensor2": dequantize_per_tensor,
    "quantized_decomposed.choose_qparams.tensor": choose_qparams,
    "quantized_decomposed.choose_qparams_symmetric.tensor": choose_qparams_symmetric,
    "quantized_decomposed.quantize_per_channel.default": quantize_per_channel,
    "quantized_decomposed.dequantize_per_channel.default": dequantize_per_channel,
    "quantized_decomposed.choose_qparams_per_token_asymmetric.default":
        choose_qparams_per_token_asymmetric,
    "quantized_decomposed.quantize_per_token.default": quantize_per_token,
    "quantized_decomposed.dequantize_per_token.default": dequantize_per_token,
}
