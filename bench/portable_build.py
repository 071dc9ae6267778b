"""Compile time and package size of portable builds (Options(march="portable")) on zoo
models, cold build cache each time: the native build, the portable build as kiln does it
(kernels and GEMM file per level, the wrapper model.cpp compiled once at the lowest level and
linked into every level's library) and the alternative of whole per-level libraries (model.cpp
compiled per level too), both in one parallel pool of Options.jobs compilers.

    python bench/portable_build.py mlp resnet18 gpt [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import kiln
    from kiln.models import get
    from kiln.targets.cpu.build import fit_gemms, toolchain
    from kiln.targets.cpu.gemm import print_gemm_file
    from kiln.toolchain.cxx import compile_objects, link_shared

    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--jobs", type=int, default=0)
    a = ap.parse_args()
    print("| model | native build s | portable s (wrapper once) | whole per level s | "
          "native package | portable package | whole per level libs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in a.models:
        ep = get(name).export()
        row = [name]
        sizes = []
        for march in ("native", "portable"):
            with tempfile.TemporaryDirectory() as cache:
                opts = kiln.Options(march=march, jobs=a.jobs, cache_dir=cache)
                t0 = time.perf_counter()
                cm = kiln.compile(ep, options=opts)
                row.append(f"{time.perf_counter() - t0:.1f} "
                           f"(C++ {cm.report['stages']['compile']:.1f})")
                sizes.append(cm.save(Path(cache) / "m.kiln").stat().st_size)
        # the alternative: every file, model.cpp included, per level
        built = cm.built
        with tempfile.TemporaryDirectory() as cache:
            opts = replace(opts, cache_dir=cache)
            jobs, per = [], []
            for lv in opts.cpu_levels:
                tc = toolchain(opts, lv)
                files = {k: v for k, v in built.sources.items() if k.endswith(".cpp")}
                if "gemm.cpp" in files:
                    files["gemm.cpp"] = print_gemm_file(built.steps, fit_gemms(built.gemms, lv))
                per.append((tc, len(files)))
                jobs += [(tc, n, t, ("-O1",) if n == "model.cpp" else ())
                         for n, t in sorted(files.items())]
            t0 = time.perf_counter()
            objs = compile_objects(jobs, opts.jobs or 2)
            k, total = 0, 0
            for tc, n in per:
                total += link_shared(tc, objs[k:k + n]).stat().st_size
                k += n
            whole = time.perf_counter() - t0
        row.append(f"C++ {whole:.1f}")
        row += [f"{sizes[0] / 1e6:.2f} MB", f"{sizes[1] / 1e6:.2f} MB", f"{total / 1e6:.2f} MB"]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
