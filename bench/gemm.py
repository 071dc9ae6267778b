"""GEMM on CPU: GFLOP/s of kiln's register-blocked GEMM ("cpp", best tile), OpenBLAS ("blas")
and torch.mm, for the GEMMs of the zoo models (at their example sizes) and small / skinny
shapes. kiln's numbers come from the autotuner's own benchmark driver (kiln/gemm/cpu.py),
so they are what `max_autotune` sees; torch.mm is timed in this process with the same thread
count.

    .venv/bin/python bench/gemm.py [--threads 1] [--models mlp,gpt,resnet18] [--markdown F]
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

from kiln.gemm import cpu
from kiln.gemm.problem import problem_of
from kiln.gemm.profile import run_candidate
from kiln.frontend.export import import_program
from kiln.ir import loop as L
from kiln.ir.sym import evaluate
from kiln.lowering import lower
from kiln.models import zoo
from kiln.options import Options
from kiln.passes.dce import dce
from kiln.targets.cpu.build import toolchain

SMALL = [(1, 64, 64), (1, 256, 256), (4, 128, 512), (8, 1024, 1024), (16, 16, 16),
         (32, 32, 32), (64, 64, 64), (5, 300, 32), (128, 8, 128), (256, 256, 256)]


def zoo_gemms(names):
    out = []
    for name in names:
        spec = zoo.get(name)
        g = dce(import_program(spec.export(), True).graph)
        env = {s.name: s.example for s in g.symbols}
        ranges = {s.name: (s.min, s.max) for s in g.symbols}
        for node in lower(g).nodes:
            if isinstance(node, L.Gemm):
                nb = 1
                for b in node.batch:
                    nb *= int(evaluate(b, env))
                p = problem_of(node, ranges)
                out.append((f"{name}:{node.name}", nb, int(evaluate(node.m, env)),
                            int(evaluate(node.n, env)), int(evaluate(node.k, env)),
                            p.layout_a, p.layout_b))
    return out


def torch_mm(nb, m, n, k, la, lb, threads, min_s=0.05):
    torch.set_num_threads(threads)
    a = torch.randn(nb, k, m).transpose(1, 2) if la == "t" else torch.randn(nb, m, k)
    b = torch.randn(nb, n, k).transpose(1, 2) if lb == "t" else torch.randn(nb, k, n)
    best = float("inf")
    for _ in range(5):
        t0, it = time.perf_counter(), 0
        while time.perf_counter() - t0 < min_s / 5:
            torch.bmm(a, b) if nb > 1 else torch.mm(a[0], b[0])
            it += 1
        best = min(best, (time.perf_counter() - t0) / it)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="mlp,gpt,resnet18")
    ap.add_argument("--markdown", default=None, help="rewrite the gemm-cpu section of this file")
    args = ap.parse_args(argv)
    opts = Options(num_threads=args.threads)
    configs = cpu.cpp_configs(opts.march)
    exe = cpu.build_driver(toolchain(opts), "float32", configs)
    env = {"OMP_NUM_THREADS": str(args.threads)}
    cases = zoo_gemms([m for m in args.models.split(",") if m])
    cases += [(f"{m}x{n}x{k}", 1, m, n, k, "n", "n") for m, n, k in SMALL]
    seen, rows = set(), []
    for name, nb, m, n, k, la, lb in cases:
        key = (nb, m, n, k, la, lb)
        if key in seen:
            continue
        seen.add(key)
        flops = 2.0 * nb * m * n * k

        def t(idx):
            r = run_candidate([str(exe), str(idx), str(nb), str(m), str(n), str(k), la, lb,
                               "0.05"], 60, env)
            return r.seconds
        blas = t(0)
        cpp = [(t(i), c.name) for i, c in enumerate(configs, 1)]
        cpp = min((x for x in cpp if x[0]), default=(None, "-"))
        tm = torch_mm(nb, m, n, k, la, lb, args.threads)
        row = (name, f"{nb}x{m}x{n}x{k} {la}{lb}", flops / cpp[0] / 1e9, cpp[1],
               flops / blas / 1e9, flops / tm / 1e9)
        rows.append(row)
        print(f"{row[0]:28s} {row[1]:24s} cpp {row[2]:7.2f} ({row[3]})  blas {row[4]:7.2f}  "
              f"torch.mm {row[5]:7.2f} GFLOP/s", flush=True)
    if args.markdown:
        lines = ["| GEMM | batch x M x N x K, layout | cpp GFLOP/s (best tile) | OpenBLAS | "
                 "torch.mm | cpp / OpenBLAS |", "| --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            lines.append(f"| {r[0]} | {r[1]} | {r[2]:.2f} ({r[3]}) | {r[4]:.2f} | {r[5]:.2f} | "
                         f"{r[2] / r[4]:.2f}x |")
        path = Path(args.markdown)
        text = path.read_text()
        block = "<!-- gemm-cpu:begin -->\n" + "\n".join(lines) + "\n<!-- gemm-cpu:end -->"
        if "<!-- gemm-cpu:begin -->" in text:
            text = re.sub(r"<!-- gemm-cpu:begin -->.*<!-- gemm-cpu:end -->", lambda _: block,
                          text, flags=re.S)
        else:
            text += "\n" + block + "\n"
        path.write_text(text)


if __name__ == "__main__":
    main()
