"""Latency of kiln's library-call ops (kiln_lib.h: sort, topk, scans, scatters, embedding_bag)
against eager PyTorch on the CPU, two threads each; prints a markdown table.

    python bench/library_ops.py [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kiln  # noqa: E402


def cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024, generator=g)
    idx = torch.randint(0, 1024, (1024, 1024), generator=g)
    rows = torch.randint(0, 1024, (4096,), generator=g)
    vals = torch.randn(4096, 1024, generator=g)
    w = torch.randn(50000, 64, generator=g)
    ids = torch.randint(0, 50000, (65536,), generator=g)
    offs = torch.arange(0, 65536, 64)
    return [
        ("sort rows [1024, 1024]", lambda x: torch.sort(x, -1)[0], (x,)),
        ("sort dim 0 [1024, 1024]", lambda x: torch.sort(x, 0)[0], (x,)),
        ("topk 10 rows [1024, 1024]", lambda x: torch.topk(x, 10)[0], (x,)),
        ("cumsum rows [1024, 1024]", lambda x: torch.cumsum(x, 1), (x,)),
        ("cumsum dim 0 [1024, 1024]", lambda x: torch.cumsum(x, 0), (x,)),
        ("cummax rows [1024, 1024]", lambda x: torch.cummax(x, 1)[0], (x,)),
        ("scatter_add dim 0 [1024, 1024]", lambda x, i: x.scatter_add(0, i, x), (x, idx)),
        ("index_put accumulate 4096 rows", lambda x, r, v: x.index_put((r,), v, accumulate=True),
         (x, rows, vals)),
        ("embedding_bag sum 1024 bags x 64", lambda w, i, o: F.embedding_bag(i, w, o),
         (w, ids, offs)),
    ]


def median_ms(fn, args, repeat: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print("| op | eager ms | kiln ms | kiln/eager |")
    print("| --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, fn, inputs) in enumerate(cases()):
            runner = kiln.compile(fn, inputs, options=kiln.Options(num_threads=2)).load(
                Path(tmp) / f"m{k}.kiln")  # kiln.compile exports a plain function itself
            with torch.no_grad():
                torch.testing.assert_close(runner(*inputs), fn(*inputs), rtol=1e-4, atol=1e-3)
                eager = median_ms(fn, inputs, args.repeat)
            ours = median_ms(runner, inputs, args.repeat)
            print(f"| {name} | {eager:.3f} | {ours:.3f} | {ours / eager:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
