"""A/B timing of kiln Options on one zoo model: each variant compiled, loaded and timed in the
same process, the variants' calls interleaved (one call of each per round, the order rotating
between rounds) so that load on a shared machine hits them alike; the median of `--repeat`
calls per variant, and its ratio to the defaults. GPU: synchronised calls, CUDA graphs as
compiled. CPU (`--device cpu`): `--threads` sets the runners' thread budget; the compile
report's max_autotune check (tuned vs default package, which was kept) is printed when present.

    python bench/options_ab.py gpt --dtype bf16 --variant fused_attention=False \
        --variant triton_max_rblock=1024 [--repeat 200]
    python bench/options_ab.py resnet18 --device cpu --threads 2 --variant max_autotune=True
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main() -> None:
    import kiln
    from kiln.models import get
    from kiln.models.zoo import in_dtype

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--threads", type=int, default=0, help="CPU: thread budget (0: automatic)")
    ap.add_argument("--variant", action="append", default=[],
                    help="name=value[,name=value] of kiln.Options fields")
    ap.add_argument("--repeat", type=int, default=200)
    a = ap.parse_args()
    spec = get(a.model)
    if a.dtype != "fp32":
        spec = in_dtype(spec, {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype])
    cuda = a.device == "cuda"
    args = tuple(t.cuda() if cuda else t for t in spec.make_inputs(7))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ep = spec.export()
    names, runners, compiled = [], [], []
    for v in ["(defaults)"] + a.variant:
        kw = {} if v == "(defaults)" else {
            k: ast.literal_eval(x) for k, x in (p.split("=", 1) for p in v.split(","))}
        t0 = time.perf_counter()
        cm = kiln.compile(ep, device=a.device, options=kiln.Options(**kw))
        secs = time.perf_counter() - t0
        r = cm.load(Path(tempfile.mkdtemp()) / "m.kiln", device="cuda:0" if cuda else "cpu")
        if not cuda and a.threads:
            r.num_threads = a.threads
        for _ in range(20):
            r(*args)
        sync()
        names.append(v)
        runners.append(r)
        compiled.append((cm, secs))
    times: list[list[float]] = [[] for _ in runners]
    for rep in range(a.repeat):
        k = rep % len(runners)
        for i in [*range(k, len(runners)), *range(k)]:
            t0 = time.perf_counter()
            runners[i](*args)
            sync()
            times[i].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times[0])
    print(f"| {a.model} {a.dtype} {a.device} variant | median ms | vs defaults | kernels | "
          f"compile s | max_autotune check |\n| --- | --- | --- | --- | --- | --- |")
    for v, ts, (cm, secs) in zip(names, times, compiled):
        ms = statistics.median(ts)
        chk = cm.report.get("gemm_check")
        note = (f"tuned {chk['tuned_ms']:.3f} ms, default {chk['default_ms']:.3f} ms: kept "
                f"{chk['kept']} ({len(chk['differing_gemms'])} GEMMs differ)") if chk else "-"
        print(f"| {v} | {ms:.3f} | {ms / base:.2f}x | {cm.report['kernels']} | {secs:.0f} | "
              f"{note} |")


if __name__ == "__main__":
    main()
