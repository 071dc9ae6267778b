"""Cold compile time per zoo model: kiln (CUDA when a GPU is present, else the CPU target and
CUDA built without a GPU) and AOTInductor, each compile in a fresh process with fresh, empty
caches (kiln's cache dir, Triton's, inductor's), plus the first `kiln.load` of the package in
another fresh process with an empty kiln cache.

    python bench/compile_time.py [--models mlp,gpt,...] [--systems kiln-cuda,kiln-cpu,aoti]
                                 [--trees new=.,base=/path/to/old/checkout] [--rounds 1]
                                 [--timeout 600] [--json FILE] [--markdown FILE]

What is timed: `compile_s`, the compile call inside the child (kiln: `kiln.compile` on the
module, torch.export included, its stage timings kept; AOTInductor: torch.export plus
`torch._inductor.aoti_compile_and_package`, in its own child: kiln never imports it);
`process_s`, the child's whole wall time (Python, torch and Triton imports, exit);
`cpu_s`, the CPU time of the child and everything it started (workers, compilers: less
sensitive to a shared machine's load than wall time); `load_s`, the first `kiln.load` in a
fresh process whose kiln cache is empty. Without a GPU
kiln compiles CUDA packages for sm_90 and skips what needs the device (launch-config tuning,
GEMM profiling with max_autotune): those figures are a lower bound of a GPU machine's.

--trees times several checkouts of kiln (e.g. before/after a change) interleaved per model
(each tree's `python -m kiln.runtime` install step runs first, untimed, where the tree has it).
--markdown FILE replaces the section between <!-- compile-time:begin --> and
<!-- compile-time:end -->."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.markdown import splice  # noqa: E402

BEGIN, END = "<!-- compile-time:begin -->", "<!-- compile-time:end -->"
MODELS = ("ln_softmax", "mlp", "gpt", "resnet18", "mobilenet_v2")

_KILN = r'''
import json, os, sys, time
t_start = time.perf_counter()
import torch, kiln
from kiln.models import get
system, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
spec = get(name)
device = "cuda" if system == "kiln-cuda" else "cpu"
opts = {"cache_dir": os.environ["KILN_CACHE_DIR"]}
if device == "cuda" and not torch.cuda.is_available():
    opts["cuda_archs"] = (90,)
t0 = time.perf_counter()
cm = kiln.compile(spec.module, spec.example_args, dynamic_shapes=spec.dynamic_shapes,
                  device=device, options=kiln.Options(**opts))
compile_s = time.perf_counter() - t0
cm.save(out)
st = cm.report["stages"]
print("KILN_RESULT " + json.dumps({
    "compile_s": compile_s, "export_s": cm.report["export_seconds"],
    "import_s": t0 - t_start, "stages": {k: v for k, v in st.items()}}), flush=True)
'''

_LOAD = r'''
import sys, time
import torch, kiln
t0 = time.perf_counter()
r = kiln.load(sys.argv[1], device=sys.argv[2])
print("LOAD_RESULT %f" % (time.perf_counter() - t0), flush=True)
'''

_AOTI = r'''
import json, sys, time
import torch
from torch.utils import _pytree as pytree
from kiln.models import get
name, path = sys.argv[1], sys.argv[2]
spec = get(name)
dev = "cuda" if torch.cuda.is_available() else "cpu"
move = lambda x: pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, x)
module = spec.module.to(dev).eval()
with torch.no_grad():
    import torch._inductor as ind
    t0 = time.perf_counter()
    ep = torch.export.export(module, move(tuple(spec.example_args)))
    ind.aoti_compile_and_package(ep, package_path=path)
    print("AOTI_RESULT " + json.dumps({"compile_s": time.perf_counter() - t0, "device": dev}),
          flush=True)
'''


def _fresh_env(tree: Path, tmp: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    for var, sub in (("KILN_CACHE_DIR", "kiln"), ("TRITON_CACHE_DIR", "triton"),
                     ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        env[var] = str(tmp / sub)
    return env


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _child(code: str, args: list[str], env: dict, timeout: float, tag: str, cwd: Path):
    """(the tagged result line, an error, wall s, CPU s of the child and its children)."""
    t0, c0 = time.perf_counter(), _cpu()
    try:
        p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                           text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        return None, f"timeout {timeout:.0f} s", time.perf_counter() - t0, 0.0
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    for line in p.stdout.splitlines():
        if line.startswith(tag + " "):
            return line[len(tag) + 1:], None, wall, cpu
    return None, (p.stderr.strip().splitlines() or ["failed"])[-1][:160], wall, cpu


def run_one(system: str, model: str, tree: Path, timeout: float) -> dict:
    """One cold compile (and, for kiln, one cold first load) in fresh processes."""
    with tempfile.TemporaryDirectory(prefix="kiln_ct_") as d:
        tmp = Path(d)
        env = _fresh_env(tree, tmp)
        if system == "aoti":
            out, err, wall, cpu = _child(_AOTI, [model, str(tmp / "m.pt2")], env, timeout,
                                         "AOTI_RESULT", tmp)
            return {"error": err} if out is None else {**json.loads(out), "process_s": wall,
                                                       "cpu_s": cpu}
        pkg = tmp / "m.kiln"
        out, err, wall, cpu = _child(_KILN, [system, model, str(pkg)], env, timeout,
                                     "KILN_RESULT", tmp)
        if out is None:
            return {"error": err}
        res = {**json.loads(out), "process_s": wall, "cpu_s": cpu}
        import torch
        if system == "kiln-cpu" or torch.cuda.is_available():
            env = _fresh_env(tree, tmp / "load")  # another empty kiln cache
            dev = "cpu" if system == "kiln-cpu" else "cuda:0"
            lo, lerr, _, _ = _child(_LOAD, [str(pkg), dev], env, timeout, "LOAD_RESULT", tmp)
            res["load_s"] = float(lo) if lo is not None else None
            if lerr:
                res["load_error"] = lerr
        return res


def _top(stages: dict, n: int = 3) -> str:
    parts = {k: v for k, v in stages.items() if "." not in k or k.endswith(".triton")}
    best = sorted(parts.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.1f}" for k, v in best)


def table(rows: list[dict]) -> str:
    out = ["| model | system | tree | compile s (median) | export s | process s | "
           "process CPU s | first load s | largest stages (s) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['model']} | {r['system']} | {r['tree']} | {r['error']} "
                       "| | | | | |")
            continue
        load = f"{r['load_s']:.2f}" if r.get("load_s") is not None else "-"
        export = f"{r['export_s']:.1f}" if r.get("export_s") is not None else "-"
        out.append(f"| {r['model']} | {r['system']} | {r['tree']} | {r['compile_s']:.1f} | "
                   f"{export} | {r['process_s']:.1f} | {r.get('cpu_s', 0):.1f} | {load} | "
                   f"{_top(r.get('stages', {}))} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--systems", default=None,
                    help="kiln-cuda,kiln-cpu,aoti (default: kiln-cuda and aoti with a GPU, "
                         "kiln-cpu and kiln-cuda without)")
    ap.add_argument("--trees", default=f"kiln={ROOT}",
                    help="name=path of kiln checkouts to time, interleaved per model")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    import torch
    gpu = torch.cuda.is_available()
    systems = (a.systems or ("kiln-cuda,aoti" if gpu else "kiln-cpu,kiln-cuda")).split(",")
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in
             a.trees.split(",")]
    for name, tree in trees:  # the install step: libkiln built before any timing
        if (tree / "kiln" / "runtime" / "__main__.py").exists():
            subprocess.run([sys.executable, "-m", "kiln.runtime"], cwd=tree, check=True,
                           env=_fresh_env(tree, Path(tempfile.gettempdir())),
                           capture_output=True)
    rows = []
    for model in a.models.split(","):
        for system in systems:
            for name, tree in trees if system != "aoti" else trees[:1]:
                runs = []
                for _ in range(a.rounds):
                    runs.append(run_one(system, model, tree, a.timeout))
                ok = [r for r in runs if not r.get("error")]
                row = {"model": model, "system": system,
                       "tree": name if system != "aoti" else "-", "runs": runs}
                if ok:
                    mid = sorted(ok, key=lambda r: r["compile_s"])[len(ok) // 2]
                    row.update(mid, compile_s=statistics.median(r["compile_s"] for r in ok))
                else:
                    row["error"] = runs[-1]["error"]
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    load = os.getloadavg()
    head = (f"{'GPU: ' + torch.cuda.get_device_name() if gpu else 'no GPU (CUDA for sm_90)'}; "
            f"{os.cpu_count()} CPUs; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
            f"at the end; {a.rounds} round(s)")
    text = head + "\n\n" + table(rows)
    print("\n" + text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.markdown:
        splice(a.markdown, BEGIN, END, text)


if __name__ == "__main__":
    main()
