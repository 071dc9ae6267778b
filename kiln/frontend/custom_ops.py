"""Ops outside kiln's tables that exported programs carry, rewritten into ATen ops kiln
compiles (applied by the importer's decomposition step, export.py `_decompose`).

- grouped matrix product, `transformers::grouped_mm_fallback(input, weight, offs)` (Hugging
  Face's mixture-of-experts layers on the CPU and in float32: a custom op whose Python body
  loops over `offs.tolist()`, opaque to export) and `aten._grouped_mm(self, mat2, offs)` in
  its 2-D x 3-D form: rows [offs[g-1], offs[g]) of `input` (K columns) are multiplied by
  `weight[g]` (K x N); rows at or past offs[-1] are zero. Rewritten as a per-row gather of
  the group's weight and a reduction over K (kiln fuses the gather into the reduction, so the
  gathered S x K x N operand is never materialised). Each row reads its group's weight, so
  this streams S x K x N weight elements: right for decoding (few rows), slower than a
  grouped GEMM kernel for long prompts.
- quantized ops (`quantized::linear_dynamic_fp16_unpacked_weight`, PT2E's
  `quantized_decomposed::` Q/DQ ops): `quant_ops.py`."""

from __future__ import annotations

import torch

from kiln.frontend.quant_ops import REWRITES as QUANT_REWRITES


def _grouped_rows(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(x.shape[0], device=x.device)
    ends = offs.to(torch.int64)
    group = (ends.unsqueeze(0) <= rows.unsqueeze(1)).sum(1)  # [S]: groups ended before s
    inside = group < weight.shape[0]
    w = weight[group.clamp(max=weight.shape[0] - 1)]  # [S, K, N], fused into the sum
    out = (x.unsqueeze(2).to(w.dtype) * w).sum(1)
    return torch.where(inside.unsqueeze(1), out, torch.zeros((), dtype=out.dtype))


def _hf_grouped_mm(input, weight, offs):
    return _grouped_rows(input, weight, offs).to(input.dtype)


def _aten_grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    if self.dim() != 2 or mat2.dim() != 3 or offs is None:
        return NotImplemented
    out = _grouped_rows(self, mat2, offs)
    if bias is not None:
        out = out + bias[(offs.to(torch.int64).unsqueeze(0)
                          <= torch.arange(self.shape[0]).unsqueeze(1)).sum(1).clamp(
                              max=mat2.shape[0] - 1)]
    return out.to(out_dtype or self.dtype)


# op name (str(OpOverload)) -> rewrite
REWRITES = {"transformers.grouped_mm_fallback.default": _hf_grouped_mm,
            "aten._grouped_mm.default": _aten_grouped_mm,
            **QUANT_REWRITES}  # quantized:: and quantized_decomposed:: ops (quant_ops.py)


def custom_rewrites(ops) -> dict:
    """The rewrites for those of `ops` (OpOverloads met in a program) that have one."""
    return {op: REWRITES[str(op)] for op in ops if str(op) in REWRITES}
