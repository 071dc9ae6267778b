"""Token generation on the GPU (issue 17): a Llama-shaped decoder compiled as one CUDA package of
three entry points (prefill, decode, sample: kiln/models/hf_decoder.py with the device sampler),
generated with `kiln.runtime.generate` (the loop of `kiln generate --device cuda`): decode
ms/token and tokens/s with sampling on the device (no host synchronisation per step) and on
the host (kiln_sample, one logits copy per step), greedy and sampled; whether greedy tokens
equal eager's; the roofline (weight bytes / copy bandwidth measured in the same run).
`--weight-quant int8,int4` adds packages with weight-only quantised GEMMs (where the CUDA
target supports them; a refusal is reported, not fatal): decode GEMVs of kiln's template
reading the quantised weights (norm / silu*mul prologues, residual epilogues fused);
`int8-calls` / `int4-calls` are the same without the Triton GEMM backend, so every quantised
GEMM is a call of quant_gemv.py's kernels (the path before the GEMV template took them; no
fusions); `int4-tc` is int4 with Options(cuda_int4_tensor_core=True) (bf16, groups >= 128):
the tensor-core weight order, each decode GEMV the tensor-core kernel or the CUDA-core loop,
as the tuner picks.
The last column is each package's decode speed over the unquantised one's ("none",
device greedy) in the same run.

Random weights (std 0.02) at the given shapes, no downloads. Each generation runs twice and
the second is reported (the first captures the CUDA graphs).

    python bench/gen_gpu.py [--layers 16] [--hidden 2048] [--inter 5632] [--heads 32]
        [--kv-heads 4] [--vocab 32000] [--cache 512] [--new 128] [--dtype bf16]
        [--weight-quant none,int8,int4,int8-calls,int4-calls,int4-tc] [--group 128]
        [--json out.json] [--c-exe path/to/generate] [--autotune 1] [--prefill-len 512]

--prefill-len N (N <= --cache - --new) also times the prefill of an N-token prompt (the package's
prefill entry point exported for prompts up to N; median of 3 after one warm-up) and eager's
forward over the same N tokens: prefill tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.cuda_timing import sync_ms  # noqa: E402
from bench.llm_gpu import DT, add_model_args, copy_gbs, weight_bytes  # noqa: E402

PROMPT = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203]


def main() -> None:
    import kiln
    from kiln.models import device_sampler, hf_decoder

    p = argparse.ArgumentParser()
    add_model_args(p, cache=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--weight-quant", default="none")
    p.add_argument("--group", type=int, default=128, help="Options.weight_quant_group (int4)")
    p.add_argument("--json", default=None)
    p.add_argument("--c-exe", default=None, help="examples/c/generate built: run it too")
    p.add_argument("--prefill-len", type=int, default=0,
                   help="also time a prompt of this many tokens (prefill tokens/s)")
    p.add_argument("--autotune", type=int, default=1,
                   help="Options.autotune (GEMM backends, quantised kernels' configs)")
    a = p.parse_args()
    dt = DT[a.dtype]
    t0 = time.perf_counter()
    model = hf_decoder.build("llama", 0, dt, init=0.02, layers=a.layers, hidden=a.hidden,
                             heads=a.heads, kv_heads=a.kv_heads, intermediate=a.inter,
                             vocab=a.vocab, max_pos=max(2048, a.cache))
    wbytes = weight_bytes(model)
    progs = hf_decoder.export_decoder(model, max_cache_len=a.cache,
                                      max_prompt=max(64, a.prefill_len),
                                      sampler=device_sampler.export_sampler)
    export_s = time.perf_counter() - t0
    bw = copy_gbs()
    print(f"model: llama {a.layers}x{a.hidden} {a.dtype}, {wbytes / 2**30:.2f} GiB of "
          f"weights; copy bandwidth {bw:.0f} GB/s; roofline {wbytes / bw / 1e6:.3f} "
          f"ms/token; built and exported in {export_s:.0f} s", flush=True)
    want = hf_decoder.eager_generate(model.to("cuda"), PROMPT, 32, max_cache_len=a.cache)
    long_prompt = [(7 * i + 3) % a.vocab for i in range(a.prefill_len)]
    eager_prefill_ms = None
    if a.prefill_len:  # eager's forward over the whole prompt (no cache: the same GEMMs)
        ids = torch.tensor([long_prompt], device="cuda")
        with torch.no_grad():
            eager_prefill_ms = sync_ms(lambda: model(input_ids=ids, use_cache=False), 5)
        print(f"eager prefill of {a.prefill_len} tokens: {eager_prefill_ms:.2f} ms "
              f"({a.prefill_len / eager_prefill_ms * 1e3:.0f} tokens/s)", flush=True)
    model.to("cpu")
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for wq in a.weight_quant.split(","):
        row = {"weights": wq}
        rows.append(row)
        mode = wq.removesuffix("-calls").removesuffix("-tc")
        # int4-tc: bf16 int4 weights in the tensor-core order, the decode GEMVs the tensor-core
        # kernel or the CUDA-core loop as the tuner picks (quant_gemv.py `tc_packed`)
        opts = kiln.Options(autotune=bool(a.autotune), weight_quant=mode,
                            weight_quant_group=a.group,
                            cuda_int4_tensor_core=wq.endswith("-tc"))
        if wq.endswith("-calls"):  # no Triton GEMMs: quant_gemv.py's kernel calls at M = 1
            opts = dataclasses.replace(opts, gemm_backends=tuple(
                b for b in opts.gemm_backends if b != "triton"))
        t0 = time.perf_counter()
        try:
            pkg = kiln.compile(progs, device="cuda", options=opts)
            path = pkg.save(tmp / f"{wq}.kiln")
        except Exception as e:  # noqa: BLE001 - reported in the table
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"{wq}: compile failed: {row['error']}", flush=True)
            continue
        row["compile_s"] = time.perf_counter() - t0
        row["package_mib"] = path.stat().st_size / 2**20
        row["decode_kernels"] = len(pkg.entries["decode"].manifest["kernels"])
        r = kiln.load(path, device="cuda")
        prefills = []  # every generation's 12-token prefill (the first captures the graphs)
        for name, kw in [("device greedy", {}),
                         ("host greedy", dict(device_sampling=False)),
                         ("device sampled", dict(temperature=0.8, top_k=40, top_p=0.95,
                                                 seed=1))]:
            for _ in range(2):
                g = kiln.runtime.generate(r, PROMPT, a.new, **kw)
                prefills.append(g.prefill_seconds * 1e3)
            row[name] = g.decode_seconds / g.decode_steps * 1e3
            row[name + " tok/s"] = g.decode_tokens_per_s
            if name == "device greedy":
                row["tokens = eager (32)"] = g.tokens[:32] == want
        # one reading varied by 2x between runs (6.9 / 14.5 ms at 16 layers): the median of
        # the second generations of each sampling mode, and all readings
        row["prefill_ms"] = statistics.median(prefills[1::2])
        row["prefill_readings_ms"] = [round(p, 2) for p in prefills]
        row["roofline_ms"] = wbytes / bw / 1e6 if wq == "none" else None
        if a.prefill_len:
            s = statistics.median([kiln.runtime.generate(r, long_prompt, 1).prefill_seconds
                                   for _ in range(4)][1:])
            row["prefill_long_ms"] = s * 1e3
            row["prefill tok/s"] = a.prefill_len / s
            row["eager prefill tok/s"] = a.prefill_len / eager_prefill_ms * 1e3
        r.close()
        if a.c_exe:
            c = subprocess.run([a.c_exe, "-n", str(a.new), "-d", "cuda", str(path),
                                ",".join(map(str, PROMPT))], capture_output=True, text=True,
                               timeout=300)
            row["c"] = (c.stdout.strip().splitlines() or [c.stderr.strip()])[-1]
        print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"model": vars(a), "rows": rows}, indent=1))
    print(f"\nGPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; decode ms/token "
          f"(tokens/s) over {a.new} new tokens, the second generation of two\n")
    print("| weights | device greedy | host greedy | device sampled | prefill ms | "
          "tokens = eager | roofline ms | compile s | decode kernels | speed / none |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = next((r["device greedy"] for r in rows if r["weights"] == "none" and
                 "error" not in r), None)
    for row in rows:
        if "error" in row:
            print(f"| {row['weights']} | {row['error'][:120]} | | | | | | | | |")
            continue
        speed = f"{base / row['device greedy']:.2f}x" if base else "-"

        def f(k):
            return f"{row[k]:.3f} ({row[k + ' tok/s']:.0f})"
        roof = f"{row['roofline_ms']:.3f}" if row["roofline_ms"] else "-"
        print(f"| {row['weights']} | {f('device greedy')} | {f('host greedy')} | "
              f"{f('device sampled')} | {row['prefill_ms']:.2f} | "
              f"{row['tokens = eager (32)']} | {roof} | {row['compile_s']:.0f} | "
              f"{row['decode_kernels']} | {speed} |")
    for row in rows:
        if "prefill tok/s" in row:
            print(f"prefill of {a.prefill_len} tokens ({row['weights']}): "
                  f"{row['prefill_long_ms']:.2f} ms, {row['prefill tok/s']:.0f} tokens/s; "
                  f"eager {row['eager prefill tok/s']:.0f} tokens/s")
    for row in rows:
        if "c" in row:
            print(f"C generate ({row['weights']}): {row['c']}")


if __name__ == "__main__":
    main()
