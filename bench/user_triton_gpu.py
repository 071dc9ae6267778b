"""User Triton kernels on the GPU: latency of kiln packages against eager for the models of
tests/user_triton_kernels.py (median of timed runs, CUDA events), and the configs the
autotuner measured. Prints one table.
    python3 bench/user_triton_gpu.py [--repeat N]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.export import Dim

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import kiln  # noqa: E402
import user_triton_kernels as K  # noqa: E402
from bench.cuda_timing import events_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    b = Dim("b")
    cases = [("add_relu b=4096", K.AddRelu(), (torch.randn(8, 16), torch.randn(8, 16)),
              ({0: b}, {0: b}), (torch.randn(4096, 16), torch.randn(4096, 16))),
             ("scale (autotuned) b=65536", K.Scale(), (torch.randn(8, 16),), ({0: b},),
              (torch.randn(65536, 16),)),
             ("linear->kernel->layernorm b=1024", K.Fused(),
              (torch.randn(4, 16), torch.randn(4, 32)), ({0: b}, {0: b}),
              (torch.randn(1024, 16), torch.randn(1024, 32)))]
    rows = []
    for name, module, ex, dyn, run_args in cases:
        module = module.eval()
        cm = kiln.compile(torch.export.export(module, ex, dynamic_shapes=dyn), device="cuda")
        runner = cm.load()
        module = module.cuda()
        dev = [a.cuda() for a in run_args]
        with torch.no_grad():
            eager = events_ms(lambda: module(*dev), args.repeat, 10) * 1000
        ours = events_ms(lambda: runner(*dev), args.repeat, 10) * 1000
        tuned = {k: v["measured_ms"] for k, v in cm.manifest["cuda"]["user_kernels"].items()
                 if v["measured_ms"]}
        rows.append((name, eager, ours, tuned))
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'model':36s} {'eager us':>9s} {'kiln us':>9s}  autotune (ms per config)")
    for name, e, o, t in rows:
        print(f"{name:36s} {e:9.1f} {o:9.1f}  {t or '-'}")


if __name__ == "__main__":
    main()
