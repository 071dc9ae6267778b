"""Decode speed of a Llama-shaped decoder on the GPU (issue 17): one token per call through
Hugging Face's static-cache module (`TorchExportableModuleForDecoderOnlyLM`, exported on the GPU
in the model's dtype, so bf16 attention is `_scaled_dot_product_cudnn_attention`), for kiln's
package (CUDA graphs, the default), eager and `torch.compile(mode="reduce-overhead")` on the same
module, against the roofline: weight bytes / the device-to-device copy bandwidth measured in the
same run (bytes read + written per second, as the issue states it).

Per token: the median of synchronised calls (each call ends with a device synchronise, as a
greedy loop that reads the token back must) and the device time per call with 20 calls
enqueued back to back (CUDA events). Also whether kiln's greedy tokens equal eager's.

    python bench/llm_gpu.py [--layers 16] [--hidden 2048] [--inter 5632] [--heads 32]
                            [--kv-heads 4] [--vocab 32000] [--cache 256] [--dtype bf16]
                            [--repeat 50] [--no-compile] [--max-autotune]

--max-autotune also compiles the module with `Options(max_autotune=True)` (every GEMM timed
against the Triton template's skinny configs, CUTLASS and cuBLASLt, the template fusing its
epilogue) and times that package in the same run (row `kiln max-autotune`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.cuda_timing import stream_ms, sync_ms  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def copy_gbs() -> float:
    """The device-to-device copy bandwidth (bytes read + written per second, in GB/s) of a
    1 GiB copy: the roofline's denominator (also bench/gen_gpu.py's)."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = stream_ms(lambda: dst.copy_(src), 10, 10)
    return 2 * src.numel() * 4 / ms / 1e6


def add_model_args(p: argparse.ArgumentParser, cache: int) -> None:
    """The Llama-shaped decoder's options (also bench/gen_gpu.py's); `cache`: the default
    static-cache length."""
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--cache", type=int, default=cache)
    p.add_argument("--dtype", default="bf16")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.parameters())


def main() -> None:
    import kiln
    from kiln.models.llm import eager_step, greedy, llama, static_cache_module

    p = argparse.ArgumentParser()
    add_model_args(p, cache=256)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--max-autotune", action="store_true")
    p.add_argument("--pdl-ab", action="store_true",
                   help="also time a package built with Options(cuda_pdl=False), interleaved")
    a = p.parse_args()
    dt = DT[a.dtype]
    rows: dict[str, float | str] = {}
    model = llama(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                  vocab=a.vocab, inter=a.inter, init=0.02, device="cuda")
    w, ep = static_cache_module(model, a.cache, device="cuda", dtype=dt)
    wbytes = weight_bytes(model)
    bw = copy_gbs()
    rows["roofline_ms"] = wbytes / bw / 1e6
    ids = torch.tensor([[11]], device="cuda")
    pos = torch.tensor([a.cache // 2], device="cuda")  # half the cache filled
    attn = sorted({str(n.target) for n in ep.run_decompositions().graph.nodes
                   if "attention" in str(n.target)})
    print(f"model: {a.layers} layers x {a.hidden}, {wbytes / 2**30:.2f} GiB of {a.dtype} "
          f"weights; copy bandwidth {bw:.0f} GB/s; attention ops {attn}", flush=True)

    t0 = time.perf_counter()
    cm = kiln.compile(ep, device="cuda")
    rows["kiln_compile_s"] = time.perf_counter() - t0
    runner = cm.load(Path(tempfile.mkdtemp()) / "llm.kiln", device="cuda:0")
    kstep = lambda: runner(input_ids=ids, cache_position=pos)  # noqa: E731
    rows["kiln_ms"] = sync_ms(kstep, a.repeat)
    rows["kiln_stream_ms"] = stream_ms(kstep, 20, 10)
    kinds: dict[str, int] = {}
    for k in cm.manifest["kernels"]:
        kinds[k["kind"]] = kinds.get(k["kind"], 0) + 1
    print(f"kiln: {rows['kiln_ms']:.3f} ms/token (compile {rows['kiln_compile_s']:.0f} s; "
          f"{cm.report['kernels']} kernels, {cm.report['extern_calls']} GEMMs; "
          f"{len(cm.manifest['kernels'])} launches/token by kind {kinds}; "
          f"{100 * rows['roofline_ms'] / rows['kiln_ms']:.0f}% of the roofline)", flush=True)

    if a.pdl_ab:  # the same package without programmatic dependent launch, interleaved
        cm_np = kiln.compile(ep, device="cuda", options=kiln.Options(cuda_pdl=False))
        r_np = cm_np.load(Path(tempfile.mkdtemp()) / "llm_np.kiln", device="cuda:0")
        np_step = lambda: r_np(input_ids=ids, cache_position=pos)  # noqa: E731
        ab = {"pdl": [], "no_pdl": []}
        for _ in range(5):
            ab["pdl"].append(stream_ms(kstep, 20, 5))
            ab["no_pdl"].append(stream_ms(np_step, 20, 5))
        med = {k: statistics.median(v) for k, v in ab.items()}
        rows["kiln_nopdl_stream_ms"] = med["no_pdl"]
        print(f"PDL A/B (back-to-back device ms/token, median of 5 interleaved): with "
              f"{med['pdl']:.3f}, without {med['no_pdl']:.3f} ({med['no_pdl'] / med['pdl']:.3f}x)",
              flush=True)

    if a.max_autotune:
        t0 = time.perf_counter()
        cm_at = kiln.compile(ep, device="cuda", options=kiln.Options(max_autotune=True))
        rows["kiln_at_compile_s"] = time.perf_counter() - t0
        r_at = cm_at.load(Path(tempfile.mkdtemp()) / "llm_at.kiln", device="cuda:0")
        at_step = lambda: r_at(input_ids=ids, cache_position=pos)  # noqa: E731
        rows["kiln_at_ms"] = sync_ms(at_step, a.repeat)
        rows["kiln_at_stream_ms"] = stream_ms(at_step, 20, 10)
        picked = {}
        for k in cm_at.manifest["kernels"]:
            g = k.get("gemm") if isinstance(k, dict) else None
            if isinstance(g, dict):
                picked[g.get("backend", "?")] = picked.get(g.get("backend", "?"), 0) + 1
        print(f"kiln max-autotune: {rows['kiln_at_ms']:.3f} ms/token (compile "
              f"{rows['kiln_at_compile_s']:.0f} s; {cm_at.report['kernels']} kernels; GEMM "
              f"backends {picked})", flush=True)

    step = eager_step(w)
    with torch.no_grad():
        rows["eager_ms"] = sync_ms(lambda: step(ids, pos), max(5, a.repeat // 5))
        prompt = [3, 17, 42, 5, 99]
        # both caches are written position by position from 0, and the mask hides the
        # positions after the current one, so what the timing runs left there is never read
        want = greedy(step, prompt, 16, "cuda")
        got = greedy(lambda i, c: runner(input_ids=i, cache_position=c), prompt, 16, "cuda")
        rows["tokens_equal"] = str(got == want)
        print(f"eager: {rows['eager_ms']:.3f} ms/token; greedy tokens equal: "
              f"{rows['tokens_equal']}", flush=True)
        if not a.no_compile:
            try:
                inner = getattr(w, "model", w)
                ro = torch.compile(inner, mode="reduce-overhead", fullgraph=False)
                t0 = time.perf_counter()
                for _ in range(3):
                    ro(input_ids=ids, cache_position=pos)
                torch.cuda.synchronize()
                rows["ro_compile_s"] = time.perf_counter() - t0
                rstep = lambda: ro(input_ids=ids, cache_position=pos)  # noqa: E731
                rows["ro_ms"] = sync_ms(rstep, a.repeat)
                rows["ro_stream_ms"] = stream_ms(rstep, 20, 10)
            except Exception as e:  # report and go on
                rows["ro_error"] = f"{type(e).__name__}: {e}"[:200]
    rows["kiln_ms_again"] = sync_ms(kstep, a.repeat)  # interleaved: a second kiln pass

    def f(k):
        v = rows.get(k)
        return f"{v:.3f}" if isinstance(v, float) else (v or "-")

    print(f"\nGPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; ms per token "
          "(synchronised median; back-to-back device time in brackets)\n")
    print("| model | kiln | kiln again | eager | reduce-overhead | roofline | kiln / roofline | "
          "ro / kiln | tokens = eager | kiln compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    kiln_best = min(rows["kiln_ms"], rows["kiln_ms_again"])
    ro = rows.get("ro_ms")
    print(f"| llama {a.layers}x{a.hidden} {a.dtype} cache {a.cache} | {f('kiln_ms')} "
          f"({f('kiln_stream_ms')}) | {f('kiln_ms_again')} | {f('eager_ms')} | {f('ro_ms')} "
          f"({f('ro_stream_ms')}) | {f('roofline_ms')} | "
          f"{kiln_best / rows['roofline_ms']:.2f} | "
          f"{format(ro / kiln_best, '.2f') if isinstance(ro, float) else '-'} | "
          f"{rows['tokens_equal']} | "
          f"{rows['kiln_compile_s']:.0f} |")
    if "kiln_at_ms" in rows:
        print(f"| kiln max-autotune | {f('kiln_at_ms')} ({f('kiln_at_stream_ms')}) | "
              f"roofline / it {rows['roofline_ms'] / rows['kiln_at_ms']:.2f} | compile "
              f"{rows['kiln_at_compile_s']:.0f} s |")
    if "ro_error" in rows:
        print("reduce-overhead:", rows["ro_error"])


if __name__ == "__main__":
    main()
