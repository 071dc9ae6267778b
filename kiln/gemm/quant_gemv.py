"""Weight-only quantised linear layers on CUDA (Options.weight_quant; issue 17): the Triton
kernels, their launch configurations and the weight packing.

y[M, N] = x[M, K] @ W^T for a constant W [N, K] (nn.Linear's layout) stored quantised:

    int8   q[N, K] int8, per output channel: s[n] = max_k |W[n, k]| / 127 (float32),
           q = round(W / s) in [-127, 127]
    int4   p[N, K / 2] uint8, two values a byte along K (k even: low nibble, k odd: high),
           each q + 8 with q = round(W / s) in [-7, 7]; group-wise along K:
           s[n, k // G] = max |W| over the group / 7 (float32); K a multiple of G

Rows of q / p are contiguous along K: a program streams whole 16-byte vectors of each row.
int4 weights of bfloat16 GEMMs in groups of 128 or more can be stored (`tc_packed`,
Options.cuda_int4_tensor_core; off by default: slower end to end so far) in the tensor-core
GEMV's order
(kiln/gemm/int4_tc.py `pack_tc`: the same bytes, each 16 bytes' nibbles permuted): the decode
GEMV (targets/cuda/gemv_template.py) multiplies them
on the tensor cores, and `qlinear_int4_kernel` (TC) reads each nibble's x at its K position
(`_tc_k`), so that prefill and decode share one stored weight.

Kernels (`qlinear_int8_kernel`, `qlinear_int4_kernel`), one program per BLOCK_N outputs of
BLOCK_M rows (grid (ceil(N / BLOCK_N), ceil(M / BLOCK_M))):
  BLOCK_M == 1 (decode, M = 1 at compile time): a GEMV, FMA and a row sum in float32 per
  BLOCK_K (int4: GPI groups) slice of K; the weights are read once, converted in registers.
  BLOCK_M > 1 (prefill): tiles of x times the dequantised weight tile on tensor cores
  (tl.dot, float32 accumulation; int4: the even and odd k of a group as two products).
The scale multiplies the float32 sum of each output channel (int4: of each group), and the
result is rounded once to x's dtype. float32 tiles multiply as 3xTF32 (`PRECISION`).

`configs(mode, m, n, k, group)` lists the launch configurations kiln's user-kernel autotuning
times on the compile machine's GPU (Options.autotune), first the heuristic's choice used
without a GPU. Needs Triton (kiln[cuda])."""

from __future__ import annotations


import torch

from kiln.gemm.int4_tc import MIN_GROUP, pack_tc, unpack_tc

try:  # the kernels need Triton (kiln[cuda]); a CPU-only install imports this module without
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


if triton is not None:
    @triton.jit
    def qlinear_int8_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K: tl.constexpr,
                            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        scale = tl.load(s_ptr + rn, mask=nmask, other=0.0)
        if BLOCK_M == 1:
            # reduced across threads once, at the end
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in tl.range(0, K, BLOCK_K):
                kk = k0 + rk
                kmask = kk < K
                xv = tl.load(x_ptr + pid_m * K + kk, mask=kmask, other=0.0).to(tl.float32)
                w = tl.load(q_ptr + rn[:, None] * K + kk[None, :],
                            mask=nmask[:, None] & kmask[None, :], other=0).to(tl.float32)
                acc += w * xv[None, :]
            y = tl.sum(acc, axis=1) * scale
            tl.store(out_ptr + pid_m * N + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)
        else:
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            mmask = rm < M
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in tl.range(0, K, BLOCK_K):
                kk = k0 + rk
                kmask = kk < K
                xt = tl.load(x_ptr + rm[:, None] * K + kk[None, :],
                             mask=mmask[:, None] & kmask[None, :], other=0.0)
                wt = tl.load(q_ptr + rn[None, :] * K + kk[:, None],
                             mask=kmask[:, None] & nmask[None, :], other=0).to(xt.dtype)
                acc2 = tl.dot(xt, wt, acc2, input_precision=PRECISION)
            y2 = acc2 * scale[None, :]
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], y2.to(out_ptr.dtype.element_ty),
                     mask=mmask[:, None] & nmask[None, :])


    @triton.jit
    def _tc_k(b, TC: tl.constexpr):
        """The K position of the low nibble of byte b of a row (the high one's: + 4 with TC,
        + 1 without): 2b, or in pack_tc's order 32 (b // 16) + 8 (b % 4) + (b % 16) // 4."""
        if TC:
            return 32 * (b // 16) + 8 * (b % 4) + (b % 16) // 4
        else:
            return 2 * b

    @triton.jit
    def qlinear_int4_kernel(x_ptr, p_ptr, s_ptr, out_ptr, M, N, K: tl.constexpr,
                            G: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, GPI: tl.constexpr, TC: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        HALF: tl.constexpr = G // 2
        NG: tl.constexpr = K // G
        HI: tl.constexpr = 4 if TC else 1  # the high nibble's K position, less the low one's
        if BLOCK_M == 1:
            # GPI groups per step: bytes [BLOCK_N, GPI * HALF], x's even / odd values of them
            rj = tl.arange(0, GPI * HALF)
            acc = tl.zeros([BLOCK_N, GPI * HALF], tl.float32)  # reduced once, at the end
            for g0 in tl.range(0, NG, GPI):
                rg = g0 + rj // HALF  # the group of each byte
                gmask = rg < NG
                m2 = nmask[:, None] & gmask[None, :]
                b = tl.load(p_ptr + rn[:, None] * (K // 2) + g0 * HALF + rj[None, :], mask=m2,
                            other=136).to(tl.int32)
                kl = _tc_k(g0 * HALF + rj, TC)  # the low nibbles' K positions
                xe = tl.load(x_ptr + pid_m * K + kl, mask=gmask, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + pid_m * K + kl + HI, mask=gmask,
                             other=0.0).to(tl.float32)
                sc = tl.load(s_ptr + rn[:, None] * NG + rg[None, :], mask=m2, other=0.0)
                lo = ((b & 15) - 8).to(tl.float32)
                hi = ((b >> 4) - 8).to(tl.float32)
                acc += (lo * xe[None, :] + hi * xo[None, :]) * sc
            y = tl.sum(acc, axis=1)
            tl.store(out_ptr + pid_m * N + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)
        else:
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            mmask = rm < M
            rh = tl.arange(0, HALF)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for g in tl.range(0, NG):
                kl = _tc_k(g * HALF + rh[None, :], TC)
                xe = tl.load(x_ptr + rm[:, None] * K + kl, mask=mmask[:, None], other=0.0)
                xo = tl.load(x_ptr + rm[:, None] * K + kl + HI, mask=mmask[:, None],
                             other=0.0)
                b = tl.load(p_ptr + rn[None, :] * (K // 2) + g * HALF + rh[:, None],
                            mask=nmask[None, :], other=136).to(tl.int32)
                lo = ((b & 15) - 8).to(xe.dtype)
                hi = ((b >> 4) - 8).to(xe.dtype)
                part = tl.dot(xe, lo, input_precision=PRECISION) + tl.dot(
                    xo, hi, input_precision=PRECISION)
                sc = tl.load(s_ptr + rn * NG + g, mask=nmask, other=0.0)
                acc2 += part * sc[None, :]
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc2.to(out_ptr.dtype.element_ty),
                     mask=mmask[:, None] & nmask[None, :])

    KERNELS = {"int8": qlinear_int8_kernel, "int4": qlinear_int4_kernel}
else:  # CUDA builds with weight_quant refuse without Triton (targets/cuda/quant.py)
    KERNELS = {}

#: tl.dot's input precision by activation dtype (PRECISION): float32 as 3xTF32 (float32-level
#: error on tensor cores, as targets/cuda/attention.py), 16-bit floats as they are
PRECISION = {torch.float32: "tf32x3", torch.float16: "tf32", torch.bfloat16: "tf32"}


def _pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """W [N, K] float -> {"q": int8 [N, K], "s": float32 [N]} (per output channel)."""
    w = w.detach().double()
    s = w.abs().amax(dim=1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    return {"q": q.contiguous(), "s": s.float().contiguous()}


def tc_packed(group: int, dtype, enabled: bool) -> bool:
    """Whether int4 weights of a GEMM of `dtype` in groups of `group` are stored in the
    tensor-core GEMV's order (module docstring): `enabled` (Options.cuda_int4_tensor_core),
    bfloat16 (the mma's operands) and a power-of-two group >= int4_tc.MIN_GROUP. Off by
    default (the plain order and the CUDA-core GEMV): a 16-layer 8B-shaped bf16 decode took 1.499
    ms/token with it on an H100, against 1.305 without on another H100 in the sixteenth
    session (bf16 2.889 / 2.883 on the two; BENCHMARKS.md, eighteenth session, s18q4)."""
    return enabled and dtype == torch.bfloat16 and group >= MIN_GROUP and \
        group & (group - 1) == 0


def quantize_int4(w: torch.Tensor, group: int, tc: bool = False) -> dict[str, torch.Tensor]:
    """W [N, K] float, K a multiple of `group` -> {"q": uint8 [N, K / 2], "s": float32
    [N, K / group]}; `tc`: q in pack_tc's order."""
    n, k = w.shape
    g = w.detach().double().reshape(n, k // group, group)
    s = g.abs().amax(dim=2) / 7
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (torch.round(g / s[:, :, None]).clamp(-7, 7) + 8).to(torch.uint8).reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    if tc:
        packed = pack_tc(packed)
    return {"q": packed.contiguous(), "s": s.float().contiguous()}


def dequantize(mode: str, parts: dict[str, torch.Tensor], group: int = 0,
               tc: bool = False) -> torch.Tensor:
    """The float64 W [N, K] a stored form stands for (the tests' reference); `tc`: int4 q in
    pack_tc's order."""
    if mode == "int8":
        return parts["q"].double() * parts["s"].double()[:, None]
    p = (unpack_tc(parts["q"]) if tc else parts["q"]).to(torch.int16)
    n = p.shape[0]
    q = torch.stack([(p & 15) - 8, (p >> 4) - 8], dim=2).reshape(n, -1).double()
    return (q.reshape(n, -1, group) * parts["s"].double()[:, :, None]).reshape(n, -1)


def supported(mode: str, k: int, group: int) -> bool:
    """Whether a GEMM of inner size K can be stored in `mode` (int4: K a multiple of the group,
    the group a power of two >= 32: tl.dot needs 16 values of each half)."""
    if mode == "int8":
        return k >= 16
    return group >= 32 and group & (group - 1) == 0 and k % group == 0


def configs(mode: str, m: int | None, n: int, k: int, group: int = 0) -> list[dict]:
    """Launch configurations ({constexprs}, num_warps, num_stages), the heuristic's first:
    `m` = 1 a GEMV (BLOCK_M 1), else (a dynamic or larger M) tensor-core tiles. GEMV: small
    BLOCK_N so that N / BLOCK_N programs fill the GPU (an H100 has 132 SMs), long K slices
    (16-byte loads per row)."""
    out = []
    if m == 1:
        kp = max(_pow2(k), 16)
        # (BLOCK_N, bytes of each row per step, warps, pipeline stages): 8 KiB of weights per
        # program and step first; each config costs a Triton compile when autotuned
        tiles = [(8, 1024, 4, 1), (4, 2048, 4, 1), (16, 512, 4, 1), (32, 256, 4, 1),
                 (8, 1024, 8, 1), (16, 512, 8, 1), (8, 1024, 4, 3), (4, 1024, 4, 1)]
        if n > 8192:  # many outputs (a vocabulary): wider blocks first
            tiles = tiles[2:3] + tiles[:2] + tiles[3:]
        for bn, nbytes, warps, stages in tiles:
            if mode == "int8":
                st = {"BLOCK_K": min(nbytes, kp)}
            else:  # a step of GPI groups: G / 2 bytes each
                ng = _pow2(max(k // group, 1))
                st = {"GPI": max(1, min(nbytes // group, ng))}  # half the bytes: registers
            c = ({"BLOCK_M": 1, "BLOCK_N": bn, **st}, warps, stages)
            if c not in out:
                out.append(c)
        return out
    for bm, bn, warps in ((32, 64, 4), (64, 128, 8), (16, 64, 4)):
        if mode == "int8":
            out.append(({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64}, warps, 3))
        else:
            out.append(({"BLOCK_M": bm, "BLOCK_N": bn, "GPI": 1}, warps, 3))
    return out
