"""The int4 GEMV on tensor cores (kiln/gemm/int4_tc.py) against the CUDA-core int4 GEMV of
the template (bench/quant_gemv_variants.py `i4_nib`, the loop kiln prints) and the bf16 GEMV,
at the decode GEMVs of Llama-3-8B (issue 17 item 4): standalone kernels, M = 1, bf16 x,
int4 group 128, weights cold (each shape has >= 400 MB of copies, one launch a copy in a CUDA
graph; the time per launch is the graph's / copies). Split-K rows (`*_sk2/4/8`: SPLIT
programs a block of rows, each over K / SPLIT, adding into a float32 result atomically)
include the zeroing of that result (a memset node in the graph); `i8` is the template's int8
loop (quant_gemv_variants `i8_sub`), `bf16_sk*` / `i8_sk*` the lane-wise loop split
(`gemv_sk`), `tc_pf0` / `tc_pf2` the tensor-core kernel with 0 / 2 steps of prefetch,
`tc_wide` with steps of 2048 values (two chunks a lane).

    python bench/int4_tc_gemv.py [--shapes o,kv] [--quick] [--variants tc,tc_sk2]
    python bench/int4_tc_gemv.py --sass   # no GPU: SASS instructions a weight byte in the
                                          # K loops (sm_90, compiled here)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.quant_gemv_variants import gemv_bf16, gemv_i4_nib, gemv_i8, graph_us  # noqa: E402
from kiln.gemm.int4_tc import _step_loads, gemv_int4_tc_kernel, mma_pair, pack_tc  # noqa: E402
from kiln.gemm.quant_gemv import dequantize, quantize_int4, quantize_int8  # noqa: E402

G = 128
SHAPES = [("o", 4096, 4096), ("kv", 1024, 4096), ("gate", 14336, 4096),
          ("down", 4096, 14336), ("qkv", 6144, 4096), ("gate_up", 28672, 4096)]
#: (XBLOCK, RBLOCK, warps): bf16 and i4_nib: the tuner's picks of earlier sessions (BENCHMARKS.md,
#: eleventh and sixteenth sessions); tc: 16 or 8 words a thread and step (no spills), 2 to 16
#: rows a warp
BF16 = [(8, 512, 4), (16, 512, 4)]
I8 = [(8, 1024, 4), (16, 512, 4)]
NIB = [(16, 1024, 4), (16, 2048, 4), (8, 2048, 4), (32, 1024, 4)]
TC = [(8, 1024, 1), (16, 512, 1), (16, 1024, 2), (32, 1024, 4), (4, 1024, 1), (8, 512, 1),
      (8, 1024, 2), (16, 256, 1)]
TC_SPLIT = [(8, 1024, 1), (16, 512, 1), (4, 1024, 1), (8, 512, 1)]
TC_WIDE = [(4, 2048, 1), (8, 2048, 2), (16, 2048, 4)]  # 2 chunks a lane: fewer, longer steps
SK = [(8, 512, 4), (16, 512, 4), (4, 1024, 4)]  # bf16 / int8 split-K (RBLOCK elements)


@triton.jit
def gemv_sk(x_ptr, w_ptr, s_ptr, out_ptr, N, K: tl.constexpr, XBLOCK: tl.constexpr,
            RBLOCK: tl.constexpr, INT8: tl.constexpr, SPLIT: tl.constexpr):
    """bf16 or int8 (per-channel scale) GEMV, split-K: program (i, j) sums part j of SPLIT
    of K (lane-wise float32 accumulator, as the template) and adds it to the float32 out."""
    KS: tl.constexpr = K // SPLIT
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    nmask = rn < N
    rk = tl.program_id(1) * KS + tl.arange(0, RBLOCK)[None, :]
    acc = tl.zeros((XBLOCK, RBLOCK), dtype=tl.float32)
    for k0 in range(0, KS, RBLOCK):
        kk = k0 + rk
        x = tl.load(x_ptr + kk).to(tl.float32)
        if INT8:
            q = tl.load(w_ptr + rn * K + kk, mask=nmask, other=0)
            w = (q.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x4B000080).to(
                tl.float32, bitcast=True) - 8388736.0
        else:
            w = tl.load(w_ptr + rn * K + kk, mask=nmask, other=0.0).to(tl.float32)
        acc += w * x
    tot = tl.sum(acc, 1, keep_dims=True)
    if INT8:
        tot = tot * tl.load(s_ptr + rn, mask=nmask, other=0.0)
    tl.atomic_add(out_ptr + rn, tot, mask=nmask, sem="relaxed")


@triton.jit
def _norm_x(ph, pg, k0):
    """x = h * gamma at one nibble place (the RMSNorm prologue, its 1 / rms factored out),
    rounded to bf16 as the template rounds the prologue's row."""
    return (tl.load(ph + k0).to(tl.float32) * tl.load(pg + k0).to(tl.float32)).to(tl.bfloat16)


@triton.jit
def gemv_int4_tc_norm(h_ptr, g_ptr, p_ptr, s_ptr, out_ptr, N, K: tl.constexpr,
                      G: tl.constexpr, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    """The tensor-core GEMV (prefetch 1) of RMSNorm(h) * gamma as the template would print
    it: x at the 8 nibble places computed from h and gamma in the weight tile's shape (so it
    gets the words' layout), the sum of squares from a [T, 1, 4] load (the [T, H, 4] tile
    would count each value H times), 1 / rms on the row sums. SASS only (`--sass`)."""
    H: tl.constexpr = XBLOCK // 2
    T: tl.constexpr = RBLOCK // 32
    r0 = tl.program_id(0) * XBLOCK + tl.arange(0, H)[None, :, None]
    ra = tl.minimum(r0, N - 1)
    rb = tl.minimum(r0 + H, N - 1)
    rt = tl.arange(0, T)[:, None, None]
    rj = tl.arange(0, 4)[None, None, :]
    rw = rt * 4 + rj
    pw = p_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    pwa = pw + ra * (K // 8) + rw
    pwb = pw + rb * (K // 8) + rw
    psa = s_ptr + ra * (K // G) + rt * 32 // G
    psb = s_ptr + rb * (K // G) + rt * 32 // G
    ph = h_ptr + rt * 32 + rj + r0 * 0
    pg = g_ptr + rt * 32 + rj + r0 * 0
    ps2 = h_ptr + rt * 32 + rj  # [T, 1, 4]
    acc_a = tl.zeros((T, H, 4), dtype=tl.float32)
    acc_b = tl.zeros((T, H, 4), dtype=tl.float32)
    ss = tl.zeros((T, 1, 4), dtype=tl.float32)
    wa, wb, sa, sb = _step_loads(pwa, pwb, psa, psb, 0, G)
    for k0 in range(RBLOCK, K + RBLOCK, RBLOCK):
        ca, cb, csa, csb = wa, wb, sa, sb
        if k0 < K:
            wa, wb, sa, sb = _step_loads(pwa, pwb, psa, psb, k0, G)
        c = k0 - RBLOCK
        for i in tl.static_range(8):
            hv = tl.load(ps2 + c + 4 * i).to(tl.float32)
            ss += hv * hv
        da, db = mma_pair(ca, cb, _norm_x(ph, pg, c), _norm_x(ph, pg, c + 4),
                          _norm_x(ph, pg, c + 8), _norm_x(ph, pg, c + 12),
                          _norm_x(ph, pg, c + 16), _norm_x(ph, pg, c + 20),
                          _norm_x(ph, pg, c + 24), _norm_x(ph, pg, c + 28), True)
        acc_a += da * csa
        acc_b += db * csb
    inv = tl.rsqrt(tl.sum(tl.sum(tl.sum(ss, 2), 1), 0) / K + 1e-5)
    ya = tl.sum(tl.sum(acc_a, 2), 0) * inv
    yb = tl.sum(tl.sum(acc_b, 2), 0) * inv
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, H)
    tl.store(out_ptr + rn, ya.to(out_ptr.dtype.element_ty), mask=rn < N)
    tl.store(out_ptr + rn + H, yb.to(out_ptr.dtype.element_ty), mask=rn + H < N)


def _tc_launch(x, n, k, split, prefetch=1):
    def run(out, t, c):
        if split > 1:
            out.zero_()
        gemv_int4_tc_kernel[(triton.cdiv(n, c[0]), split)](
            x, t[0], t[1], out, n, k, G=G, XBLOCK=c[0], RBLOCK=c[1], USE_MMA=True,
            SPLIT=split, PREFETCH=prefetch, num_warps=c[2])
    return run


def _sk_launch(x, n, k, split, int8):
    def run(out, t, c):
        out.zero_()
        gemv_sk[(triton.cdiv(n, c[0]), split)](
            x, t[0], t[1] if int8 else t[0], out, n, k, XBLOCK=c[0], RBLOCK=c[1], INT8=int8,
            SPLIT=split, num_warps=c[2])
    return run


def bench(shapes: list[str], quick: bool, only: list[str]) -> None:
    from bench.llm_gpu import copy_gbs
    torch.manual_seed(0)
    bw = copy_gbs()
    print(f"GPU {torch.cuda.get_device_name(0)}, copy bandwidth {bw:.0f} GB/s", flush=True)
    best: dict[tuple[str, str], tuple[float, tuple, int]] = {}
    for name, n, k in [s for s in SHAPES if s[0] in shapes]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        q4 = quantize_int4(w.float().cpu(), G)
        i4_bytes = n * k // 2 + 4 * n * (k // G)
        q8 = quantize_int8(w.float().cpu())
        forms = {"bf16": ([w], n * k * 2), "i8": ([q8["q"].cuda(), q8["s"].cuda()], n * k + 4 * n),
                 "i4": ([q4["q"].cuda(), q4["s"].cuda()], i4_bytes),
                 "i4tc": ([pack_tc(q4["q"]).cuda(), q4["s"].cuda()], i4_bytes)}
        ref4 = dequantize("int4", q4, G).cuda() @ x.double()
        refs = {"bf16": w.double() @ x.double(), "i4": ref4, "i4tc": ref4,
                "i8": dequantize("int8", q8).cuda() @ x.double()}
        variants = {
            "bf16": ("bf16", BF16, torch.bfloat16, lambda o, t, c: gemv_bf16[(
                triton.cdiv(n, c[0]),)](x, t[0], o, n, k, XBLOCK=c[0], RBLOCK=c[1],
                                        num_warps=c[2])),
            "i4_nib": ("i4", NIB, torch.bfloat16, lambda o, t, c: gemv_i4_nib[(
                triton.cdiv(n, c[0]),)](x, t[0], t[1], o, n, k, GS=G, XBLOCK=c[0],
                                        RBLOCK=c[1], num_warps=c[2])),
            "i8": ("i8", I8, torch.bfloat16, lambda o, t, c: gemv_i8[(triton.cdiv(n, c[0]),)](
                x, t[0], t[1], o, n, k, XBLOCK=c[0], RBLOCK=c[1], SUB=16, num_warps=c[2])),
            "tc": ("i4tc", TC, torch.bfloat16, _tc_launch(x, n, k, 1)),
            "tc_pf0": ("i4tc", TC, torch.bfloat16, _tc_launch(x, n, k, 1, 0)),
            "tc_pf2": ("i4tc", TC + TC_WIDE, torch.bfloat16, _tc_launch(x, n, k, 1, 2)),
            "tc_wide": ("i4tc", TC_WIDE, torch.bfloat16, _tc_launch(x, n, k, 1)),
        }
        for sp in (2, 4, 8):
            variants[f"tc_sk{sp}"] = ("i4tc", TC_SPLIT, torch.float32, _tc_launch(x, n, k, sp))
            variants[f"bf16_sk{sp}"] = ("bf16", SK, torch.float32, _sk_launch(x, n, k, sp, False))
            variants[f"i8_sk{sp}"] = ("i8", SK, torch.float32, _sk_launch(x, n, k, sp, True))
        if only:
            variants = {v: f for v, f in variants.items() if v in only}
        for vname, (form, cfgs, odt, fn) in variants.items():
            tensors, nbytes = forms[form]
            copies = max(2, math.ceil(400e6 / nbytes))
            sets = [tensors] + [[t.clone() for t in tensors] for _ in range(copies - 1)]
            out = torch.empty(n, device="cuda", dtype=odt)
            for cfg in cfgs[:3] if quick else cfgs:
                xb, rb, nw = cfg
                split = int(vname.rsplit("_sk", 1)[1]) if "_sk" in vname else 1
                if rb > k // split or (k // split) % rb or \
                        (vname == "tc_pf2" and k // split < 2 * rb):
                    continue
                try:
                    out.fill_(float("nan"))
                    fn(out, sets[0], cfg)
                    torch.cuda.synchronize()
                    ref = refs[form]
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:  # (NaN too: an unwritten output)
                        print(f"{name} {vname} {cfg}: WRONG (rel err {err:.3g})", flush=True)
                        continue
                    us = graph_us([lambda t=t: fn(out, t, cfg) for t in sets])
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"{name} {vname} {cfg}: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                    continue
                gbs = nbytes / us / 1e3
                print(f"{name} {n}x{k} {vname} {cfg}: {us:.2f} us, {gbs:.0f} GB/s "
                      f"({100 * gbs / bw:.0f}%), err {err:.1e}", flush=True)
                if (name, vname) not in best or us < best[name, vname][0]:
                    best[name, vname] = (us, cfg, nbytes)
            del sets
        del forms, refs
        torch.cuda.empty_cache()
    names = [s[0] for s in SHAPES if s[0] in shapes]
    order = ["bf16", "bf16_sk2", "bf16_sk4", "bf16_sk8", "i8", "i8_sk2", "i8_sk4", "i8_sk8",
             "i4_nib", "tc", "tc_pf0", "tc_pf2", "tc_wide", "tc_sk2", "tc_sk4", "tc_sk8"]
    vnames = [v for v in order if any((s, v) in best for s in names)]
    print(f"\nbest config per shape: us, GB/s (% of the copy bandwidth {bw:.0f} GB/s), "
          f"(XBLOCK, RBLOCK, warps)\n")
    print("| variant | " + " | ".join(f"{s} {n}x{k}" for s, n, k in SHAPES if s in names)
          + " |")
    print("|---|" + "---|" * len(names))
    for v in vnames:
        cells = []
        for s in names:
            if (s, v) in best:
                us, cfg, nbytes = best[s, v]
                gbs = nbytes / us / 1e3
                cells.append(f"{us:.2f} us, {gbs:.0f} ({100 * gbs / bw:.0f}%) {cfg}")
            else:
                cells.append("-")
        print(f"| {v} | " + " | ".join(cells) + " |")


NORM_PTRS = {"h_ptr": "*bf16", "g_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*fp32",
             "out_ptr": "*bf16", "N": "i32"}


def sass() -> None:
    """SASS instructions a weight byte in the K loop, tc and i4_nib, compiled here (sm_90)."""
    import collections
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.quant_gemv_variants import _loop_sass
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    ptrs = {"x_ptr": "*bf16", "p_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32"}
    print("| kernel | K | (XBLOCK, RBLOCK, warps) | loop SASS / weight byte | STL | top opcodes |")
    print("|---|---:|---|---:|---:|---|")
    for kname, fn, extra, cfgs in (
            ("i4_nib", gemv_i4_nib, {"GS": G}, NIB),
            ("tc", gemv_int4_tc_kernel, {"G": G, "USE_MMA": True, "SPLIT": 1, "PREFETCH": 1}, TC),
            ("tc_pf2", gemv_int4_tc_kernel, {"G": G, "USE_MMA": True, "SPLIT": 1, "PREFETCH": 2},
             TC[:3]),
            ("tc + RMSNorm prologue", gemv_int4_tc_norm, {"G": G}, TC[:3] + TC[4:7])):
        for k in (4096, 14336):
            for xb, rb, nw in cfgs:
                if k % rb:
                    continue
                consts = {"K": k, **extra, "XBLOCK": xb, "RBLOCK": rb}
                base = NORM_PTRS if fn is gemv_int4_tc_norm else ptrs
                sig = {**base, **{c: "constexpr" for c in consts}}
                src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                                attrs={(i,): [["tt.divisibility", 16]]
                                       for i in range(len(base))})
                ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": nw})
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(ck.asm["cubin"])
                    f.flush()
                    text = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True,
                                          text=True, check=True).stdout
                body = _loop_sass(text)
                ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
                                          .split(".")[0] for t in body)
                per = len(body) / (xb * rb / 2 / (32 * nw))
                top = ", ".join(f"{o} {c}" for o, c in ops.most_common(6))
                print(f"| {kname} | {k} | ({xb}, {rb}, {nw}) | {per:.2f} | "
                      f"{text.count('STL')} | {top} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--variants", default="", help="comma-separated subset")
    a = ap.parse_args()
    if a.sass:
        sass()
        return
    bench(a.shapes.split(","), a.quick, [v for v in a.variants.split(",") if v])


if __name__ == "__main__":
    main()
