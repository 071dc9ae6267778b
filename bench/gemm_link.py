"""CUDA packages with the GEMM backend the autotuner links (kiln/gemm, issue 6): model
latency with `max_autotune` off (the heuristic: cuBLAS) and on (every allowed backend
profiled: cuBLAS, the Triton template with its epilogue fused, CUTLASS), the backend that won
each GEMM, and the Triton template alone (forced by `gemm_backends=("triton",)`). Models: the
zoo's mlp and gpt in float16, and one-GEMM programs (x @ W) over bench/gemm_gpu.py's sweep
shapes. Every package's outputs are checked against eager on the GPU.

    python bench/gemm_link.py [--models mlp,gpt] [--sweep] [--cutlass-configs 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kiln
from kiln.models import ALL_MODELS
from kiln.models.zoo import in_dtype
from kiln.options import Options

SWEEP = [(1024, 1024, 1024), (4096, 4096, 4096), (64, 4096, 4096), (128, 8192, 1024),
         (4096, 64, 4096), (512, 512, 512)]


def latency_ms(fn, args, reps: int = 50) -> float:
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(*args)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def _leaves(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def package(ep, opts: Options, tmp: Path, name: str):
    t0 = time.perf_counter()
    cm = kiln.compile(ep, device="cuda", options=opts)
    secs = time.perf_counter() - t0
    runner = kiln.load(cm.save(tmp / f"{name}.kiln"), device="cuda:0")
    gemms = [{"gemm": k["name"], "backend": k["gemm"]["backend"],
              "config": k["gemm"]["config"].get("name", ""), "how": k["gemm"]["how"],
              "problem": k["gemm"]["problem"],
              "best_ms": {b: round(v[0][1] * 1e3, 4) for b, v in k["gemm"]["timings"].items()}}
             for k in cm.manifest["kernels"] if "gemm" in k]
    return runner, gemms, secs


def measure(name, module, ep, args, tmp: Path, cutlass_configs: int, tol: float) -> dict:
    """Every variant compiled and checked, then timed in interleaved rounds (median of the
    rounds' medians), so clock drift does not favour the variant timed first."""
    want = [w.float() for w in _leaves(module(*args))]
    row = {"model": name}
    variants = {
        "off": Options(),
        "on": Options(max_autotune=True, gemm_backends=("blas", "triton", "cutlass"),
                      cutlass_max_profiling_configs=cutlass_configs),
        "triton": Options(gemm_backends=("triton",)),
    }
    runners = {}
    for v, opts in variants.items():
        try:
            runner, gemms, secs = package(ep, opts, tmp, f"{name}_{v}")
            got = _leaves(runner(*args))
            err = max(float((g.float() - w).abs().max()) for g, w in zip(got, want))
            row[v] = {"compile_s": round(secs, 1), "max_err": err, "ok": err <= tol,
                      "gemms": gemms}
            runners[v] = runner
        except Exception as e:  # one variant failing must not hide the others' numbers
            row[v] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    runners["eager"] = module
    rounds: dict = {v: [] for v in runners}
    for _ in range(5):
        for v, r in runners.items():
            rounds[v].append(latency_ms(r, args, reps=30))
    for v, ts in rounds.items():
        ms = sorted(ts)[len(ts) // 2]
        if v == "eager":
            row["eager_ms"] = ms
        else:
            row[v]["ms"] = ms
    print(json.dumps({name: {v: {k: x for k, x in row[v].items() if k != "gemms"}
                             for v in variants}}), flush=True)
    return row


class _MM(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(k, n) / k ** 0.5)

    def forward(self, x):
        return x @ self.w


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cutlass-configs", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tmp", default="/tmp/kiln_gemm_link")
    args = ap.parse_args(argv)
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    out = {"device": torch.cuda.get_device_name(0), "rows": []}
    todo = []
    for n in filter(None, args.models.split(",")):
        spec = in_dtype(ALL_MODELS[n](), torch.float16)
        ep = spec.export()  # on the CPU, before the module moves to the GPU
        todo.append((spec.name, spec.module.cuda(), ep,
                     tuple(a.cuda() if isinstance(a, torch.Tensor) else a
                           for a in spec.example_args), 5e-2))
    if args.sweep:
        for m, n, k in SWEEP:
            mod = _MM(k, n).half()
            x = torch.randn(m, k, dtype=torch.float16)
            ep = torch.export.export(mod, (x,))
            todo.append((f"mm_{m}x{n}x{k}", mod.cuda(), ep, (x.cuda(),),
                         5e-2 * k ** 0.5 / 8))
    for name, module, ep, a, tol in todo:
        with torch.no_grad():
            out["rows"].append(measure(name, module, ep, a, tmp, args.cutlass_configs, tol))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"{'model':<22} {'eager':>8} {'off':>8} {'on':>8} {'triton':>8}  winners (on)")
    for r in out["rows"]:
        def ms(v):
            return f"{r[v]['ms']:8.3f}" if "ms" in r[v] else f"{'ERR':>8}"
        wins: dict = {}
        for g in r["on"].get("gemms", []):
            wins[g["backend"]] = wins.get(g["backend"], 0) + 1
        print(f"{r['model']:<22} {r['eager_ms']:8.3f} {ms('off')} {ms('on')} {ms('triton')}  "
              + ", ".join(f"{b} x{c}" for b, c in sorted(wins.items())))


if __name__ == "__main__":
    main()
