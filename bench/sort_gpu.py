"""kiln's CUDA sort kernel (targets/cuda/sort.py) beside eager's CUDA sort / topk / median on a
few row shapes, and kiln's unique / unique_consecutive (a sort, an adjacent compare, nonzero's
compaction: frontend/aten_unique.py) beside eager's: device time per call (CUDA events over
back-to-back calls, `stream_ms`; a call of either that returns a data-dependent length reads
it back to the host, so that synchronisation is in both), the ratio kiln / eager, and
whether kiln's package has no ATen op. The unique cases round randn * 100 first (about 600
distinct floats; the same round in both) or draw integers in [-50, 50).

Usage (a GPU machine): `PYTHONPATH=. python bench/sort_gpu.py [--repeat 20] [--only 'A;B']`."""

from __future__ import annotations

import argparse
import tempfile

import torch

import kiln
from bench.cuda_timing import stream_ms

CASES = [  # (name, fn, shape, dtype)
    ("sort f32 [4096, 1024]", lambda x: tuple(torch.sort(x, 1)), (4096, 1024), torch.float32),
    ("sort bf16 [16384, 256]", lambda x: tuple(torch.sort(x, 1)), (16384, 256), torch.bfloat16),
    ("sort f32 dim0 [64, 8192]", lambda x: tuple(torch.sort(x, 0)), (64, 8192), torch.float32),
    ("argsort i32 [8192, 128]", lambda x: torch.argsort(x, 1, stable=True), (8192, 128),
     torch.int32),
    ("topk 8 f32 [8192, 4096]", lambda x: tuple(torch.topk(x, 8, 1)), (8192, 4096),
     torch.float32),
    ("topk 50 f16 [128, 4096]", lambda x: tuple(torch.topk(x, 50, 1)), (128, 4096),
     torch.float16),
    ("median f32 [4096, 512]", lambda x: tuple(torch.median(x, 1)), (4096, 512),
     torch.float32),
    # 64-bit values (two tl.sort passes) and the merge sort (rows over 4096; s17cov)
    ("sort f64 [4096, 1024]", lambda x: tuple(torch.sort(x, 1)), (4096, 1024), torch.float64),
    ("sort i64 [16384, 256]", lambda x: tuple(torch.sort(x, 1)), (16384, 256), torch.int64),
    ("sort f32 [64, 65536]", lambda x: tuple(torch.sort(x, 1)), (64, 65536), torch.float32),
    ("sort f32 [1, 1048576]", lambda x: tuple(torch.sort(x, 1)), (1, 1 << 20), torch.float32),
    ("sort i64 [8, 200000]", lambda x: tuple(torch.sort(x, 1)), (8, 200000), torch.int64),
    ("topk 1000 f32 [16, 100000]", lambda x: tuple(torch.topk(x, 1000, 1)), (16, 100000),
     torch.float32),
    # unique (s18cov): one sort tile, the merge sort, no sort (consecutive)
    ("unique inv+counts f32 [4096]", lambda x: torch.unique(
        x.round(), return_inverse=True, return_counts=True), (4096,), torch.float32),
    ("unique inv+counts f32 [1048576]", lambda x: torch.unique(
        x.round(), return_inverse=True, return_counts=True), (1 << 20,), torch.float32),
    ("unique i64 [1048576]", lambda x: torch.unique(x), (1 << 20,), torch.int64),
    ("unique_consecutive inv+counts i32 [1048576]", lambda x: torch.unique_consecutive(
        x, return_inverse=True, return_counts=True), (1 << 20,), torch.int32),
]


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--only", default="", help="cases whose name holds one of these "
                   "';'-separated strings (case names hold commas)")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for k, (name, fn, shape, dt) in enumerate(CASES):
            if not any(part in name for part in a.only.split(";")):
                continue
            x = (torch.randn(shape) * 100).to(dt) if dt.is_floating_point else \
                torch.randint(-50, 50, shape, dtype=dt)
            cm = kiln.compile(torch.export.export(_Fn(fn), (x,)), device="cuda")
            native = cm.manifest["requires"]["aten_fallback_ops"] == []
            run = kiln.load(cm.save(f"{d}/{k}.kiln"), device="cuda:0")
            xc = x.cuda()
            t_k = stream_ms(lambda: run(xc), 10, a.repeat)
            t_e = stream_ms(lambda: fn(xc), 10, a.repeat)
            rows.append((name, t_k * 1e3, t_e * 1e3, native))
            print(name, f"{t_k * 1e3:.1f} {t_e * 1e3:.1f}", flush=True)
    print("| case | kiln µs | eager µs | kiln / eager | no ATen op |\n|---|---|---|---|---|")
    for name, tk, te, native in rows:
        print(f"| {name} | {tk:.1f} | {te:.1f} | {tk / te:.2f} | {'yes' if native else 'no'} |")


if __name__ == "__main__":
    main()
