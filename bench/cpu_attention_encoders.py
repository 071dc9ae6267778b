"""The fused CPU attention (kiln_attention.h) at the transformer encoders' shapes, packages of
several trees in one process (issue 14; BENCHMARKS.md, eighteenth session, s18attn):

    python bench/cpu_attention_encoders.py build TAG        # with this tree: DIR/TAG_<case>.kiln
    taskset -c 1 python bench/cpu_attention_encoders.py time old,new [--threads 1]

`build` compiles one scaled_dot_product_attention per case with the tree it runs from (run it
from each tree, e.g. a `git worktree` of the base commit, with the same --dir); `time` loads the
tags' packages, checks each output against eager in float64, then times them in rotating
bursts (--burst seconds each, --rounds rounds): a burst's figure is its fastest call (wall
time). Printed per case: the median over rounds per tag and the median of the per-round
ratios to the first tag. Cases: Whisper tiny's encoder (6 heads, 750 positions), ViT-base (12,
197) unmasked and under an all-true bool mask (what ViT ran before the mask was dropped at
import), BERT-base (12, 128, a bool padding mask) and an odd shape (float mask, head size 40)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kiln  # noqa: E402

CASES = {  # name: (B, H, L, S, E, mask)
    "whisper": (1, 6, 750, 750, 64, None),
    "vit": (1, 12, 197, 197, 64, None),
    "vit_allmask": (1, 12, 197, 197, 64, "true"),
    "bert": (1, 12, 128, 128, 64, "bool"),
    "odd": (2, 3, 333, 333, 40, "float"),
}


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v, m=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def inputs(case: str) -> tuple:
    b, h, lq, s, e, mask = CASES[case]
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(b, h, lq, e, generator=g), torch.randn(b, h, s, e, generator=g),
         torch.randn(b, h, s, e, generator=g)]
    if mask == "bool":
        a.append(torch.rand(b, 1, lq, s, generator=g) > 0.1)
    elif mask == "true":  # an input, so it is not dropped at import
        a.append(torch.ones(b, 1, lq, s, dtype=torch.bool))
    elif mask == "float":
        a.append(torch.randn(b, 1, lq, s, generator=g))
    return tuple(a)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("build", "time"))
    p.add_argument("tags")
    p.add_argument("--dir", default=".dev_attention_encoders")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--burst", type=float, default=0.3)
    a = p.parse_args()
    cases = a.cases.split(",")
    os.makedirs(a.dir, exist_ok=True)
    if a.mode == "build":
        for c in cases:
            cm = kiln.compile(Sdpa(), inputs(c), options=kiln.Options(num_threads=a.threads))
            print("built", cm.save(os.path.join(a.dir, f"{a.tags}_{c}.kiln")))
        return
    tags = a.tags.split(",")
    print(f"load {os.getloadavg()[0]:.2f}, {a.threads} thread(s)")
    for c in cases:
        args = inputs(c)
        want = Sdpa()(*(x.double() if x.is_floating_point() else x for x in args))
        runs = {t: kiln.load(os.path.join(a.dir, f"{t}_{c}.kiln"), num_threads=a.threads)
                for t in tags}
        for t, r in runs.items():
            err = (r(*args).double() - want).abs().max().item()
            if not err < 1e-4:
                raise SystemExit(f"{t} {c}: max error {err:.3g} against eager (float64)")
        ms: dict[str, list[float]] = {t: [] for t in tags}
        for k in range(a.rounds):
            for t in tags[k % len(tags):] + tags[:k % len(tags)]:
                best, w0 = float("inf"), time.perf_counter()
                while time.perf_counter() - w0 < a.burst:
                    t0 = time.perf_counter()
                    runs[t](*args)
                    best = min(best, time.perf_counter() - t0)
                ms[t].append(best * 1e3)
        cells = []
        for t in tags:
            ratio = statistics.median(x / y for x, y in zip(ms[t], ms[tags[0]]))
            cells.append(f"{t} {statistics.median(ms[t]):.3f} ms (x{ratio:.3f})")
        print(f"{c:12s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
