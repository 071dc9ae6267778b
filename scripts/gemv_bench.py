"""Micro-benchmark of kiln's GEMV template (M = 1; kiln/gemm/gemv.py) against cuBLAS
(torch.nn.functional.linear) at a Llama decoder's merged shapes, in GB/s of weights streamed
(N * K * itemsize + the row and the result, per call); each GEMV config of `gemv.configs` is
timed and the best and the heuristic's first reported. Device time: CUDA graphs of 20 calls
replayed (bench/cuda_timing.stream_ms), interleaved GEMV / cuBLAS per shape. Also the A/B of
the whole decode step: kiln's default (GEMVs fused with their norms) against
`gemm_backends=("blas",)` (every GEMM cuBLAS), kernels per token and ms per token.

    python scripts/gemv_bench.py [--hidden 2048] [--inter 5632] [--heads 32] [--kv-heads 4]
                                 [--vocab 32000] [--layers 16] [--no-decode]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.cuda_timing import stream_ms  # noqa: E402


class Lin(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.lin(x)


def graphed(fn, calls=20):
    """A CUDA graph of `calls` calls of fn, replayed: the device time of the kernels alone."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def gemv_runs(n, k, dtype):
    """(config name, run) for each GEMV config, on the same fresh operands, and the operands."""
    import kiln
    from kiln.gemm import gemv as GV
    from kiln.ir import loop as L
    from kiln.schedule.steps import GemmKernel
    from kiln.targets.cuda.gemv_template import print_template_kernel
    from kiln.targets.cuda.kernel import print_triton_module
    from kiln.targets.cuda.wrapper_py import import_triton_module, launch_kernel

    m = Lin(k, n).to("cuda", dtype)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    cm = kiln.compile(torch.export.export(m, (x,)), device="cuda",
                      options=kiln.Options(gemm_backends=("triton",), autotune=False))
    b = cm.built
    gk = next(s for s in b.steps if isinstance(s, GemmKernel))
    bufs = L.all_buffers(b.loop)
    w = m.lin.weight.detach()
    out = torch.empty(1, n, device="cuda", dtype=dtype)
    tensors = {gk.gemm.a.buf: x, gk.gemm.b.buf: w, gk.out: out}
    runs = []
    for cfg in GV.configs(n, k, torch.empty((), dtype=dtype).element_size()):
        tk = print_template_kernel(dataclasses.replace(gk, config=cfg), bufs)
        mod = import_triton_module(print_triton_module([tk]))
        runs.append((cfg.name, lambda mod=mod, tk=tk: launch_kernel(
            mod, tk, {}, tensors, None, "cuda")))
    return runs, (x, w, out)


def bench_shapes(shapes, dtype):
    rows = []
    for label, n, k in shapes:
        runs, (x, w, out) = gemv_runs(n, k, dtype)
        blas = graphed(lambda: torch.nn.functional.linear(x, w))  # cuBLAS
        want = torch.nn.functional.linear(x.double(), w.double())
        best, first, errs = None, None, []
        for name, run in runs:
            run()
            torch.cuda.synchronize()
            errs.append((out.double() - want).abs().max().item())
            rep = graphed(run)
            ms_g = stream_ms(rep, 1, 10) / 20
            ms_b = stream_ms(blas, 1, 10) / 20  # interleaved
            if first is None:
                first = (name, ms_g)
            if best is None or ms_g < best[1]:
                best = (name, ms_g, ms_b)
        nbytes = (n * k + n + k) * w.element_size()
        rows.append((label, n, k, nbytes / best[2] / 1e6, nbytes / best[1] / 1e6, best[0],
                     nbytes / first[1] / 1e6, first[0], max(errs)))
        print(rows[-1], flush=True)
    return rows


def decode_ab(a, dtype):
    """ms/token (device time, 20 steps back to back) and kernels per token of the default
    package (GEMVs) and the cuBLAS-only one, built from the same module (launch configs of
    the heuristic in both: autotune off), interleaved."""
    import kiln
    from kiln.models.llm import llama, static_cache_module

    model = llama(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                  vocab=a.vocab, inter=a.inter, init=0.02, device="cuda")
    _, ep = static_cache_module(model, 256, device="cuda", dtype=dtype)
    ids = torch.tensor([[11]], device="cuda")
    pos = torch.tensor([128], device="cuda")
    out = {}
    runners = {}
    for tag, opts in (("gemv", kiln.Options(autotune=False)),
                      ("blas", kiln.Options(autotune=False, gemm_backends=("blas",)))):
        cm = kiln.compile(ep, device="cuda", options=opts)
        kinds = [k["kind"] for k in cm.manifest["kernels"]]
        runners[tag] = cm.load(Path(tempfile.mkdtemp()) / f"{tag}.kiln", device="cuda:0")
        out[tag] = {"kernels": len(kinds), "gemv": kinds.count("triton_gemv"), "ms": []}
    for _ in range(3):  # interleaved
        for tag, r in runners.items():
            out[tag]["ms"].append(stream_ms(
                lambda r=r: r(input_ids=ids, cache_position=pos), 20, 5))
    want = runners["blas"](input_ids=ids, cache_position=pos).float()
    got = runners["gemv"](input_ids=ids, cache_position=pos).float()
    out["max_logit_diff"] = (got - want).abs().max().item()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--no-decode", action="store_true")
    a = p.parse_args()
    h, hd = a.hidden, a.hidden // a.heads
    shapes = [("qkv", h + 2 * a.kv_heads * hd, h), ("o", h, h), ("gate/up", 2 * a.inter, h),
              ("down", h, a.inter), ("head", a.vocab, h)]
    torch.manual_seed(0)
    rows = bench_shapes(shapes, torch.bfloat16)
    print(f"\nGPU: {torch.cuda.get_device_name(0)}; bf16, M = 1; GB/s of weights streamed "
          "(device time, CUDA graphs)\n")
    print("| GEMM | N x K | cuBLAS GB/s | GEMV best GB/s (config) | GEMV heuristic GB/s "
          "(config) | best / cuBLAS | max err |")
    print("|---|---|---|---|---|---|---|")
    for label, n, k, gb_b, gb_g, name, gb_f, fname, err in rows:
        print(f"| {label} | {n} x {k} | {gb_b:.0f} | {gb_g:.0f} ({name}) | {gb_f:.0f} "
              f"({fname}) | {gb_g / gb_b:.2f} | {err:.2g} |")
    # the decode A/B after the table (printed first: it survives a timeout of what follows)
    ab = None if a.no_decode else decode_ab(a, torch.bfloat16)
    if ab:
        print(f"\ndecode step {a.layers}x{a.hidden} bf16 (device ms/token, 20 steps back to "
              f"back, 3 interleaved rounds): max logit diff GEMV vs cuBLAS "
              f"{ab['max_logit_diff']:.3g}")
        for tag in ("gemv", "blas"):
            r = ab[tag]
            print(f"| {tag} | {min(r['ms']):.3f} ms ({', '.join(f'{x:.3f}' for x in r['ms'])}) "
                  f"| {r['kernels']} kernels ({r['gemv']} GEMVs) |")


if __name__ == "__main__":
    main()
