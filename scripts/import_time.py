"""The import stage alone (`kiln.frontend.export.import_program` on a CPU export), per model
and per kiln checkout: what torch's re-trace (run_decompositions) costs when a program needs it.

    python scripts/import_time.py TREE [TREE ...] --models hf_resnet50,hf_llama [--rounds 2]

Each tree runs in its own process (its kiln imported from there), trees interleaved per round.
Models: bench/cpu_peers_models.py names."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(tree: str, models: str) -> None:
    sys.path[:0] = [tree, str(ROOT / "bench")]
    import torch

    from cpu_peers_models import build
    from kiln.frontend.export import import_program

    for name in models.split(","):
        case = build(name)
        ep = torch.export.export(case.module, case.args)
        t = time.perf_counter()
        import_program(ep)
        print(f"{tree} {name}: import {time.perf_counter() - t:.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--models", default="hf_resnet50,hf_mobilenet_v2,hf_llama,hf_t5_encoder")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.trees[0], a.models)
        return
    for _ in range(a.rounds):
        for tree in a.trees:
            out = subprocess.run([sys.executable, __file__, tree, "--models", a.models, "--child"],
                                 capture_output=True, text=True)
            print("".join(x + "\n" for x in out.stdout.splitlines() if ": import " in x) or
                  out.stderr[-400:], end="")


if __name__ == "__main__":
    main()
