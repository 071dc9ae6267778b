"""Cost of kiln's compiled control flow: time per while_loop iteration (a 16x16 tanh update and
a counter test per iteration) and per torch.cond call, kiln against eager.

    python bench/control_flow.py [--device cpu|cuda] [--n 4000]

Prints one markdown table. Each figure is the median of 5 runs of `n` iterations (the loop) or
of 200 calls (cond); CUDA runs end with a device synchronise."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch._higher_order_ops.while_loop import while_loop

import kiln


class Loop(torch.nn.Module):
    def forward(self, x, n):
        return while_loop(lambda i, y: i < n.sum(),
                          lambda i, y: (i + 1, (y * 0.999 + 0.001).tanh()),
                          (torch.zeros((), dtype=torch.int64), x))


class Cond(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin() * 2, lambda x: x.cos() - 1, (x,))


def _median(fn, repeat: int, sync) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=4000)
    a = ap.parse_args()
    dev = a.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    load_dev = "cuda:0" if dev.startswith("cuda") else "cpu"
    tmp = Path(tempfile.mkdtemp())
    rows = []
    x = torch.randn(16, 16)
    loop = kiln.load(kiln.compile(Loop(), (x, torch.tensor([3])), device=dev.split(":")[0])
                     .save(tmp / "loop.kiln"), device=load_dev)
    xd, nd = x.to(load_dev), torch.tensor([a.n], device=load_dev)
    loop(xd, nd)
    k = _median(lambda: loop(xd, nd), 5, sync) / a.n
    e = _median(lambda: Loop()(xd, nd), 3, sync) / a.n
    rows.append(("while_loop, per iteration", k, e))
    cond = kiln.load(kiln.compile(Cond(), (x,), device=dev.split(":")[0])
                     .save(tmp / "cond.kiln"), device=load_dev)
    for sign in (1, -1):
        xs = (sign * x.abs()).to(load_dev)

        def calls(f=cond, xs=xs):
            for _ in range(200):
                f(xs)
        cond(xs)
        k = _median(calls, 5, sync) / 200
        e = _median(lambda xs=xs: calls(Cond(), xs), 5, sync) / 200
        rows.append((f"cond, {'true' if sign > 0 else 'false'} branch, per call", k, e))
    print(f"device: {torch.cuda.get_device_name() if load_dev != 'cpu' else 'cpu'}, "
          f"torch {torch.__version__}, 16x16 float32")
    print("| what | kiln us | eager us | kiln vs eager |")
    print("| --- | --- | --- | --- |")
    for what, k, e in rows:
        print(f"| {what} | {k * 1e6:.2f} | {e * 1e6:.2f} | {e / k:.1f}x |")


if __name__ == "__main__":
    main()
