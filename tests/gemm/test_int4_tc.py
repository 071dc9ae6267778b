"""The int4 GEMV on tensor cores (kiln/gemm/int4_tc.py; issue 17 item 4) against float64 math
of the dequantised weights (quant_gemv.py's values and scales): the packing, the argument
checks, the kernel's addressing in Triton's interpreter (its stand-in for the inline PTX:
`USE_MMA=False`), the lane mapping Triton gives the inline PTX's operands (compiled for sm_90
here, no GPU), and on a GPU the tensor-core kernel itself (odd N, groups 128 / 256, K of
several steps, split-K, several tiles)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kiln.gemm import int4_tc as TC
from kiln.gemm.quant_gemv import dequantize, quantize_int4


def test_packing_places_value_k_at_nibble_i_of_word_j():
    torch.manual_seed(0)
    n, k = 3, 96
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    stored = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # quant_gemv.py's K order
    packed = TC.pack_tc(stored)
    words = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for r in range(n):
        for c in range(k // 32):
            for j in range(4):
                w = int(words[r, 4 * c + j])
                for i in range(8):
                    assert (w >> (4 * i)) & 15 == int(q[r, 32 * c + 4 * i + j])
    assert torch.equal(TC.unpack_tc(packed), stored)


def test_bad_arguments_are_named():
    x = torch.zeros(256, dtype=torch.bfloat16)
    parts = quantize_int4(torch.randn(8, 256), 64)
    with pytest.raises(ValueError, match="group a power of two >= 128"):
        TC.check(8, 256, 64, 8, 128)
    with pytest.raises(ValueError, match="K a multiple of the group"):
        TC.check(8, 320, 128, 8, 128)
    with pytest.raises(ValueError, match="K a multiple of RBLOCK"):
        TC.check(8, 384, 128, 8, 256)
    with pytest.raises(ValueError, match="XBLOCK a power of two"):
        TC.check(8, 256, 128, 6, 128)
    with pytest.raises(ValueError, match="rows of a multiple of 16 bytes"):
        TC.pack_tc(torch.zeros(2, 8, dtype=torch.uint8))
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match=r"x: expected shape \(256,\)"):
        TC.gemv_int4_tc(x[:128], TC.pack_tc(parts["q"]), parts["s"], 64)
    with pytest.raises(ValueError, match="scales: expected shape"):
        TC.gemv_int4_tc(x, TC.pack_tc(parts["q"]), parts["s"], 128)
    p128 = quantize_int4(torch.randn(8, 256), 128)
    with pytest.raises(ValueError, match="prefetch: expected 0, 1 or 2"):
        TC.gemv_int4_tc(x, TC.pack_tc(p128["q"]), p128["s"], 128, rblock=128, prefetch=2,
                        split=2)


#: (N, K, group, XBLOCK, RBLOCK, warps, split): odd N, a partial last program, K of 1-8
#: steps, groups 128 / 256, split-K
CASES = [(37, 512, 128, 8, 256, 1, 1), (5, 384, 128, 4, 128, 1, 1),
         (19, 1024, 256, 16, 512, 1, 1), (33, 1024, 128, 8, 128, 2, 2),
         (20, 1024, 128, 4, 256, 1, 4)]

_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from kiln.gemm import int4_tc as TC
    from kiln.gemm.quant_gemv import dequantize, quantize_int4
    torch.manual_seed(1)
    for n, k, g, xb, rb, nw, sp, pf in {cases}:
        w = torch.randn(n, k) * 0.05
        parts = quantize_int4(w, g)
        x = torch.randn(k).to(torch.bfloat16)
        ref = dequantize("int4", parts, g) @ x.double()
        y = TC.gemv_int4_tc(x, TC.pack_tc(parts["q"]), parts["s"], g, xblock=xb, rblock=rb,
                            num_warps=nw, split=sp, prefetch=pf, use_mma=False)
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        print(n, k, g, xb, rb, sp, pf, err)
        assert err < 5e-3, (n, k, g, xb, rb, sp, pf, err)  # bf16 output rounding: <= 2^-8
""")


def test_addressing_matches_float64_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cases = [c + (1,) for c in CASES] + [(37, 1024, 128, 8, 256, 1, 1, 2),
                                         (20, 2048, 128, 4, 256, 1, 2, 2),
                                         (9, 512, 128, 4, 128, 1, 1, 0)]  # prefetch 2, 0
    r = subprocess.run([sys.executable, "-c", _SCRIPT.format(cases=cases)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(r.stdout.splitlines()) == len(cases)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,g,xb,rb,nw,sp", CASES + [
    (4099, 4096, 128, 32, 256, 1, 1), (4096, 4096, 128, 16, 512, 1, 1),
    (1027, 4096, 128, 64, 512, 4, 1), (4096, 14336, 128, 32, 256, 2, 1),
    (4101, 4096, 256, 128, 256, 4, 1), (1024, 4096, 128, 32, 256, 1, 4),
    (4096, 14336, 128, 16, 512, 1, 2)])
def test_tensor_core_gemv_matches_float64(n, k, g, xb, rb, nw, sp):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.manual_seed(n + k)
    parts = quantize_int4(torch.randn(n, k) * 0.05, g)
    x = torch.randn(k).to(torch.bfloat16)
    ref = dequantize("int4", parts, g) @ x.double()
    y = TC.gemv_int4_tc(x.cuda(), TC.pack_tc(parts["q"]).cuda(), parts["s"].cuda(), g,
                        xblock=xb, rblock=rb, num_warps=nw, split=sp)
    assert y.shape == (n,) and not y.isnan().any()
    err = ((y.cpu().double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 5e-3, err  # bf16 output rounding: <= 2^-8 of a value


def _layout(ttgir: str) -> dict:
    """The blocked layout of the inline-PTX op's operands and results in `ttgir` (exactly one)."""
    import re
    line = next(t for t in ttgir.splitlines() if "tt.elementwise_inline_asm" in t)
    names = set(re.findall(r"tensor<[0-9x]+x(?:i32|bf16|f32), (#blocked\d*)>", line))
    assert len(names) == 1, names  # every operand and result in one layout
    m = re.search(re.escape(names.pop()) + r" = #ttg\.blocked<\{(.*)\}>", ttgir)
    return {k: [int(v) for v in vs.split(",")] for k, vs in
            re.findall(r"(\w+) = \[([0-9, ]+)\]", m.group(1))}


@pytest.mark.parametrize("xb,rb,nw,pf", [(8, 1024, 2, 1), (16, 512, 1, 1), (4, 1024, 1, 2),
                                         (32, 128, 1, 1), (16, 2048, 4, 2)])
def test_mma_operands_get_the_lane_mapping_the_ptx_assumes(xb, rb, nw, pf):
    """Compiled for sm_90 here (no GPU): the inline PTX's operands share one blocked layout
    of the [T, H, 4] tile whose lanes run along T first (no lane along the 4 words), in
    quads: lanes 4m..4m+3 hold 4 consecutive 32-value chunks, one group of 128. A Triton
    whose layouts differ fails here, not with wrong sums on a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    consts = {"K": 4096, "G": 128, "XBLOCK": xb, "RBLOCK": rb, "USE_MMA": True, "SPLIT": 1,
              "PREFETCH": pf}
    sig = {"x_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*bf16",
           "N": "i32", **{c: "constexpr" for c in consts}}
    src = ASTSource(fn=TC.gemv_int4_tc_kernel, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
    lay = _layout(k.asm["ttgir"])
    assert lay["order"][:2] == [2, 0], lay  # words in a thread, then lanes along T
    assert lay["threadsPerWarp"][2] == 1 and lay["threadsPerWarp"][0] % 4 == 0, lay
    assert lay["sizePerThread"][0] == 1, lay  # lane t holds chunk t (no chunks in registers
    # between a quad's lanes)
    assert "mma.sync.aligned.m16n8k16" in k.asm["ptx"]
