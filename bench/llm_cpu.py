"""Decode one token of a Llama-shaped decoder on the CPU (issue 17 item 3): kiln against eager
and torch.compile, and the memory roofline, at 2 threads.

The model is built from a config with random weights (no downloads; tests/e2e/hf_decoders.py),
wrapped in transformers' static-cache module (`TorchExportableModuleWithStaticCache`, batch 1,
`--cache` positions) and exported for one decode step (input_ids [1, 1], cache_position [1]).
Every call decodes at position `--pos` (the same slot is rewritten, so each call does the
same work: the mask hides the positions after it).

  kiln           kiln.compile(ep, Options(num_threads=T)), run through kiln.load(num_threads=T)
  eager          the static-cache module, torch.no_grad(), torch.set_num_threads(T)
  torch.compile  torch.compile(module) (default mode) on the same module; its error when it
                 does not compile on this machine

Roofline: parameter bytes (every weight, as in issue 17) / copy bandwidth, the bandwidth
measured in the same run (torch copy of a 256 MiB buffer with T threads, read + write bytes
per second, best of 5, every round). % of roofline = roofline ms / measured ms.

Timing: `--rounds` rounds, each timing every system in turn (order rotated per round) for
`--calls` calls after 2 warm-up calls; a round's figure is its median call, the reported one the
median over rounds. `uptime` load is sampled every round.

    python bench/llm_cpu.py [--size 8x1024|1b] [--dtypes fp32,bf16] [--threads 1,2]
        [--rounds 5] [--calls 10] [--markdown BENCHMARKS.md] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import torch  # noqa: E402

import kiln  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from bench.markdown import splice  # noqa: E402
import hf_decoders as H  # noqa: E402

SIZES = {  # Llama-shaped decoders: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "8x1024": dict(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816,
                   vocab=32000),
    "1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_avg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def copy_gbs(threads: int) -> float:
    """Copy bandwidth in GB/s (bytes read + bytes written per second), best of 5."""
    torch.set_num_threads(threads)
    a = torch.ones(256 * 2**20, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() / best / 1e9


def time_calls(fn, calls: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def build(size: str, dt: str, cache: int, threads: int, work: Path) -> dict:
    """The model, its package (compiled for `threads`) and one call per system."""
    model = H.build_model("llama", DTYPES[dt], **SIZES[size], max_pos=max(2048, cache))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    module = H.static_module(model, cache)
    ep = H.export_decode(module)
    systems = {}
    t = time.perf_counter()
    pkg = work / f"llm_{size}_{dt}.kiln"
    kiln.compile(ep, options=kiln.Options(num_threads=threads)).save(pkg)
    compile_s = {"kiln": time.perf_counter() - t}
    runner = kiln.load(pkg, num_threads=threads)
    ids, pos = torch.tensor([[5]]), torch.tensor([0])
    systems["kiln"] = lambda: runner(input_ids=ids, cache_position=pos)

    def eager():
        with torch.no_grad():
            return module(input_ids=ids, cache_position=pos)
    systems["eager"] = eager
    errors = {}
    try:
        t = time.perf_counter()
        compiled = torch.compile(module)
        with torch.no_grad():
            compiled(input_ids=ids, cache_position=pos)
        compile_s["torch.compile"] = time.perf_counter() - t

        def tc():
            with torch.no_grad():
                return compiled(input_ids=ids, cache_position=pos)
        systems["torch.compile"] = tc
    except Exception as e:  # noqa: BLE001 - reported in the table
        errors["torch.compile"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return {"systems": systems, "nbytes": nbytes, "compile_s": compile_s, "errors": errors,
            "pos": pos, "module": module, "runner": runner, "pkg": pkg, "ids": ids}


def check(b: dict, pos: int) -> float:
    """Max |kiln - eager| of the logits at `pos` after the same prompt (both from zeros)."""
    H.reset_caches(b["module"])
    outs = []
    for step in (b["systems"]["eager"], b["systems"]["kiln"]):
        for p in range(pos + 1):
            b["pos"].fill_(p)
            out = step()
        outs.append(out.float())
    return (outs[0] - outs[1]).abs().max().item()


def run(args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in str(args.threads).split(",")]
    results = {"size": args.size, "config": SIZES[args.size], "cache": args.cache,
               "pos": args.pos, "cpu": cpu_name(), "rows": []}
    for dt in args.dtypes.split(","):
        b = build(args.size, dt, args.cache, max(threads), work)
        torch.set_num_threads(max(threads))
        diff = check(b, min(args.pos, 8))
        b["pos"].fill_(args.pos)
        for nt in threads:
            runner = kiln.load(b["pkg"], num_threads=nt)
            b["systems"]["kiln"] = lambda r=runner: r(input_ids=b["ids"],
                                                      cache_position=b["pos"])
            names = list(b["systems"])
            times = {n: [] for n in names}
            bws, loads = [], []
            for r in range(args.rounds):
                bws.append(copy_gbs(nt))
                loads.append(load_avg())
                order = names[r % len(names):] + names[:r % len(names)]
                for n in order:
                    torch.set_num_threads(nt)
                    times[n].append(time_calls(b["systems"][n], args.calls))
            runner.close()
            bw = statistics.median(bws)
            roof_ms = b["nbytes"] / (bw * 1e9) * 1e3
            row = {"dtype": dt, "threads": nt, "weight_bytes": b["nbytes"], "copy_gbs": bw,
                   "roofline_ms": roof_ms, "kiln_vs_eager_max_abs_logit_diff": diff,
                   "loads": loads, "compile_s": b["compile_s"], "errors": b["errors"],
                   "ms": {}}
            for n in names:
                ms = statistics.median(times[n]) * 1e3
                row["ms"][n] = {"median": ms, "rounds": [t * 1e3 for t in times[n]],
                                "pct_roofline": 100 * roof_ms / ms}
            results["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "loads"}, default=str),
                  flush=True)
        b["runner"].close()
    return results


def markdown(res: dict, command: str) -> str:
    c = res["config"]
    lines = [f"Llama-shaped decoder `{res['size']}` (hidden {c['hidden']}, {c['layers']} layers, "
             f"{c['heads']} heads / {c['kv_heads']} KV heads, MLP {c['intermediate']}, vocab "
             f"{c['vocab']}), HF static cache of {res['cache']} positions, one token decoded at "
             f"position {res['pos']}, {res['cpu']}. "
             f"Command: `{command}`.", "",
             "| dtype | threads | weights | copy GB/s | roofline ms | kiln ms | eager ms "
             "| torch.compile ms "
             "| kiln % roofline | eager % | kiln / eager | load (1/5/15 min) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        ms = r["ms"]
        tc = (f"{ms['torch.compile']['median']:.1f}" if "torch.compile" in ms
              else r["errors"].get("torch.compile", "-").replace("|", "/"))
        lines.append(
            f"| {r['dtype']} | {r['threads']} | {r['weight_bytes'] / 2**20:.0f} MiB "
            f"| {r['copy_gbs']:.1f} | "
            f"{r['roofline_ms']:.1f} | {ms['kiln']['median']:.1f} | {ms['eager']['median']:.1f} "
            f"| {tc} | {ms['kiln']['pct_roofline']:.0f}% | {ms['eager']['pct_roofline']:.0f}% | "
            f"{ms['eager']['median'] / ms['kiln']['median']:.2f}x | "
            f"{r['loads'][0]} ... {r['loads'][-1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8x1024", choices=sorted(SIZES))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", default="2", help="thread counts, comma-separated")
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--work", default="/tmp/kiln-llm-cpu")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if args.markdown:
        command = "python bench/llm_cpu.py " + " ".join(sys.argv[1:])
        splice(args.markdown, "<!-- llm-cpu:begin -->", "<!-- llm-cpu:end -->",
               markdown(res, command),
               heading="## CPU LLM decode: kiln against eager and torch.compile (issue 17)")


if __name__ == "__main__":
    main()
