"""Weight quantisation for CPU GEMMs (passes/quant_weights.py, kiln_qgemm.h): how a float
weight B [K, N] (the GEMM's B operand: K inputs, N outputs) is stored, and the float64 twin
of the kernel (`ROUTINE`, registered in ir/interp.py) that tests compare against.

Every stored form is a sequence of panels of NB = 16 output columns (N zero-padded to a
multiple of 16); inside a panel, K in steps of `KSTEP` values, and for each step the 16
columns, each holding its KSTEP values in one 32-bit lane (the layout AVX-512 VNNI's
vpdpbusd and avx512_bf16's vdpbf16ps read as B, and that a GEMV streams once, front to back):

    int8   q[p, k // 4, n % 16, k % 4]         int8, KSTEP 4; scale s[n] per column (fp32):
           symmetric, s = max_k |B[k, n]| / 127, q = round(B / s) in [-127, 127]
           (wsum[n] = sum_k q[k, n] (int32) for the VNNI kernel's activation offset)
    int4   q[p, k // 8, n % 16, (k % 8) // 2]   two values a byte, value k % 8 in bits
           4 * (k % 8) of the lane (low nibble first); KSTEP 8; group-wise along K:
           s[p, k // G, n % 16] (fp32), s = max |B| over the group / 7, q in [-7, 7]; K
           padded to a multiple of G (zero weights)
    bf16   b[p, k // 2, n % 16, k % 2]          bfloat16 as given (no rounding), KSTEP 2

The "_vnni" modes store int8 / int4 as above; their kernels also quantise each activation row
(`quantize_rows`) and multiply integers.

K is zero-padded to a multiple of KSTEP (of G for int4)."""

from __future__ import annotations

import numpy as np
import torch

NB = 16  # columns per panel
KSTEP = {"int8": 4, "int4": 8, "bf16": 2}
MODES = {"int8": 0, "int4": 1, "int8_vnni": 2, "bf16": 3, "int4_vnni": 4}  # kiln_qgemm.h's codes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_k(mode: str, k: int, group: int = 0) -> int:
    step = group if mode == "int4" else KSTEP[mode]
    return _cdiv(k, step) * step


def _pad(w: torch.Tensor, kp: int, np_: int) -> torch.Tensor:
    k, n = w.shape
    out = torch.zeros(kp, np_, dtype=w.dtype)
    out[:k, :n] = w
    return out


def _panels(q: torch.Tensor, step: int) -> torch.Tensor:
    """[Kp, Np] -> [P, Kp // step, 16, step] (contiguous)."""
    kp, np_ = q.shape
    return q.reshape(kp // step, step, np_ // NB, NB).permute(2, 0, 3, 1).contiguous()


def _unpanel(p: torch.Tensor, kp: int, np_: int) -> torch.Tensor:
    step = p.shape[-1]
    return p.reshape(np_ // NB, kp // step, NB, step).permute(1, 3, 0, 2).reshape(kp, np_)


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """B [K, N] float -> {"q": int8 panels (flat), "s": fp32 [Np], "wsum": int32 [Np]}."""
    k, n = w.shape
    w64 = w.detach().to(torch.float64)
    amax = w64.abs().amax(0)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(torch.float32)
    q = torch.round(w64 / s.to(torch.float64)).clamp(-127, 127).to(torch.int8)
    np_ = _cdiv(n, NB) * NB
    qp = _pad(q, padded_k("int8", k), np_)
    return {"q": _panels(qp, 4).reshape(-1), "s": _pad(s[None], 1, np_)[0].contiguous(),
            "wsum": qp.to(torch.int32).sum(0).to(torch.int32).contiguous()}


def quantize_int4(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """B [K, N] float -> {"q": int8 bytes (two values each, flat), "s": fp32 [P, Kp/G, 16]}."""
    k, n = w.shape
    kp, np_ = padded_k("int4", k, group), _cdiv(n, NB) * NB
    w64 = _pad(w.detach().to(torch.float64), kp, np_)
    g = w64.reshape(kp // group, group, np_)
    amax = g.abs().amax(1)  # [Kp/G, Np]
    s = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).to(torch.float32)
    q = torch.round(g / s.to(torch.float64)[:, None]).clamp(-7, 7).to(torch.int32)
    v = _panels(q.reshape(kp, np_), 8)  # [P, Kp/8, 16, 8]
    byte = (v[..., 0::2] & 0xF) | ((v[..., 1::2] & 0xF) << 4)
    sp = s.reshape(kp // group, np_ // NB, NB).permute(1, 0, 2).contiguous()
    return {"q": byte.to(torch.uint8).view(torch.int8).reshape(-1), "s": sp}


def pack_bf16(w: torch.Tensor) -> dict[str, torch.Tensor]:
    k, n = w.shape
    return {"q": _panels(_pad(w.detach().to(torch.bfloat16), padded_k("bf16", k),
                              _cdiv(n, NB) * NB), 2).reshape(-1)}


def dequantize(mode: str, parts: dict, k: int, n: int, group: int = 0) -> torch.Tensor:
    """The float64 B [K, N] a stored form stands for (what the kernels multiply by)."""
    np_ = _cdiv(n, NB) * NB
    kp = padded_k("int4" if mode == "int4" else mode.removesuffix("_vnni"), k, group)
    q = torch.as_tensor(parts["q"])
    if mode in ("int8", "int8_vnni"):
        w = _unpanel(q.reshape(np_ // NB, kp // 4, NB, 4), kp, np_).to(torch.float64)
        w = w * torch.as_tensor(parts["s"]).to(torch.float64)[None]
    elif mode in ("int4", "int4_vnni"):
        b = q.view(torch.uint8).to(torch.int32).reshape(np_ // NB, kp // 8, NB, 4)
        nib = torch.stack([b & 0xF, b >> 4], -1).reshape(np_ // NB, kp // 8, NB, 8)
        nib = torch.where(nib >= 8, nib - 16, nib)
        w = _unpanel(nib, kp, np_).to(torch.float64)
        s = torch.as_tensor(parts["s"]).to(torch.float64).permute(1, 0, 2).reshape(-1, np_)
        w = w * s.repeat_interleave(group, 0)
    else:
        w = _unpanel(q.reshape(np_ // NB, kp // 2, NB, 2), kp, np_).to(torch.float64)
    return w[:k, :n]


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The VNNI kernel's dynamic activation quantisation: per row, symmetric, round half to
    even (nearbyint): (int8 values, fp32 scales)."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True) if x.shape[-1] else np.zeros((x.shape[0], 1))
    s = np.where(amax > 0, amax / np.float32(127), 1).astype(np.float32)
    return np.clip(np.rint(x / s), -127, 127).astype(np.int64), s


def routine(outs, attrs, x, *parts) -> list[np.ndarray]:
    """numpy twin of kl::qgemm: out [M, N] = x [M, K] @ dequantised B [+ bias] (float64)."""
    mode = {v: k for k, v in MODES.items()}[attrs["mode"]]
    k, n, group = attrs["k"], attrs["n"], attrs.get("group", 0)
    if len(parts) > {"int8": 2, "int4": 2, "int8_vnni": 3, "bf16": 1, "int4_vnni": 2}[mode]:
        *parts, bias = parts
        return [y + np.asarray(bias, np.float64)[None] for y in routine(outs, attrs, x, *parts)]
    names = ("q", "s", "wsum")[:len(parts)]
    w = dequantize(mode, {a: torch.from_numpy(np.ascontiguousarray(p)) for a, p in
                          zip(names, parts)}, k, n, group).numpy()
    x = np.asarray(x, dtype=np.float64).reshape(-1, k)
    if mode == "int8_vnni":
        xq, sx = quantize_rows(x)
        q = dequantize("int8", {"q": torch.from_numpy(np.ascontiguousarray(parts[0])),
                                "s": torch.ones(_cdiv(n, NB) * NB)}, k, n).numpy()
        return [(xq.astype(np.float64) @ q) * sx.astype(np.float64) *
                np.asarray(parts[1], np.float64)[:n][None]]
    if mode == "int4_vnni":  # the row-quantised x times the dequantised int4 weights
        xq, sx = quantize_rows(x)
        return [(xq.astype(np.float64) @ w) * sx.astype(np.float64)]
    return [x @ w]
