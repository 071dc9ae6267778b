"""kiln at 1 and at 2 threads on the CPU benchmark models (issue 14, item 3: 2 threads should
run close to 2x faster than 1).

For every model (bench/cpu_peers_models.py) one package is compiled with
Options(num_threads=2) (bench/cpu_peers.py's prepare and compile steps, in their own
processes); it is then timed with kiln.load(num_threads=1) and with num_threads=2, each in a
fresh process, in R interleaved rounds (the order of 1 and 2 alternates per round, so both see
the same load). A process warms up, times calls for --min-time seconds (at least --min-calls)
and reports its median call (--stat min: its fastest call) and checks its output against eager.
The figure per thread count
is the median over rounds; speed-up = t(1 thread) / t(2 threads). `uptime` load is sampled
every round. --taskset pins every timing process to the given CPUs; --env sets environment
variables (e.g. OMP_WAIT_POLICY=PASSIVE) in the timing processes; --ort adds ONNX Runtime at 1
and 2 threads (bench/cpu_peers.py's compile and timing workers, intra_op_num_threads=n) to the
same interleaved rounds, for its own speed-up beside kiln's; each --variant NAME=VALUE adds
a column: 2 threads with that variable set (interleaved with the others in every round), e.g.
GOMP_SPINCOUNT=1000, the spin count libkiln gives the OpenMP pool a package starts itself (a
Python process that imported torch shares torch's pool, whose settings were read at import).

--calibrate instead measures what the parallel thresholds are derived from (a C++ program built
with the compiler and flags of CPU packages, on kiln's thread pool, kiln_pool.h): the
cost F of one parallel region of a 2-thread team (fork, an empty body, the closing barrier;
back to back, as a run's kernels are), the cost of one element of a pointwise kernel and of one
vector FMA at 1 thread, and the least work W = 4F / (cost per unit) worth a second thread: from
there, halving the work saves at least one more region cost than the region costs (T/2 + F <=
T - F), to compare with the thresholds in use (kernel.py PARALLEL_MIN_WORK, kiln_conv.h's
16384 vector FMAs, kiln_model_rt.h's 262144 multiply-adds).

    python bench/threads_cpu.py [--models mlp,resnet18] [--rounds 5] [--min-time 1.0]
        [--taskset 0,1] [--env NAME=VALUE ...] [--variant NAME=VALUE ...] [--json out.json]
        [--markdown BENCHMARKS.md]
    python bench/threads_cpu.py --calibrate
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_peers import _load_arrays, _uptime, machine_info  # noqa: E402
from bench.markdown import splice  # noqa: E402

MODELS = ("mlp", "resnet18", "resnet18_b8", "mobilenet_v2", "gpt", "bert_like_b4",
          "ln_softmax")
BEGIN, END = "<!-- cpu-threads:begin -->", "<!-- cpu-threads:end -->"


def w_time(d: Path, threads: int, warmup: int, min_calls: int, min_time: float) -> dict:
    """Load the package with `threads` threads, warm up, time calls, check the output."""
    import numpy as np
    import torch

    import kiln
    from bench.cpu_peers import _flat_np

    torch.set_num_threads(threads)
    arrays = _load_arrays(d / "inputs.npz")
    want = _load_arrays(d / "expected.npz")
    meta = json.loads((d / "prepare.json").read_text())
    args = tuple(torch.from_numpy(a) for a in arrays)
    fn = kiln.load(str(d / "kiln.kiln"), num_threads=threads)
    with torch.inference_mode():
        for _ in range(warmup):
            out = fn(*args)
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < min_calls or time.perf_counter() - start < min_time:
            t = time.perf_counter()
            out = fn(*args)
            times.append(time.perf_counter() - t)
    got = [np.asarray(g, dtype=np.float64) for g in _flat_np(out)]
    err = max((float(np.max(np.abs(g - w))) for g, w in zip(got, want) if w.size), default=0.0)
    scale = max((float(np.max(np.abs(w))) for w in want if w.size), default=0.0)
    return {"latency_s": statistics.median(times), "min_s": min(times), "calls": len(times),
            "matches": bool(err <= meta["atol"] + meta["rtol"] * scale), "max_abs_err": err}


CALIBRATE_CPP = r"""
#include "kiln_pool.h"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include <immintrin.h>
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
template <class F> double best_of(int reps, int inner, F f) {  // min over reps, s per call
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    const double t = now();
    for (int i = 0; i < inner; ++i) f();
    best = std::min(best, (now() - t) / inner);
  }
  return best;
}
int main() {
  kr::Pool pool;  // kiln's pool, as a package run has it (kiln_pool.h)
  kr::tls().requested = 2;  // as libkiln's kiln_pool_set_num_threads(2)
  kr::RunScope scope(&pool);
  volatile int sink = 0;
  std::vector<double> regions;  // each region timed alone: min (an idle machine) and median
  for (int i = 0; i < 20000; ++i) {
    const double t = now();
    kr::parallel(2, [&](int t, int) { if (t == 7) sink = 1; });
    regions.push_back(now() - t);
  }
  std::sort(regions.begin(), regions.end());
  const double region = regions[regions.size() / 100], region_med = regions[regions.size() / 2];
  const int n = 1 << 16;  // pointwise: y = relu(x * 2 + 1), in L2
  std::vector<float> x(n, 0.5f), y(n);
  const double pw = best_of(15, 200, [&] {
#pragma omp simd
    for (int i = 0; i < n; ++i) { const float v = x[i] * 2.0f + 1.0f; y[i] = v > 0 ? v : 0; }
    asm volatile("" : : "r"(y.data()) : "memory");
  }) / n;
#ifdef __AVX512F__
  typedef __m512 V; const int lanes = 16;
#define FMA _mm512_fmadd_ps
#define SET _mm512_set1_ps
#else
  typedef __m256 V; const int lanes = 8;
#define FMA _mm256_fmadd_ps
#define SET _mm256_set1_ps
#endif
  const int iters = 1 << 14;  // 12 independent accumulators, as the conv / GEMM tiles
  V acc[12]; for (auto &a : acc) a = SET(0.f);
  const V w = SET(1.0001f), b = SET(0.5f);
  const double fma = best_of(15, 20, [&] {
    for (int i = 0; i < iters; ++i)
      for (int j = 0; j < 12; ++j) acc[j] = FMA(w, acc[j], b);
    asm volatile("" : : "x"(acc[0]), "x"(acc[5]), "x"(acc[11]) : "memory");
  }) / (iters * 12.0);
  std::printf("%g %g %g %g %d\n", region, region_med, pw, fma, lanes);
}
"""


def calibrate() -> int:
    """Builds and runs CALIBRATE_CPP; prints F (1st percentile and median of 20000 regions,
    each timed alone), the unit costs and the break-even sizes."""
    from kiln.config import cxx

    work = Path(tempfile.mkdtemp(prefix="kiln-calibrate-"))
    src, exe = work / "calibrate.cpp", work / "calibrate"
    src.write_text(CALIBRATE_CPP)
    cxx = cxx()
    subprocess.run([cxx, "-std=c++17", "-O3", "-march=native", "-fopenmp-simd", "-pthread",
                    f"-I{ROOT / 'kiln' / 'runtime' / 'model'}", str(src), "-o", str(exe)],
                   check=True)
    env = dict(os.environ)  # KILN_SPIN_US: the pool's spin before sleeping (default 20)
    out = subprocess.run([str(exe)], env=env, capture_output=True, text=True, check=True)
    vals = out.stdout.split()
    region, median, pw, fma, lanes = (*map(float, vals[:4]), int(vals[4]))
    print(f"# {_uptime()}")
    for label, f in (("1st percentile (a quiet machine)", region), ("median", median)):
        print(f"parallel region, 2 threads, back to back, {label}: {f * 1e6:.2f} us -> "
              f"worth splitting from {4 * f / pw:.0f} pointwise elements (PARALLEL_MIN_WORK), "
              f"{4 * f / fma:.0f} vector FMAs (kMinParallelFmas), "
              f"{4 * f / fma * lanes:.0f} multiply-adds (kGemmMinParallelMacs)")
    print(f"unit costs at 1 thread: pointwise element {pw * 1e9:.3f} ns, vector FMA "
          f"({lanes} lanes) {fma * 1e9:.3f} ns")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _ort(a: argparse.Namespace, step: str, model: str, d: Path, threads: int = 2) -> dict:
    """bench/cpu_peers.py's ORT worker (compile: the ONNX export; time: at `threads`)."""
    out = d / f"ort-{step}-{threads}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "cpu_peers.py"), "--worker", step, "--model",
           model, "--system", "ort", "--dir", str(d), "--worker-out", str(out)]
    if step == "time":
        cmd += ["--warmup", str(a.warmup), "--min-calls", str(a.min_calls), "--min-time",
                str(a.min_time), "--max-calls", "20000"]
        if a.taskset:
            cmd = ["taskset", "-c", a.taskset, *cmd]
    env = dict(os.environ, PYTHONPATH=str(ROOT), KILN_BENCH_THREADS=str(threads),
               OMP_NUM_THREADS=str(threads))
    env.update(kv.split("=", 1) for kv in a.env)
    try:
        subprocess.run(cmd, env=env, timeout=a.timeout, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout ({a.timeout:.0f} s)"}
    return json.loads(out.read_text()) if out.exists() else {"error": "worker died"}


def _worker(a: argparse.Namespace) -> None:
    from bench.cpu_peers import w_compile, w_prepare

    d = Path(a.dir)
    try:
        if a.worker == "prepare":
            res = w_prepare(a.model, d)
            (d / "prepare.json").write_text(json.dumps(res))
        elif a.worker == "compile":
            res = w_compile(a.model, "kiln", d)
        else:
            res = w_time(d, a.threads, a.warmup, a.min_calls, a.min_time)
    except BaseException as e:  # reported in the table
        lines = str(e).strip().splitlines()
        res = {"error": f"{type(e).__name__}: {lines[0] if lines else ''}"}
    Path(a.worker_out).write_text(json.dumps(res, default=str))


def _run(a: argparse.Namespace, step: str, model: str, d: Path, threads: int = 2,
         pin: bool = False, variant: str | None = None) -> dict:
    out = d / f"{step}-{threads}.json"
    cmd = [sys.executable, __file__, "--worker", step, "--model", model, "--dir", str(d),
           "--threads", str(threads), "--warmup", str(a.warmup), "--min-calls",
           str(a.min_calls), "--min-time", str(a.min_time), "--worker-out", str(out)]
    if pin and a.taskset:
        cmd = ["taskset", "-c", a.taskset, *cmd]
    env = dict(os.environ, PYTHONPATH=str(ROOT), KILN_CACHE_DIR=str(d / "kiln-cache"))
    if step == "time":
        env.update(kv.split("=", 1) for kv in a.env + ([variant] if variant else []))
    try:
        subprocess.run(cmd, env=env, timeout=a.timeout, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout ({a.timeout:.0f} s)"}
    return json.loads(out.read_text()) if out.exists() else {"error": "worker died"}


def _geo(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--min-calls", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--taskset", default=None, help="CPUs for the timing processes, e.g. 0,1")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for timing runs")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=VALUE: a further 2-thread column with this variable set")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="a process's figure: its median call, or its fastest (min: on a "
                         "loaded shared machine, the calls in which every thread had a core)")
    ap.add_argument("--ort", action="store_true", help="ONNX Runtime at 1 and 2 threads too")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--keep", default=None, help="directory for the packages (kept)")
    ap.add_argument("--calibrate", action="store_true", help="measure the parallel thresholds")
    # worker arguments
    ap.add_argument("--worker", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker-out", default=None)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    if a.calibrate:
        return calibrate()
    models = [m for m in a.models.split(",") if m]
    base = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="kiln-threads-"))
    load_start = _uptime()
    print(f"# {load_start}", flush=True)
    dirs: dict[str, Path] = {}
    errors: dict[str, str] = {}
    for m in models:  # prepare + compile (a package already in --keep is reused)
        d = base / m
        d.mkdir(parents=True, exist_ok=True)
        dirs[m] = d
        if not ((d / "kiln.kiln").exists() and (d / "prepare.json").exists()):
            for step in ("prepare", "compile"):
                r = _run(a, step, m, d)
                if "error" in r:
                    errors[m] = f"{step}: {r['error']}"
                    print(f"{m}: {errors[m]}", flush=True)
                    break
        if a.ort and m not in errors and not (d / "model.onnx").exists():
            r = _ort(a, "compile", m, d)
            if "error" in r:
                errors[m] = f"ort compile: {r['error']}"
    cols: list[tuple[int, str | None]] = [(1, None), (2, None)] + [(2, v) for v in a.variant]
    if a.ort:
        cols += [(1, "ort"), (2, "ort")]
    times: dict[str, dict[tuple, list[float]]] = {m: {c: [] for c in cols} for m in models}
    bad: dict[str, str] = {}
    loads: list[float] = []
    for rnd in range(a.rounds):
        loads.append(os.getloadavg()[0])
        for m in models:
            if m in errors:
                continue
            for c in (cols if rnd % 2 == 0 else cols[::-1]):
                if c[1] == "ort":
                    r = _ort(a, "time", m, dirs[m], c[0])
                else:
                    r = _run(a, "time", m, dirs[m], c[0], pin=True, variant=c[1])
                if "error" in r:
                    bad[m] = r["error"]
                    continue
                if not r["matches"]:
                    bad[m] = f"MISMATCH (max abs err {r['max_abs_err']:.3g})"
                times[m][c].append(r["min_s" if a.stat == "min" else "latency_s"])
        print(f"round {rnd + 1}/{a.rounds} done (load {loads[-1]:.2f})", flush=True)
    load_end = _uptime()

    def med(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3 if xs else math.nan

    rows = []
    for m in models:
        t1, t2 = med(times[m][cols[0]]), med(times[m][cols[1]])
        rows.append({"model": m, "t1_ms": t1, "t2_ms": t2, "speedup": t1 / t2,
                     "variants": {v: med(times[m][(2, v)]) for v in a.variant},
                     "ort_1_ms": med(times[m].get((1, "ort"), [])),
                     "ort_2_ms": med(times[m].get((2, "ort"), [])),
                     "rounds": {f"{c[0]}{' ' + c[1] if c[1] else ''}": [x * 1e3 for x in xs]
                                for c, xs in times[m].items()},
                     "error": errors.get(m) or bad.get(m)})
    geo = _geo([r["speedup"] for r in rows])
    command = "python bench/threads_cpu.py " + " ".join(
        x for x in (argv if argv is not None else sys.argv[1:]))
    info = machine_info(a.taskset)
    lines = [f"{info['date']}, {info['cpu']}, {info['cores']} cores, torch {info['torch']}; "
             f"`{command.strip()}`" + (f"; env {' '.join(a.env)}" if a.env else ""),
             f"load before: `{load_start}`; after: `{load_end}`; load1 per round "
             f"{', '.join(f'{x:.2f}' for x in loads)}", "",
             "| model | 1 thread (ms) | 2 threads (ms) | speed-up | "
             + "".join(f"2 threads, {v} (ms) | speed-up | " for v in a.variant)
             + ("ORT 1 thread (ms) | ORT 2 threads (ms) | ORT speed-up | " if a.ort else "")
             + "note |",
             "|---|---|---|---|" + "---|---|" * len(a.variant) + "---|---|---|" * a.ort
             + "---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['t1_ms']:.3g} | {r['t2_ms']:.3g} | "
                     f"{r['speedup']:.2f}x | "
                     + "".join(f"{r['variants'][v]:.3g} | {r['t1_ms'] / r['variants'][v]:.2f}x | "
                               for v in a.variant)
                     + (f"{r['ort_1_ms']:.3g} | {r['ort_2_ms']:.3g} | "
                        f"{r['ort_1_ms'] / r['ort_2_ms']:.2f}x | " if a.ort else "")
                     + f"{r['error'] or ''} |")
    lines += ["", f"Geometric mean speed-up: {geo:.2f}x"
              + (f"; ORT: {_geo([r['ort_1_ms'] / r['ort_2_ms'] for r in rows]):.2f}x"
                 if a.ort else "")
              + "".join(f"; with {v}: {_geo([r['t1_ms'] / r['variants'][v] for r in rows]):.2f}x"
                        for v in a.variant)]
    md = "\n".join(lines)
    print(md, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "info": info, "loads": loads,
                                            "env": a.env}, indent=1))
    if a.markdown:
        splice(Path(a.markdown), BEGIN, END, md,
               heading="## CPU: 1 thread against 2 threads (issue 14, item 3)")
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
