"""kiln's CUDA embedding_bag and masked_scatter kernels (targets/cuda/bag_mask.py; masked_scatter
with the scan of its mask, targets/cuda/scan.py) beside eager's CUDA kernels: device time per
call (CUDA events over back-to-back calls, `stream_ms`), the ratio kiln / eager, and whether
kiln's package has no ATen op.

Usage (a GPU machine): `PYTHONPATH=. python bench/bag_mask_gpu.py [--repeat 20]`."""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F

import kiln
from bench.cuda_timing import stream_ms


def _bags(dt, n_rows=50000, dim=128, bags=4096, per_bag=30, weighted=False):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_rows, dim, generator=g).to(dt)
    n = bags * per_bag
    idx = torch.randint(0, n_rows, (n,), generator=g)
    off = torch.sort(torch.randint(0, n + 1, (bags,), generator=g)).values
    off[0] = 0
    args = (w, idx, off)
    if weighted:
        args += (torch.rand(n, generator=g).to(dt),)
    return args


def _mask(dt, shape, mask_shape, p=0.5):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dt)
    m = torch.rand(mask_shape, generator=g) < p
    s = torch.randn(x.numel(), generator=g).to(dt)
    return x, m, s


CASES = [  # (name, fn, args)
    ("embedding_bag sum f32 [50000, 128], 4096 bags of 30",
     lambda w, i, o: F.embedding_bag(i, w, o, mode="sum"), _bags(torch.float32)),
    ("embedding_bag mean bf16 [50000, 128], 4096 bags of 30",
     lambda w, i, o: F.embedding_bag(i, w, o, mode="mean"), _bags(torch.bfloat16)),
    ("embedding_bag max f16 [50000, 128], 4096 bags of 30",
     lambda w, i, o: F.embedding_bag(i, w, o, mode="max"), _bags(torch.float16)),
    ("embedding_bag sum weighted f32 [50000, 64], 16384 bags of 8",
     lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p),
     _bags(torch.float32, dim=64, bags=16384, per_bag=8, weighted=True)),
    ("masked_scatter f32 [1024, 1024]", lambda x, m, s: x.masked_scatter(m, s),
     _mask(torch.float32, (1024, 1024), (1024, 1024))),
    ("masked_scatter bf16 [8192, 512], mask [512]", lambda x, m, s: x.masked_scatter(m, s),
     _mask(torch.bfloat16, (8192, 512), (512,))),
    ("masked_scatter i64 [16, 65536], 1% set", lambda x, m, s: x.masked_scatter(m, s),
     _mask(torch.int64, (16, 65536), (16, 65536), p=0.01)),
]


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for k, (name, fn, args) in enumerate(CASES):
            cm = kiln.compile(torch.export.export(_Fn(fn), args), device="cuda")
            native = cm.manifest["requires"]["aten_fallback_ops"] == []
            run = kiln.load(cm.save(f"{d}/{k}.kiln"), device="cuda:0")
            xc = [t.cuda() for t in args]
            got, want = run(*xc), fn(*xc)
            err = (got.double() - want.double()).abs().max().item()
            t_k = stream_ms(lambda: run(*xc), 10, a.repeat)
            t_e = stream_ms(lambda: fn(*xc), 10, a.repeat)
            rows.append((name, t_k * 1e3, t_e * 1e3, native, err))
    print("| case | kiln µs | eager µs | kiln / eager | no ATen op | max abs diff |\n"
          "|---|---|---|---|---|---|")
    for name, tk, te, native, err in rows:
        print(f"| {name} | {tk:.1f} | {te:.1f} | {tk / te:.2f} | {'yes' if native else 'no'} | "
              f"{err:.2g} |")


if __name__ == "__main__":
    main()
