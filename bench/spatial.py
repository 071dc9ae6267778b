"""Spatial ops and integer matmul: kiln against eager, one thread each, median of 20 calls.

    python bench/spatial.py          # prints a markdown table
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import kiln


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def cases() -> dict:
    torch.manual_seed(0)
    img = torch.randn(8, 64, 64, 64)
    return {
        "conv_transpose2d 64->32 k4 s2, 8x64x32x32": (
            nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), (torch.randn(8, 64, 32, 32),)),
        "conv1d 64->64 k3, 8x64x1024": (nn.Conv1d(64, 64, 3, padding=1),
                                        (torch.randn(8, 64, 1024),)),
        "conv3d 16->16 k3, 2x16x16x32x32": (nn.Conv3d(16, 16, 3, padding=1),
                                            (torch.randn(2, 16, 16, 32, 32),)),
        "bilinear x2, 8x64x64x64": (
            Fn(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")), (img,)),
        "nearest x2 + relu, 8x64x64x64": (
            Fn(lambda x: torch.relu(F.interpolate(x, scale_factor=2, mode="nearest"))), (img,)),
        "max_pool2d k3 s2 p1 ceil, 8x64x112x112": (
            Fn(lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True)),
            (torch.randn(8, 64, 112, 112),)),
        "int64 mm 256x256x256": (Fn(lambda a, b: a @ b), (
            torch.randint(-9, 9, (256, 256)), torch.randint(-9, 9, (256, 256)))),
    }


def median_ms(fn, n: int = 20) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e3


def main() -> None:
    torch.set_num_threads(1)
    print("| case | eager ms | kiln ms |\n| --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, (module, args)) in enumerate(cases().items()):
            module = module.eval()
            runner = kiln.compile(module, args, options=kiln.Options(num_threads=1)).load(
                Path(tmp) / f"m{k}.kiln")
            with torch.no_grad():
                eager = median_ms(lambda: module(*args))
            ours = median_ms(lambda: runner(*args))
            print(f"| {name} | {eager:.2f} | {ours:.2f} |", flush=True)


if __name__ == "__main__":
    main()
