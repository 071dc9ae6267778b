"""Kernel-by-kernel GPU profile of kiln against torch.compile on the same model.

For each model and dtype: kiln's package (CUDA graphs off, so that every kernel is its own
launch) and `torch.compile(mode="max-autotune-no-cudagraphs")` each run `--iters` times under
torch.profiler (CUPTI sees every kernel of the process, kiln's cuLaunchKernel ones too); the
kernels of one call are listed in launch order with their mean device time, side by side, with
the total device time per call. Also the end-to-end device time per call (20 calls enqueued
back to back, CUDA events) of kiln with CUDA graphs and of torch.compile reduce-overhead.

    python bench/profile_gpu.py [--models gpt,bert] [--dtypes bf16,fp32] [--out DIR]
                                [--budget-s 330]

Models: gpt = the zoo's 2-block GPT (batch 2, seq 128, d 256); bert = bench/gemm_cpu.py's
4-layer BERT-like encoder (batch 4, seq 128, d 256).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.cuda_timing import stream_ms  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model(name: str, dtype: torch.dtype):
    if name == "gpt":
        from kiln.models import get
        spec = get("gpt")
        return spec.module, spec.example_args
    from bench.gemm_cpu import BertLike
    torch.manual_seed(0)
    return BertLike().eval().requires_grad_(False), (torch.randn(4, 128, 256),)


def _cast(args, dtype):
    return tuple(a.to(dtype) if a.is_floating_point() else a for a in args)


def kernel_trace(fn, iters: int) -> list[tuple[str, float]]:
    """[(kernel name, mean device us)] of one call of `fn`, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
           and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    evs.sort(key=lambda e: e.time_range.start)
    n = len(evs) // iters
    if n * iters != len(evs):
        print(f"  note: {len(evs)} kernels over {iters} iterations", flush=True)
    out = []
    for i in range(n):
        ds = [evs[j * n + i].time_range.elapsed_us() for j in range(iters)]
        ds.sort()
        out.append((evs[i].name, ds[len(ds) // 2]))
    return out


def _short(name: str, width: int = 58) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def side_by_side(a: list, b: list) -> str:
    lines = [f"{'kiln kernel':58s} {'us':>7s} | "
             f"{'torch.compile max-autotune kernel':58s} {'us':>7s}"]
    for i in range(max(len(a), len(b))):
        left = a[i] if i < len(a) else ("", 0.0)
        r = b[i] if i < len(b) else ("", 0.0)
        lines.append(f"{_short(left[0]):58s} {left[1]:7.1f} | {_short(r[0]):58s} {r[1]:7.1f}")
    lines.append(f"{'TOTAL (' + str(len(a)) + ' kernels)':58s} {sum(x[1] for x in a):7.1f} | "
                 f"{'TOTAL (' + str(len(b)) + ' kernels)':58s} {sum(x[1] for x in b):7.1f}")
    return "\n".join(lines)


def main() -> None:
    import kiln
    from kiln.options import Options

    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gpt,bert")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=330)
    p.add_argument("--out", default=None)
    p.add_argument("--no-tc", action="store_true", help="kiln alone")
    p.add_argument("--ro-only", action="store_true",
                   help="no max-autotune profile: kiln's kernels and the reduce-overhead timing")
    a = p.parse_args()
    t_start = time.time()
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp())
    summary = []
    for dt in a.dtypes.split(","):
        for name in a.models.split(","):
            if time.time() - t_start > a.budget_s:
                summary.append(f"{name} {dt}: skipped (budget)")
                continue
            row = {"model": name, "dtype": dt}
            try:
                module, args = _model(name, DT[dt])
                module = module.to(DT[dt])
                args = _cast(args, DT[dt])
                ep = torch.export.export(module, args)
                dargs = tuple(x.cuda() for x in args)
                t0 = time.time()
                dump = out / f"dump_{name}_{dt}"
                cm = kiln.compile(ep, device="cuda", options=Options(
                    cuda_graphs=False, dump_dir=str(dump)))
                row["kiln_compile_s"] = time.time() - t0
                (dump / "report.json").write_text(json.dumps(cm.report, default=str, indent=1))
                runner = cm.load(Path(tempfile.mkdtemp()) / "m.kiln", device="cuda:0")
                ktrace = kernel_trace(lambda: runner(*dargs), a.iters)
                row["kiln_nograph_ms"] = stream_ms(lambda: runner(*dargs), 20, 20)
                g = kiln.compile(ep, device="cuda").load(
                    Path(tempfile.mkdtemp()) / "g.kiln", device="cuda:0")
                row["kiln_graph_ms"] = stream_ms(lambda: g(*dargs), 20, 20)
                dm = copy.deepcopy(module).cuda()
                ref = dm(*dargs)
                row["kiln_err"] = (runner(*dargs).double() - ref.double()).abs().max().item()
                ttrace = []
                if not a.no_tc and not a.ro_only:
                    torch._dynamo.reset()
                    t0 = time.time()
                    tc = torch.compile(dm, mode="max-autotune-no-cudagraphs")
                    with torch.no_grad():
                        tc(*dargs)
                    row["tc_ma_compile_s"] = time.time() - t0
                    with torch.no_grad():
                        ttrace = kernel_trace(lambda: tc(*dargs), a.iters)
                        row["tc_ma_ms"] = stream_ms(lambda: tc(*dargs), 20, 20)
                if not a.no_tc:
                    torch._dynamo.reset()
                    ro = torch.compile(copy.deepcopy(module).cuda(), mode="reduce-overhead")
                    with torch.no_grad():
                        for _ in range(3):
                            ro(*dargs)
                        row["tc_ro_ms"] = stream_ms(lambda: ro(*dargs), 20, 20)
                    torch._dynamo.reset()
                print(f"\n=== {name} {dt}: {json.dumps(row)}", flush=True)
                print(side_by_side(ktrace, ttrace), flush=True)
                row["kiln_sum_us"] = sum(x[1] for x in ktrace)
                row["tc_sum_us"] = sum(x[1] for x in ttrace)
                runner = g = None  # unload before the next model
            except Exception as e:  # report and go on
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            summary.append(json.dumps(row))
    print("\nSUMMARY")
    for s in summary:
        print(s)


if __name__ == "__main__":
    main()
