"""Where a cold CUDA compile spends its wall time (issue 15 item 3): one zoo model compiled in
this process with empty kiln and Triton caches, under cProfile, then the stages and the
functions with the most cumulative time; and, in fresh processes, what a first CUDA context
and a first cuDNN convolution cost on their own (launch-config tuning and its cuDNN reference
pay them inside the compile).

    python scripts/prof_cold_compile.py resnet18 [bf16] [--top 30] [--options '{"k": v}']
    python scripts/prof_cold_compile.py hf_resnet50 bf16    # bench/cpu_peers_models.py names too
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_FIRSTS = r"""
import time, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
x = torch.randn(1, 64, 56, 56, device="cuda", dtype=torch.bfloat16).to(
    memory_format=torch.channels_last)
w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16).to(
    memory_format=torch.channels_last)
torch.nn.functional.conv2d(x, w, None, 1, 1); torch.cuda.synchronize()
t3 = time.perf_counter()
torch.nn.functional.conv2d(x, w, None, 1, 1); torch.cuda.synchronize()
t4 = time.perf_counter()
print(f"import torch {t1 - t0:.2f} s, CUDA context {t2 - t1:.2f} s, first cuDNN conv "
      f"{t3 - t2:.2f} s, second {1e3 * (t4 - t3):.2f} ms")
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("dtype", nargs="?", default="bf16")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--options", default="")
    ap.add_argument("--tuned", default="",
                    help="write the launch tuner's timings (ms per candidate config) as JSON")
    ap.add_argument("--on-cuda", action="store_true",
                    help="export the module and inputs on the GPU, as bench/gpu_peers.py does")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kiln-cold-")
    os.environ["KILN_CACHE_DIR"] = f"{tmp}/kiln"
    os.environ["TRITON_CACHE_DIR"] = f"{tmp}/triton"
    firsts = subprocess.run([sys.executable, "-c", _FIRSTS], capture_output=True, text=True)
    print("fresh process:", (firsts.stdout or firsts.stderr[-400:]).strip())

    import torch

    import kiln
    from kiln.models import zoo
    from kiln.options import Options

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    if a.model in zoo.ALL_MODELS:
        spec = zoo.get(a.model)
        if a.dtype != "fp32":
            spec = zoo.in_dtype(spec, dt)
        module, args, dyn = spec.module, spec.example_args, spec.dynamic_shapes
    else:  # a Hugging Face model built from its config (bench/cpu_peers_models.py)
        from bench.cpu_peers_models import build

        case = build(a.model)
        module = case.module.to(dt)
        args = tuple(x.to(dt) if torch.is_tensor(x) and x.is_floating_point() else x
                     for x in case.args)
        dyn = None
    if a.on_cuda:
        module = module.cuda()
        args = tuple(x.cuda() if torch.is_tensor(x) else x for x in args)
    t = time.perf_counter()
    ep = torch.export.export(module, args, dynamic_shapes=dyn)
    export_s = time.perf_counter() - t
    opts = Options(**json.loads(a.options)) if a.options else Options()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    cm = kiln.compile(ep, device="cuda", options=opts)
    prof.disable()
    wall = time.perf_counter() - t
    stages = cm.report["stages"]
    print(f"\n{a.model} {a.dtype}: export {export_s:.2f} s, kiln.compile {wall:.2f} s "
          f"(stages {sum(v for k, v in stages.items() if '.' not in k):.2f} s)")
    for k, v in sorted(stages.items(), key=lambda kv: -kv[1]):
        if v >= 0.05:
            print(f"  {k:32s} {v:8.2f}")
    if a.tuned:
        Path(a.tuned).write_text(json.dumps(cm.manifest.get("cuda", {}).get("autotuned", {}),
                                            indent=1))
    if a.top:
        print()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
