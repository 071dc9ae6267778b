"""What the CPU wrapper's per-step profiling hooks cost when off (and on).

Compiles one model twice: as every package is printed (hooks in, kiln/targets/cpu/wrapper_prof.py)
and with the hooks printed as blank lines (the wrapper before them), then times both packages
in one process, interleaved in blocks, with profiling off; then the hooked package with
profiling on. The model is the worst case for the hooks: a chain of many tiny steps (a 4 x 32
by 32 x 32 GEMM and a softmax per link), where a branch per step is the largest share of a
step.

    python bench/profile_hooks.py --steps 40 --blocks 30 --block 200

Prints the medians (us per run) and the ratios with/without hooks; run `uptime` beside it."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kiln
from kiln.runtime import profiling
from kiln.targets.cpu import wrapper_prof


class Chain(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList(torch.randn(32, 32) / 6 for _ in range(n))

    def forward(self, x):
        for w in self.w:  # a tiny GEMM and a softmax kernel per link
            x = torch.softmax(x @ w, dim=-1)
        return x


def _compile(n: int, hooks: bool, path: Path) -> Path:
    saved = wrapper_prof.BEGIN, wrapper_prof.end
    if not hooks:  # printed as blank lines: the wrapper as it was before the hooks
        wrapper_prof.BEGIN, wrapper_prof.end = "", (lambda i: "")
    torch.manual_seed(0)  # the same weights in both
    try:
        kiln.compile(Chain(n), (torch.randn(4, 32),),
                     options=kiln.Options(num_threads=1)).save(path)
    finally:
        wrapper_prof.BEGIN, wrapper_prof.end = saved
    return path


def _block(runner, x, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        runner(x)
    return (time.perf_counter() - t) / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40, help="links (GEMM + softmax) in the chain")
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--block", type=int, default=200, help="runs per timed block")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        hooked = kiln.load(_compile(a.steps, True, Path(d) / "hooked.kiln"))
        plain = kiln.load(_compile(a.steps, False, Path(d) / "plain.kiln"))
        x = torch.randn(4, 32)
        profiling.enable(plain)  # its table lists the steps, but nothing times them
        plain(x)
        assert all(s.last_s == 0 for s in profiling.steps(plain))
        profiling.enable(plain, False)
        torch.testing.assert_close(hooked(x), plain(x), rtol=0, atol=0)
        n_steps = len(profiling.steps(hooked))
        times: dict[str, list[float]] = {"no hooks": [], "hooks, off": [], "hooks, on": []}
        for r in (hooked, plain):
            _block(r, x, a.block)  # warm-up
        for _ in range(a.blocks):
            times["no hooks"].append(_block(plain, x, a.block))
            times["hooks, off"].append(_block(hooked, x, a.block))
            profiling.enable(hooked)
            times["hooks, on"].append(_block(hooked, x, a.block))
            profiling.enable(hooked, False)
    base = statistics.median(times["no hooks"])
    print(f"{a.steps} links: {n_steps} steps per run, {a.blocks} interleaved blocks of "
          f"{a.block} runs, 1 thread")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:11s} median {med * 1e6:8.2f} us/run  ratio {med / base:.4f}  "
              f"({(med - base) * 1e9 / n_steps:+.1f} ns per step)")


if __name__ == "__main__":
    main()
