"""Weight-only int8 / int4 GEMV kernel variants on the GPU (issue 17 item 4): which way of
converting and accumulating quantised weights streams them closest to the copy bandwidth, at
the decode GEMVs of a Llama-3-8B shape (q/k/v merged 6144 x 4096, o 4096 x 4096, gate/up
merged 28672 x 4096, down 4096 x 14336, head 128256 x 4096), M = 1, bf16 activations.

Each variant is a standalone Triton kernel of the shape kiln's GEMV template prints
(kiln/targets/cuda/gemv_template.py; the weight layouts of kiln/gemm/quant_gemv.py), swept over
launch configs. Weights are cold: each shape has enough copies (>= 400 MB) that a CUDA graph
of one launch per copy never finds them in L2; the time per launch is the graph's / copies.

Variants:
  bf16        the template's float GEMV: lane-wise float32 accumulator [XBLOCK, RBLOCK]
  i8_lane     the template's int8 GEMV today: bytes converted by the 2^23 bit trick, lane-wise
              accumulator, scale on the row sum
  i8_sub      int8, products summed in registers over each thread's 16 contiguous bytes
              (accumulator [XBLOCK, RBLOCK / 16]: 16x fewer accumulator registers)
  i4_lane     the template's int4 GEMV today: [XBLOCK, groups, G / 2] bytes, x split into
              even / odd positions by reshape + split, every product times its group's scale
  i4_grp      int4, each group's products summed (over G / 2 bytes) before its scale multiplies
  i4_sub      int4, products summed over 16 bytes in registers, then the scale
  i4_pair     int4, x read as 32-bit words (two bf16: even k low half, odd k high half), so
              no reshape / split; the products summed over 16 bytes, then the scale
  i4_nib      int4 as the template reads it now: 32-bit words of 8 nibbles, each nibble
              masked in place and its bits (a subnormal float) turned into (q - 8) * 2^-23 by
              one FMA, x read as [groups, words, 8], a word's 8 products summed in registers
  i4_nibx     i4_nib with each nibble place's multiplier moved onto x (as i4_plx; x past
              2^41 would overflow): a weight is one LOP3 and one FFMA, each group's
              8 * sum(x) * scale taken off at the end (twelfth session: SASS only)
  i4_pl       int4 in a place-major packing (`planes_from_pairs`: nibble i of word b of a
              16-byte chunk is k = 32 * chunk + 4i + b; the template's was branch s11q4's
              6f244f0, not kept: BENCHMARKS.md, eleventh session),
              the tile [groups, XBLOCK, words] and the loop unrolled over the 8 nibble
              places, x of place i loaded in the tile's shape (4 contiguous values a thread):
              x and the words share one layout, no shared-memory conversion
  i4_plx      i4_pl with each place's multiplier moved onto x (x * 2^(126 - 4P - 40), the
              zero point 8 * sum(x) taken off each word's sum): a weight is one LOP3 and one
              FFMA, but x past 2^42 overflows (not in the template: 1% faster, see
              BENCHMARKS.md, eleventh session)

    python bench/quant_gemv_variants.py [--quick] [--variants i4_nib,i4_pl] [--xblock 8,16]
        [--bytes 1024,2048] [--warps 4]
    python bench/quant_gemv_variants.py --sass-decode int4 [--configs 8x2048x4,16x2048x8]
        # no GPU: the same count for kiln's own decode GEMVs (prologues and epilogues
        included) of a 1-layer decoder at the 8B widths
    python bench/quant_gemv_variants.py --sass   # no GPU needed: the int4 variants' K loops
        compiled for sm_90, SASS instructions per weight byte each thread issues (an H100
        issues about 128 a clock per SM against about 13 bytes of copy bandwidth: ~10 a byte
        keeps up with memory, fewer leave room to hide latency)
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.cuda_timing import events_ms  # noqa: E402
from bench.llm_gpu import copy_gbs  # noqa: E402
from kiln.gemm.quant_gemv import quantize_int4, quantize_int8  # noqa: E402

G = 128


def planes_from_pairs(p: torch.Tensor) -> torch.Tensor:
    """quant_gemv.py's int4 rows (two values a byte in K order, k even: low nibble) repacked
    place-major for i4_pl / i4_plx: in each 16 bytes (four little-endian 32-bit words), nibble
    i of word b holds k = 32 * chunk + 4 * i + b. Same values and bytes, another order."""
    n = p.shape[0]
    p16 = p.to(torch.int16)
    q = torch.stack([p16 & 15, p16 >> 4], dim=2).reshape(n, -1)  # K order
    q = q.reshape(n, -1, 8, 4).transpose(2, 3).reshape(n, -1)  # position 8b + i: k = 4i + b
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("head", 128256, 4096)]
PER_TOKEN = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "head": 1}


@triton.jit
def gemv_bf16(x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, XBLOCK: tl.constexpr,
              RBLOCK: tl.constexpr):
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    nmask = rn < N
    rk = tl.arange(0, RBLOCK)[None, :]
    acc = tl.zeros((XBLOCK, RBLOCK), dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        kk = k0 + rk
        x = tl.load(x_ptr + kk).to(tl.float32)
        w = tl.load(w_ptr + rn * K + kk, mask=nmask, other=0.0).to(tl.float32)
        acc += w * x
    tot = tl.sum(acc, 1, keep_dims=True)
    tl.store(out_ptr + rn, tot.to(tl.bfloat16), mask=nmask)


@triton.jit
def gemv_i8(x_ptr, q_ptr, s_ptr, out_ptr, N, K: tl.constexpr, XBLOCK: tl.constexpr,
            RBLOCK: tl.constexpr, SUB: tl.constexpr):
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    nmask = rn < N
    rk = tl.arange(0, RBLOCK)[None, :]
    if SUB == 1:
        acc = tl.zeros((XBLOCK, RBLOCK), dtype=tl.float32)
    else:
        acc = tl.zeros((XBLOCK, RBLOCK // SUB), dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        kk = k0 + rk
        x = tl.load(x_ptr + kk).to(tl.float32)
        q = tl.load(q_ptr + rn * K + kk, mask=nmask, other=0)
        w = (q.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x4B000080).to(
            tl.float32, bitcast=True) - 8388736.0
        if SUB == 1:
            acc += w * x
        else:
            acc += tl.sum(tl.reshape(w * x, [XBLOCK, RBLOCK // SUB, SUB]), 2)
    tot = tl.sum(acc, 1, keep_dims=True) * tl.load(s_ptr + rn, mask=nmask, other=0.0)
    tl.store(out_ptr + rn, tot.to(tl.bfloat16), mask=nmask)


@triton.jit
def gemv_i4(x_ptr, p_ptr, s_ptr, out_ptr, N, K: tl.constexpr, GS: tl.constexpr,
            XBLOCK: tl.constexpr, RBLOCK: tl.constexpr, MODE: tl.constexpr,
            SUB: tl.constexpr):
    # MODE 0: lane (template today); 1: group sums; 2: 16-byte sums then scale;
    # 3: x as 32-bit pairs + 16-byte sums
    NG: tl.constexpr = RBLOCK // GS
    HB: tl.constexpr = GS // 2
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None, None]
    nmask = rn < N
    rg = tl.arange(0, NG)[None, :, None]
    rj = tl.arange(0, HB)[None, None, :]
    rk = rg * GS + tl.arange(0, GS)[None, None, :]
    pb = p_ptr + rn * (K // 2)
    ps = s_ptr + rn * (K // GS)
    if MODE == 0:
        acc = tl.zeros((XBLOCK, NG, HB), dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros((XBLOCK, NG, 1), dtype=tl.float32)
    else:
        acc = tl.zeros((XBLOCK, NG, HB // SUB), dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        gi = k0 // GS + rg
        if MODE == 3:
            xw = tl.load(x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
                         + gi * HB + rj)
            xe = (xw << 16).to(tl.float32, bitcast=True)
            xo = (xw & -65536).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + k0 + rk).to(tl.float32)
            xe, xo = tl.split(tl.reshape(x, [1, NG, HB, 2]))
        b = tl.load(pb + gi * HB + rj, mask=nmask, other=136).to(tl.int32)
        lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        s = tl.load(ps + gi, mask=nmask, other=0.0)
        if MODE == 0:
            acc += (lo * xe + hi * xo) * s
        elif MODE == 1:
            acc += tl.sum(lo * xe + hi * xo, 2, keep_dims=True) * s
        else:
            part = tl.sum(tl.reshape(lo * xe + hi * xo, [XBLOCK, NG, HB // SUB, SUB]), 3)
            acc += part * s
    tot = tl.sum(tl.sum(acc, 2, keep_dims=True), 1, keep_dims=True)
    tl.store(out_ptr + rn, tot.to(tl.bfloat16), mask=nmask)


@triton.jit
def gemv_i4_nib(x_ptr, p_ptr, s_ptr, out_ptr, N, K: tl.constexpr, GS: tl.constexpr,
                XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    NG: tl.constexpr = RBLOCK // GS
    WG: tl.constexpr = GS // 8
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None, None]
    nmask = rn < N
    rg = tl.arange(0, NG)[None, :, None]
    rw = rg * WG + tl.arange(0, WG)[None, None, :]
    ri = tl.arange(0, 8)[None, None, None, :]
    nsh = tl.where(ri >= 6, 16, 0)
    place = ri - nsh // 4
    nbits = 15 << (4 * place)
    nmul = ((253 - 4 * place) << 23).to(tl.float32, bitcast=True)
    pw = p_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rn * (K // 8)
    ps = s_ptr + rn * (K // GS)
    acc = tl.zeros((XBLOCK, NG, WG), dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        w = tl.load(pw + k0 // 8 + rw, mask=nmask, other=-2004318072)
        x = tl.load(x_ptr + (k0 // 8 + rw[:, :, :, None]) * 8 + ri).to(tl.float32)
        v = ((w[:, :, :, None] >> nsh) & nbits).to(tl.float32, bitcast=True) * nmul \
            - 9.5367431640625e-07
        s = tl.load(ps + k0 // GS + rg, mask=nmask, other=0.0)
        acc += tl.sum(v * x, 3) * s
    tot = tl.sum(tl.sum(acc, 2, keep_dims=True), 1, keep_dims=True) * 8388608.0
    tl.store(out_ptr + rn, tot.to(tl.bfloat16), mask=nmask)


@triton.jit
def gemv_i4_nibx(x_ptr, p_ptr, s_ptr, out_ptr, N, K: tl.constexpr, GS: tl.constexpr,
                 XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    # i4_nib with each nibble place's multiplier moved onto x (as i4_plx, in i4_nib's layout):
    # x'_i = x_i * 2^(86 - 4 * place), once a program and position; a weight is one LOP3 (its
    # bits in place: n * 2^(4 * place - 149)) and one FFMA (n * x * 2^-63). The zero point:
    # 8 * sum(x) over the group, times the group's scale, taken off at the end
    NG: tl.constexpr = RBLOCK // GS
    WG: tl.constexpr = GS // 8
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None, None]
    nmask = rn < N
    rg = tl.arange(0, NG)[None, :, None]
    rw = rg * WG + tl.arange(0, WG)[None, None, :]
    ri = tl.arange(0, 8)[None, None, None, :]
    nsh = tl.where(ri >= 6, 16, 0)
    place = ri - nsh // 4
    nbits = 15 << (4 * place)
    xmul = ((213 - 4 * place) << 23).to(tl.float32, bitcast=True)  # 2^(86 - 4 * place)
    pw = p_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rn * (K // 8)
    ps = s_ptr + rn * (K // GS)
    acc = tl.zeros((XBLOCK, NG, WG), dtype=tl.float32)
    accz = tl.zeros((XBLOCK, NG, 1), dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        w = tl.load(pw + k0 // 8 + rw, mask=nmask, other=-2004318072)
        x = tl.load(x_ptr + (k0 // 8 + rw[:, :, :, None]) * 8 + ri).to(tl.float32)
        xs = tl.sum(tl.sum(x, 3), 2, keep_dims=True)  # [1, NG, 1]: each group's sum of x
        v = ((w[:, :, :, None] >> nsh) & nbits).to(tl.float32, bitcast=True)
        s = tl.load(ps + k0 // GS + rg, mask=nmask, other=0.0)
        acc += tl.sum(v * (x * xmul), 3) * s
        accz += xs * s
    tot = tl.sum(tl.sum(acc, 2, keep_dims=True), 1, keep_dims=True) * (2.0 ** 63) - \
        8.0 * tl.sum(accz, 1, keep_dims=True)
    tl.store(out_ptr + rn, tot.to(tl.bfloat16), mask=nmask)


@triton.jit
def gemv_i4_pl(x_ptr, p_ptr, s_ptr, out_ptr, N, K: tl.constexpr, GS: tl.constexpr,
               XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    # place-major packing (`planes_from_pairs`): in each 16-byte chunk of 32 values,
    # nibble i of word b is k = 32 * chunk + 4 * i + b, so x's 4 positions of one nibble
    # place are contiguous and the weight words stay in their 16-byte load layout
    # the tile is [groups, XBLOCK, words]: Triton's coalescing orders the non-contiguous dims
    # first to last, so the rows are the slowest: each thread holds several rows' words and
    # reuses its x values across them
    NG: tl.constexpr = RBLOCK // GS
    WG: tl.constexpr = GS // 8
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[None, :, None]
    nmask = rn < N
    rg = tl.arange(0, NG)[:, None, None]
    rj = tl.arange(0, WG)[None, None, :]
    rw = rg * WG + rj  # the step's words
    rkb = rg * GS + (rj // 4) * 32 + rj % 4  # place 0's positions
    pw = p_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rn * (K // 8)
    ps = s_ptr + rn * (K // GS)
    acc = tl.zeros((NG, XBLOCK, WG), dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        w = tl.load(pw + k0 // 8 + rw, mask=nmask, other=-2004318072)
        s = tl.load(ps + k0 // GS + rg, mask=nmask, other=0.0)
        d = tl.zeros((NG, XBLOCK, WG), dtype=tl.float32)
        for i in tl.static_range(8):
            x = tl.load(x_ptr + k0 + rkb + 4 * i + rn * 0).to(tl.float32)  # (w's shape: its layout)
            if i >= 6:  # nibbles 6, 7: places 2, 3 of the word >> 16
                v = ((w >> 16) & (15 << (4 * i - 16))).to(tl.float32, bitcast=True) * \
                    (2.0 ** (142 - 4 * i)) - 9.5367431640625e-07
            else:
                v = (w & (15 << (4 * i))).to(tl.float32, bitcast=True) * \
                    (2.0 ** (126 - 4 * i)) - 9.5367431640625e-07
            d += v * x
        acc += d * s
    tot = tl.sum(tl.sum(acc, 2, keep_dims=True), 0, keep_dims=True) * 8388608.0
    tl.store(out_ptr + rn, tot.to(tl.bfloat16), mask=nmask)


@triton.jit
def gemv_i4_plx(x_ptr, p_ptr, s_ptr, out_ptr, N, K: tl.constexpr, GS: tl.constexpr,
                XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    # i4_pl with each nibble place's multiplier moved onto x: x'_i = x_i * 2^(126 - 4 P - E)
    # (E = 40), so a weight is one LOP3 (its bits in place, a subnormal n * 2^(4P - 149)) and
    # one FFMA (n * x * 2^(-23 - E)); the zero point 8 * sum(x) is taken off each word's sum
    NG: tl.constexpr = RBLOCK // GS
    WG: tl.constexpr = GS // 8
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[None, :, None]
    nmask = rn < N
    rg = tl.arange(0, NG)[:, None, None]
    rj = tl.arange(0, WG)[None, None, :]
    rw = rg * WG + rj  # the step's words
    rkb = rg * GS + (rj // 4) * 32 + rj % 4  # place 0's positions
    pw = p_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rn * (K // 8)
    ps = s_ptr + rn * (K // GS)
    acc = tl.zeros((NG, XBLOCK, WG), dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        w = tl.load(pw + k0 // 8 + rw, mask=nmask, other=0)
        s = tl.load(ps + k0 // GS + rg, mask=nmask, other=0.0)
        wh = w >> 16
        for i in tl.static_range(8):
            x = tl.load(x_ptr + k0 + rkb + 4 * i + rn * 0).to(tl.float32)
            if i == 0:
                xs = x
            else:
                xs += x
            if i >= 6:  # nibbles 6, 7: places 2, 3 of the word >> 16
                t = (wh & (15 << (4 * i - 16))).to(tl.float32, bitcast=True) * \
                    (x * (2.0 ** (142 - 4 * i - 40)))
            else:
                t = (w & (15 << (4 * i))).to(tl.float32, bitcast=True) * \
                    (x * (2.0 ** (126 - 4 * i - 40)))
            if i == 0:
                d = t
            else:
                d += t
        acc += (d - xs * (8.0 * 2.0 ** -63)) * s
    tot = tl.sum(tl.sum(acc, 2, keep_dims=True), 0, keep_dims=True) * (2.0 ** 63)
    tl.store(out_ptr + rn, tot.to(tl.bfloat16), mask=nmask)


def graph_us(launches: list, repeat: int = 7) -> float:
    """Per-launch device time of a CUDA graph of `launches` (callables), median of runs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in launches:  # compile + warm outside the capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in launches:
            f()
    return events_ms(g.replay, repeat) * 1e3 / len(launches)


def _loop_sass(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the K loop) in nvdisasm's
    output."""
    labels, ins, cur = {}, [], None
    for line in sass.splitlines():
        m = re.match(r"\s*\.L_x_(\d+):", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"/\*([0-9a-f]{4})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            if cur is not None:
                labels.setdefault(cur, addr)
            ins.append((addr, m.group(2)))
    best = (0, -1)
    for addr, text in ins:
        m = re.search(r"BRA.*\.L_x_(\d+)", text)
        if m and labels.get(m.group(1), addr) < addr and addr - labels[m.group(1)] > \
                best[1] - best[0]:
            best = (labels[m.group(1)], addr)
    return [t for a, t in ins if best[0] <= a <= best[1]]


def sass_counts() -> None:
    """Compile the int4 variants for sm_90 here (no GPU) and print their K loops' SASS
    instructions per weight byte a thread streams, with the most frequent opcodes."""
    import collections
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    ptrs = {"x_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*bf16",
            "N": "i32"}
    print("| variant | config (XBLOCK, RBLOCK, warps) | loop instructions / weight byte | "
          "top opcodes |")
    print("|---|---|---:|---|")
    for vname, fn, extra in (("i4_lane", gemv_i4, {"MODE": 0, "SUB": 16}),
                             ("i4_sub", gemv_i4, {"MODE": 2, "SUB": 16}),
                             ("i4_pair", gemv_i4, {"MODE": 3, "SUB": 16}),
                             ("i4_nib", gemv_i4_nib, {}),
                             ("i4_nibx", gemv_i4_nibx, {}),
                             ("i4_pl", gemv_i4_pl, {}),
                             ("i4_plx", gemv_i4_plx, {})):
        for xb, rb, nw in ((8, 2048, 4), (16, 1024, 4), (8, 1024, 4), (32, 1024, 4)):
            consts = {"K": 4096, "GS": G, "XBLOCK": xb, "RBLOCK": rb, **extra}
            sig = {**ptrs, **{c: "constexpr" for c in consts}}
            src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                            attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": nw})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True,
                                      text=True, check=True).stdout
            body = _loop_sass(sass)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                      for t in body)
            per_byte = len(body) / (xb * rb / 2 / (32 * nw))
            top = ", ".join(f"{o} {c}" for o, c in ops.most_common(6))
            print(f"| {vname} | ({xb}, {rb}, {nw}) | {per_byte:.1f} | {top} |", flush=True)


def _regs(cubin: str) -> str:
    """Registers a thread of a cubin file (cuobjdump's resource usage)."""
    import subprocess
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), "-res-usage", cubin], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return m.group(1) if m else "?"


def decode_sass(mode: str, cfgs: list[tuple[int, int, int]]) -> None:
    """No GPU: kiln's own decode GEMVs (the GEMV template with its prologues and epilogues) of a
    1-layer decoder at the 8B widths (vocab 256), weights `mode`, compiled for sm_90 at each
    config of `cfgs`; the K loop's SASS instructions per weight byte a thread streams."""
    import collections
    import subprocess
    import tempfile
    from dataclasses import replace

    import kiln
    from kiln.models.hf_decoder import export_step, llama
    from kiln.options import Options
    from kiln.targets.cuda.build import triton_kernels
    from kiln.targets.cuda.kernel import Config
    from kiln.targets.cuda.wrapper_py import import_triton_module
    from kiln.toolchain.triton_aot import compile_kernel
    torch.manual_seed(0)
    model = llama(layers=1, hidden=4096, heads=32, kv_heads=8, vocab=256, inter=14336)
    _, ep = export_step(model, 16, dtype=torch.bfloat16)
    b = kiln.compile(ep, device="cuda", options=Options(
        cuda_archs=(90,), autotune=False, weight_quant=mode, weight_quant_group=G)).built
    mod = import_triton_module(b.sources["kernels_triton.py"])
    bufs = {x.name: x for x in b.loop.buffers}
    hints = {s.name: s.example for s in b.graph.symbols}
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    per = {"int4": 0.5, "int8": 1, "none": 2}[mode]
    print("| kernel | config (XBLOCK, RBLOCK, warps) | loop instructions / weight byte | "
          "STL | registers | top opcodes |")
    print("|---|---|---:|---:|---:|---|")
    for k in triton_kernels(b.steps, bufs, hints):
        if not k.name.startswith("gemm"):
            continue
        for xb, rb, nw in cfgs:
            ck = compile_kernel(mod, replace(k, config=Config(xb, rb, nw, k.config.num_stages)),
                                90)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(ck.asm["cubin"])
                f.flush()
                sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True,
                                      text=True, check=True).stdout
                regs = _regs(f.name)
            body = _loop_sass(sass)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                      for t in body)
            top = ", ".join(f"{o} {c}" for o, c in ops.most_common(6))
            print(f"| {k.name} | ({xb}, {rb}, {nw}) | {len(body) / (xb * rb * per / (32 * nw)):.1f}"
                  f" | {sass.count('STL')} | {regs} | {top} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer configs (a smoke run)")
    ap.add_argument("--sass", action="store_true",
                    help="no GPU: the int4 loops' SASS instructions per weight byte")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--variants", default="", help="comma-separated variant names (all)")
    ap.add_argument("--xblock", default="", help="comma-separated XBLOCKs (the sweep's)")
    ap.add_argument("--warps", default="", help="comma-separated num_warps (the sweep's)")
    ap.add_argument("--bytes", default="", help="comma-separated weight bytes a row and step")
    ap.add_argument("--sass-decode", default="", metavar="MODE",
                    help="no GPU: SASS a weight byte of kiln's decode GEMVs (int4 / int8 / none)"
                    " at the --configs")
    ap.add_argument("--configs", default="8x2048x4,16x2048x8,32x1024x4",
                    help="XBLOCKxRBLOCKxwarps list for --sass-decode")
    a = ap.parse_args()
    if a.sass:
        sass_counts()
        return
    if a.sass_decode:
        decode_sass(a.sass_decode, [tuple(int(v) for v in c.split("x"))
                                    for c in a.configs.split(",")])
        return
    torch.manual_seed(0)
    bw = copy_gbs()
    print(f"GPU {torch.cuda.get_device_name(0)}, copy bandwidth {bw:.0f} GB/s", flush=True)
    xb = [4, 8] if a.quick else [2, 4, 8, 16]
    bytes_step = [1024] if a.quick else [512, 1024, 2048]
    warps = [4] if a.quick else [4, 8]
    if a.xblock:
        xb = [int(v) for v in a.xblock.split(",")]
    if a.warps:
        warps = [int(v) for v in a.warps.split(",")]
    if a.bytes:
        bytes_step = [int(v) for v in a.bytes.split(",")]
    best: dict[tuple[str, str], tuple[float, tuple]] = {}
    for name, n, k in [s for s in SHAPES if s[0] in a.shapes.split(",")]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        q8 = quantize_int8(w.float().cpu())
        q4 = quantize_int4(w.float().cpu(), G)
        forms = {
            "bf16": ([w], w.numel() * 2),
            "i8": ([q8["q"].cuda(), q8["s"].cuda()], n * k + 4 * n),
            "i4": ([q4["q"].cuda(), q4["s"].cuda()], n * k // 2 + 4 * n * (k // G)),
            "i4pl": ([planes_from_pairs(q4["q"]).cuda(), q4["s"].cuda()],
                     n * k // 2 + 4 * n * (k // G)),
        }
        refs = {"bf16": w.double() @ x.double(),
                "i8": (q8["q"].double() * q8["s"].double()[:, None]).cuda() @ x.double()}
        p = q4["q"].to(torch.int16)
        deq = torch.stack([(p & 15) - 8, (p >> 4) - 8], 2).reshape(n, -1).double()
        refs["i4"] = ((deq.reshape(n, -1, G) * q4["s"].double()[:, :, None]).reshape(n, -1)
                      ).cuda() @ x.double()
        refs["i4pl"] = refs["i4"]  # (the same values, repacked)
        del p, deq
        variants = {
            "bf16": ("bf16", lambda o, t, c: gemv_bf16[(triton.cdiv(n, c[0]),)](
                x, t[0], o, n, k, XBLOCK=c[0], RBLOCK=c[1], num_warps=c[2]), 2),
            "i8_lane": ("i8", lambda o, t, c: gemv_i8[(triton.cdiv(n, c[0]),)](
                x, t[0], t[1], o, n, k, XBLOCK=c[0], RBLOCK=c[1], SUB=1, num_warps=c[2]), 1),
            "i8_sub": ("i8", lambda o, t, c: gemv_i8[(triton.cdiv(n, c[0]),)](
                x, t[0], t[1], o, n, k, XBLOCK=c[0], RBLOCK=c[1], SUB=16, num_warps=c[2]), 1),
        }
        for vname, mode in (("i4_lane", 0), ("i4_grp", 1), ("i4_sub", 2), ("i4_pair", 3)):
            variants[vname] = ("i4", lambda o, t, c, mode=mode: gemv_i4[(triton.cdiv(n, c[0]),)](
                x, t[0], t[1], o, n, k, GS=G, XBLOCK=c[0], RBLOCK=c[1], MODE=mode, SUB=16,
                num_warps=c[2]), 0.5)
        variants["i4_nib"] = ("i4", lambda o, t, c: gemv_i4_nib[(triton.cdiv(n, c[0]),)](
            x, t[0], t[1], o, n, k, GS=G, XBLOCK=c[0], RBLOCK=c[1], num_warps=c[2]), 0.5)
        variants["i4_nibx"] = ("i4", lambda o, t, c: gemv_i4_nibx[(triton.cdiv(n, c[0]),)](
            x, t[0], t[1], o, n, k, GS=G, XBLOCK=c[0], RBLOCK=c[1], num_warps=c[2]), 0.5)
        variants["i4_pl"] = ("i4pl", lambda o, t, c: gemv_i4_pl[(triton.cdiv(n, c[0]),)](
            x, t[0], t[1], o, n, k, GS=G, XBLOCK=c[0], RBLOCK=c[1], num_warps=c[2]), 0.5)
        variants["i4_plx"] = ("i4pl", lambda o, t, c: gemv_i4_plx[(triton.cdiv(n, c[0]),)](
            x, t[0], t[1], o, n, k, GS=G, XBLOCK=c[0], RBLOCK=c[1], num_warps=c[2]), 0.5)
        if a.variants:
            variants = {v: f for v, f in variants.items() if v in a.variants.split(",")}
        for vname, (form, fn, itemsize) in variants.items():
            tensors, nbytes = forms[form]
            copies = max(2, math.ceil(400e6 / nbytes))
            sets = [tensors] + [[t.clone() for t in tensors] for _ in range(copies - 1)]
            out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
            for xblock, bs, nw in itertools.product(xb, bytes_step, warps):
                rblock = min(int(bs / itemsize), k)
                if form.startswith("i4") and (rblock < G or k % rblock):  # (no K mask in i4's loop)
                    continue
                cfg = (xblock, rblock, nw)
                try:
                    fn(out, sets[0], cfg)
                    torch.cuda.synchronize()
                    ref = refs[form]
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    if err > 2e-2:
                        print(f"{name} {vname} {cfg}: WRONG (rel err {err:.3g})", flush=True)
                        continue
                    us = graph_us([lambda t=t: fn(out, t, cfg) for t in sets])
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"{name} {vname} {cfg}: {type(e).__name__}: {str(e)[:160]}",
                          flush=True)
                    continue
                gbs = nbytes / us / 1e3
                print(f"{name} {vname} {cfg}: {us:.2f} us, {gbs:.0f} GB/s "
                      f"({100 * gbs / bw:.0f}% of the copy bandwidth), err {err:.1e}",
                      flush=True)
                if (name, vname) not in best or us < best[name, vname][0]:
                    best[name, vname] = (us, cfg, nbytes)
            del sets
        del forms, refs
        torch.cuda.empty_cache()
    names = [s[0] for s in SHAPES if s[0] in a.shapes.split(",")]
    vnames = sorted({v for _, v in best}, key=lambda v: list(variants).index(v))
    print(f"\nbest config per shape: us (weight bytes / time as % of the copy bandwidth, "
          f"{bw:.0f} GB/s: the roofline's)\n")
    print("| variant | " + " | ".join(names) + " | 8B GEMVs ms/token | vs bf16 |")
    print("|---|" + "---|" * len(names) + "---|---|")
    tot_bf16 = sum(best[s, "bf16"][0] * PER_TOKEN[s] for s in names if (s, "bf16") in best)
    for v in vnames:
        cells, tot = [], 0.0
        for s in names:
            if (s, v) in best:
                us, cfg, nbytes = best[s, v]
                cells.append(f"{us:.1f} ({100 * nbytes / us / 1e3 / bw:.0f}%) {cfg}")
                tot += us * PER_TOKEN[s]
            else:
                cells.append("-")
        print(f"| {v} | " + " | ".join(cells) + f" | {tot / 1e3:.3f} | "
              f"{tot_bf16 / tot if tot else 0:.2f}x |")


if __name__ == "__main__":
    main()
