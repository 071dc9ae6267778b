"""A/B of kiln_gemm.h's packed GEMM between two trees: builds bench/gemm_packed_ab.cpp
against each tree's headers, runs the two alternately (order swapped each round) at the
given thread counts, prints the median over rounds of each shape's median time (us).
  python bench/gemm_packed_ab.py A_ROOT B_ROOT [--rounds 6] [--threads 1,2] [--secs 0.2]"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(root: str, out: Path) -> None:
    subprocess.run(["c++", "-O3", "-std=c++17", "-march=native", "-fopenmp-simd", "-pthread",
                    f"-I{root}/kiln/runtime/model", f"-I{root}/kiln/runtime/include",
                    str(HERE / "gemm_packed_ab.cpp"), "-o", str(out)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--secs", default="0.2")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gemm_ab_"))
    exes = {"A": tmp / "a", "B": tmp / "b"}
    build(args.a, exes["A"])
    build(args.b, exes["B"])
    for th in args.threads.split(","):
        res: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
                out = subprocess.run([str(exes[k]), args.secs], check=True, text=True,
                                     capture_output=True,
                                     env={**os.environ, "OMP_NUM_THREADS": th}).stdout
                for line in out.splitlines():
                    m, n, kk, us = line.split()
                    res.setdefault((f"{m}x{n}x{kk}", k), []).append(float(us))
        print(f"threads {th}, {args.rounds} rounds: shape (MxNxK)  A us  B us  B/A")
        for shape in dict.fromkeys(s for s, _ in res):
            a = statistics.median(res[(shape, "A")])
            b = statistics.median(res[(shape, "B")])
            print(f"  {shape:16s} {a:9.1f} {b:9.1f} {b / a:6.3f}")


if __name__ == "__main__":
    main()
