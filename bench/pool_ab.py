"""kiln's own thread pool against OpenMP (issue 14 item 3): the same models compiled by another
kiln tree (--before, e.g. main's checkout, whose packages use libgomp) and by this one (kiln's
pool, kiln_pool.h), timed at 1 and 2 threads beside ONNX Runtime at 2 threads, interleaved.

Per model (bench/cpu_peers_models.py): one prepare (export, inputs, eager reference; this
tree's bench/cpu_peers.py), then the kiln package compiled by each tree (its own
bench/threads_cpu.py compile worker, Options(num_threads=2)) and the ONNX file. Every round
starts one fresh process per cell, in an order that alternates per round: kiln before/after at
1 and 2 threads (bench/threads_cpu.py's timing worker of that tree: torch imported first,
torch.set_num_threads(n), kiln.load(num_threads=n), default environment otherwise) and ORT at 2
threads (bench/cpu_peers.py's worker). A cell's figure is the median over rounds of each
process's median call (--stat min: its fastest call); ratios are of those medians. --ort1 adds
ORT at 1 thread; --labels names the before/after columns. `uptime` is sampled every round.

    python bench/pool_ab.py --before /work/main [--models mlp,resnet18,mobilenet_v2,gpt]
        [--rounds 5] [--min-time 1.0] [--env NAME=VALUE] [--json out.json] [--markdown B.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_peers import _uptime, machine_info  # noqa: E402
from bench.markdown import splice  # noqa: E402

BEGIN, END = "<!-- cpu-pool:begin -->", "<!-- cpu-pool:end -->"
HEADING = "## CPU: kiln's own thread pool (issue 14 item 3)"


def _worker(tree: Path, script: str, args: list[str], d: Path, env_extra: dict,
            timeout: float) -> dict:
    out = d / f"w-{os.getpid()}-{len(list(d.glob('w-*')))}.json"
    cmd = [sys.executable, str(tree / "bench" / script), *args, "--dir", str(d),
           "--worker-out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(tree), KILN_CACHE_DIR=str(d / "kiln-cache"),
               **env_extra)
    try:
        subprocess.run(cmd, env=env, timeout=timeout, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout ({timeout:.0f} s)"}
    if not out.exists():
        return {"error": "worker died"}
    res = json.loads(out.read_text())
    out.unlink()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the other kiln tree (e.g. /work/main)")
    ap.add_argument("--models", default="mlp,resnet18,mobilenet_v2,gpt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for kiln timings")
    ap.add_argument("--keep", default=None)
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="a process's figure: its median call or its fastest")
    ap.add_argument("--ort1", action="store_true", help="ORT at 1 thread too")
    ap.add_argument("--labels", default="OpenMP,pool", help="names of the before/after columns")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args(argv)
    before = Path(a.before).resolve()
    base = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="kiln-pool-ab-"))
    kenv = dict(kv.split("=", 1) for kv in a.env)
    models = [m for m in a.models.split(",") if m]
    load_start = _uptime()
    print(f"# {load_start}", flush=True)
    timing = ["--warmup", "3", "--min-calls", "5", "--min-time", str(a.min_time)]
    dirs, errors = {}, {}
    for m in models:
        da, db = base / m / "after", base / m / "before"
        dirs[m] = {"after": da, "before": db}
        if (da / "kiln.kiln").exists() and (db / "kiln.kiln").exists():
            continue
        da.mkdir(parents=True, exist_ok=True)
        r = _worker(ROOT, "threads_cpu.py", ["--worker", "prepare", "--model", m], da, {},
                    a.timeout)
        if "error" in r:
            errors[m] = f"prepare: {r['error']}"
            continue
        shutil.copytree(da, db, dirs_exist_ok=True)
        for tree, d in ((ROOT, da), (before, db)):
            r = _worker(tree, "threads_cpu.py", ["--worker", "compile", "--model", m], d, {},
                        a.timeout)
            if "error" in r:
                errors[m] = f"compile ({d.name}): {r['error']}"
        r = _worker(ROOT, "cpu_peers.py", ["--worker", "compile", "--model", m, "--system",
                                           "ort"], da, {"OMP_NUM_THREADS": "2"}, a.timeout)
        if "error" in r:
            errors[m] = f"ort: {r['error']}"
    cells = [("before", 1), ("before", 2), ("after", 1), ("after", 2), ("ort", 2)]
    if a.ort1:
        cells.append(("ort", 1))
    times = {m: {c: [] for c in cells} for m in models}
    bad: dict[str, str] = {}
    loads = []
    for rnd in range(a.rounds):
        loads.append(os.getloadavg()[0])
        for m in models:
            if m in errors:
                continue
            for c in (cells if rnd % 2 == 0 else cells[::-1]):
                which, n = c
                if which == "ort":
                    r = _worker(ROOT, "cpu_peers.py", ["--worker", "time", "--model", m,
                                                       "--system", "ort", *timing,
                                                       "--max-calls", "20000"],
                                dirs[m]["after"], {"OMP_NUM_THREADS": str(n),
                                                   "KILN_BENCH_THREADS": str(n)}, a.timeout)
                else:
                    tree = ROOT if which == "after" else before
                    r = _worker(tree, "threads_cpu.py", ["--worker", "time", "--model", m,
                                                         "--threads", str(n), *timing],
                                dirs[m][which], kenv, a.timeout)
                if "error" in r:
                    bad[m] = f"{which} {n}: {r['error']}"
                    continue
                if r.get("matches") is False:
                    bad[m] = f"{which} {n}: MISMATCH"
                times[m][c].append(r["min_s" if a.stat == "min" else "latency_s"])
        print(f"round {rnd + 1}/{a.rounds} (load {loads[-1]:.2f})", flush=True)
    load_end = _uptime()

    def med(xs):
        return statistics.median(xs) * 1e3 if xs else float("nan")

    info = machine_info(None)
    command = "python bench/pool_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    B, A = a.labels.split(",")
    lines = [f"{info['date']}, {info['cpu']}, {info['cores']} cores, torch {info['torch']}; "
             f"`{command.strip()}`" + (f"; env {' '.join(a.env)}" if a.env else ""),
             f"load before: `{load_start}`; after: `{load_end}`; load1 per round "
             f"{', '.join(f'{x:.2f}' for x in loads)}", "",
             f"| model | {B} 1 thr (ms) | {B} 2 thr (ms) | {A} 1 thr (ms) | "
             f"{A} 2 thr (ms) | ORT 2 thr (ms) | {A}/{B} 1 thr | {A}/{B} 2 thr | "
             f"{B} 2 thr / ORT | {A} 2 thr / ORT | {B} 1/2 thr speed-up | "
             f"{A} 1/2 thr speed-up | " + ("ORT 1 thr (ms) | ORT 1/2 thr speed-up | "
                                          if a.ort1 else "") + "note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * a.ort1]
    rows = []
    for m in models:
        b1, b2, a1, a2, o2 = (med(times[m][c]) for c in cells[:5])
        o1 = med(times[m][("ort", 1)]) if a.ort1 else float("nan")
        rows.append({"model": m, "before_1": b1, "before_2": b2, "after_1": a1, "after_2": a2,
                     "ort_2": o2, "ort_1": o1, "rounds": {f"{c[0]} {c[1]}": [x * 1e3 for x in xs]
                                             for c, xs in times[m].items()},
                     "error": errors.get(m) or bad.get(m)})
        lines.append(f"| {m} | {b1:.3g} | {b2:.3g} | {a1:.3g} | {a2:.3g} | {o2:.3g} | "
                     f"{a1 / b1:.2f}x | {a2 / b2:.2f}x | {b2 / o2:.2f}x | {a2 / o2:.2f}x | "
                     f"{b1 / b2:.2f}x | {a1 / a2:.2f}x | "
                     + (f"{o1:.3g} | {o1 / o2:.2f}x | " if a.ort1 else "")
                     + f"{errors.get(m) or bad.get(m) or ''} |")
    md = "\n".join(lines)
    print(md, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "loads": loads, "info": info},
                                           indent=1))
    if a.markdown:
        splice(Path(a.markdown), BEGIN, END, md, heading=HEADING)
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
