"""Programmatic dependent launch (PDL) for a decoder's chain of GEMVs: does letting each kernel
start during the previous one's tail, prefetch its weights into L2 and only then wait for the
previous kernel's results pay on this GPU? (issue 17 item 3; Hopper and later)

A Llama-shaped layer's four GEMVs (q/k/v merged, o, gate/up merged, down; bf16, M = 1) and a
small dependent kernel between each pair (as attention / norms are), `--layers` layers with
their own weights (more bytes than L2), captured into one CUDA graph and replayed. Variants:

  plain     no PDL (cuLaunchKernel semantics: each kernel starts when the previous ends)
  pdl       launched with programmatic stream serialisation; every kernel triggers its
            dependents at entry and waits (griddepcontrol.wait) before its first read of data
            a previous kernel wrote
  pdl+pf    as pdl, and the GEMVs first issue an L2 bulk prefetch of their weight rows (weights
            are never written by a kernel, so reading them early is safe)

Printed: ms per layer-chain replay (device time of the graph, median), the weight bytes and
GB/s, and the max difference between the variants' outputs (they must agree exactly).

    python bench/pdl_gpu.py [--layers 16] [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.cuda_timing import events_ms  # noqa: E402


@triton.jit
def _prefetch_rows(p, nbytes):
    """An L2 bulk prefetch of the `nbytes` bytes at p (a scalar pointer; nbytes a multiple of
    16): 4 KiB chunks, one a thread, so no chunk is asked for twice."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t, o, c; .reg .u64 a; mov.u32 t, %tid.x; "
        "mul.lo.u32 o, t, 4096; setp.lt.u32 p, o, $2; sub.u32 c, $2, o; min.u32 c, c, 4096; "
        "mul.wide.u32 a, t, 4096; add.u64 a, a, $1; "
        "@p cp.async.bulk.prefetch.L2.global [a], c; } mov.u32 $0, 0;",
        "=r,l,r", [p, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gemv(x, w, out, N: tl.constexpr, K: tl.constexpr, XBLOCK: tl.constexpr,
         RBLOCK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
         TRIGGER: tl.constexpr = True):
    rn = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    nmask = rn < N
    rk = tl.arange(0, RBLOCK)[None, :]
    pb = w + rn * K
    if PDL:
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH:
            row0 = tl.program_id(0) * XBLOCK
            _prefetch_rows(w + row0 * K, (tl.minimum(N - row0, XBLOCK) * K * 2).to(tl.int32))
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((XBLOCK, RBLOCK), dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        kk = k0 + rk
        kmask = kk < K
        a = tl.load(x + kk, mask=kmask, other=0.0).to(tl.float32)
        b = tl.load(pb + kk, mask=nmask & kmask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out + rn, tl.sum(acc, 1, keep_dims=True).to(tl.bfloat16), mask=nmask)


@triton.jit
def squash(x, out, N: tl.constexpr, KEEP: tl.constexpr, BLOCK: tl.constexpr,
           PDL: tl.constexpr):
    """out[:KEEP] = tanh-ish(x[:KEEP]) (a stand-in for attention / a norm: small, dependent)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + r, mask=r < N, other=0.0).to(tl.float32)
    v = v / (1 + tl.abs(v))
    tl.store(out + r, v.to(tl.bfloat16), mask=r < KEEP)


def layer_shapes(hidden, inter, heads, kv_heads):
    hd = hidden // heads
    return [("qkv", hidden + 2 * kv_heads * hd, hidden), ("o", hidden, hidden),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def build(layers, shapes, dev):
    torch.manual_seed(0)
    ws = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _, n, k in shapes]
          for _ in range(layers)]
    width = max(max(n, k) for _, n, k in shapes)
    bufs = [torch.zeros(width, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    return ws, bufs


def chain(ws, bufs, shapes, x0, pdl, pf, xblock=8, rblock=512, trigger=True):
    cur, tmp = bufs
    cur[: x0.numel()].copy_(x0)
    for lw in ws:
        for (name, n, k), w in zip(shapes, lw):
            grid = (triton.cdiv(n, xblock),)
            gemv[grid](cur, w, tmp, n, k, xblock, rblock, pdl, pf, trigger, num_warps=4,
                       launch_pdl=pdl)
            nxt = {"qkv": shapes[1][2], "o": shapes[2][2], "gate_up": shapes[3][2],
                   "down": shapes[0][2]}[name]
            squash[(triton.cdiv(n, 1024),)](tmp, cur, n, nxt, 1024, pdl, num_warps=4,
                                            launch_pdl=pdl)
    return cur


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--configs", default="8x512",
                   help="GEMV BLOCK_N x BLOCK_K configs to time (plain and pdl), e.g. 8x512,4x2048")
    a = p.parse_args()
    dev = "cuda"
    shapes = layer_shapes(a.hidden, a.inter, a.heads, a.kv_heads)
    ws, bufs = build(a.layers, shapes, dev)
    x0 = torch.randn(a.hidden, device=dev, dtype=torch.bfloat16)
    nbytes = sum(w.numel() * 2 for lw in ws for w in lw)
    variants = {}
    for c in a.configs.split(","):
        xb, rb = (int(v) for v in c.split("x"))
        variants.update({
            f"plain {c}": (False, False, True, xb, rb), f"pdl {c}": (True, False, True, xb, rb),
            f"pdl+pf {c}": (True, True, True, xb, rb),
            f"pdl, GEMVs trigger at exit {c}": (True, False, False, xb, rb)})
    graphs, outs = {}, {}
    for name, (pdl, pf, trig, xb, rb) in variants.items():
        run = lambda: chain(ws, bufs, shapes, x0, pdl, pf, xb, rb, trig)  # noqa: E731
        run()  # compile
        torch.cuda.synchronize()
        outs[name] = run().clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        graphs[name] = g
    times = {k: [] for k in variants}
    for _ in range(a.repeat):  # interleaved
        for name, g in graphs.items():
            times[name].append(events_ms(g.replay, 1, warmup=0))
    ref = next(iter(outs.values()))
    print(f"GPU: {torch.cuda.get_device_name()}; {a.layers} layers, weights {nbytes / 2**20:.0f} "
          f"MiB, {len(shapes) * 2 * a.layers} kernels a replay")
    print("| variant | ms (median) | min | GB/s of weights | max diff vs plain |")
    print("|---|---:|---:|---:|---:|")
    for name in variants:
        med = statistics.median(times[name])
        diff = (outs[name].float() - ref.float()).abs().max().item()
        print(f"| {name} | {med:.3f} | {min(times[name]):.3f} | {nbytes / med / 1e6:.0f} | "
              f"{diff:.2e} |")


if __name__ == "__main__":
    main()
