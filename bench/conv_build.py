"""Rebuild a kiln package from a bench/cpu_peers.py --keep directory's export, with this tree,
for an A/B beside the directory's own package in bench/cpu_paired.py (two kiln packages as two
systems of one process):

    python bench/conv_build.py DIR OUT.kiln [--threads 2]"""

from __future__ import annotations

import argparse
import os
import time

import torch

import kiln


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    ep = torch.export.load(os.path.join(a.dir, "ep.pt2"))
    t = time.perf_counter()
    cm = kiln.compile(ep, options=kiln.Options(num_threads=a.threads))
    cm.save(a.out)
    print(f"{a.out}: compiled in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
