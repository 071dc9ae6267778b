"""A 1-row attention call (a decode step: q [B, H, 1, E], k and v [B, H, S, E], no mask) as
kiln packages for bench/cpu_paired.py: the fused step (kiln_attention.h's row path) and the
decomposition (bmm, softmax, bmm), built by whichever tree this script is imported from, so
that two trees' packages can be timed side by side in one process:

    python bench/cpu_attention_decode.py DIR --seq 128 --tag new     # this tree
    PYTHONPATH=/other/tree python /other/tree/bench/cpu_attention_decode.py DIR --seq 128 \
        --tag old                                     # (or this file, run with that path)
    taskset -c 1 python bench/cpu_paired.py DIR DIR/decomposed_new.kiln,DIR/fused_old.kiln,\
DIR/fused_new.kiln

DIR holds ep.pt2 and inputs.npz (written once, seeded, by the first call), then
decomposed_<tag>.kiln and fused_<tag>.kiln (Options.fused_attention False / True, --threads
threads). bench/cpu_attention_shapes.py times the same two paths of one tree."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kiln  # noqa: E402


class Decode(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="new")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    ep_path = os.path.join(a.dir, "ep.pt2")
    if not os.path.exists(ep_path):
        g = torch.Generator().manual_seed(0)
        b, h, s, e = a.batch, a.heads, a.seq, a.head_dim
        args = (torch.randn(b, h, 1, e, generator=g), torch.randn(b, h, s, e, generator=g),
                torch.randn(b, h, s, e, generator=g))
        torch.export.save(torch.export.export(Decode(), args), ep_path)
        np.savez(os.path.join(a.dir, "inputs.npz"), *[x.numpy() for x in args])
    ep = torch.export.load(ep_path)
    with np.load(os.path.join(a.dir, "inputs.npz")) as z:
        args = tuple(torch.from_numpy(z[f"arr_{i}"]) for i in range(len(z.files)))
    want = Decode()(*(x.double() for x in args))
    for name, fused in (("decomposed", False), ("fused", True)):
        cm = kiln.compile(ep, options=kiln.Options(num_threads=a.threads, fused_attention=fused))
        path = os.path.join(a.dir, f"{name}_{a.tag}.kiln")
        cm.save(path)
        got = kiln.load(path, num_threads=a.threads)(*args)
        err = (got.double() - want).abs().max().item()
        print(f"{name} -> {path} (max error vs float64 eager {err:.2e})")


if __name__ == "__main__":
    main()
