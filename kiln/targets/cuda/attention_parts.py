"""What the prefill (targets/cuda/attention.py) and decode (targets/cuda/attention_decode.py)
attention kernels share: the base-2 softmax constants and the float mask's conversion to base-2
units, tl.dot's input precision per dtype, sm_90's per-block shared memory and the key / value
tiles' estimate of it, the static head dims and item size of a call, power-of-two padding."""

from __future__ import annotations

from typing import NamedTuple


from kiln.ir import loop as L
from kiln.targets.cuda.kernel import Config
from kiln.toolchain.cuda import SHARED_PER_BLOCK

LOG2E = 1.4426950408889634
F32_MAX = 3.4028234663852886e38


def finite_log2(m: str) -> str:
    """Triton text of float mask `m` in base-2 units (times LOG2E): a finite value stays finite
    (HF's masks use finfo.min, which times LOG2E overflows to -inf: a row masked that way is
    then uniform over its keys, eager's mean of V, not an empty row), -inf and NaN stay."""
    return (f"tl.where(({m} > float(\"-inf\")) & ({m} * {LOG2E!r} == float(\"-inf\")), "
            f"-{F32_MAX!r}, {m} * {LOG2E!r})")


SHARED_LIMIT = SHARED_PER_BLOCK[90]  # bytes of shared memory one sm_90 block may use (227 KiB)


# tl.dot's input precision per operand dtype where Triton's default is not eager's: float32
# products as 3xTF32 (each operand split into a TF32 head and a TF32 tail, three tensor-core
# products: float32-level error, unlike Triton's default single TF32 product). On the H100,
# gpt fp32 (bench/attention_fp32.py): 3xTF32 0.202 ms, max error vs float64 1.14e-6; IEEE
# float32 (FMA, no tensor cores) 0.263 ms, 1.23e-6; eager float32 attention 1.45e-6
DOT_PRECISION = {"float32": "tf32x3"}


def pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def head_dims(call: L.Extern) -> tuple[int, int]:
    """(E, Ev): the static head dims of q / k and of v."""
    return int(call.args[0].shape[3]), int(call.args[2].shape[3])


def itemsize(call: L.Extern, buffers) -> int:
    return buffers[call.args[0].buf].dtype.itemsize


def shared_estimate(cfg: Config, e_pad: int, ev_pad: int, size: int) -> int:
    """Shared memory the pipelined key / value tiles need (Triton's own layout may add a little;
    the compiled kernel's figure is checked by the callers that compile it)."""
    stages = max(1, cfg.num_stages - 1) if cfg.num_stages else 2
    return stages * cfg.rblock * (e_pad + ev_pad) * size + cfg.xblock * e_pad * size


class Operands(NamedTuple):
    """What both kernels' printers read off an attention call."""

    q: L.LibArg
    k: L.LibArg
    v: L.LibArg
    mask: L.LibArg | None
    kind: int  # the mask's kind (lowering/attention.py)
    causal: bool
    scale: float
    name: str  # the kernel's: attn_<call>
    out: L.Buffer
    dt: str  # q's dtype name


def operands(call: L.Extern, buffers) -> Operands:
    q, k, v = call.args[:3]
    return Operands(q, k, v, call.args[3] if len(call.args) > 3 else None, call.attr("mask", 0),
                    bool(call.attr("causal")), float(call.attr("scale")), f"attn_{call.name}",
                    buffers[call.name], buffers[q.buf].dtype.name)
