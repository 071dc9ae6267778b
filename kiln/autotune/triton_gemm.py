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

Tensor-memory-accelerator loads are not used: Triton 3.6's device-side descriptors
(`tl.make_tensor_descriptor`) need a global scratch allocator, which kiln's launcher does not
provide, and host-side descriptors need a CUtensorMap built by the wrapper. The template uses
block loads that Triton pipelines with cp.async (`num_stages`)."""

from __future__ import annotations

from dataclasses import dataclass

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
              HAS_RES: tl.constexpr, QUANT: tl.constexpr, HAS_SCALE: tl.constexpr):
    # persistent: program `pid` computes tiles pid, pid + NUM_SMS, ... in grouped order
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
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


@dataclass(frozen=True)
class TritonConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8

    @property
    def name(self) -> str:
        return (f"triton_{self.block_m}x{self.block_n}x{self.block_k}_g{self.group_m}"
                f"_s{self.num_stages}_w{self.num_warps}")


def config_space(m: int, n: int, k: int) -> list[TritonConfig]:
    """Configs for a problem: large tiles for large problems, small tiles for skinny ones
    (a tile larger than the padded problem only wastes work)."""
    space = [TritonConfig(128, 256, 64, 8, 3, 8), TritonConfig(128, 128, 64, 8, 4, 8),
             TritonConfig(128, 128, 32, 8, 4, 4), TritonConfig(64, 128, 64, 8, 4, 4),
             TritonConfig(128, 64, 64, 8, 4, 4), TritonConfig(64, 64, 64, 8, 4, 4),
             TritonConfig(32, 64, 128, 8, 4, 4), TritonConfig(16, 128, 128, 8, 4, 4),
             TritonConfig(16, 64, 256, 8, 3, 4)]

    def p2(x):
        return 1 << max(4, (max(int(x), 1) - 1).bit_length())
    return [c for c in space if c.block_m <= p2(m) and c.block_n <= p2(n)
            and c.block_k <= max(32, p2(k))]


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
              "HAS_SCALE"):
        sig[n] = "constexpr"
    return sig


def constexprs(cfg: TritonConfig, bias: bool = False, act: str = "none",
               residual: bool = False, quant: str = "", scale: bool = False) -> dict[str, int]:
    return {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m, "HAS_BIAS": int(bias), "ACT": ACTIVATIONS[act],
            "HAS_RES": int(residual), "QUANT": QUANT[quant], "HAS_SCALE": int(scale)}


def compile_cubin(cfg: TritonConfig, dtype: str, arch: int = 90, *, bias: bool = False,
                  act: str = "none", residual: bool = False, quant: str = "",
                  scale: bool = False, cache=None):
    """The template for one config and epilogue, compiled ahead of time for `arch`: returns
    Triton's compiled kernel (`.asm["cubin"]`, `.metadata`). No GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget

    from kiln.toolchain.triton_aot import import_module
    from pathlib import Path
    mod = import_module(SOURCE, Path(cache) if cache else Path("/tmp/kiln_triton_gemm"))
    sig = signature(dtype, quant=quant)
    cx = constexprs(cfg, bias, act, residual, quant, scale)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*")}
    src = triton.compiler.ASTSource(fn=mod.kiln_gemm, signature=sig,
                                    constexprs={(names.index(k),): v for k, v in cx.items()},
                                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
