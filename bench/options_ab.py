"""A/B timing of kiln Options on one zoo model on the GPU: each variant compiled, loaded and
timed in the same process (median of `--repeat` synchronised calls, CUDA graphs as compiled).

    python bench/options_ab.py gpt --dtype bf16 --variant fused_attention=False \
        --variant triton_max_rblock=1024 [--repeat 200]
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
    ap.add_argument("--variant", action="append", default=[],
                    help="name=value[,name=value] of kiln.Options fields")
    ap.add_argument("--repeat", type=int, default=200)
    a = ap.parse_args()
    spec = get(a.model)
    if a.dtype != "fp32":
        spec = in_dtype(spec, {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype])
    args = tuple(t.cuda() for t in spec.make_inputs(7))
    ep = spec.export()
    rows = []
    for v in ["(defaults)"] + a.variant:
        kw = {} if v == "(defaults)" else {
            k: ast.literal_eval(x) for k, x in (p.split("=", 1) for p in v.split(","))}
        cm = kiln.compile(ep, device="cuda", options=kiln.Options(**kw))
        r = cm.load(Path(tempfile.mkdtemp()) / "m.kiln", device="cuda:0")
        for _ in range(20):
            r(*args)
        torch.cuda.synchronize()
        ts = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            r(*args)
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        rows.append((v, statistics.median(ts), cm.report["kernels"]))
    print(f"| {a.model} {a.dtype} variant | median ms | kernels |\n| --- | --- | --- |")
    for v, ms, k in rows:
        print(f"| {v} | {ms:.3f} | {k} |")


if __name__ == "__main__":
    main()
