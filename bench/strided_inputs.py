"""Cost of the copy-in of inputs with other strides (libkiln, kiln/runtime/src/copy_in.h):
one kiln package run on a contiguous input and on the same values transposed in memory,
interleaved, medians of N runs each; eager on both for reference.

    PYTHONPATH=$PWD python bench/strided_inputs.py [rows cols reps]
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

import kiln


def main() -> None:
    rows, cols, reps = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (2048, 1024, 30)))
    torch.set_num_threads(1)
    model = lambda x: torch.relu(x) * 2 + 1  # noqa: E731 - one pass over the input
    x = torch.randn(rows, cols)
    xt = x.t().contiguous().t()  # same values, transposed in memory
    path = kiln.compile(model, (x,), options=kiln.Options(num_threads=1)).save(
        os.path.join(tempfile.mkdtemp(), "m.kiln"))
    runner = kiln.load(path, num_threads=1)
    times = {k: [] for k in ("kiln contiguous", "kiln transposed", "eager contiguous",
                             "eager transposed")}
    for _ in range(reps):
        for name, fn, arg in (("kiln contiguous", runner, x), ("kiln transposed", runner, xt),
                              ("eager contiguous", model, x), ("eager transposed", model, xt)):
            t0 = time.perf_counter()
            fn(arg)
            times[name].append(time.perf_counter() - t0)
    print(f"{rows}x{cols} float32, {reps} interleaved runs, load {os.getloadavg()[0]:.2f}")
    base = statistics.median(times["kiln contiguous"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:18s} {m * 1e3:8.3f} ms  ({m / base:.2f}x kiln contiguous)")


if __name__ == "__main__":
    main()
