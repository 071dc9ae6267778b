"""Low-precision GEMMs on the GPU: TFLOP/s of kiln's CUDA packages (cuBLASLt) for
`torch._scaled_mm` (e4m3 x e4m3 -> bf16, tensor-wise scales) and `torch._int_mm` (int8 -> int32,
TOPS) against eager's same op, for square and skinny shapes. Each shape is one package (static
shapes, compiled in parallel); both sides are timed with triton.testing.do_bench on the same
inputs (kiln's time includes its Python call overhead and, where inputs and outputs are small, a
CUDA-graph replay); results are checked against eager first. Packages are built in parallel
processes (8) from CPU example inputs, for sm_90.

    python bench/lowp_gpu.py [--json out.json] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from triton.testing import do_bench

import kiln

SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
          (16, 4096, 4096), (64, 8192, 8192), (128, 4096, 14336), (4096, 1024, 4096)]


class ScaledMM(torch.nn.Module):
    def forward(self, a, w, sa, sb):
        return torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)


class IntMM(torch.nn.Module):
    def forward(self, a, w):
        return torch._int_mm(a, w.t())


def inputs(kind: str, m: int, k: int, n: int, device: str = "cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "fp8":
        a = torch.randn(m, k, device=device, generator=g).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=device, generator=g).to(torch.float8_e4m3fn)
        return (a, w, torch.tensor(0.5, device=device), torch.tensor(2.0, device=device))
    m = max(m, 17)  # eager's _int_mm needs M > 16
    return (torch.randint(-8, 8, (m, k), device=device, dtype=torch.int8, generator=g),
            torch.randint(-8, 8, (n, k), device=device, dtype=torch.int8, generator=g))


def build(job):
    """One package, exported from CPU example inputs (the child never touches the GPU)."""
    kind, shape, root = job
    mod = ScaledMM() if kind == "fp8" else IntMM()
    cm = kiln.compile(mod, inputs(kind, *shape, device="cpu"), device="cuda",
                      options=kiln.Options(cuda_archs=(90,)))
    return kind, shape, cm.save(root / f"{kind}_{'x'.join(map(str, shape))}.kiln")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    opts = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kiln-lowp-"))
    jobs = [(kind, s, root) for kind in ("fp8", "int8") for s in SHAPES]
    with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as ex:
        built = list(ex.map(build, jobs))
    rows = []
    for kind, (m, k, n), path in built:
        mod = ScaledMM() if kind == "fp8" else IntMM()
        args = inputs(kind, m, k, n)
        runner = kiln.load(path, device="cuda:0")
        got, want = runner(*args), mod(*args)
        if kind == "int8":
            ok = bool(torch.equal(got, want))
        else:
            ok = bool(torch.allclose(got.float(), want.float(), rtol=1.6e-2, atol=1e-1))
        t_kiln = do_bench(lambda: runner(*args), warmup=25, rep=100)
        t_eager = do_bench(lambda: mod(*args), warmup=25, rep=100)
        flop = 2.0 * args[0].shape[0] * k * n
        rows.append({"op": "_scaled_mm e4m3->bf16" if kind == "fp8" else "_int_mm int8->int32",
                     "M": args[0].shape[0], "N": n, "K": k, "ok": ok,
                     "kiln_ms": t_kiln, "eager_ms": t_eager,
                     "kiln_tflops": flop / t_kiln / 1e9, "eager_tflops": flop / t_eager / 1e9})
    head = ("| op | M | N | K | kiln ms | eager ms | kiln TFLOP/s | eager TFLOP/s | kiln/eager "
            "| correct |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head] + [
        f"| {r['op']} | {r['M']} | {r['N']} | {r['K']} | {r['kiln_ms']:.4f} | "
        f"{r['eager_ms']:.4f} | {r['kiln_tflops']:.1f} | {r['eager_tflops']:.1f} | "
        f"{r['eager_ms'] / r['kiln_ms']:.2f}x | {'yes' if r['ok'] else 'NO'} |" for r in rows]
    table = "\n".join(lines)
    dev = torch.cuda.get_device_name()
    if opts.json:
        Path(opts.json).write_text(json.dumps({"device": dev, "rows": rows}, indent=1))
    if opts.markdown:
        Path(opts.markdown).write_text(f"Device: {dev}, torch {torch.__version__}\n\n{table}\n")
    print(f"Device: {dev}, torch {torch.__version__}")
    print(table)


if __name__ == "__main__":
    main()
