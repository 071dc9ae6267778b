"""Fused CPU attention (kiln_attention.h) against the decomposed path (bmm, softmax, bmm), as
two kiln packages of one `bench/cpu_peers.py --keep` work directory, for bench/cpu_paired.py:

    python bench/cpu_attention_ab.py DIR [--threads 1]  # DIR/fused.kiln, DIR/decomposed.kiln
    taskset -c 1 python bench/cpu_paired.py DIR ort,openvino,DIR/decomposed.kiln,DIR/fused.kiln

The only difference between the two is Options.fused_attention."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kiln  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    ep = torch.export.load(os.path.join(a.dir, "ep.pt2"))
    for name, fused in (("decomposed", False), ("fused", True)):
        cm = kiln.compile(ep, options=kiln.Options(num_threads=a.threads,
                                                   fused_attention=fused))
        cm.save(os.path.join(a.dir, f"{name}.kiln"))
        print(name, "->", os.path.join(a.dir, f"{name}.kiln"))


if __name__ == "__main__":
    main()
