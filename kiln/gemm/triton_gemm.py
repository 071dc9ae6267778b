"""The Triton GEMM template: a persistent kernel (one program per SM, looping over output
tiles in grouped order for L2 reuse) with a config space, and the fused epilogues.

C[M, N] = epilogue(A[M, K] @ B[K, N]) with arbitrary strides for A, B and C; accumulation in
float32, the result cast to C's element type. Epilogues (constexpr switches, so each variant
compiles to its own kernel): bias (a row vector over N, or a full [M, N] tensor with strides),
activation (relu, relu6 = clamp(0, 6), gelu (erf form), or none), and a scaled residual add
(`C = act(A @ B + bias) + alpha * R`). Mixed dtypes (`QUANT`): A (1) or B (2) holds int8
integers, converted to the other operand's float type as each tile is loaded, and the
accumulator is multiplied by a scale (`HAS_SCALE`, strided over [M, N]: a per-column vector has
stride_sm = 0) before the bias. Loads use masks at the edges, so every config is valid for
every size: candidates stay valid over a whole Dim range.

Tensor-memory-accelerator loads (`TMA`, sm_90): A and B tiles come through device-side tensor
descriptors (`tl.make_tensor_descriptor`, built once per program in global scratch memory that
the launcher provides: Triton's allocator here, the model instance's scratch block in a
package, see kiln/toolchain/triton_aot.py) instead of masked pointer loads. TMA fills what lies
outside the descriptor's shape with zeros, so edges need no masks and every config stays valid
for every size. TMA needs a 16-byte aligned base, strides that are multiples of 16 bytes and a
unit inner stride: an operand whose rows are contiguous (BLAS "t") is described transposed and
its tile used as `.T`. `tma_refusal` decides this for a Loop IR GEMM over its whole Dim range;
TMA configs are offered (`config_space(..., tma=True)`) only when it finds nothing.
Mixed int8 GEMMs and float32 GEMMs keep the pointer loads: the int8 tiles are converted in
registers anyway, and float32's IEEE products run on FMA units, which TMA does not feed."""

from __future__ import annotations

from kiln.gemm.configs import TritonConfig
from kiln.toolchain.triton_aot import import_module
from pathlib import Path
import sympy

ACTIVATIONS = {"none": 0, "relu": 1, "relu6": 2, "gelu": 3}

SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def kiln_gemm(a_ptr, b_ptr, c_ptr, bias_ptr, res_ptr, M, N, K,
              stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
              stride_bias_m, stride_bias_n, stride_rm, stride_rn, res_scale, scale_ptr,
              stride_sm, stride_sn, NUM_SMS,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              HAS_RES: tl.constexpr, QUANT: tl.constexpr, HAS_SCALE: tl.constexpr,
              TMA: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr):
    # persistent: program `pid` computes tiles pid, pid + NUM_SMS, ... in grouped order
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if TMA:  # descriptors over the operands (A_T / B_T: rows contiguous, described transposed)
        if A_T:
            da = tl.make_tensor_descriptor(a_ptr, [K, M], [stride_ak, 1], [BLOCK_K, BLOCK_M])
        else:
            da = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        if B_T:
            db = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        else:
            db = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N])
    tiles = num_m * num_n
    per_group = GROUP_M * num_n
    for tile in range(pid, tiles, NUM_SMS):
        group = tile // per_group
        first_m = group * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size_m
        pid_n = (tile % per_group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if TMA:
                if A_T:
                    a = da.load([k0, pid_m * BLOCK_M]).T
                else:
                    a = da.load([pid_m * BLOCK_M, k0])
                if B_T:
                    b = db.load([pid_n * BLOCK_N, k0]).T
                else:
                    b = db.load([k0, pid_n * BLOCK_N])
            else:
                kk = k0 + rk
                a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                            mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
                b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                            mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            if QUANT == 1:
                a = a.to(b.dtype)
            elif QUANT == 2:
                b = b.to(a.dtype)
            acc = tl.dot(a, b, acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + rm[:, None] * stride_sm + rn[None, :] * stride_sn,
                           mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rm[:, None] * stride_bias_m + rn[None, :] * stride_bias_n,
                           mask=mask, other=0.0).to(tl.float32)
        if ACT == 1:
            acc = tl.maximum(acc, 0.0)
        elif ACT == 2:
            acc = tl.minimum(tl.maximum(acc, 0.0), 6.0)
        elif ACT == 3:
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        if HAS_RES:
            acc += res_scale * tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :] * stride_rn,
                                       mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=mask)
'''


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


def config_space(m: int, n: int, k: int, tma: bool = False) -> list[TritonConfig]:
    """Configs for a problem: large tiles for large problems, small tiles for skinny ones
    (a tile larger than the padded problem only wastes work). `tma`: the GEMM's operands allow
    TMA loads (`tma_refusal` found nothing): the TMA variants follow the plain configs (the
    first config, which the heuristic takes without profiling, stays a plain one)."""
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
    return [c for c in space if c.block_m <= p2(m) and c.block_n <= p2(n)
            and c.block_k <= max(32, p2(k))]



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

_TL = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


QUANT = {"": 0, "a": 1, "b": 2}  # which operand holds int8 integers (mixed-dtype GEMMs)


def signature(dtype: str, out_dtype: str | None = None, quant: str = "") -> dict[str, str]:
    t, o = _TL[dtype], _TL[out_dtype or dtype]
    sig = {"a_ptr": "*i8" if quant == "a" else f"*{t}", "b_ptr": "*i8" if quant == "b" else
           f"*{t}", "c_ptr": f"*{o}", "bias_ptr": f"*{o}", "res_ptr": f"*{o}"}
    for n in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm",
              "stride_cn", "stride_bias_m", "stride_bias_n", "stride_rm", "stride_rn"):
        sig[n] = "i32"
    sig["res_scale"] = "fp32"
    sig["scale_ptr"] = f"*{t}"
    sig["stride_sm"] = sig["stride_sn"] = "i32"
    sig["NUM_SMS"] = "i32"
    for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "HAS_BIAS", "ACT", "HAS_RES", "QUANT",
              "HAS_SCALE", "TMA", "A_T", "B_T"):
        sig[n] = "constexpr"
    return sig


def constexprs(cfg: TritonConfig, bias: bool = False, act: str = "none",
               residual: bool = False, quant: str = "", scale: bool = False,
               a_t: bool = False, b_t: bool = False) -> dict[str, int]:
    """`a_t` / `b_t`: the operand's rows are contiguous (BLAS "t"; read by TMA transposed)."""
    if cfg.tma and quant:
        raise ValueError("TMA configs are for GEMMs of one float type (see tma_refusal)")
    return {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m, "HAS_BIAS": int(bias), "ACT": ACTIVATIONS[act],
            "HAS_RES": int(residual), "QUANT": QUANT[quant], "HAS_SCALE": int(scale),
            "TMA": int(cfg.tma), "A_T": int(a_t), "B_T": int(b_t)}


def compile_cubin(cfg: TritonConfig, dtype: str, arch: int = 90, *, bias: bool = False,
                  act: str = "none", residual: bool = False, quant: str = "",
                  scale: bool = False, a_t: bool = False, b_t: bool = False, cache=None):
    """The template for one config and epilogue, compiled ahead of time for `arch`: returns
    Triton's compiled kernel (`.asm["cubin"]`, `.metadata`). No GPU needed."""
    # deferred: Triton is optional (GPU builds only)
    import triton
    # deferred: Triton is optional (GPU builds only)
    from triton.backends.compiler import GPUTarget

    mod = import_module(SOURCE, Path(cache) if cache else Path("/tmp/kiln_triton_gemm"))
    sig = signature(dtype, quant=quant)
    cx = constexprs(cfg, bias, act, residual, quant, scale, a_t, b_t)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*")}
    src = triton.compiler.ASTSource(fn=mod.kiln_gemm, signature=sig,
                                    constexprs={(names.index(k),): v for k, v in cx.items()},
                                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
