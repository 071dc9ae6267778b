"""Where a model's GPU time goes, kiln against torch.compile(mode="reduce-overhead"), kernel
by kernel (issue 15 item 1). On a GPU machine:

    python scripts/prof_gpu_vs_ro.py hf_vit_base fp32 [--top 15] [--json FILE]

The model is built as bench/gpu_peers.py builds it (bench/cpu_peers_models.py), exported and
compiled by kiln with default options; kiln's package is profiled by `kiln profile`'s CUDA
path (CUPTI device times per kernel, median over runs); the reduce-overhead module's kernels
are traced the same way (torch.profiler, CUDA activity), summed per kernel name and divided by
the runs. Prints both top lists with each one's device total, grouped into GEMM / attention /
other by kernel name."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu_peers import DT  # noqa: E402  (the benchmark's dtype names)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

GEMM = re.compile(r"gemm|sm90_|cutlass|cublas|nvjet|matmul|mm_|_mm\b|linear|addmm", re.I)
ATTN = re.compile(r"attn|attention|flash|fmha|sdpa", re.I)


def _kind(name: str) -> str:
    return "attention" if ATTN.search(name) else "gemm" if GEMM.search(name) else "other"


def _traced(fn, runs: int) -> dict[str, float]:
    """Kernel name -> device ms per run."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        kind = getattr(e, "device_type", None)
        if kind is None or not str(kind).endswith("CUDA") or e.name.startswith(
                ("Memcpy", "Memset", "cudaGraph")):
            continue
        out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us() * 1e-3 / runs
    return out


def _summary(label: str, times: dict[str, float], top: int) -> dict:
    total = sum(times.values())
    by_kind: dict[str, float] = {}
    for n, t in times.items():
        by_kind[_kind(n)] = by_kind.get(_kind(n), 0.0) + t
    print(f"\n== {label}: device total {total:.3f} ms/run, {len(times)} kernel names; "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(by_kind.items())))
    for n, t in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t:8.4f} ms  {_kind(n):9s} {n[:110]}")
    return {"total_ms": total, "by_kind": by_kind, "kernels": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("dtype", choices=sorted(DT))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)

    import kiln
    from bench.cpu_peers_models import build
    from bench.gpu_peers import _inputs
    from kiln.cli.profile import profile_package

    torch.manual_seed(0)
    case = build(a.model)
    module = case.module.to("cuda", DT[a.dtype]).eval()
    args = _inputs(case.args, a.batch, DT[a.dtype])
    out: dict = {"model": a.model, "dtype": a.dtype, "batch": a.batch}
    with torch.no_grad():
        ep = torch.export.export(module, args)
        pkg = Path(tempfile.mkdtemp()) / f"{a.model}.kiln"
        kiln.compile(ep, device="cuda").save(pkg)
        prof = profile_package(pkg, repeat=a.runs)
        kiln_times = {s["name"]: s["median_s"] * 1e3 for s in prof["steps"]}
        out["kiln"] = _summary("kiln", kiln_times, a.top)
        torch._dynamo.reset()
        ro = torch.compile(module, mode="reduce-overhead")
        for _ in range(5):
            ro(*args)
        torch.cuda.synchronize()
        out["ro"] = _summary("reduce-overhead", _traced(lambda: ro(*args), a.runs), a.top)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
