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

`configs(n, k, dtype)` lists the launch configurations the GEMM autotuner profiles, the
heuristic's first (about 8 KiB of weights per program and step, enough programs for the SMs)."""

from __future__ import annotations

import sympy

from kiln.gemm.configs import GemvConfig
from kiln.ir import loop as L

DTYPES = ("float16", "bfloat16", "float32")
SMS = 132  # an H100's multiprocessors: the heuristic keeps >= 2 programs per SM when it can


def _int(e) -> int | None:
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else None


def applies(g: L.Gemm) -> bool:
    """`g` is a GEMV the template computes: M = 1 at compile time, no batch dims, a float16 /
    bfloat16 / float32 GEMM of operands of its dtype (no int8 / 8-bit operands), K and N
    static."""
    if g.lowp is not None or g.mixed is not None or g.dtype.name not in DTYPES:
        return False
    if _int(g.m) != 1 or g.batch:
        return False
    return _int(g.n) is not None and _int(g.k) is not None and _int(g.n) > 0


def streams_rows(g: L.Gemm) -> bool:
    """The weight's rows are contiguous along K (b.rows == 1, nn.Linear's layout): the loads
    are 16-byte vectors. (Other layouts are computed, but strided: the heuristic leaves them
    to cuBLAS.)"""
    return sympy.sympify(g.b.rows) == 1


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def configs(n: int, k: int, itemsize: int) -> list[GemvConfig]:
    """Launch configurations, the heuristic's first: BLOCK_N the largest of 16, 8, 4, 2, 1
    leaving at least 2 programs per SM (else 1), BLOCK_K covering about 1 KiB of each row a
    step (at most K rounded up to a power of two), then variations of both and of the warps."""
    kp = max(_pow2(k), 16)
    bk = min(max(1024 // itemsize, 16), kp)
    bn = 16
    while bn > 1 and -(-n // bn) < 2 * SMS:
        bn //= 2
    out = [GemvConfig(bn, bk, 4, 1)]
    for cand_bn, cand_bk, warps, stages in (
            (bn, min(2 * bk, kp), 4, 1), (max(1, bn // 2), min(2 * bk, kp), 4, 1),
            (bn * 2, max(16, bk // 2), 4, 1), (bn, bk, 8, 1), (bn, bk, 4, 3),
            (bn * 2, bk, 8, 1), (max(1, bn // 2), bk, 2, 1),
            # pipelined loops (more weight bytes in flight a program)
            (bn * 2, max(16, bk // 2), 4, 3), (max(1, bn // 2), min(2 * bk, kp), 4, 3),
            # smaller steps, deeper pipelines: fewer registers a program, more programs an SM
            (bn, max(16, bk // 4), 4, 4), (bn * 2, max(16, bk // 4), 4, 4)):
        c = GemvConfig(cand_bn, cand_bk, warps, stages)
        if c not in out:
            out.append(c)
    return out
