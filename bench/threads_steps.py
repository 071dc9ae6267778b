"""Which steps of a CPU package scale badly from 1 to 2 threads (issue 14 item 3).

For every package a bench/threads_cpu.py --keep DIR run left (DIR/<model>/kiln.kiln, its
inputs.npz), fresh processes load it at 1 and at 2 threads (pinned with --taskset), warm up,
turn the package's own per-step profiling hooks on (kiln/runtime/profiling.py, the wrapper's
clock reads around every step) and run --calls times; a process reports each step's minimum
over its calls (--stat min, the default: on a loaded shared machine the calls in which both
threads had a core; or the median), and the same of the whole call. Rounds alternate the order
of 1 and 2. Per step the figure is the median over rounds;
"lost" = t(2) - t(1)/2, the time by which the step misses a perfect 2x, and the table lists the
steps that lose most (serial steps, too-fine splits, imbalance, the wake-up of a region), with
their kind and source ops, and the totals per kind.

--pool instead runs each package at 2 threads with KILN_POOL_STATS=1 (kiln_pool.h): every
region's members measure the CPU time of their share, so the figures do not depend on how
loaded the machine is (a member that waits for a core is not charged for the wait). Per model:
the CPU time of the serial parts (outside regions, e.g. kernels below the parallel threshold),
the members' summed CPU time, the critical path (serial + the largest member of every region)
and the speed-up a core per thread would give, (serial + summed) / critical path; then the
region bodies (named from the package library's symbols) that lose most to imbalance,
largest member - summed / team. (Cache effects of the second thread are in the CPU times; the
wake-up of the team is not: add regions x bench/threads_cpu.py --calibrate's F.) A region whose
members share work out as they run (kr::parallel_for_dynamic; kr::parallel_for once a member
has finished its own share) gives a descheduled member's work to the running one, so on a
loaded machine its balance shows the load, not the split; the summed CPU time is the work
either way.

    python bench/threads_steps.py --keep DIR [--models mlp,resnet18] [--rounds 3]
        [--calls 200] [--top 12] [--taskset 0,1] [--json out.json]
    python bench/threads_steps.py --keep DIR --pool [--threads 2] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_peers import _load_arrays, _uptime  # noqa: E402


def w_steps(d: Path, threads: int, calls: int, stat: str) -> dict:
    import torch

    import kiln
    from kiln.runtime import profiling

    torch.set_num_threads(threads)
    args = tuple(torch.from_numpy(a) for a in _load_arrays(d / "inputs.npz"))
    fn = kiln.load(str(d / "kiln.kiln"), num_threads=threads)
    runner = getattr(fn, "runner", fn)
    with torch.inference_mode():
        for _ in range(5):
            fn(*args)
        ends = []
        for _ in range(calls):
            t = time.perf_counter()
            fn(*args)
            ends.append(time.perf_counter() - t)
        profiling.enable(runner)
        best: dict[str, list] = {}
        for _ in range(calls):
            fn(*args)
            for s in profiling.steps(runner):
                b = best.setdefault(s.name, [s.kind, ", ".join(s.source_ops), s.last_s, []])
                b[2] = min(b[2], s.last_s)
                b[3].append(s.last_s)
        profiling.enable(runner, False)
    pick = min if stat == "min" else statistics.median
    return {"run_s": pick(ends),
            "steps": [[k, v[0], v[1], pick(v[3])] for k, v in best.items()]}


def w_pool(d: Path, threads: int, calls: int) -> None:
    """Runs the package `calls` times at `threads` (KILN_POOL_STATS set by the driver); the
    pool prints its summary on stderr when the runner is closed."""
    import torch

    import kiln

    torch.set_num_threads(threads)
    args = tuple(torch.from_numpy(a) for a in _load_arrays(d / "inputs.npz"))
    runner = kiln.load(str(d / "kiln.kiln"), num_threads=threads)
    with torch.inference_mode():
        for _ in range(calls):
            runner(*args)
    runner.close()


_WRAP = re.compile(r"^(?:kr::parallel(?:_for|_for_dynamic)?<)+")


def _symbols(lib: str) -> list[tuple[int, str]]:
    """(address, demangled name) of the library's functions, sorted."""
    out = subprocess.run(["nm", "-C", "--defined-only", lib], capture_output=True, text=True)
    syms = []
    for line in out.stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in "tTwW":
            syms.append((int(parts[0], 16), parts[2]))
    return sorted(syms)


def _name(syms: list[tuple[int, str]], off: int) -> tuple[str, bool]:
    """The region body at `off`: the enclosing kernel or routine of kr::parallel's trampoline,
    and whether it is a dynamic schedule (kr::parallel_for_dynamic)."""
    best = None
    for a, n in syms:
        if a > off:
            break
        best = n
    if best is None:
        return hex(off), False
    dyn = best.startswith("kr::parallel<kr::parallel_for_dynamic<")
    n = _WRAP.sub("", best)
    n = n.split("::{lambda")[0]
    return n.split("(")[0][:90] + (" (dynamic)" if dyn else ""), dyn


def pool_stats(a: argparse.Namespace, d: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker-pool", "--dir", str(d), "--threads",
           str(a.threads), "--calls", str(a.calls), "--keep", "-"]
    if a.taskset:
        cmd = ["taskset", "-c", a.taskset, *cmd]
    p = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT), KILN_POOL_STATS="1"),
                       capture_output=True, text=True, check=True)
    head = next((ln for ln in p.stderr.splitlines() if ln.startswith("kiln pool stats:")), None)
    if head is None:
        raise SystemExit(f"{d}: no pool stats (a package built before KILN_POOL_STATS?)\n"
                         f"{p.stderr[-2000:]}")
    tot = {k: float(v) for k, v in re.findall(
        r"(runs|wall|caller cpu|serial cpu|regions' member cpu|critical path) ([0-9.]+)", head)}
    regions, cache = [], {}
    for ln in p.stderr.splitlines():
        m = re.match(r"kiln pool region: (.*)\+0x([0-9a-f]+) team (\d+) regions (\d+) "
                     r"cpu_sum (\d+) cpu_max (\d+) wall (\d+)", ln)
        if not m:
            continue
        lib, off = m.group(1), int(m.group(2), 16)
        if lib not in cache:
            cache[lib] = _symbols(lib) if os.path.exists(lib) else []
        team, n, cs, cm = (int(m.group(i)) for i in (3, 4, 5, 6))
        name, dyn = _name(cache[lib], off)
        regions.append({"name": name, "dynamic": dyn, "team": team, "regions": n,
                        "cpu_sum_s": cs * 1e-9, "cpu_max_s": cm * 1e-9,
                        "lost_s": (cm - cs / team) * 1e-9})
    return {"totals": tot, "regions": regions}


def pool_main(a: argparse.Namespace) -> int:
    print(f"# {_uptime()}", flush=True)
    result = {}
    for m in [x for x in a.models.split(",") if x]:
        d = Path(a.keep) / m
        r = pool_stats(a, d)
        t = r["totals"]
        runs = t["runs"]
        serial, summed, path = t["serial cpu"], t["regions' member cpu"], t["critical path"]
        nreg = sum(x["regions"] for x in r["regions"])
        # a dynamic schedule's tasks go to whichever member is running: under load the caller
        # takes them all, so its balance says nothing of a quiet machine; counted balanced here
        dyn_lost = sum(x["lost_s"] for x in r["regions"] if x["dynamic"])
        print(f"\n## {m}: {a.threads} threads, per run: serial cpu {serial / runs * 1e6:.0f} us, "
              f"members' cpu {summed / runs * 1e6:.0f} us in {nreg / runs:.0f} regions, "
              f"critical path {path / runs * 1e6:.0f} us -> with a core per thread "
              f"{(serial + summed) / path:.2f}x over the same work on one"
              + (f", {(serial + summed) / (path - dyn_lost):.2f}x with the dynamic regions "
                 "balanced" if dyn_lost else "")
              + f" (wall per run under this load: {t['wall'] / runs * 1e6:.0f} us)")
        print("| region body | team | regions/run | members' cpu (us/run) | largest member "
              "(us/run) | balance | lost (us/run) |\n|---|---|---|---|---|---|---|")
        for x in sorted(r["regions"], key=lambda x: -x["lost_s"])[:a.top]:
            bal = x["cpu_sum_s"] / x["team"] / x["cpu_max_s"] if x["cpu_max_s"] else 1.0
            print(f"| {x['name']} | {x['team']} | {x['regions'] / runs:.0f} | "
                  f"{x['cpu_sum_s'] / runs * 1e6:.1f} | {x['cpu_max_s'] / runs * 1e6:.1f} | "
                  f"{bal:.2f} | {x['lost_s'] / runs * 1e6:.1f} |")
        result[m] = r
    print(f"\n# {_uptime()}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", required=True, help="bench/threads_cpu.py --keep directory")
    ap.add_argument("--models", default="mlp,resnet18,mobilenet_v2,gpt,bert_like_b4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--stat", choices=("min", "median"), default="min",
                    help="per process: each step's (and the run's) min or median over calls")
    ap.add_argument("--taskset", default="0,1")
    ap.add_argument("--json", default=None)
    ap.add_argument("--pool", action="store_true", help="CPU time per region (KILN_POOL_STATS)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--worker-pool", action="store_true")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.worker:
        Path(a.out).write_text(json.dumps(w_steps(Path(a.dir), a.threads, a.calls, a.stat)))
        return 0
    if a.worker_pool:
        w_pool(Path(a.dir), a.threads, a.calls)
        return 0
    if a.pool:
        return pool_main(a)
    base = Path(a.keep)
    print(f"# {_uptime()}", flush=True)
    result = {}
    for m in [x for x in a.models.split(",") if x]:
        d = base / m
        if not (d / "kiln.kiln").exists():
            print(f"{m}: no package in {d}")
            continue
        per = {1: defaultdict(list), 2: defaultdict(list)}
        runs = {1: [], 2: []}
        meta = {}
        loads = []
        for rnd in range(a.rounds):
            loads.append(os.getloadavg()[0])
            for n in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                out = d / f"steps-{n}.json"
                cmd = [sys.executable, __file__, "--worker", "--dir", str(d), "--threads",
                       str(n), "--calls", str(a.calls), "--stat", a.stat, "--out", str(out),
                       "--keep", "-"]
                if a.taskset:
                    cmd = ["taskset", "-c", a.taskset, *cmd]
                subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
                r = json.loads(out.read_text())
                runs[n].append(r["run_s"])
                for name, kind, src, s in r["steps"]:
                    per[n][name].append(s)
                    meta[name] = (kind, src)
        med = {n: {k: statistics.median(v) for k, v in per[n].items()} for n in (1, 2)}
        r1, r2 = statistics.median(runs[1]), statistics.median(runs[2])
        rows = []
        for name, (kind, src) in meta.items():
            t1, t2 = med[1].get(name, 0.0), med[2].get(name, 0.0)
            rows.append((t2 - t1 / 2, name, kind, src, t1, t2))
        rows.sort(reverse=True)
        print(f"\n## {m}: run {r1 * 1e3:.3f} ms (1 thread) / {r2 * 1e3:.3f} ms (2 threads) = "
              f"{r1 / r2:.2f}x; steps sum {sum(med[1].values()) * 1e3:.3f} / "
              f"{sum(med[2].values()) * 1e3:.3f} ms; load1 {', '.join(f'{x:.2f}' for x in loads)}")
        kinds = defaultdict(lambda: [0.0, 0.0, 0])
        for _, name, kind, src, t1, t2 in rows:
            k = kinds[kind]
            k[0] += t1
            k[1] += t2
            k[2] += 1
        print("| kind | steps | 1 thr (us) | 2 thr (us) | speed-up |\n|---|---|---|---|---|")
        for kind, (t1, t2, c) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
            print(f"| {kind} | {c} | {t1 * 1e6:.0f} | {t2 * 1e6:.0f} | "
                  f"{t1 / t2 if t2 else float('nan'):.2f}x |")
        print("\n| step | kind | source ops | 1 thr (us) | 2 thr (us) | speed-up | lost (us) |"
              "\n|---|---|---|---|---|---|---|")
        for lost, name, kind, src, t1, t2 in rows[:a.top]:
            print(f"| {name} | {kind} | {src[:40]} | {t1 * 1e6:.1f} | {t2 * 1e6:.1f} | "
                  f"{t1 / t2 if t2 else float('nan'):.2f}x | {lost * 1e6:.1f} |")
        result[m] = {"run_1_s": r1, "run_2_s": r2, "loads": loads,
                     "steps": [dict(zip(("lost_s", "name", "kind", "source", "t1_s", "t2_s"), r))
                               for r in rows]}
    print(f"\n# {_uptime()}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
