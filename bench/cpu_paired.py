"""Paired CPU timing in one process, for a shared, noisy machine: ONNX Runtime, OpenVINO and
one or more kiln packages of the same model run in turn, in short bursts (--burst seconds
each), for --rounds rounds; each burst's figure is the process CPU time per call (time
the process was descheduled does not count, cache and memory contention from other cores
still does; with --wall, or --threads above 1, wall-clock time per call instead: CPU time
would sum the threads). Printed: per system the median over rounds, the lowest round, and
the median of the per-round ratios to the first system (each ratio compares bursts a
fraction of a second apart).

Artifacts come from a `bench/cpu_peers.py --keep` work directory (model.onnx, ov.xml,
aoti.pt2, inputs.npz, expected.npz); kiln packages are paths (e.g. the directory's kiln.kiln,
or one built from another tree with `kiln compile`); `eager` rebuilds the model
(bench/cpu_peers_models.py, --model names it) and runs it under torch.inference_mode. Every
system's output is checked against the directory's expected.npz (eager's, from the prepare
step) before timing; a mismatch is printed and recorded. Pin it to the cores it may use
(`taskset -c 1` for one thread; give each system that many threads with --threads).

    taskset -c 1 python bench/cpu_paired.py /tmp/kiln-peers-gpt-XXXX ort,openvino,A.kiln,B.kiln
    taskset -c 0,1 python bench/cpu_paired.py DIR ort,openvino,aoti,eager,DIR/kiln.kiln \
        --model gpt --threads 2 --rotate --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _flat(out) -> list[np.ndarray]:
    """Any system's result as a flat list of numpy arrays."""
    if hasattr(out, "to_tuple"):  # OpenVINO's OVDict
        out = out.to_tuple()
    elif isinstance(out, dict):
        out = list(out.values())
    if not isinstance(out, (list, tuple)):
        out = [out]
    flat = []
    for o in out:
        if isinstance(o, (list, tuple)):
            flat += _flat(o)
        else:
            flat.append(np.asarray(o.detach().numpy() if hasattr(o, "detach") else o))
    return flat


def check(d: str, fns: dict) -> dict[str, str]:
    """name -> "ok" or what differs from the prepare step's eager outputs (within the model's
    own tolerances from prepare.json)."""
    path = os.path.join(d, "expected.npz")
    if not os.path.exists(path):
        return {}
    with np.load(path) as z:
        want = [z[f"arr_{i}"] for i in range(len(z.files))]
    tol = {"rtol": 1e-3, "atol": 1e-3}
    meta = os.path.join(d, "prepare.json")
    if os.path.exists(meta):
        with open(meta) as f:
            m = json.load(f)
        tol = {k: m.get(k) or v for k, v in tol.items()}
    res = {}
    for k, f in fns.items():
        got = _flat(f())
        if len(got) != len(want):
            res[k] = f"{len(got)} outputs, eager {len(want)}"
            continue
        errs = [float(np.abs(g.astype(np.float64) - w).max()) if g.shape == w.shape
                else float("inf") for g, w in zip(got, want)]
        bad = [i for i, (g, w) in enumerate(zip(got, want))
               if g.shape != w.shape or not np.allclose(g.astype(np.float64), w,
                                                        tol["rtol"], tol["atol"],
                                                        equal_nan=True)]
        res[k] = "ok" if not bad else \
            f"MISMATCH in outputs {bad} (max abs err {max(errs[i] for i in bad):.2e})"
    return res


def systems(d: str, names: list[str], threads: int, model: str | None = None) -> dict:
    with np.load(os.path.join(d, "inputs.npz")) as z:
        arrays = [z[f"arr_{i}"] for i in range(len(z.files))]
    fns = {}
    for s in names:
        if s == "ort":
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
            sess = ort.InferenceSession(os.path.join(d, "model.onnx"), so,
                                        providers=["CPUExecutionProvider"])
            feeds = dict(zip([i.name for i in sess.get_inputs()], arrays))
            fns[s] = lambda sess=sess, feeds=feeds: sess.run(None, feeds)
        elif s == "openvino":
            import openvino as ov

            cm = ov.Core().compile_model(os.path.join(d, "ov.xml"), "CPU", {
                "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
                "INFERENCE_PRECISION_HINT": "f32"})
            req = cm.create_infer_request()
            fns[s] = lambda req=req: req.infer(arrays, share_inputs=True)
        elif s in ("eager", "aoti"):
            import torch

            torch.set_num_threads(threads)
            args = tuple(torch.from_numpy(a) for a in arrays)
            if s == "eager":
                from bench.cpu_peers_models import build

                if not model:
                    raise SystemExit("eager needs --model (a bench/cpu_peers_models.py name)")
                fn = build(model).module.eval()
            else:
                import torch._inductor as ind  # the peer under test (kiln never imports it)

                fn = ind.aoti_load_package(os.path.join(d, "aoti.pt2"))

            def call(fn=fn, args=args):
                with torch.inference_mode():
                    return fn(*args)
            fns[s] = call
        else:
            import torch

            import kiln

            torch.set_num_threads(threads)
            runner = kiln.load(s, num_threads=threads)
            args = tuple(torch.from_numpy(a) for a in arrays)
            fns[s] = lambda r=runner, args=args: r(*args)
    return fns


def paired(fns: dict, rounds: int, burst: float, wall: bool = False, rotate: bool = False
           ) -> dict[str, tuple[float, float, float]]:
    """name -> (median s per call, lowest round, median ratio to the first system); process
    CPU time, or wall-clock time with `wall`. `rotate`: round r starts at the r-th system (in
    one process another runtime's threads may still spin or sleep after its burst, which
    favours or penalises whichever system always follows it)."""
    clock = time.perf_counter if wall else time.process_time
    for f in fns.values():
        for _ in range(2):
            f()
    per: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)] if rotate else names
        for k in order:
            f = fns[k]
            n, c0, w0 = 0, clock(), time.perf_counter()
            while time.perf_counter() - w0 < burst or n < 3:
                f()
                n += 1
            per[k].append((clock() - c0) / n)
    base = per[next(iter(fns))]
    return {k: (statistics.median(v), min(v),
                statistics.median([a / b for a, b in zip(v, base)])) for k, v in per.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="a bench/cpu_peers.py --keep work directory")
    p.add_argument("systems", help="comma-separated: ort, openvino, kiln package paths")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--burst", type=float, default=0.15, help="seconds per system per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wall", action="store_true", help="wall-clock time (default with threads > 1)")
    p.add_argument("--rotate", action="store_true",
                   help="start each round at the next system (no system always follows another)")
    p.add_argument("--model", help="the model's bench/cpu_peers_models.py name (for eager)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    a = p.parse_args()
    fns = systems(a.dir, a.systems.split(","), a.threads, a.model)
    checked = check(a.dir, fns)
    for k, v in checked.items():
        if v != "ok":
            print(f"{k}: {v}")
    load0 = os.getloadavg()
    res = paired(fns, a.rounds, a.burst, a.wall or a.threads > 1, a.rotate)
    load1 = os.getloadavg()
    print(f"load: {load0} -> {load1}")
    for k, (med, low, ratio) in res.items():
        print(f"{k:40s} {med * 1e3:9.3f} ms (lowest {low * 1e3:9.3f})  x{ratio:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"dir": a.dir, "model": a.model, "threads": a.threads,
                       "rounds": a.rounds, "burst": a.burst, "load": [load0, load1],
                       "check": checked,
                       "systems": {k: {"median_s": m, "lowest_s": lo, "ratio_to_first": r}
                                   for k, (m, lo, r) in res.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
