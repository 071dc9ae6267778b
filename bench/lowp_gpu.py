"""Low-precision GEMMs on the GPU: TFLOP/s of kiln's CUDA packages (cuBLASLt) for
`torch._scaled_mm` (e4m3 x e4m3 -> bf16, tensor-wise scales), `torch._int_mm` (int8 -> int32,
TOPS) and the mixed-dtype GEMM of weight-only quantisation, `x @ (w_int8.to(fp16) * s).t()`
(kiln: the Triton template reading int8, heuristic config, or profiled with --max-autotune;
eager dequantises the weight each call; the last column times cuBLAS on a float16 weight
dequantised ahead of time, what a package without mixed GEMMs would ship at twice the bytes)
against eager's same code, for square and skinny shapes. Each shape is one package (static
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

# weight-only quantisation is for decoding: also M = 1 (a single token)
MIXED_ONLY = [(1, 4096, 4096)]
SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
          (16, 4096, 4096), (64, 8192, 8192), (128, 4096, 14336), (4096, 1024, 4096)]


class ScaledMM(torch.nn.Module):
    def forward(self, a, w, sa, sb):
        return torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)


class IntMM(torch.nn.Module):
    def forward(self, a, w):
        return torch._int_mm(a, w.t())


class MixedLinear(torch.nn.Module):
    """Weight-only int8 quantisation: an int8 weight [N, K] and a per-channel scale [N]."""

    def __init__(self, k: int, n: int, device: str = "cuda"):
        super().__init__()
        g = torch.Generator().manual_seed(1)  # on the CPU: the package's weights are eager's
        self.register_buffer("w", torch.randint(-128, 128, (n, k), dtype=torch.int8,
                                                generator=g).to(device))
        self.register_buffer("s", (torch.rand(n, generator=g) / 256).half().to(device))

    def forward(self, x):
        return x @ (self.w.to(x.dtype) * self.s[:, None]).t()


MODULES = {"fp8": lambda k, n, dev: ScaledMM(), "int8": lambda k, n, dev: IntMM(),
           "mixed": MixedLinear}
OPS = {"fp8": "_scaled_mm e4m3->bf16", "int8": "_int_mm int8->int32",
       "mixed": "fp16 x int8 weight (x @ (w.half()*s).t())"}


def inputs(kind: str, m: int, k: int, n: int, device: str = "cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "mixed":
        return (torch.randn(m, k, device=device, generator=g).half(),)
    if kind == "fp8":
        a = torch.randn(m, k, device=device, generator=g).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=device, generator=g).to(torch.float8_e4m3fn)
        return (a, w, torch.tensor(0.5, device=device), torch.tensor(2.0, device=device))
    m = max(m, 17)  # eager's _int_mm needs M > 16
    return (torch.randint(-8, 8, (m, k), device=device, dtype=torch.int8, generator=g),
            torch.randint(-8, 8, (n, k), device=device, dtype=torch.int8, generator=g))


def build(job):
    """One package, exported from CPU example inputs (the child never touches the GPU)."""
    kind, shape, root, autotune = job
    mod = MODULES[kind](shape[1], shape[2], "cpu")
    cm = kiln.compile(mod, inputs(kind, *shape, device="cpu"), device="cuda",
                      options=kiln.Options(cuda_archs=(90,), max_autotune=autotune))
    return kind, shape, cm.save(root / f"{kind}_{'x'.join(map(str, shape))}.kiln")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--max-autotune", action="store_true",
                    help="profile the mixed GEMMs' Triton configs (built one at a time, here)")
    opts = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kiln-lowp-"))
    jobs = [(kind, s, root, False) for kind in ("fp8", "int8", "mixed") for s in SHAPES
            if not (kind == "mixed" and opts.max_autotune)] + \
        [("mixed", s, root, False) for s in MIXED_ONLY if not opts.max_autotune]
    with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as ex:
        built = list(ex.map(build, jobs))
    if opts.max_autotune:  # profiling needs the GPU: in this process
        built += [build(("mixed", s, root, True)) for s in SHAPES + MIXED_ONLY]
    rows = []
    for kind, (m, k, n), path in built:
        mod = MODULES[kind](k, n, "cuda")
        args = inputs(kind, m, k, n)
        runner = kiln.load(path, device="cuda:0")
        got, want = runner(*args), mod(*args)
        if kind == "int8":
            ok = bool(torch.equal(got, want))
        else:
            ok = bool(torch.allclose(got.float(), want.float(), rtol=1.6e-2, atol=1e-1))
        t_kiln = do_bench(lambda: runner(*args), warmup=25, rep=100)
        t_eager = do_bench(lambda: mod(*args), warmup=25, rep=100)
        t_fp16 = None
        if kind == "mixed":  # cuBLAS on a weight dequantised ahead of time
            w16 = (mod.w.half() * mod.s[:, None]).t()
            t_fp16 = do_bench(lambda: args[0] @ w16, warmup=25, rep=100)
        flop = 2.0 * args[0].shape[0] * k * n
        rows.append({"op": OPS[kind], "M": args[0].shape[0], "N": n, "K": k, "ok": ok,
                     "kiln_ms": t_kiln, "eager_ms": t_eager,
                     "kiln_tflops": flop / t_kiln / 1e9, "eager_tflops": flop / t_eager / 1e9,
                     "fp16_dequantised_ms": t_fp16})
    head = ("| op | M | N | K | kiln ms | eager ms | kiln TFLOP/s | eager TFLOP/s | kiln/eager "
            "| correct | fp16 GEMM, weight dequantised ahead: ms |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head] + [
        f"| {r['op']} | {r['M']} | {r['N']} | {r['K']} | {r['kiln_ms']:.4f} | "
        f"{r['eager_ms']:.4f} | {r['kiln_tflops']:.1f} | {r['eager_tflops']:.1f} | "
        f"{r['eager_ms'] / r['kiln_ms']:.2f}x | {'yes' if r['ok'] else 'NO'} | "
        f"{'-' if r['fp16_dequantised_ms'] is None else format(r['fp16_dequantised_ms'], '.4f')}"
        " |" for r in rows]
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
