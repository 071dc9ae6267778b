"""The Triton GEMM template's config space and its TMA rule. The template itself is printed
for each GEMM by the CUDA target (kiln/targets/cuda/gemm_template.py: a persistent kernel, one
program per SM looping over output tiles in grouped order for L2 reuse, with the GEMM's
absorbed epilogue); its configs (`TritonConfig`, kiln/gemm/configs.py) are the candidates
max_autotune times and the heuristic picks from. Loads use masks at the edges, so every config
is valid for every size: candidates stay valid over a whole Dim range.

Tensor-memory-accelerator loads (TMA configs, sm_90): A and B tiles come through device-side
tensor descriptors (`tl.make_tensor_descriptor`, built once per program in global scratch
memory that the launcher provides: Triton's allocator in the Python runner, the model
instance's scratch block in a package, see kiln/toolchain/triton_aot.py) instead of masked
pointer loads. TMA fills what lies outside the descriptor's shape with zeros, so edges need no
masks and every config stays valid for every size. TMA needs a 16-byte aligned base, strides
that are multiples of 16 bytes and a unit inner stride: an operand whose rows are contiguous
(BLAS "t") is described transposed and its tile used as `.T`. `tma_refusal` decides this for
a Loop IR GEMM over its whole Dim range; TMA configs are offered (`config_space(..., tma=True)`)
only when it finds nothing. Mixed int8 GEMMs and float32 GEMMs keep the pointer loads: the
int8 tiles are converted in registers anyway, and float32's IEEE products run on FMA units,
which TMA does not feed."""

from __future__ import annotations

from dataclasses import replace

import sympy

from kiln.gemm.configs import TritonConfig
from kiln.toolchain.cuda import SHARED_PER_BLOCK

SM90_SHARED = SHARED_PER_BLOCK[90]

# TMA variants: the tiles that feed Hopper's warp-group MMA (64 rows per warp group) from
# shared memory, with one more pipeline stage where shared memory allows (TMA copies need no
# registers, so deeper pipelines cost only shared memory)
TMA_SPACE = [TritonConfig(128, 256, 64, 8, 3, 8, True), TritonConfig(128, 128, 64, 8, 4, 8, True),
             TritonConfig(128, 128, 64, 8, 5, 8, True), TritonConfig(64, 128, 64, 8, 5, 4, True),
             TritonConfig(128, 64, 64, 8, 5, 4, True), TritonConfig(64, 64, 128, 8, 4, 4, True)]


# narrow tiles with deep K steps for skinny problems (decode-shaped: M or N <= 64), where the
# configs above leave SMs idle: M = 16, N = 4096 makes 64 tiles of 64 columns for 132 SMs,
# 128 of 32; such GEMMs are bound by reading the weight, which every SM then shares
SKINNY_SPACE = [TritonConfig(16, 32, 256, 8, 5, 4), TritonConfig(32, 32, 256, 8, 4, 4),
                TritonConfig(64, 32, 128, 8, 4, 4), TritonConfig(32, 16, 256, 8, 5, 4),
                TritonConfig(16, 16, 512, 8, 4, 4)]


def pipeline_bytes(c: TritonConfig, itemsize: int) -> int:
    """Shared memory of the template's pipelined A and B tiles: one buffer of each a stage
    (Triton 3.6 for sm_90: a float32 128 x 128 x 64 config at 4 stages compiled to exactly
    4 * (128 * 64 + 64 * 128) * 4 = 262,144 bytes)."""
    return c.num_stages * (c.block_m + c.block_n) * c.block_k * itemsize


def fit(c: TritonConfig, itemsize: int, limit: int) -> TritonConfig | None:
    """`c` with fewer stages (down to 2) until its tiles fit `limit` bytes, or None."""
    while pipeline_bytes(c, itemsize) > limit and c.num_stages > 2:
        c = replace(c, num_stages=c.num_stages - 1)
    return c if pipeline_bytes(c, itemsize) <= limit else None


def config_space(m: int, n: int, k: int, tma: bool = False, itemsize: int = 2,
                 shared_limit: int = SM90_SHARED) -> list[TritonConfig]:
    """Configs for a problem: large tiles for large problems, small tiles for skinny ones
    (a tile larger than the padded problem only wastes work). `tma`: the GEMM's operands allow
    TMA loads (`tma_refusal` found nothing): the TMA variants follow the plain configs (the
    first config, which the heuristic takes without profiling, stays a plain one). Each
    config's pipeline fits `shared_limit` bytes a block for operands of `itemsize` bytes
    (float32's tiles are twice bfloat16's: fewer stages, or the config is dropped)."""
    space = [TritonConfig(128, 256, 64, 8, 3, 8), TritonConfig(128, 128, 64, 8, 4, 8),
             TritonConfig(128, 128, 32, 8, 4, 4), TritonConfig(64, 128, 64, 8, 4, 4),
             TritonConfig(128, 64, 64, 8, 4, 4), TritonConfig(64, 64, 64, 8, 4, 4),
             TritonConfig(32, 64, 128, 8, 4, 4), TritonConfig(16, 128, 128, 8, 4, 4),
             TritonConfig(16, 64, 256, 8, 3, 4)]

    def p2(x):
        return 1 << max(4, (max(int(x), 1) - 1).bit_length())
    if min(p2(m), p2(n)) <= 64:
        space += SKINNY_SPACE
    space += TMA_SPACE if tma else []
    out = []
    for c in space:
        if c.block_m <= p2(m) and c.block_n <= p2(n) and c.block_k <= max(32, p2(k)):
            c = fit(c, itemsize, shared_limit)
            if c is not None and c not in out:
                out.append(c)
    return out



TMA_DTYPES = ("float16", "bfloat16")
TMA_MAX_BATCH_DIMS = 3  # a descriptor has at most 5 dims: the batch dims, rows and columns


def multiple_of(e, d: int) -> bool:
    """Whether the integer expression `e` is a multiple of `d` for every value of its size
    symbols: every term of its expanded sum has an integer coefficient divisible by `d` times
    integer factors (size symbols, floor divisions, remainders)."""
    e = sympy.expand(sympy.sympify(e))
    for term, coeff in e.as_coefficients_dict().items():
        if not (coeff.is_Integer and int(coeff) % d == 0):
            return False
        if term != 1 and term.is_integer is not True:
            return False
    return True


def tma_operands(g) -> list[tuple[str, object, bool]]:
    """(name, Operand, transposed) of a GEMM's A and B as the TMA template describes them:
    `transposed` when the operand's rows are contiguous (its descriptor is the transposed view
    and the loaded tile is used as `.T`)."""
    return [(n, op, sympy.sympify(op.cols) != 1) for n, op in (("A", g.a), ("B", g.b))]


def tma_refusal(g) -> str | None:
    """Why the Loop IR GEMM `g` cannot load its operands through TMA descriptors, or None when
    it can for every size of its Dim range: one float type of 16 bits (not mixed, not
    low-precision), a unit inner stride, a nonzero leading dimension, and base offset, leading
    dimension and every nonzero batch stride multiples of 16 bytes whatever the size symbols
    are (buffers themselves are 16-byte aligned: arena offsets are multiples of 64, inputs
    are checked, weights are 256-byte aligned). Batch dims of stride 0 (a broadcast operand)
    are left out of its descriptor; at most three others."""
    if g.lowp is not None or g.mixed is not None:
        return "mixed-dtype GEMMs convert int8 tiles in registers (pointer loads)"
    if g.dtype.name not in TMA_DTYPES:
        return f"{g.dtype.name}: TMA configs are for {', '.join(TMA_DTYPES)}"
    size = g.dtype.itemsize
    for name, op, tr in tma_operands(g):
        inner, lead = (op.rows, op.cols) if tr else (op.cols, op.rows)
        if sympy.sympify(inner) != 1:
            return f"operand {name} ({op.buf}) has no unit stride (rows {op.rows}, cols {op.cols})"
        if sympy.sympify(lead) == 0:
            return f"operand {name} ({op.buf}) repeats one row (leading dimension 0)"
        strides = [("offset", op.offset), ("leading dimension", lead)] + [
            (f"batch stride {d}", s) for d, s in enumerate(op.batch_strides)
            if sympy.sympify(s) != 0]
        for what, e in strides:
            if not multiple_of(sympy.sympify(e) * size, 16):
                return (f"operand {name} ({op.buf}): {what} {e} x {size} bytes is not a multiple "
                        "of 16 bytes for every size")
        if len(strides) - 2 > TMA_MAX_BATCH_DIMS:
            return f"operand {name} ({op.buf}) has more than {TMA_MAX_BATCH_DIMS} batch dims"
    return None
