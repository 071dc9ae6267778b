"""Throughput of compiled packages with 1, 2 and 4 handles (one Python thread each), and the
single-handle latency, for zoo models. Each configuration is measured `--repeat` times and the
median is printed (the development box is shared: single measurements are noisy).

    python bench/throughput.py [--models mlp,gpt,resnet18] [--handles 1,2,4] [--seconds 1.0]
                               [--repeat 3] [--budgets 0,2] [--packages DIR]

`--packages DIR` keeps the compiled packages there (reused when present, so a rerun after a
runtime-only change does not recompile). `--budgets 0,2` measures each configuration with
every handle loaded as `kiln.load(..., num_threads=N)` for each N (0: the automatic budget;
N = the core count: every run forks a full team, as kiln did before the budget), interleaved
within each repeat so that load changes on a shared machine hit all of them alike. OpenMP
environment variables (OMP_WAIT_POLICY, OMP_NUM_THREADS) apply as usual.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def package(name: str, out_dir: Path) -> tuple[Path, tuple]:
    import kiln
    from kiln.models import ALL_MODELS

    spec = ALL_MODELS[name]()
    path = out_dir / f"{name}.kiln"
    if not path.exists():
        c = kiln.compile(spec.module, spec.example_args, dynamic_shapes=spec.dynamic_shapes)
        c.save(path)
    return path, spec.example_args


def throughput(path: Path, args: tuple, handles: int, seconds: float,
               num_threads: int) -> tuple[float, float]:
    """(runs per second, process CPU milliseconds per run) with `handles` handles, one thread
    each, for `seconds`. CPU time per run counts OpenMP threads spin-waiting too, and depends
    less than runs/s on what else runs on a shared machine."""
    import kiln

    runners = [kiln.load(path, num_threads=num_threads) for _ in range(handles)]
    counts = [0] * handles
    barrier = threading.Barrier(handles + 1)
    stop = [0.0]

    def work(t: int) -> None:
        barrier.wait()
        while time.perf_counter() < stop[0]:
            runners[t](*args)
            counts[t] += 1

    for r in runners:
        r(*args)  # warm up (plan cache, pages)
    threads = [threading.Thread(target=work, args=(t,)) for t in range(handles)]
    for th in threads:
        th.start()
    t0, c0 = time.perf_counter(), time.process_time()
    stop[0] = t0 + seconds
    barrier.wait()
    for th in threads:
        th.join()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    for r in runners:
        r.close()
    runs = max(sum(counts), 1)
    return runs / elapsed, 1e3 * cpu / runs


def latency_ms(path: Path, args: tuple, runs: int, num_threads: int) -> float:
    import kiln

    with kiln.load(path, num_threads=num_threads) as r:
        for _ in range(3):
            r(*args)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            r(*args)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,resnet18")
    ap.add_argument("--handles", default="1,2,4")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--latency-runs", type=int, default=50)
    ap.add_argument("--budgets", default="0")
    ap.add_argument("--packages", default=None)
    a = ap.parse_args(argv)
    out = Path(a.packages) if a.packages else Path(tempfile.mkdtemp(prefix="kiln-tput-"))
    out.mkdir(parents=True, exist_ok=True)
    handles = [int(h) for h in a.handles.split(",")]
    budgets = [int(b) for b in a.budgets.split(",")]
    print("| model | num_threads | latency, 1 handle (ms) | " +
          " | ".join(f"{h} handle{'s' if h > 1 else ''}: runs/s (CPU ms/run)" for h in handles)
          + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in handles) + " |")
    for name in a.models.split(","):
        path, args = package(name, out)
        lat: dict = {b: [] for b in budgets}
        tput: dict = {(b, h): [] for b in budgets for h in handles}
        for _ in range(a.repeat):
            for b in budgets:
                lat[b].append(latency_ms(path, args, a.latency_runs, b))
            for h in handles:
                for b in budgets:
                    tput[b, h].append(throughput(path, args, h, a.seconds, b))
        for b in budgets:
            cells = [f"{statistics.median(x for x, _ in tput[b, h]):.0f} "
                     f"({statistics.median(c for _, c in tput[b, h]):.1f})" for h in handles]
            print(f"| {name} | {b or 'auto'} | {statistics.median(lat[b]):.2f} "
                  f"(min {min(lat[b]):.2f}) | " +
                  " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
