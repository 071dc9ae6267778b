"""Fused CPU attention (kiln_attention.h) against kiln's decomposed path (bmm, softmax, bmm)
for one scaled_dot_product_attention call, at the sequence lengths of issue 14 (128, 197,
512), head size 64, with no mask / causal / a bool padding mask [B, 1, L, S]:

    taskset -c 1 python bench/cpu_attention_shapes.py [--seqs 128,197,512] [--rounds 7]

Both packages of a case are timed in alternating bursts (--burst seconds each) in one
process; a burst's figure is the process CPU time per call. Printed: median over rounds of
each, and the median of the per-round ratios fused / decomposed (below 1: fused faster)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kiln  # noqa: E402


class Sdpa(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, m):
        if self.kind == "causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m if self.kind == "bool"
                                              else None)


def burst(fn, seconds: float) -> float:
    n, t0, w0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - w0 < seconds:
        fn()
        n += 1
    return (time.process_time() - t0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="128,197,512")
    p.add_argument("--kinds", default="none,causal,bool")
    p.add_argument("--queries", type=int, default=0,
                   help="query rows (default: the sequence length; 1: a decode step)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--burst", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    d = tempfile.mkdtemp(prefix="kiln-attn-")
    print(f"load {os.getloadavg()}")
    print(f"{'kind':7s} {'seq':>5s} {'decomposed ms':>14s} {'fused ms':>9s} {'fused/dec':>9s}")
    for kind in a.kinds.split(","):
        for s in map(int, a.seqs.split(",")):
            b, h, e, lq = a.batch, a.heads, a.head_dim, a.queries or s
            args = (torch.randn(b, h, lq, e), torch.randn(b, h, s, e), torch.randn(b, h, s, e),
                    torch.rand(b, 1, lq, s) > 0.1)
            runs = {}
            for name, fused in (("decomposed", False), ("fused", True)):
                c = kiln.compile(Sdpa(kind), args, options=kiln.Options(
                    num_threads=a.threads, fused_attention=fused))
                r = kiln.load(c.save(os.path.join(d, f"{kind}{s}{name}.kiln")),
                              num_threads=a.threads)
                for _ in range(3):
                    r(*args)
                runs[name] = r
            t = {n: [] for n in runs}
            ratios = []
            for k in range(a.rounds):
                order = list(runs) if k % 2 == 0 else list(runs)[::-1]
                got = {n: burst(lambda: runs[n](*args), a.burst) for n in order}
                for n in runs:
                    t[n].append(got[n])
                ratios.append(got["fused"] / got["decomposed"])
            print(f"{kind:7s} {s:5d} {statistics.median(t['decomposed']):14.3f} "
                  f"{statistics.median(t['fused']):9.3f} {statistics.median(ratios):9.3f}",
                  flush=True)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
