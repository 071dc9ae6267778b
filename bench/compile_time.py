"""Cold compile time per zoo model: kiln (CUDA when a GPU is present, else the CPU target and
CUDA built without a GPU) and AOTInductor, each compile in a fresh process with fresh, empty
caches (kiln's cache dir, Triton's, inductor's), plus the first `kiln.load` of the package in
another fresh process with an empty kiln cache.

    python bench/compile_time.py [--models mlp,gpt,...] [--systems kiln-cuda,kiln-cpu,aoti]
                                 [--dtypes fp32,bf16] [--trees new=.,base=/path/to/old/checkout]
                                 [--rounds 1] [--load-rounds 1] [--options k=v,...]
                                 [--timeout 600] [--json FILE] [--markdown FILE]
    python bench/compile_time.py --plan [--models ...] [--dtypes ...]   # no GPU needed

Models: the zoo's (`kiln.models`, at their example sizes: ResNet-18 and MobileNetV2 batch 1,
mlp 64 and gpt 2 with a dynamic batch, ln_softmax 4096 x 1024) and bert_like_b4
(bench/cpu_peers_models.py: 4 layers x 256, seq 128, batch 4; needs transformers); --dtypes
converts weights and float inputs (bf16: torch.bfloat16).

CUDA rows add the tuning counts of the compile (stage launch_autotune, kiln/targets/cuda/
tune_plan.py): `tuned` = steps timed / candidates compiled (and the untuned kernels its
workers prebuilt), `kernels` = the Triton kernels the cubins stage compiled (cache misses);
`load` is the first `kiln.load` with its parts (cuInit alone, in the same fresh process
before the load: a slow driver start is the driver's, not kiln's). --plan prints, without
compiling or a GPU, what launch_autotune would compile per model: pruned (the default) and
full (tune_prune=False, as max_autotune).

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
(each tree's install steps run first, untimed: its bytecode written with compileall, as
`pip install` does, and `python -m kiln.runtime` where the tree has it).
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
MODELS = ("ln_softmax", "mlp", "gpt", "resnet18", "mobilenet_v2", "bert_like_b4")

_MODEL = r'''
def model_of(name, dtype):
    """(module, example args, dynamic shapes) of a benchmark model in `dtype`."""
    import torch
    if name == "bert_like_b4":
        from bench.cpu_peers_models import build
        case = build(name)
        module, args, dyn = case.module, case.args, None
    else:
        from kiln.models import get
        spec = get(name)
        module, args, dyn = spec.module, spec.example_args, spec.dynamic_shapes
    if dtype != "fp32":
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        module = module.to(dt)
        args = tuple(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
    return module, args, dyn
'''

_KILN = _MODEL + r'''
import json, os, sys, time
t_start = time.perf_counter()
import torch, kiln
system, name, out, dtype, extra = sys.argv[1:6]
module, args, dyn = model_of(name, dtype)
device = "cuda" if system == "kiln-cuda" else "cpu"
opts = {"cache_dir": os.environ["KILN_CACHE_DIR"], **json.loads(extra)}
if device == "cuda" and not torch.cuda.is_available():
    opts["cuda_archs"] = (90,)
t0 = time.perf_counter()
cm = kiln.compile(module, args, dynamic_shapes=dyn, device=device,
                  options=kiln.Options(**opts))
compile_s = time.perf_counter() - t0
cm.save(out)
st = cm.report["stages"]
print("KILN_RESULT " + json.dumps({
    "compile_s": compile_s, "export_s": cm.report["export_seconds"],
    "import_s": t0 - t_start, "stages": {k: v for k, v in st.items()}}), flush=True)
'''

_LOAD = r'''
import ctypes, json, sys, time
import torch, kiln
from kiln.runtime import loader
pkg, dev = sys.argv[1], sys.argv[2]
parts = {}
t0 = time.perf_counter()
if dev.startswith("cuda"):  # the parts kiln.load goes through, each timed on its own
    loader.preload_cublas()
    parts["cublas_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    ctypes.CDLL("libcuda.so.1").cuInit(0)  # the driver's start alone (not kiln's code)
    parts["cuinit_s"] = time.perf_counter() - t
t = time.perf_counter()
import warnings
from kiln.runtime.build import RuntimeBuildWarning
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    loader.libkiln(pkg)
parts["libkiln_s"] = time.perf_counter() - t
parts["libkiln_built"] = any(issubclass(w.category, RuntimeBuildWarning) for w in seen)
t = time.perf_counter()
r = kiln.load(pkg, device=dev)
parts["model_s"] = time.perf_counter() - t
print("LOAD_RESULT " + json.dumps({"load_s": time.perf_counter() - t0, **parts}), flush=True)
'''

_AOTI = _MODEL + r'''
import json, sys, time
import torch
from torch.utils import _pytree as pytree
name, path, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
module, args, _ = model_of(name, dtype)
dev = "cuda" if torch.cuda.is_available() else "cpu"
move = lambda x: pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, x)
module = module.to(dev).eval()
with torch.no_grad():
    import torch._inductor as ind
    t0 = time.perf_counter()
    ep = torch.export.export(module, move(tuple(args)))
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


def run_one(system: str, model: str, tree: Path, timeout: float, dtype: str = "fp32",
            options: dict | None = None, load_rounds: int = 1) -> dict:
    """One cold compile (and, for kiln, `load_rounds` cold first loads, each in a fresh
    process with an empty kiln cache) in fresh processes."""
    with tempfile.TemporaryDirectory(prefix="kiln_ct_") as d:
        tmp = Path(d)
        env = _fresh_env(tree, tmp)
        if system == "aoti":
            out, err, wall, cpu = _child(_AOTI, [model, str(tmp / "m.pt2"), dtype], env,
                                         timeout, "AOTI_RESULT", tmp)
            return {"error": err} if out is None else {**json.loads(out), "process_s": wall,
                                                       "cpu_s": cpu}
        pkg = tmp / "m.kiln"
        out, err, wall, cpu = _child(_KILN, [system, model, str(pkg), dtype,
                                             json.dumps(options or {})], env, timeout,
                                     "KILN_RESULT", tmp)
        if out is None:
            return {"error": err}
        res = {**json.loads(out), "process_s": wall, "cpu_s": cpu}
        import torch
        if system == "kiln-cpu" or torch.cuda.is_available():
            dev = "cpu" if system == "kiln-cpu" else "cuda:0"
            loads = []
            for r in range(load_rounds):
                env = _fresh_env(tree, tmp / f"load{r}")  # another empty kiln cache
                lo, lerr, _, _ = _child(_LOAD, [str(pkg), dev], env, timeout, "LOAD_RESULT",
                                        tmp)
                if lo is not None:
                    loads.append(json.loads(lo))
                if lerr:
                    res["load_error"] = lerr
            res["loads"] = loads
            res["load_s"] = statistics.median(x["load_s"] for x in loads) if loads else None
        return res


def _top(stages: dict, n: int = 3) -> str:
    parts = {k: v for k, v in stages.items() if "." not in k}  # (parts: counts, sub-times)
    best = sorted(parts.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.1f}" for k, v in best)


def _tuned(stages: dict) -> str:
    """launch_autotune's counts: steps timed / candidates compiled (+ untuned kernels its
    workers prebuilt), or "-" where it did not run."""
    if "launch_autotune" not in stages:
        return "-"
    g = lambda k: int(stages.get(f"launch_autotune.{k}", 0))  # noqa: E731
    return (f"{g('timed')}/{g('candidates')} (+{g('prebuilt')}, wait "
            f"{stages.get('launch_autotune.wait', 0):.1f} s)")


def _load(r: dict) -> str:
    if r.get("load_s") is None:
        return "-"
    parts = r.get("loads", [])
    text = f"{r['load_s']:.2f}"
    if len(parts) > 1:
        text += " [" + " ".join(f"{x['load_s']:.1f}" for x in parts) + "]"
    worst = max(parts, key=lambda x: x["load_s"]) if parts else {}
    if "cuinit_s" in worst:
        text += (f" (slowest: cuInit {worst['cuinit_s']:.2f}, cuBLAS {worst['cublas_s']:.2f}, "
                 f"libkiln {worst['libkiln_s']:.2f}"
                 f"{' COMPILED' if worst.get('libkiln_built') else ''}, "
                 f"model {worst['model_s']:.2f})")
    return text


def table(rows: list[dict]) -> str:
    out = ["| model | dtype | system | tree | compile s (median) | export s | process s | "
           "process CPU s | tuned: timed/candidates | kernels | first load s | "
           "largest stages (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['model']} | {r.get('dtype', 'fp32')} | {r['system']} | {r['tree']} "
        if r.get("error"):
            out.append(head + f"| {r['error']} | | | | | | | |")
            continue
        export = f"{r['export_s']:.1f}" if r.get("export_s") is not None else "-"
        st = r.get("stages", {})
        kernels = f"{int(st['cubins.compiled'])}" if "cubins.compiled" in st else "-"
        out.append(head + f"| {r['compile_s']:.1f} | {export} | {r['process_s']:.1f} | "
                   f"{r.get('cpu_s', 0):.1f} | {_tuned(st)} | {kernels} | {_load(r)} | "
                   f"{_top(st)} |")
    return "\n".join(out)


def stage_table(rows: list[dict], least: float = 0.05) -> str:
    """Per kiln row: compile seconds split into export, each stage that took at least `least`
    seconds in some row (in pipeline order; the report's `compiler_imports`, kiln's compiler
    imported by the first `kiln.compile`, and `manifest` among them), and `rest` (the
    compile call's time outside export and the named stages: the driver between stages)."""
    kiln = [r for r in rows if r["system"] != "aoti" and not r.get("error")]
    if not kiln:
        return ""
    names: list[str] = []
    for r in kiln:
        names += [k for k, v in r["stages"].items() if "." not in k and k not in names and
                  any(x["stages"].get(k, 0) >= least for x in kiln)]
    out = ["| model | dtype | tree | compile | export | " + " | ".join(names) + " | rest |",
           "|---|---|---|---:|---:|" + "---:|" * (len(names) + 1)]
    for r in kiln:
        st = r["stages"]
        rest = r["compile_s"] - r["export_s"] - sum(v for k, v in st.items() if "." not in k)
        out.append(f"| {r['model']} | {r.get('dtype', 'fp32')} | {r['tree']} | "
                   f"{r['compile_s']:.2f} | {r['export_s']:.2f} | " +
                   " | ".join(f"{st.get(k, 0):.2f}" for k in names) + f" | {rest:.2f} |")
    return "\n".join(out)


def ratios(rows: list[dict]) -> str:
    """Per model and dtype: kiln's CUDA compile seconds over AOTInductor's (the target: at
    most 0.2), where both ran."""
    aoti = {(r["model"], r["dtype"]): r["compile_s"] for r in rows
            if r["system"] == "aoti" and not r.get("error")}
    out = [f"{r['model']} {r['dtype']} ({r['tree']}): kiln {r['compile_s']:.1f} s / AOTI "
           f"{aoti[(r['model'], r['dtype'])]:.1f} s = "
           f"{r['compile_s'] / aoti[(r['model'], r['dtype'])]:.2f}"
           for r in rows if r["system"] == "kiln-cuda" and not r.get("error") and
           (r["model"], r["dtype"]) in aoti]
    return ("\n\nkiln / AOTInductor compile time:\n" + "\n".join(out)) if out else ""


def _compile_plan(todo, extra, workers: int) -> tuple[float, int]:
    """(wall seconds, candidates compiled) of launch_autotune's compile pass over `todo` and
    the untuned kernels `extra`, for sm_90, with `workers` processes and a fresh Triton
    cache, without timing anything (no GPU needed). The workers are started first, as a
    build's `workers` stage starts them, and their start is timed (a build hides it behind
    its front end)."""
    from kiln.targets.cuda import launch_tune
    from kiln.toolchain.triton_aot import Workers
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln_plan_triton_")
    cache = Path(tempfile.mkdtemp(prefix="kiln_plan_cache_"))
    t0 = time.perf_counter()
    started = Workers(workers)
    try:
        compiled = launch_tune._compile_candidates(todo, cache, 90, workers, extra, started)
        try:
            n = sum((i, j) in compiled for i, (_, tks, _) in enumerate(todo)
                    for j in range(len(tks)))
            compiled.store_extra()
        finally:
            compiled.close()
    finally:
        started.close()
    return time.perf_counter() - t0, n


def plan(models: list[str], dtypes: list[str], compile_workers: int = 0) -> str:
    """What launch_autotune would compile per model and dtype (no GPU): steps tuned /
    distinct steps timed / candidates, pruned and full; with `compile_workers`, also the
    seconds its compile pass takes (candidates, then the untuned kernels) with that many
    worker processes."""
    ns: dict = {}
    exec(_MODEL, ns)
    import kiln
    from kiln.api import export
    from kiln.ir import loop as L
    from kiln.pipeline import target_of
    from kiln.targets.cuda import build as B
    from kiln.targets.cuda.launch_tune import plan as tune_plan
    out = ["| model | dtype | kernels | pruned: steps / timed / candidates | "
           "full: steps / timed / candidates |", "|---|---|---|---|---|"]
    for model in models:
        for dtype in dtypes:
            module, args, dyn = ns["model_of"](model, dtype)
            ep = export(module, args, None, dyn)
            cells = []
            for prune in (True, False):
                target = target_of("cuda")
                st = target.state(ep=ep, options=kiln.Options(
                    cuda_archs=(90,), tune_prune=prune,
                    cache_dir=tempfile.mkdtemp(prefix="kiln_plan_")))
                for stage in target.stages:
                    if stage.name == "check_routines":
                        break
                    if stage.when(st):
                        st = stage.run(st)
                fams = B.tuning_families(st)
                todo, _, fam, _ = tune_plan(fams, B._hints(st))
                per: dict = {}
                for step, tks, _ in todo:
                    per.setdefault(fam[step.name].label or "kernel", []).append(len(tks))
                kinds = ", ".join(f"{k} {len(v)}/{sum(v)}" for k, v in per.items())
                cells.append(f"{sum(len(f.items) for f in fams)} / {len(todo)} / "
                             f"{sum(len(t) for _, t, _ in todo)}" + (f" ({kinds})" if kinds
                                                                     else ""))
                if compile_workers and todo:
                    extra = B.untuned_kernels(st, fams)
                    sec, ok = _compile_plan(todo, extra, compile_workers)
                    cells[-1] += f"; compiled {ok} + {len(extra)} untuned in {sec:.1f} s"
            n = len(B.triton_kernels(B._launched(st.steps), L.all_buffers(st.loop),
                                     B._hints(st), B._heuristic_configs(st)))
            out.append(f"| {model} | {dtype} | {n} | {cells[0]} | {cells[1]} |")
            print(out[-1], flush=True)
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
    ap.add_argument("--dtypes", default="fp32", help="fp32,bf16,fp16")
    ap.add_argument("--cases", default="",
                    help="model:dtype pairs in this order, instead of --models x --dtypes")
    ap.add_argument("--load-rounds", type=int, default=1,
                    help="cold first loads per kiln compile, each in a fresh process")
    ap.add_argument("--options", default="",
                    help="kiln Options as JSON, e.g. '{\"tune_prune\": false}'")
    ap.add_argument("--plan", action="store_true",
                    help="print what launch_autotune would compile (no GPU, no compile)")
    ap.add_argument("--plan-compile", type=int, default=0, metavar="WORKERS",
                    help="with --plan: also time its compile pass with WORKERS processes")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    if a.plan:
        text = plan(a.models.split(","), a.dtypes.split(","), a.plan_compile)
        if a.markdown:
            splice(a.markdown, BEGIN, END, text)
        return
    options = json.loads(a.options) if a.options else {}
    import torch
    gpu = torch.cuda.is_available()
    systems = (a.systems or ("kiln-cuda,aoti" if gpu else "kiln-cpu,kiln-cuda")).split(",")
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in
             a.trees.split(",")]
    for name, tree in trees:  # the install step: libkiln built before any timing
        # and kiln's bytecode, as `pip install` writes it: a source tree run where Python
        # writes none (PYTHONDONTWRITEBYTECODE=1, as on the device machines) compiles every
        # module of kiln in every fresh process (about 1 s of a cold compile there)
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(tree / "kiln")],
                       capture_output=True)
        if (tree / "kiln" / "runtime" / "__main__.py").exists():
            subprocess.run([sys.executable, "-m", "kiln.runtime"], cwd=tree, check=True,
                           env=_fresh_env(tree, Path(tempfile.gettempdir())),
                           capture_output=True)
    rows = []
    cases = ([tuple(c.split(":", 1)) for c in a.cases.split(",")] if a.cases else
             [(m, d) for m in a.models.split(",") for d in a.dtypes.split(",")])
    for (model, dtype), system in ((c, s) for c in cases for s in systems):
        for name, tree in trees if system != "aoti" else trees[:1]:
            runs = []
            for _ in range(a.rounds):
                runs.append(run_one(system, model, tree, a.timeout, dtype, options,
                                    a.load_rounds if system != "aoti" else 0))
            ok = [r for r in runs if not r.get("error")]
            row = {"model": model, "dtype": dtype, "system": system,
                   "tree": name if system != "aoti" else "-", "runs": runs}
            if ok:
                mid = sorted(ok, key=lambda r: r["compile_s"])[len(ok) // 2]
                row.update(mid, compile_s=statistics.median(r["compile_s"] for r in ok))
            else:
                row["error"] = runs[-1]["error"]
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            if a.json:  # after every row: a run cut short keeps what it measured
                Path(a.json).write_text(json.dumps(rows, indent=1))
    load = os.getloadavg()
    head = (f"{'GPU: ' + torch.cuda.get_device_name() if gpu else 'no GPU (CUDA for sm_90)'}; "
            f"{os.cpu_count()} CPUs; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
            f"at the end; {a.rounds} round(s)")
    stages = stage_table(rows)
    text = head + "\n\n" + table(rows) + ratios(rows) + (
        "\n\nSeconds per stage (kiln):\n\n" + stages if stages else "")
    print("\n" + text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.markdown:
        splice(a.markdown, BEGIN, END, text)


if __name__ == "__main__":
    main()
