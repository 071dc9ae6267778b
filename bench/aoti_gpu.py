"""AOTInductor vs kiln on the GPU: compile time, load, latency, correctness, per zoo model.

Each AOTInductor step runs in a child process with a time limit, so a crash (a signal, as the
GPU image's torch 2.11 was reported to do at load) or a hang is a table cell, not the end of
the benchmark:
1. compile: export the model on CUDA (module and example inputs moved to the GPU, as
   AOTInductor needs), `torch._inductor.aoti_compile_and_package`; wall time of that call;
2. load + run: `aoti_load_package`, one call checked against eager (max abs error), then the
   median latency of synchronised calls (as bench/gpu.py times kiln).
kiln compiles the CPU export of the same model for CUDA (`kiln.compile(ep, device="cuda")`,
export excluded) in the parent, for the compile-time ratio.

    python bench/aoti_gpu.py [--models mlp,resnet18,gpt] [--dtypes fp32,bf16]
                             [--timeout 240] [--repeat 50] [--markdown FILE]

--markdown FILE replaces the section between <!-- aoti-gpu:begin --> and <!-- aoti-gpu:end -->.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.markdown import splice  # noqa: E402

BEGIN, END = "<!-- aoti-gpu:begin -->", "<!-- aoti-gpu:end -->"

_CHILD = r'''
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from torch.utils import _pytree as pytree
from kiln.models import get
from kiln.models.zoo import in_dtype
step, name, dtype, path, repeat = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], \
    int(sys.argv[6])
spec = get(name)
if dtype != "fp32":
    spec = in_dtype(spec, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
cuda = lambda x: pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, x)
module = spec.module.cuda().eval()
out = {}
with torch.no_grad():
    if step == "compile":
        import torch._inductor as ind
        ep = torch.export.export(module, cuda(tuple(spec.example_args)))
        t0 = time.perf_counter()
        ind.aoti_compile_and_package(ep, package_path=path)
        out["compile_s"] = time.perf_counter() - t0
    else:
        import torch._inductor as ind
        args = cuda(spec.make_inputs(7))
        t0 = time.perf_counter()
        runner = ind.aoti_load_package(path)
        out["load_s"] = time.perf_counter() - t0
        got = pytree.tree_leaves(runner(*args))
        ref = pytree.tree_leaves(module(*args))
        out["err"] = max((g.double() - r.double()).abs().max().item() for g, r in zip(got, ref))
        for _ in range(5):
            runner(*args)
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            runner(*args)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        out["ms"] = statistics.median(ts)
print("AOTI_RESULT " + json.dumps(out), flush=True)
'''


def _child(step: str, name: str, dtype: str, path: Path, repeat: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), step, name, dtype,
                            str(path), str(repeat)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{step}: no result after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("AOTI_RESULT "):
            return json.loads(line[len("AOTI_RESULT "):])
    how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
    tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-1:] or [""]
    return {"error": f"{step}: {how} after {time.perf_counter() - t0:.0f} s: {tail[0][:160]}"}


def _kiln_compile_s(name: str, dtype: str) -> tuple[float, float]:
    """kiln's compile time with an empty cache (every kernel generated, compiled and, with the
    GPU here, its launch config timed), then again with that cache warm."""
    import torch

    import kiln
    from kiln.models import get
    from kiln.models.zoo import in_dtype
    from kiln.options import Options
    spec = get(name)
    if dtype != "fp32":
        spec = in_dtype(spec, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    ep = spec.export()
    opts = Options(cache_dir=tempfile.mkdtemp(prefix="kiln_cold_"))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        kiln.compile(ep, device="cuda", options=opts)
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def run(models: list[str], dtypes: list[str], timeout: float, repeat: int) -> list[dict]:
    rows = []
    work = Path(tempfile.mkdtemp(prefix="aoti_gpu_"))
    for name in models:
        for dt in dtypes:
            row = {"model": name, "dtype": dt}
            try:
                row["kiln_compile_s"], row["kiln_warm_s"] = _kiln_compile_s(name, dt)
            except Exception as e:  # report and go on
                row["kiln_error"] = f"{type(e).__name__}: {e}"[:160]
            path = work / f"{name}_{dt}.pt2"
            row.update(_child("compile", name, dt, path, repeat, timeout))
            if "error" not in row:
                row.update(_child("run", name, dt, path, repeat, timeout))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    import torch
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    lines = [f"Device: {dev}, torch {torch.__version__}", "",
             "| model | dtype | AOTI compile s | kiln compile s (empty cache) | AOTI / kiln "
             "compile | kiln compile s (warm cache) | AOTI load s | AOTI ms | AOTI max err | "
             "AOTI failure |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(r, k, fmt="{:.2f}"):
        return fmt.format(r[k]) if k in r else "-"
    for r in rows:
        ratio = f"{r['compile_s'] / r['kiln_compile_s']:.0f}x" \
            if "compile_s" in r and r.get("kiln_compile_s") else "-"
        lines.append(f"| {r['model']} | {r['dtype']} | {f(r, 'compile_s', '{:.1f}')} | "
                     f"{f(r, 'kiln_compile_s')} | {ratio} | {f(r, 'kiln_warm_s')} | "
                     f"{f(r, 'load_s')} | "
                     f"{f(r, 'ms', '{:.3f}')} | {f(r, 'err', '{:.1e}')} | "
                     f"{r.get('error', r.get('kiln_error', ''))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,resnet18,gpt")
    ap.add_argument("--dtypes", default="fp32")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--markdown")
    a = ap.parse_args()
    rows = run(a.models.split(","), a.dtypes.split(","), a.timeout, a.repeat)
    text = table(rows)
    print(text)
    if a.markdown:
        splice(a.markdown, BEGIN, END, text)


if __name__ == "__main__":
    main()
