"""Builds, on a machine without a GPU, the CUTLASS objects (.o, linked into packages) and
shared libraries (.so, profiled by max_autotune) that bench/gemm_link.py and
tests/gemm/test_autotune_gpu.py will ask for, into $KILN_CACHE_DIR: the GPU machine then finds
them by content hash instead of spending its time in nvcc. GEMMs whose epilogue maps to a
visitor tree (kiln/gemm/cutlass_evt.py) get the fused kernels as well.

    KILN_CACHE_DIR=build/gpucache python scripts/prebuild_cutlass.py [max configs]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import kiln
from kiln import config
from kiln.gemm import cutlass
from kiln.gemm.cutlass_evt import Evt
from kiln.gemm.cutlass_link import _tag, source_for
from kiln.gemm.problem import problem_of
from kiln.gemm.select import _evt
from kiln.ir import loop as L
from kiln.models import ALL_MODELS
from kiln.models.zoo import in_dtype
from kiln.options import Options

sys.path.insert(0, str(Path(__file__).parent.parent))
from bench.gemm_link import SWEEP, _MM  # noqa: E402
from tests.gemm_models import Bmm, Fused, Linear  # noqa: E402


def programs():
    for n in ("mlp", "gpt"):
        yield in_dtype(ALL_MODELS[n](), torch.float16).export()
    for m, n, k in SWEEP:
        yield torch.export.export(_MM(k, n).half(), (torch.randn(m, k).half(),))
    lin = torch.nn.Linear(256, 128).half()
    b = torch.export.Dim("b", min=1, max=1024)
    yield torch.export.export(lin, (torch.randn(64, 256).half(),), dynamic_shapes=({0: b},))
    for dt in (torch.float16, torch.bfloat16):
        yield torch.export.export(Bmm(), (torch.randn(3, 40, 72, dtype=dt),
                                           torch.randn(3, 72, 24, dtype=dt)))
    lin = torch.nn.Linear(512, 512).half()
    yield torch.export.export(lin, (torch.randn(256, 512).half(),))
    # tests/gemm/test_autotune_gpu.py's Linear + epilogue models (same structure and sizes)
    for act in ("none", "relu", "gelu"):
        yield torch.export.export(Linear(256, 128, act).half(), (
            torch.randn(64, 256).half(), torch.randn(64, 128).half()),
            dynamic_shapes={"x": {0: b}, "r": {0: b}})
    yield torch.export.export(Linear(512, 512, "gelu").half(), (
        torch.randn(256, 512).half(), torch.randn(256, 512).half()))
    bb = torch.export.Dim("b", min=1, max=512)
    for dt in (torch.float16, torch.bfloat16):
        yield torch.export.export(Fused(256, 128).to(dt), (
            torch.randn(64, 256, dtype=dt), torch.randn(64, 128, dtype=dt)),
            dynamic_shapes={"x": {0: bb}, "r": {0: bb}})


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    opts = Options(cuda_archs=(90,), gemm_backends=("blas",), cutlass_max_profiling_configs=n)
    root = config.cache_dir()
    names, fused = {}, {}
    for ep in programs():
        b = kiln.compile(ep, device="cuda", options=opts).built
        ranges = {s.name: (s.min, s.max) for s in b.graph.symbols}
        keep = set(b.loop.outputs)
        for i, g in enumerate(b.steps):
            if isinstance(g, L.Gemm) and g.dtype.name in ("float16", "bfloat16"):
                for c in cutlass.enumerate_candidates(problem_of(g, ranges), opts):
                    names[c.name] = c
                evt = _evt(b.steps, i, keep)
                if isinstance(evt, Evt):
                    p = problem_of(g, ranges, evt.key)
                    for c in cutlass.enumerate_candidates(p, opts, evt=evt):
                        fused[(c.name, evt.key)] = c
    print(len(names), "kernels,", len(fused), "fused:", *names, *fused, sep="\n  ", flush=True)
    so = cutlass.compile_all({k: cutlass.render(c) for k, c in names.items()},
                             root / "autotune_cutlass", shared=True)
    for key in sorted({e for _, e in fused}):  # named as gpu.candidates names them
        so.update({(k, key): v for k, v in cutlass.compile_all(
            {k: cutlass.render(c) for (k, e), c in fused.items() if e == key},
            root / "autotune_cutlass", shared=True).items()})
    obj = cutlass.compile_all({**{f"cutlass_{_tag(k)}": source_for(k) for k in names},
                               **{f"cutlass_{_tag(k, e)}": source_for(k, evt=c.evt)
                                  for (k, e), c in fused.items()}}, root / "cutlass")
    bad = [k for k, v in {**so, **obj}.items() if not isinstance(v, Path)]
    print("failed:", bad or "none")


if __name__ == "__main__":
    main()
