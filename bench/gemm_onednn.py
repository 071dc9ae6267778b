"""kiln's CPU GEMM against oneDNN's matmul per GEMM shape, with the autotuner's own driver
(kiln/targets/cpu/dnnl_gemm.py: kiln's choice with the package's epilogue code vs oneDNN's
matmul with the epilogue as bias + post-ops, calls alternating, each one's fastest kept).

The GEMMs are those of hf_bert_base (seq 128: QKV / attention output 128x768x768 + bias,
FFN up 128x3072x768 + bias + exact GELU, FFN down 128x768x3072 + bias + residual) and the mlp
zoo model (64x1024x1024 + bias + GELU), and each at M = 1. kiln's side is the choice kiln makes
without max_autotune (the packed "cpp" GEMM, its default tile) unless --kiln-config names
another packed tile. Rounds are interleaved (round r: every shape at every thread count, in
turn); the table gives the median over rounds of each round's fastest call, as GFLOP/s.

    python bench/gemm_onednn.py --rounds 7 --threads 1,2 [--taskset 0,1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kiln  # noqa: E402
from kiln.gemm.cpu import packed_configs  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.targets.cpu import dnnl_gemm  # noqa: E402
from kiln.targets.cpu.build import toolchain  # noqa: E402
from kiln.toolchain.cxx import build_executable  # noqa: E402
from kiln.toolchain.onednn import find_library  # noqa: E402

#: (label, M, N, K, epilogue)
SHAPES = [("bert qkv/out", 128, 768, 768, "bias"),
          ("bert ffn up", 128, 3072, 768, "gelu"),
          ("bert ffn down", 128, 768, 3072, "residual"),
          ("mlp layer", 64, 1024, 1024, "gelu")]


class Layer(nn.Module):
    def __init__(self, k: int, n: int, epi: str) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.epi = epi

    def forward(self, x, r):
        y = self.fc(x)
        if self.epi == "gelu":
            return nn.functional.gelu(y)
        if self.epi == "residual":
            return y + r
        return y


def gemm_of(m: int, n: int, k: int, epi: str, cache: str):
    """The L.Gemm (with its fused epilogue) and oneDNN config of one layer."""
    model = Layer(k, n, epi).eval()
    opts = kiln.Options(cpu_gemm_backends=("onednn",), cache_dir=cache)
    c = kiln.compile(model, (torch.randn(m, k), torch.randn(m, n)), options=opts)
    g = next(s for s in c.built.steps if isinstance(s, L.Gemm))
    return g, c.built.gemms[g.name].config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seconds", type=float, default=0.2, help="timed s per driver run")
    ap.add_argument("--taskset", default="", help="pin the drivers (taskset -c CPUS)")
    ap.add_argument("--kiln-config", default="", help="a packed tile MR,KC (default: kiln's)")
    ap.add_argument("--m1", action=argparse.BooleanOptionalAction, default=True,
                    help="also each shape at M = 1")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    found = find_library()
    if found is None:
        sys.exit("oneDNN is not installed: pip install onednn-cpu-gomp")
    cache = os.environ.get("KILN_CACHE_DIR", "")
    opts = kiln.Options(cache_dir=cache or None)
    kcfg = packed_configs(opts.march)[0]
    if args.kiln_config:
        mr, kc = (int(v) for v in args.kiln_config.split(","))
        kcfg = type(kcfg)(mr, kcfg.nv, kc, packed=True)
    shapes = list(SHAPES)
    if args.m1:
        shapes += [(f"{lab} M=1", 1, n, k, e) for lab, _, n, k, e in SHAPES]
    tc = toolchain(opts)
    exes = {}
    for lab, m, n, k, e in shapes:
        g, cfg = gemm_of(m, n, k, e, cache or None)
        src = dnnl_gemm.driver_source(g, cfg, kcfg, opts.march, str(found[0]))
        exes[lab] = build_executable(tc, src, "gemm_dnnl", "the driver", libs=("-ldl",))
        print(f"built {lab}: {exes[lab].name}", file=sys.stderr)
    threads = [int(t) for t in args.threads.split(",")]
    res: dict = {}
    pin = ["taskset", "-c", args.taskset] if args.taskset else []
    for r in range(args.rounds):
        for lab, *_ in shapes:
            for t in threads:
                env = dnnl_gemm.driver_env(t)
                p = subprocess.run([*pin, str(exes[lab]), str(args.seconds)], env=env,
                                   capture_output=True, text=True, timeout=600)
                line = next((x for x in p.stdout.splitlines()
                             if x.startswith("KILN_GEMM_DNNL")), None)
                if line is None:
                    sys.exit(f"{lab}: {p.stderr.strip()[-500:]}")
                ks, ds, err, tol = map(float, line.split()[1:5])
                impl = line.split()[5]
                assert err <= tol, (lab, err, tol)
                res.setdefault((lab, t), {"kiln": [], "onednn": [], "impl": impl})
                res[(lab, t)]["kiln"].append(ks)
                res[(lab, t)]["onednn"].append(ds)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"kiln: {kcfg.name}; oneDNN {found[1]} ({found[0].name}); "
          f"load {os.getloadavg()[0]:.2f}")
    print("| GEMM (M x N x K, epilogue) | threads | kiln us | oneDNN us | kiln GFLOP/s | "
          "oneDNN GFLOP/s | oneDNN / kiln speed | oneDNN impl |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    out = []
    for lab, m, n, k, e in shapes:
        for t in threads:
            v = res[(lab, t)]
            ks, ds = statistics.median(v["kiln"]), statistics.median(v["onednn"])
            fl = 2.0 * m * n * k
            print(f"| {lab} {m}x{n}x{k} +{e} | {t} | {ks * 1e6:.1f} | {ds * 1e6:.1f} | "
                  f"{fl / ks / 1e9:.1f} | {fl / ds / 1e9:.1f} | {ks / ds:.2f} | {v['impl']} |")
            out.append({"gemm": lab, "m": m, "n": n, "k": k, "epilogue": e, "threads": t,
                        "kiln_s": v["kiln"], "onednn_s": v["onednn"], "impl": v["impl"]})
    if args.json:
        Path(args.json).write_text(json.dumps({"kiln": kcfg.name, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
