"""Where a convolutional network's time goes, kiln against ONNX Runtime, layer by layer (issue 14):
kiln's per-step profile (`kiln profile PKG --json`'s hooks, at --threads) beside ORT's per-node
profile (SessionOptions.enable_profiling), both at the same thread count, grouped by kiln step: a
kiln step (a convolution with its epilogue, an inverted residual block of three) names the source
convolutions it computes (`conv2d`, `conv2d_1`, ...: the export's order), and each ORT node
(named after its output tensor, `<tensor>_nchwc` in ORT's blocked regions) joins the group of
the latest convolution at or before that tensor's producer in the ONNX graph (torch's ONNX
export keeps the convolutions in the same order), so each row compares the same layers.

    python bench/conv_profile.py DIR PKG [--threads 2] [--repeat 50]

DIR: a bench/cpu_peers.py --keep directory (model.onnx, inputs.npz); PKG: a kiln package of
the same model. Run pinned (`taskset -c 0,1`) on a quiet machine: the two profiles run one
after the other, so on a shared box compare the shares, not the absolute times."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np


def kiln_steps(pkg: str, repeat: int, threads: int) -> dict:
    """`kiln profile PKG --json`'s per-step medians (the package's own profiling hooks), at
    `threads` threads, in a child process."""
    out = subprocess.run([sys.executable, __file__, "--kiln-child", pkg, str(repeat),
                          str(threads)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def _kiln_child(pkg: str, repeat: int, threads: int) -> None:
    import statistics as st
    import time

    import torch

    from kiln.cli import profile as kp
    from kiln.cli.manifest_view import random_inputs
    from kiln.package.reader import read_package
    from kiln.runtime import load

    manifest = read_package(pkg).manifest
    args, kwargs = random_inputs(manifest, 0)
    runner = load(pkg, num_threads=threads)
    with torch.no_grad():
        for _ in range(5):
            runner(*args, **kwargs)
        totals = []
        for _ in range(repeat):
            t = time.perf_counter()
            runner(*args, **kwargs)
            totals.append(time.perf_counter() - t)
        runs = kp._hooked_runs(runner, args, kwargs, repeat)
    med = st.median(totals)
    print(json.dumps({"package_run_median_s": med, "threads": threads,
                      **kp._hooked_steps(manifest, runs, med)}))


def conv_index(op: str) -> int | None:
    m = re.fullmatch(r"conv2d(?:_(\d+))?", op)
    return None if m is None else int(m.group(1) or 0)


def ort_nodes(d: str, threads: int, repeat: int) -> tuple[dict[str, float], list, float]:
    """Median microseconds per ORT node over `repeat` runs, the ONNX graph's nodes (op type,
    name, outputs) in order, and the median run in microseconds."""
    import onnx  # deferred: optional benchmark dependency
    import onnxruntime as ort  # deferred: optional benchmark dependency

    graph = onnx.load(os.path.join(d, "model.onnx"), load_external_data=False).graph
    order = [(n.op_type, n.name, list(n.output)) for n in graph.node]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="ortprof-"), "p")
    sess = ort.InferenceSession(os.path.join(d, "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    inputs = dict(np.load(os.path.join(d, "inputs.npz")))
    feed = {i.name: v for i, v in zip(sess.get_inputs(), inputs.values())}
    for _ in range(5):
        sess.run(None, feed)
    for _ in range(repeat):
        sess.run(None, feed)
    path = sess.end_profiling()
    events = json.load(open(path))
    per: dict[str, list[float]] = {}
    runs = []
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per.setdefault(e["name"][:-len("_kernel_time")], []).append(e["dur"])
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            runs.append(e["dur"])
    skip = lambda v: v[len(v) - repeat:] if len(v) > repeat else v  # noqa: E731 (warm-up)
    return ({k: statistics.median(skip(v)) for k, v in per.items()}, order,
            statistics.median(skip(runs)) if runs else float("nan"))


def main() -> None:
    if sys.argv[1:2] == ["--kiln-child"]:
        return _kiln_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("package")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    prof = kiln_steps(a.package, a.repeat, a.threads)
    ort_us, order, ort_run = ort_nodes(a.dir, a.threads, a.repeat)
    rows = []  # (label, kiln us, [conv indices])
    group_of: dict[int, int] = {}
    for s in prof["steps"]:
        convs = sorted(i for i in map(conv_index, s["source_ops"]) if i is not None)
        for i in convs:
            group_of[i] = len(rows)
        rows.append([s["name"], s["kind"].replace("lib.", ""), s["median_s"] * 1e6, convs, 0.0,
                     []])
    # ORT names a node after its (fused) output tensor, `<tensor>_nchwc` in its NCHWc
    # regions: the ONNX node that produces that tensor places it after its convolution
    conv_at: dict[str, int] = {}  # tensor -> index of the latest conv up to its producer
    seen = -1
    for op, _name, outs in order:
        seen += op == "Conv"
        for t in outs:
            conv_at[t] = seen
    other = [0.0, []]
    for name, t in ort_us.items():
        base = name[:-len("_nchwc")] if name.endswith("_nchwc") else name
        cur = group_of.get(conv_at.get(base, -1))
        if cur is None:
            other[0] += t
            other[1].append(name)
        else:
            rows[cur][4] += t
            rows[cur][5].append(name)
    kiln_total = sum(r[2] for r in rows)
    ort_total = sum(r[4] for r in rows) + other[0]
    print(f"kiln {a.package}: run median {prof['package_run_median_s'] * 1e3:.3f} ms, steps "
          f"{kiln_total / 1e3:.3f} ms; ORT ({a.threads} threads): run median "
          f"{ort_run / 1e3:.3f} ms, nodes {ort_total / 1e3:.3f} ms")
    print("| kiln step | kind | convs | kiln us | ORT us | kiln / ORT |")
    print("|---|---|---|---:|---:|---:|")
    for name, kind, us, convs, ous, _ in sorted(rows, key=lambda r: (r[3] or [999])[0]):
        c = f"{convs[0]}-{convs[-1]}" if len(convs) > 1 else (str(convs[0]) if convs else "")
        print(f"| {name} | {kind} | {c} | {us:.1f} | {ous:.1f} | "
              f"{us / ous if ous else float('nan'):.2f} |")
    print(f"| (ORT nodes outside those: {', '.join(other[1])}) | | | | {other[0]:.1f} | |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kiln": prof, "ort_us": ort_us, "ort_run_us": ort_run,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
