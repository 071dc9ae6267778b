"""Per-step profile of kiln CPU packages (kiln.runtime.profiling), grouped by kind of step
(GEMMs, attention, softmax, LayerNorm, GELU, copies / other fused kernels), beside ONNX
Runtime's total for the same `bench/cpu_peers.py --keep` work directory, at --threads threads:

    taskset -c 1 python bench/cpu_step_profile.py DIR [PKG ...] [--calls 200]

PKG defaults to DIR/kiln.kiln. Step times are wall-clock (the package's own hooks): on a loaded
machine a step's median includes the time it was descheduled, so each step's lowest time over
the calls is printed too (closer to its cost when it runs undisturbed); the profiled totals are
their sums, the run total the median wall time of an unprofiled call."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kiln  # noqa: E402
from kiln.runtime import profiling  # noqa: E402


def group(name: str, kind: str, src: str) -> str:
    s = f"{name} {src}".lower()
    if kind.endswith("_gemm") and "scaled_dot_product" in s:
        return "attention: bmm (decomposed)"
    if kind.endswith("_gemm") or kind == "lib.qgemm":
        return "gemm (+ epilogue)"
    if kind == "lib.attention":
        return "attention (fused)"
    for key, g in (("softmax", "softmax"), ("layer_norm", "layernorm"), ("layernorm", "layernorm"),
                   ("gelu", "gelu"), ("scaled_dot_product", "attention: q/k/v/mask prep"),
                   ("matmul", "bmm prep / copies")):
        if key in s:
            return g
    return "other fused kernels"


def median_wall(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("packages", nargs="*")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", action="store_true", help="print every step too")
    a = p.parse_args()
    with np.load(os.path.join(a.dir, "inputs.npz")) as z:
        arrays = [z[f"arr_{i}"] for i in range(len(z.files))]
    import onnxruntime as ort  # deferred: the peer, only for its total

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
    sess = ort.InferenceSession(os.path.join(a.dir, "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    feed = {i.name: x for i, x in zip(sess.get_inputs(), arrays)}
    for _ in range(5):
        sess.run(None, feed)
    print(f"ort total {median_wall(lambda: sess.run(None, feed), a.calls):.3f} ms  "
          f"(load {os.getloadavg()[0]:.2f})")
    for pkg in a.packages or [os.path.join(a.dir, "kiln.kiln")]:
        r = kiln.load(pkg, num_threads=a.threads)
        for _ in range(5):
            r(*arrays)
        total = median_wall(lambda: r(*arrays), a.calls)
        profiling.enable(r)
        per: dict[str, list[float]] = {}
        meta = {}
        for _ in range(a.calls):
            r(*arrays)
            for s in profiling.steps(r):
                per.setdefault(s.name, []).append(s.last_s * 1e3)
                meta[s.name] = (s.kind, ", ".join(s.source_ops))
        med = {n: statistics.median(v) for n, v in per.items()}
        low = {n: min(v) for n, v in per.items()}
        groups: dict[str, list[float]] = {}
        for n in med:
            g = groups.setdefault(group(n, *meta[n]), [0.0, 0.0])
            g[0] += med[n]
            g[1] += low[n]
        tm, tl = sum(med.values()), sum(low.values())
        print(f"{pkg}: run {total:.3f} ms, profiled steps: median {tm:.3f} ms, lowest "
              f"{tl:.3f} ms (load {os.getloadavg()[0]:.2f})")
        for g, (m, lo) in sorted(groups.items(), key=lambda x: -x[1][1]):
            print(f"  {g:32s} median {m:8.3f} ms {100 * m / tm:5.1f}%   lowest {lo:8.3f} ms "
                  f"{100 * lo / tl:5.1f}%")
        if a.steps:
            for n in sorted(med, key=lambda x: -low[x]):
                print(f"    {n:50s} {meta[n][0]:14s} median {med[n]:8.3f} lowest {low[n]:8.3f}")


if __name__ == "__main__":
    main()
