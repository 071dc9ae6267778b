"""Low-precision CPU GEMMs (issue 14 item 2, issue 17 item 4): kiln's quantised / bf16 weight
kernels (kiln_qgemm.h) against kiln's fp32 GEMM and eager, at LLM shapes.

1. GEMV (M = 1) and small-M GEMM (M = 8) for (K, N) in (2048, 2048), (2048, 5632),
   (5632, 2048): a bias-free Linear compiled per weight format: fp32 (kiln default), bf16
   (bf16 model, Options.cpu_bf16_gemm: vdpbf16ps), bf16 widened (cpu_bf16_gemm=False),
   int8 (weight-only), int8_vnni (activations quantised per row, vpdpbusd), int4 (group 128),
   int4_vnni (int4 weights, activations quantised per row, vpdpbusd per group);
   eager F.linear fp32 as the peer. Median time per call (interleaved rounds), GB/s of weight
   bytes streamed (values + scales), and that over the copy bandwidth measured in the same run
   (a 256 MiB torch copy, read + write bytes per second, as bench/gemm_cpu.py).
2. A Llama-shaped decoder (kiln/models/tp.py) decoding one token (tokens [1, 1]; no KV cache:
   every weight streamed once per token): tokens/s in fp32 / int8 / int8_vnni / int4 / bf16
   and eager fp32, with the weight bytes per token and the roofline tokens/s (copy bandwidth /
   bytes).
3. (--accuracy) kiln.models.quant_report's KL divergence of next-token distributions.

    PYTHONPATH=$PWD .venv/bin/python bench/quant_cpu.py [--rounds 5] [--threads 2]
        [--markdown BENCHMARKS.md] [--accuracy] [--skip-gemv] [--skip-llama] [--no-eager]
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.export import Dim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from bench.gemm_cpu import _bench, copy_bandwidth  # noqa: E402
from kiln.models.quant_report import default_modes, kl_report, small_llama, token_stream  # noqa: E402
from kiln.models.tp import LlamaConfig, random_llama  # noqa: E402

SHAPES = ((2048, 2048), (2048, 5632), (5632, 2048))  # (K, N)
ROWS = (1, 8)
GROUP = 128


def formats(threads: int) -> dict[str, tuple[kiln.Options, torch.dtype]]:
    base = kiln.Options(num_threads=threads)
    return {
        "fp32": (base, torch.float32),
        "bf16": (base, torch.bfloat16),
        "bf16 widened": (replace(base, cpu_bf16_gemm=False), torch.bfloat16),
        "int8": (replace(base, weight_quant="int8"), torch.float32),
        "int8_vnni": (replace(base, weight_quant="int8", weight_quant_kernel="vnni"),
                      torch.float32),
        "int4": (replace(base, weight_quant="int4", weight_quant_group=GROUP), torch.float32),
        "int4_vnni": (replace(base, weight_quant="int4", weight_quant_group=GROUP,
                              weight_quant_kernel="vnni"), torch.float32),
    }


def weight_bytes(fmt: str, k: int, n: int) -> int:
    if fmt == "fp32":
        return 4 * k * n
    if fmt.startswith("bf16"):
        return 2 * k * n
    if fmt.startswith("int8"):
        return k * n + 4 * n
    return k * n // 2 + 4 * n * (-(-k // GROUP))


def gemv_table(rounds: int, threads: int, bw: float, work: Path, eager: bool = True
               ) -> list[str]:
    rows = ["| K x N | M | format | ms | weight GB/s | / copy bw | vs fp32 |",
            "|---|---|---|---|---|---|---|"]
    for k, n in SHAPES:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False).eval()
        runners = {}
        for fmt, (opts, dt) in formats(threads).items():
            mod = copy.deepcopy(lin).to(dt)
            x = torch.randn(8, k).to(dt)
            cm = kiln.compile(mod, (x,), dynamic_shapes=({0: Dim("m", min=1, max=64)},),
                              options=opts)
            runners[fmt] = (cm.load(work / f"{fmt.replace(' ', '_')}_{k}_{n}.kiln"), dt)
        torch.set_num_threads(threads)
        for m in ROWS:
            xs = {dt: torch.randn(m, k).to(dt) for dt in (torch.float32, torch.bfloat16)}
            fns = {fmt: (lambda r=r, x=xs[dt]: r(x)) for fmt, (r, dt) in runners.items()}
            w = lin.weight.detach()
            if eager:
                fns["eager fp32"] = lambda x=xs[torch.float32], w=w: F.linear(x, w)
            t = _bench(fns, rounds)
            for fmt, sec in t.items():
                b = weight_bytes(fmt.removeprefix("eager "), k, n)
                gbs = b / sec / 1e9
                rows.append(f"| {k} x {n} | {m} | {fmt} | {sec * 1e3:.3f} | {gbs:.1f} | "
                            f"{gbs / bw:.2f} | {t['fp32'] / sec:.2f}x |")
            print("\n".join(rows[-len(t):]), flush=True)
    return rows


LLAMA = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8)


def llama_table(rounds: int, threads: int, bw: float, work: Path, eager: bool = True
                ) -> list[str]:
    cfg = LLAMA
    tok = torch.randint(0, cfg.vocab_size, (1, 1), generator=torch.Generator().manual_seed(0))
    base = kiln.Options(num_threads=threads)
    modes = {"fp32": (base, torch.float32), "bf16": (base, torch.bfloat16),
             **{k: (v, torch.float32) for k, v in default_modes(GROUP, base).items()}}
    fns, nbytes = {}, {}
    torch.set_num_threads(threads)
    for name, (opts, dt) in modes.items():
        model = random_llama(cfg, dtype=dt)
        cm = kiln.compile(model, (tok,), options=opts)
        r = cm.load(work / f"llama_{name}.kiln")
        fns[name] = lambda r=r: r(tok)
        nbytes[name] = sum(w["nbytes"] for w in cm.manifest["weights"]
                           if "embed_tokens" not in w["fqn"])
        if name == "fp32" and eager:
            eager_model = model
            fns["eager fp32"] = lambda: eager_model(tok)
            nbytes["eager fp32"] = nbytes["fp32"]
    with torch.no_grad():
        t = _bench(fns, rounds, 0.3)
    rows = [f"Llama-shaped decoder (kiln/models/tp.py): hidden {cfg.hidden_size}, "
            f"intermediate {cfg.intermediate_size}, {cfg.num_hidden_layers} layers, "
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, vocab "
            f"{cfg.vocab_size}; one token (tokens [1, 1]), {threads} threads", "",
            "| format | ms/token | tokens/s | weight MB/token | roofline tokens/s | "
            "of roofline | vs kiln fp32 |", "|---|---|---|---|---|---|---|"]
    for name, sec in t.items():
        mb = nbytes[name] / 1e6
        roof = bw * 1e3 / mb
        rows.append(f"| {name} | {sec * 1e3:.2f} | {1 / sec:.1f} | {mb:.0f} | {roof:.1f} | "
                    f"{(1 / sec) / roof:.2f} | {t['fp32'] / sec:.2f}x |")
    print("\n".join(rows), flush=True)
    return rows


def accuracy_table() -> list[str]:
    model = small_llama()
    seq, windows = 32, 4
    tokens = token_stream(model.cfg.vocab_size, seq * windows)
    rep = kl_report(model, tokens, seq, default_modes(GROUP))
    c = model.cfg
    rows = [f"Accuracy (kiln.models.quant_report): random-weight Llama (hidden {c.hidden_size}, "
            f"{c.num_hidden_layers} layers, vocab {c.vocab_size}), {seq * windows} positions "
            f"in windows of {seq}; KL(P_fp32 || P_quant) of next-token distributions, nats",
            "", "| format | KL mean | KL max | top-1 agree | max abs logit diff |",
            "|---|---|---|---|---|"]
    for name, s in rep.items():
        rows.append(f"| {name} | {s['kl_mean']:.2e} | {s['kl_max']:.2e} | "
                    f"{s['top1_agree']:.3f} | {s['max_abs_logit_diff']:.3f} |")
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--skip-gemv", action="store_true")
    ap.add_argument("--skip-llama", action="store_true")
    # torch's own OpenMP pool (eager) spins between calls and competes with kiln's threads
    # when both run interleaved at 2+ threads on a 2-core machine: --no-eager times kiln alone
    ap.add_argument("--no-eager", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    bw = copy_bandwidth(a.threads)
    head = [f"`uptime` at start: {load}", "",
            f"copy bandwidth (256 MiB, read + write, {a.threads} threads): {bw:.1f} GB/s", ""]
    print("\n".join(head), flush=True)
    body = list(head)
    if not a.skip_gemv:
        body += gemv_table(a.rounds, a.threads, bw, work, not a.no_eager) + [""]
    if not a.skip_llama:
        body += llama_table(a.rounds, a.threads, bw, work, not a.no_eager) + [""]
    if a.accuracy:
        body += accuracy_table() + [""]
    end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    body.append(f"`uptime` at end: {end}")
    print("\n".join(body))
    if a.markdown:
        from bench.markdown import splice
        splice(a.markdown, "<!-- quant-cpu:begin -->", "<!-- quant-cpu:end -->", "\n".join(body),
               "## CPU quantised and bf16 weight GEMMs (bench/quant_cpu.py)")


if __name__ == "__main__":
    main()
