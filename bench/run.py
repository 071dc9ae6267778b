"""Benchmark kiln against eager PyTorch, torch.compile (inductor) and AOTInductor.

For each zoo model and system: compile time, median latency after warm-up, package size, peak
RSS and the max abs error against eager; kiln also reports its arena bytes and the ``ldd`` of
its ``lib/model.so`` (to show that no torch library is linked). Each (model, system) pair runs
in its own subprocess, so one failure or crash is reported in its table cell and the others go
on, and peak RSS is per system. ``torch.set_num_threads(2)`` everywhere.

    python bench/run.py [--models mlp,gpt] [--systems eager,aoti,kiln] [--repeat 30]
                        [--json out.json] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_name  # noqa: E402
from bench.markdown import splice  # noqa: E402

SYSTEMS = ("eager", "torch.compile", "aoti", "kiln")
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
THREADS = 2


# ------------------------------------------------------------------------ worker (one system)

def _peak_rss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _latencies(fn: Callable[[], Any], repeat: int, warmup: int) -> tuple[list[float], Any]:
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def _max_err(got: Any, want: Any) -> float:
    import torch
    from torch.utils._pytree import tree_flatten

    g, w = tree_flatten(got)[0], tree_flatten(want)[0]
    if len(g) != len(w):
        return float("inf")
    err = 0.0
    for a, b in zip(g, w):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        if a.shape != b.shape:
            return float("inf")
        if a.numel():
            err = max(err, float((a.double() - b.double()).abs().max()))
    return err


def ldd_of_package(pkg: Path) -> list[str]:
    """``ldd`` lines of ``lib/model.so`` inside a kiln package (a zip, or a directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        so = Path(tmp) / "model.so"
        if pkg.is_dir():
            shutil.copy(pkg / "lib" / "model.so", so)
        else:
            with zipfile.ZipFile(pkg) as zf:
                so.write_bytes(zf.read("lib/model.so"))
        tool = "otool" if sys.platform == "darwin" else "ldd"
        args = [tool, "-L", str(so)] if tool == "otool" else [tool, str(so)]
        res = subprocess.run(args, capture_output=True, text=True, check=False)
        return [ln.strip() for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]


def run_system(model: str, system: str, repeat: int, warmup: int, workdir: Path) -> dict:
    """Measure one system on one zoo model in this process; returns a result dict."""
    import torch

    from kiln.models import get

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    spec = get(model)
    args = spec.example_args
    res: dict[str, Any] = {"model": model, "system": system}
    with torch.no_grad():
        want = spec.module(*args)
        if system == "eager":
            fn: Callable[[], Any] = lambda: spec.module(*args)  # noqa: E731
        elif system == "torch.compile":
            t = time.perf_counter()
            cm = torch.compile(spec.module, backend="inductor")
            cm(*args)
            res["compile_s"] = time.perf_counter() - t
            fn = lambda: cm(*args)  # noqa: E731
        elif system == "aoti":
            import torch._inductor as ind

            t = time.perf_counter()
            ep = spec.export()
            res["export_s"] = time.perf_counter() - t
            path = workdir / f"{model}.pt2"
            t = time.perf_counter()
            ind.aoti_compile_and_package(ep, package_path=str(path))
            res["compile_s"] = time.perf_counter() - t
            res["package_bytes"] = path.stat().st_size
            runner = ind.aoti_load_package(str(path))
            fn = lambda: runner(*args)  # noqa: E731
        elif system == "kiln":
            import kiln

            t = time.perf_counter()
            ep = spec.export()
            res["export_s"] = time.perf_counter() - t
            path = workdir / f"{model}.kiln"
            options = kiln.Options(num_threads=THREADS)
            t = time.perf_counter()
            compiled = kiln.compile(ep, options=options)
            compiled.save(str(path))
            res["compile_s"] = time.perf_counter() - t
            report = dict(compiled.report or {})
            res["kiln_report"] = {k: v for k, v in report.items()
                                  if isinstance(v, (int, float, str, dict))}
            res["arena_bytes"] = report.get("arena_bytes")
            res["lower_bound_bytes"] = report.get("lower_bound_bytes")
            res["kernels"] = report.get("kernels")
            res["package_bytes"] = path.stat().st_size
            try:
                res["ldd"] = ldd_of_package(path)
            except Exception as e:  # the numbers still count without it
                res["ldd"] = [f"ldd failed: {e}"]
            runner = kiln.load(str(path))
            fn = lambda: runner(*args)  # noqa: E731
        else:
            raise ValueError(f"unknown system {system!r}")
        res["rss_before_bytes"] = _peak_rss()
        times, got = _latencies(fn, max(repeat, 1), warmup)
    res["latency_s"] = statistics.median(times)
    res["latency_min_s"] = min(times)
    res["max_abs_err"] = _max_err(got, want)
    res["matches"] = bool(res["max_abs_err"] <= spec.atol + spec.rtol * _max_abs(want))
    res["peak_rss_bytes"] = _peak_rss()
    return res


def _max_abs(x: Any) -> float:
    import torch
    from torch.utils._pytree import tree_flatten

    vals = [float(torch.as_tensor(t).abs().max()) for t in tree_flatten(x)[0]
            if torch.as_tensor(t).numel()]
    return max(vals, default=0.0)


def worker_main(model: str, system: str, repeat: int, warmup: int, out: str) -> None:
    """Entry point of one subprocess: writes its result (or error) as JSON to ``out``."""
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        try:
            res = run_system(model, system, repeat, warmup, Path(tmp))
        except BaseException as e:  # reported in the table
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            res = {"model": model, "system": system, "error": f"{type(e).__name__}: {first}",
                   "traceback": traceback.format_exc()}
    Path(out).write_text(json.dumps(res, default=str))


# ------------------------------------------------------------------------ driver and reports

def measure(model: str, system: str, repeat: int, warmup: int, timeout: float,
            warm_cache: bool = False) -> dict:
    """Run one (model, system) pair in a fresh subprocess and return its result dict."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--worker", f"{model}/{system}", "--repeat", str(repeat),
           "--warmup", str(warmup), "--worker-out", out]
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    cache = tempfile.mkdtemp(prefix="kiln-bench-cache-")
    if not warm_cache:  # cold compiles: inductor and kiln get empty cache directories
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        env["KILN_CACHE_DIR"] = os.path.join(cache, "kiln")
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
        text = Path(out).read_text() if Path(out).stat().st_size else ""
        if text:
            res = json.loads(text)
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            res = {"error": f"worker exited {proc.returncode}: {tail[0]}"}
    except subprocess.TimeoutExpired:
        res = {"error": f"timed out after {timeout:.0f} s"}
    finally:
        Path(out).unlink(missing_ok=True)
        shutil.rmtree(cache, ignore_errors=True)
    res.update(model=model, system=system, wall_s=time.perf_counter() - t)
    return res


def machine_info() -> dict[str, Any]:
    """CPU, cores, OS, Python and torch versions and the date, for the report header."""
    cpu = cpu_name()
    try:
        import torch

        tv = torch.__version__
    except ImportError:
        tv = "?"
    cxx = shutil.which("c++") or shutil.which("g++") or "?"
    try:
        cxx_ver = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 check=False).stdout.splitlines()[0]
    except (OSError, IndexError):
        cxx_ver = cxx
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(),
            "python": platform.python_version(), "torch": tv, "cxx": cxx_ver,
            "threads": THREADS, "date": datetime.date.today().isoformat()}


def _ms(s: Any) -> str:
    return f"{s * 1e3:.3f} ms" if isinstance(s, (int, float)) else "-"


def _mib(b: Any) -> str:
    return f"{b / 2**20:.1f} MiB" if isinstance(b, (int, float)) else "-"


def _cell(r: dict | None, kind: str) -> str:
    if r is None:
        return "-"
    if "error" in r:
        msg = str(r["error"]).replace("|", "/")
        return f"error: {msg[:70]}{'...' if len(msg) > 70 else ''}"
    parts = [_ms(r.get("latency_s"))]
    if kind != "eager":
        parts.append(f"compile {r['compile_s']:.1f} s" if "compile_s" in r else "")
    if r.get("package_bytes") is not None:
        parts.append(f"pkg {_mib(r['package_bytes'])}")
    if r.get("arena_bytes") is not None:
        parts.append(f"arena {_mib(r['arena_bytes'])}")
    parts.append(f"RSS {_mib(r.get('peak_rss_bytes'))}")
    if not r.get("matches", True):
        parts.append(f"**MISMATCH** err {r.get('max_abs_err', float('nan')):.1e}")
    return "<br>".join(p for p in parts if p)


def _ratio(num: Any, den: Any) -> str:
    if isinstance(num, (int, float)) and isinstance(den, (int, float)) and den > 0:
        return f"{num / den:.2f}x"
    return "-"


def markdown(results: list[dict], info: dict[str, Any], command: str) -> str:
    """The results as markdown: machine line, one row per model, the ldd of kiln's model.so."""
    by = {(r["model"], r["system"]): r for r in results}
    models = list(dict.fromkeys(r["model"] for r in results))
    lines = [f"Measured {info['date']} on {info['cpu']} ({info['cores']} cores), "
             f"{info['threads']} threads, torch {info['torch']}, Python {info['python']}, "
             f"{info['cxx']}.", "", f"Command: `{command}`", "",
             "| model | eager | torch.compile | AOTInductor | kiln | kiln/AOTI latency "
             "| AOTI/kiln compile time |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in models:
        aoti, kl = by.get((m, "aoti"), {}), by.get((m, "kiln"), {})
        cells = [_cell(by.get((m, s)), s) for s in SYSTEMS]
        lines.append(f"| {m} | " + " | ".join(cells) + " | "
                     f"{_ratio(kl.get('latency_s'), aoti.get('latency_s'))} | "
                     f"{_ratio(aoti.get('compile_s'), kl.get('compile_s'))} |")
    lines += ["", "Latency is the median over the timed runs after warm-up; compile time is "
              "from an ExportedProgram (export time excluded) for AOTInductor and kiln, and "
              "of the first call for torch.compile, with an empty inductor cache. RSS is the "
              "peak resident set of the process that measured that one system (torch "
              "included)."]
    with_ldd = [r for r in results if r.get("ldd")]
    if with_ldd:
        ldd = with_ldd[0]["ldd"]
        linked = [ln for ln in ldd if "torch" in ln or "c10" in ln]
        verdict = "links no torch library" if not linked else "LINKS TORCH: " + "; ".join(linked)
        lines += ["", f"`ldd lib/model.so` (kiln, {with_ldd[0]['model']}): {verdict}",
                  "", "```", *ldd, "```"]
    return "\n".join(lines) + "\n"


def rewrite_section(path: Path, body: str) -> None:
    """Replace the text between the bench markers in ``path`` (appending them if absent)."""
    splice(path, BEGIN, END, body)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure every (model, system) pair and print/write the reports."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    p.add_argument("--repeat", type=int, default=30, help="timed runs per system (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per (model, system)")
    p.add_argument("--warm-cache", action="store_true",
                   help="let inductor reuse its on-disk cache (default: cold compiles)")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--markdown", metavar="PATH",
                   help="rewrite the bench section of this file (e.g. BENCHMARKS.md)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        model, system = a.worker.split("/", 1)
        worker_main(model, system, a.repeat, a.warmup, a.worker_out)
        return 0

    from kiln.models import ALL_MODELS

    models = a.models.split(",") if a.models else [m for m in ALL_MODELS if m != "demo"]
    systems = a.systems.split(",")
    for name in models + systems:
        if name not in ALL_MODELS and name not in SYSTEMS:
            p.error(f"unknown model or system {name!r}")
    results = []
    for m in models:
        for s in systems:
            print(f"[bench] {m:14s} {s:14s} ...", end=" ", flush=True)
            r = measure(m, s, a.repeat, a.warmup, a.timeout, a.warm_cache)
            results.append(r)
            print(r.get("error") or f"{_ms(r.get('latency_s'))}"
                  + (f", compile {r['compile_s']:.1f} s" if "compile_s" in r else ""),
                  flush=True)
    command = "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    info = machine_info()
    md = markdown(results, info, command.strip())
    print()
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": info, "results": results}, indent=2,
                                           default=str))
    if a.markdown:
        rewrite_section(Path(a.markdown), md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
