"""kiln's CUDA compile of one model in a fresh process, optionally after torch.compile ran in
the same process (what bench/gpu_peers.py does): where the compile's seconds go, to find why
a compile after torch.compile is slower (issue 15 item 3). On a GPU machine:

    KILN_CACHE_DIR=$(mktemp -d) python scripts/compile_in_process.py MODEL fp32 [--after ro]

Prints the compile seconds and the report's stages over 0.2 s (launch tuning's parts:
"wait" for the workers, "load" of the compiled candidates here, the rest is timing), and the
TRITON_CACHE_DIR in effect."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.gpu_peers import DT  # noqa: E402  (the benchmark's dtype names)



def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("dtype", choices=sorted(DT))
    p.add_argument("--after", choices=["ro", "default"], help="torch.compile this mode first")
    a = p.parse_args()
    import kiln
    from bench.cpu_peers_models import build
    from bench.gpu_peers import _inputs

    torch.manual_seed(0)
    case = build(a.model)
    module = case.module.to("cuda", DT[a.dtype]).eval()
    args = _inputs(case.args, 1, DT[a.dtype])
    with torch.no_grad():
        if a.after:
            mode = "reduce-overhead" if a.after == "ro" else "default"
            t0 = time.perf_counter()
            torch.compile(module, mode=mode)(*args)
            torch.cuda.synchronize()
            print(f"torch.compile {mode}: {time.perf_counter() - t0:.1f} s")
            torch._dynamo.reset()
        ep = torch.export.export(module, args)
        t0 = time.perf_counter()
        cm = kiln.compile(ep, device="cuda")
        total = time.perf_counter() - t0
    print(f"{a.model} {a.dtype} after={a.after}: kiln.compile {total:.1f} s; "
          f"TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR')}")
    for k, v in sorted(cm.report["stages"].items(), key=lambda kv: -kv[1]):
        if v >= 0.2:
            print(f"  {k:40s} {v:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
