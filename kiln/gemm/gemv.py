"""The GEMV template (M = 1 on CUDA; issue 17.3): which GEMMs it computes, its launch
configurations and the heuristic's pick. The kernel is printed by
targets/cuda/gemv_template.py; its choice is a "triton" backend choice with a `GemvConfig`.

    out[0, n] = sum_k a[0, k] * b[k, n]        b[k, n] at b.offset + k * b.rows + n * b.cols

A program computes BLOCK_N outputs: it streams their BLOCK_N weight rows (nn.Linear's W [N, K]:
b.rows == 1, each row contiguous along K) BLOCK_K elements a step (16-byte loads), multiplies
them by the same slice of the A row in float32, and reduces the lanes once at the end. The
grid is ceil(N / BLOCK_N) programs (no split-K: N / BLOCK_N fills an H100's 132 SMs for the
N >= 1024 of a decoder's projections at BLOCK_N <= 8). The weights are read once; the A row
(K elements, a few KiB, from L2) once per program. Epilogue (gemm/fuse.py) and prologue
(gemm/prologue.py) fuse as in the template.

Quantised weights (weight-only int8 / int4, targets/cuda/quant.py; a `Gemm` whose `mixed` is
side "b"): the weight rows are int8 / uint8 (converted exactly in registers, the per-output-
channel scale multiplying each row's float32 sum at the end) or int4, two values a byte along
K with one scale per (n, k // group) multiplying each group's partial sum (`MixedGemm.group`);
a step then covers whole groups (BLOCK_K a multiple of the group).

`configs(n, k, bytes)` lists the launch configurations the GEMM autotuner profiles and the
launch tuner times, the heuristic's first (about 1 KiB of each weight row per program and
step, enough programs for the SMs); `weight_bytes(g)` and `min_block_k(g)` give its arguments
for a GEMM."""

from __future__ import annotations

from dataclasses import replace

import sympy

from kiln.gemm.configs import GemvConfig
from kiln.ir import loop as L

DTYPES = ("float16", "bfloat16", "float32")
QDTYPES = ("int8", "uint8")  # a quantised B's storage (int4: uint8, two values a byte)
SMS = 132  # an H100's multiprocessors: the heuristic keeps >= 2 programs per SM when it can


def _int(e) -> int | None:
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else None


def applies(g: L.Gemm) -> bool:
    """`g` is a GEMV the template computes: M = 1 at compile time, no batch dims, a float16 /
    bfloat16 / float32 GEMM of operands of its dtype or of such an A and a quantised B (int8 /
    uint8, or int4 in groups of a power of two >= 32 dividing K; no 8-bit float or
    low-precision operands), K and N static."""
    mx = g.mixed
    if g.lowp is not None or g.dtype.name not in DTYPES:
        return False
    if mx is not None and (mx.side != "b" or mx.qdtype.name not in QDTYPES):
        return False
    if _int(g.m) != 1 or g.batch:
        return False
    n, k = _int(g.n), _int(g.k)
    if mx is not None and mx.group and (mx.group < 32 or mx.group & (mx.group - 1) or
                                        k is None or k % mx.group or mx.scale is None):
        return False
    if mx is not None and mx.tc and (g.dtype.name != "bfloat16" or mx.group < 128):
        return False
    return n is not None and k is not None and n > 0


def weight_bytes(g: L.Gemm) -> float:
    """Bytes of memory one weight element takes: the GEMM dtype's, 1 for an int8 / uint8 B,
    0.5 for an int4 one."""
    mx = g.mixed
    if mx is None:
        return g.dtype.itemsize
    return 0.5 if mx.group else mx.qdtype.itemsize


def min_block_k(g: L.Gemm) -> int:
    """The smallest BLOCK_K: 16, or an int4 weight's group (a step covers whole groups)."""
    return g.mixed.group if g.mixed is not None and g.mixed.group else 16


def tc_configs(n: int, k: int, group: int) -> list[GemvConfig]:
    """Launch configurations of the tensor-core int4 GEMV (`MixedGemm.tc`, kiln/gemm/
    int4_tc.py; BLOCK_N the XBLOCK rows, two halves of XBLOCK / 2, BLOCK_K the RBLOCK values
    of K a step, a multiple of the group dividing K), the heuristic's first: the fastest of
    each decoder shape standalone on an H100 (BENCHMARKS.md, seventeenth session: 16 x 512
    on 1 warp for gate / up and wider, 8 x 1024 on 2 warps for o, k / v and down, 4 x 1024 on
    1 warp between), then the others and two wider tiles."""
    first = (16, 512, 1) if n >= 8192 else (8, 1024, 2) if n <= 4096 else (4, 1024, 1)
    out: list[GemvConfig] = []
    for bn, bk, warps in (first, (16, 512, 1), (8, 1024, 2), (4, 1024, 1), (8, 2048, 2),
                          (16, 1024, 2), (32, 1024, 4), (8, 512, 1)):
        bk = max(bk, group)
        while bk > group and k % bk:
            bk //= 2
        c = GemvConfig(bn, bk, warps, 1)
        if k % bk == 0 and bk % group == 0 and c not in out:
            out.append(c)
    return out


def gemv_configs(g: L.Gemm) -> list[GemvConfig]:
    """`configs` of GEMM `g` (static N and K); for int4 weights in the tensor-core order
    (`MixedGemm.tc`), `tc_configs` then `configs` of variant "cc" (the CUDA-core loop reading
    that order), so that the launch tuner picks between the two kernels per GEMV."""
    n, k = _int(g.n), _int(g.k)
    plain = configs(n, k, weight_bytes(g), min_block_k(g))
    if g.mixed is not None and g.mixed.tc:
        return tc_configs(n, k, g.mixed.group) + [replace(c, variant="cc") for c in plain]
    return plain


def streams_rows(g: L.Gemm) -> bool:
    """The weight's rows are contiguous along K (b.rows == 1, nn.Linear's layout): the loads
    are 16-byte vectors. (Other layouts are computed, but strided: the heuristic leaves them
    to cuBLAS.)"""
    return sympy.sympify(g.b.rows) == 1


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def configs(n: int, k: int, itemsize: float, min_k: int = 16) -> list[GemvConfig]:
    """Launch configurations, the heuristic's first: BLOCK_N the largest of 16, 8, 4, 2, 1
    leaving at least 2 programs per SM (else 1), BLOCK_K covering about 1 KiB of each row a
    step (`itemsize` bytes an element: 1024 elements of int8, 2048 of int4; at most K rounded
    up to a power of two, at least `min_k`), then variations of both and of the warps.
    Quantised weights (itemsize < 2) keep the float32 accumulator at <= 64 registers a thread
    in the first config (8 warps where 4 would hold more)."""
    kp = max(_pow2(k), 16, min_k)
    bk = min(max(int(1024 / itemsize), 16), kp)
    bn = 16
    while bn > 1 and -(-n // bn) < 2 * SMS:
        bn //= 2
    warps = 4
    if itemsize < 2 and bn * bk * min(itemsize, 1) > 64 * 32 * 4:  # int4: one lane a byte
        warps = 8
    out = [GemvConfig(bn, bk, warps, 1)]
    for cand_bn, cand_bk, warps, stages in (
            (bn, min(2 * bk, kp), 4, 1), (max(1, bn // 2), min(2 * bk, kp), 4, 1),
            (bn * 2, max(16, bk // 2), 4, 1), (bn, bk, 8, 1), (bn, bk, 4, 3),
            (bn * 2, bk, 8, 1), (max(1, bn // 2), bk, 2, 1),
            # pipelined loops (more weight bytes in flight a program)
            (bn * 2, max(16, bk // 2), 4, 3), (max(1, bn // 2), min(2 * bk, kp), 4, 3),
            # smaller steps, deeper pipelines: fewer registers a program, more programs an SM
            (bn, max(16, bk // 4), 4, 4), (bn * 2, max(16, bk // 4), 4, 4),
            # few rows, long steps (a whole 2048-wide row at once: 16 loads of 16 bytes a
            # thread in flight; a chain of cold-weight GEMVs of a 2048-wide decoder ran 4-5%
            # faster at 4 x 2048 and 2 x 2048 than at 8 x 512, bench/pdl_gpu.py on an H100)
            (4, min(2048, kp), 4, 1), (2, min(2048, kp), 4, 1)):
        c = GemvConfig(cand_bn, cand_bk, warps, stages)
        if c not in out:
            out.append(c)
    if itemsize < 2:  # quantised: more rows a program, so a prologue (recomputed by each
        # program: silu(gate) * up, a norm) costs 1 / BLOCK_N of its instructions per weight;
        # then 4-warp programs of the heuristic's rows at half its step, of twice its rows, and
        # of twice its rows over twice its step (the fastest of a 32-config grid for int4's
        # gate/up, q/k/v and o at the 8B widths on an H100, BENCHMARKS.md sixteenth session)
        for cand_bn, cand_bk, warps in ((bn * 4, bk, 8), (bn * 4, max(16, bk // 2), 4),
                                        (bn, max(16, bk // 2), 4), (bn * 2, bk, 4),
                                        (bn * 2, min(2 * bk, kp), 4)):
            c = GemvConfig(cand_bn, cand_bk, warps, 1)
            if c not in out:
                out.append(c)
    if min_k > 16:  # whole int4 groups a step
        out = list(dict.fromkeys(replace(c, block_k=max(c.block_k, min_k)) for c in out))
    return out
