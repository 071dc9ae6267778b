"""OpenVINO's per-node profile of a `bench/cpu_peers.py --keep` directory (ov.xml, inputs.npz):
the CPU plugin's PERF_COUNT times (median over runs) per node, the slowest nodes, then the
totals per (layer type, kernel) — the OpenVINO side of an op-by-op comparison with
`kiln profile PKG --json` (issue 14; BENCHMARKS.md, sixteenth session, s16wh). Settings as
bench/cpu_paired.py's: LATENCY hint, float32 inference precision, --threads threads.

    taskset -c 0,1 python bench/ov_profile.py DIR [--threads 2] [--repeat 20] [--top 40]

The times are the plugin's own per-node clocks; their sum is not the wall time of a call."""

from __future__ import annotations

import argparse
import collections
import os
import statistics

import numpy as np


def profile(d: str, threads: int, repeat: int) -> dict[str, tuple[str, str, float]]:
    """node name -> (layer type, kernel, median microseconds)."""
    import openvino as ov

    with np.load(os.path.join(d, "inputs.npz")) as z:
        arrays = [z[f"arr_{i}"] for i in range(len(z.files))]
    cm = ov.Core().compile_model(os.path.join(d, "ov.xml"), "CPU", {
        "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "f32", "PERF_COUNT": "YES"})
    req = cm.create_infer_request()
    for _ in range(5):
        req.infer(arrays, share_inputs=True)
    runs: dict[str, list[float]] = collections.defaultdict(list)
    kind: dict[str, tuple[str, str]] = {}
    for _ in range(repeat):
        req.infer(arrays, share_inputs=True)
        for p in req.profiling_info:
            runs[p.node_name].append(p.real_time.total_seconds() * 1e6)
            kind[p.node_name] = (p.node_type, p.exec_type)
    return {k: (*kind[k], statistics.median(v)) for k, v in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    nodes = profile(a.dir, a.threads, a.repeat)
    rows = sorted(nodes.items(), key=lambda kv: -kv[1][2])
    for name, (typ, kernel, us) in rows[:a.top]:
        print(f"{us:10.1f} us  {typ:>16} {kernel:>28}  {name[:70]}")
    by: collections.Counter = collections.Counter()
    for typ, kernel, us in nodes.values():
        by[(typ, kernel)] += us
    print(f"\nsum of nodes {sum(by.values()) / 1e3:.2f} ms")
    for (typ, kernel), us in by.most_common():
        if us > 0:
            print(f"{us / 1e3:9.2f} ms  {typ} ({kernel})")


if __name__ == "__main__":
    main()
