"""Why a program's import re-traces it (run_decompositions, seconds on a large model): the ops
kiln does not convert as exported, or the converter that declined, per model.

    python scripts/why_decompose.py hf_resnet50 [bf16] [--on-cuda]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models")
    ap.add_argument("dtype", nargs="?", default="fp32")
    ap.add_argument("--on-cuda", action="store_true")
    a = ap.parse_args()
    from bench.cpu_peers_models import build
    from kiln.frontend import export as E
    from kiln.frontend.aten_table import TABLE

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    for name in a.models.split(","):
        case = build(name)
        module = case.module.to(dt)
        args = tuple(x.to(dt) if torch.is_tensor(x) and x.is_floating_point() else x
                     for x in case.args)
        if a.on_cuda:
            module = module.cuda()
            args = tuple(x.cuda() if torch.is_tensor(x) else x for x in args)
        ep = torch.export.export(module, args)
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        unknown = sorted(o for o in ops if o not in TABLE)
        print(f"{name}: all known {E._all_known(ep)}; not in the table: {unknown}")
        if E._all_known(ep):
            t = time.perf_counter()
            try:
                E._import(ep, True, False, 0, True, a.on_cuda)
                print(f"  imported as exported in {time.perf_counter() - t:.2f} s")
            except Exception as e:  # noqa: BLE001 - the reason is the output
                print(f"  declined: {type(e).__name__}: {e}"[:300])


if __name__ == "__main__":
    main()
