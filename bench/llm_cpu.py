"""Decode one token of a Llama-shaped decoder on the CPU (issue 17 items 3 and 4, issue 14
item 2): kiln in every weight format against eager and torch.compile, and the memory roofline.

The model is built from a config with random weights (no downloads; tests/e2e/hf_decoders.py),
wrapped in transformers' static-cache module (`TorchExportableModuleWithStaticCache`, batch 1,
`--cache` positions) and exported for one decode step (input_ids [1, 1], cache_position [1]).
Every call decodes at position `--pos` (the same slot is rewritten, so each call does the
same work: the mask hides the positions after it).

Formats (`--dtypes`, FORMATS): fp32, bf16 (fp16) models; int8 / int4 are the fp32 model with
`Options(weight_quant=...)` (weight-only: fp32 activations times dequantised weights), and
int8_vnni / int4_vnni with `weight_quant_kernel="vnni"` (each activation row quantised to int8
too, integer products).

  kiln           kiln.compile(ep, Options(num_threads=T, ...)), run through kiln.load
  eager          the static-cache module, torch.no_grad(), torch.set_num_threads(T) (float
                 formats; a quantised format's logits are compared with its fp32 model's)
  torch.compile  torch.compile(module) (default mode) on the same module; its error when it
                 does not compile on this machine

Roofline: the bytes a decode step streams (the package's stored weights, quantised where they
are, but the embedding table, of which one row is read) / read bandwidth (torch.sum over a
256 MiB float32 buffer with T threads, best of 5, every round; the copy bandwidth, read +
write, is recorded beside it). % of roofline = roofline ms / measured ms.

Timing: all packages are built first; then `--rounds` rounds, each timing every (format,
system) in turn (order rotated per round) for `--calls` calls after 2 warm-up calls; a round's
figure is its median call, the reported one the median over rounds. `uptime` load is sampled
every round. "speed vs kiln bf16" = kiln bf16 ms / this row's kiln ms, same run.

`--profile N` then profiles N kiln calls of each format per step (the package's own hooks,
kiln.runtime.profiling): each step's lowest time over the calls (a step's median on a shared
machine includes the time it was descheduled), summed by group (GEMMs, attention, other),
and the slowest steps, with GB/s of the GEMMs' stored weights (parsed from the wrapper).

    python bench/llm_cpu.py [--size 8x1024|1b] [--dtypes fp32,bf16,int8,int4] [--threads 1,2]
        [--rounds 5] [--calls 10] [--profile 20] [--markdown BENCHMARKS.md] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import struct
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import torch  # noqa: E402

import kiln  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from bench.markdown import splice  # noqa: E402
from kiln.runtime import profiling  # noqa: E402
import hf_decoders as H  # noqa: E402

SIZES = {  # Llama-shaped decoders: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "8x1024": dict(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816,
                   vocab=32000),
    "1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: weight formats: the model's dtype and the kiln Options that store its GEMM weights so
#: ("int8" / "int4": the fp32 model with weight-only quantisation; "_vnni": the kernels that
#: also quantise each activation row and multiply integers)
FORMATS = {"fp32": ("fp32", {}), "bf16": ("bf16", {}), "fp16": ("fp16", {}),
           "int8": ("fp32", dict(weight_quant="int8")),
           "int8_vnni": ("fp32", dict(weight_quant="int8", weight_quant_kernel="vnni")),
           "int4": ("fp32", dict(weight_quant="int4")),
           "int4_vnni": ("fp32", dict(weight_quant="int4", weight_quant_kernel="vnni"))}


def load_avg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def best_gbs(fn, nbytes: int, threads: int) -> float:
    torch.set_num_threads(threads)
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def copy_gbs(threads: int) -> float:
    """Copy bandwidth in GB/s (bytes read + bytes written per second), best of 5."""
    a = torch.ones(256 * 2**20, dtype=torch.uint8)
    b = torch.empty_like(a)
    return best_gbs(lambda: b.copy_(a), 2 * a.numel(), threads)


def read_gbs(threads: int) -> float:
    """Read bandwidth in GB/s: torch.sum of a 256 MiB float32 buffer, best of 5."""
    a = torch.ones(64 * 2**20, dtype=torch.float32)
    return best_gbs(lambda: a.sum(), a.nbytes, threads)


def time_calls(fn, calls: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def streamed_bytes(pkg: Path, skip: str = "embed_tokens") -> int:
    """Bytes of the package's stored weights a decode step reads: every stored tensor but the
    embedding table (`skip` in its name: one row of it is read)."""
    with zipfile.ZipFile(pkg) as z, z.open("weights.safetensors") as f:
        head = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items()
               if k != "__metadata__" and skip not in k)


def build(size: str, fmt: str, cache: int, threads: int, work: Path, models: dict) -> dict:
    """The model, its package (compiled for `threads`) and one call per system (eager and
    torch.compile for the float formats only)."""
    dt, opts = FORMATS[fmt]
    if dt not in models:
        model = H.build_model("llama", DTYPES[dt], **SIZES[size], max_pos=max(2048, cache))
        models[dt] = {"model": model, "module": H.static_module(model, cache)}
    m = models[dt]
    nbytes = sum(p.numel() * p.element_size() for p in m["model"].parameters())
    module = m["module"]
    ep = m.setdefault("ep", H.export_decode(module))
    systems = {}
    t = time.perf_counter()
    pkg = work / f"llm_{size}_{fmt}.kiln"
    kiln.compile(ep, options=kiln.Options(num_threads=threads, **opts)).save(pkg)
    compile_s = {"kiln": time.perf_counter() - t}
    runner = kiln.load(pkg, num_threads=threads)
    ids, pos = torch.tensor([[5]]), torch.tensor([0])
    systems["kiln"] = lambda: runner(input_ids=ids, cache_position=pos)
    errors = {}
    if not opts:
        def eager():
            with torch.no_grad():
                return module(input_ids=ids, cache_position=pos)
        systems["eager"] = eager
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
    return {"systems": systems, "nbytes": nbytes, "stream_bytes": streamed_bytes(pkg),
            "compile_s": compile_s, "errors": errors, "pos": pos, "module": module,
            "eager": lambda: module(input_ids=ids, cache_position=pos),
            "runner": runner, "pkg": pkg, "ids": ids}


def check(b: dict, pos: int) -> float:
    """Max |kiln - eager| of the logits at `pos` after the same prompt (both from zeros);
    eager is the model kiln compiled (fp32 for the quantised formats)."""
    H.reset_caches(b["module"])
    outs = []
    for step in (b["eager"], b["systems"]["kiln"]):
        for p in range(pos + 1):
            b["pos"].fill_(p)
            with torch.no_grad():
                out = step()
        outs.append(out.float())
    return (outs[0] - outs[1]).abs().max().item()


#: bytes a stored weight value takes, by kiln_qgemm.h mode (int4: two a byte; scales apart)
QGEMM_BYTES = {0: 1.0, 1: 0.5, 2: 1.0, 3: 2.0, 4: 0.5}
QGEMM_CALL = re.compile(r'kl::qgemm\(e, "(\w+)".*?/\*mode=\*/int64_t\((\d+)\), /\*k=\*/int64_t'
                        r'\((\d+)\), /\*n=\*/int64_t\((\d+)\), /\*group=\*/int64_t\((\d+)\)')


def qgemm_bytes(pkg: Path) -> dict[str, float]:
    """Weight bytes each qgemm step of the package streams (values, and the fp32 scales of
    int8 / int4), from its wrapper source."""
    with zipfile.ZipFile(pkg) as z:
        src = z.read("src/model.cpp").decode()
    out = {}
    for name, mode, k, n, group in QGEMM_CALL.findall(src):
        mode, k, n, group = int(mode), int(k), int(n), int(group)
        scales = 4 * n * (-(-k // group) if group else 1) if mode != 3 else 0
        out[name] = QGEMM_BYTES[mode] * k * n + scales
    return out


def profile(pkg: Path, call, runner, calls: int, stream_bytes: int, top: int = 6) -> dict:
    """Per-step times of one decode step (kiln.runtime.profiling, the package's own hooks):
    each step's lowest time over `calls` calls (closest to its cost undisturbed on a shared
    machine), by group (GEMMs: qgemm and float GEMM steps, their GB/s the streamed bytes over
    their time; attention; other) and the `top` steps, with the GB/s of each qgemm step's
    weights."""
    nbytes = qgemm_bytes(pkg)
    profiling.enable(runner)
    low: dict[str, float] = {}
    kind: dict[str, str] = {}
    for _ in range(calls):
        call()
        for st in profiling.steps(runner):
            low[st.name] = min(low.get(st.name, float("inf")), st.last_s)
            kind[st.name] = st.kind
    profiling.enable(runner, False)
    groups: dict[str, list[float]] = {}
    for n, t in low.items():
        g = ("gemm" if n in nbytes or kind[n].endswith("_gemm") else
             "attention" if kind[n] == "lib.attention" else "other")
        groups[g] = groups.get(g, 0.0) + t
    steps = sorted(low, key=lambda n: -low[n])[:top]
    return {"sum_ms": 1e3 * sum(low.values()),
            "groups": {g: {"ms": 1e3 * t, "gbs": stream_bytes / t / 1e9 if g == "gemm" else None}
                       for g, t in groups.items()},
            "top": [{"step": n, "kind": kind[n], "ms": 1e3 * low[n],
                     "gbs": nbytes[n] / low[n] / 1e9 if n in nbytes else None}
                    for n in steps]}


def run(args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in str(args.threads).split(",")]
    fmts = args.dtypes.split(",")
    results = {"size": args.size, "config": SIZES[args.size], "cache": args.cache,
               "pos": args.pos, "cpu": cpu_name(), "rows": []}
    models: dict = {}
    builds = {}
    for fmt in fmts:
        b = build(args.size, fmt, args.cache, max(threads), work, models)
        torch.set_num_threads(max(threads))
        b["diff"] = check(b, min(args.pos, 8))
        b["pos"].fill_(args.pos)
        builds[fmt] = b
        print(f"{fmt}: compiled in {b['compile_s']['kiln']:.0f} s, max |kiln - eager| "
              f"{b['diff']:.3g}", flush=True)
    for nt in threads:
        calls = {}
        for fmt, b in builds.items():
            b["runner"].close()
            b["runner"] = runner = kiln.load(b["pkg"], num_threads=nt)
            b["systems"]["kiln"] = lambda r=runner, b=b: r(input_ids=b["ids"],
                                                           cache_position=b["pos"])
            for n, fn in b["systems"].items():
                calls[(fmt, n)] = fn
        keys = list(calls)
        times = {k: [] for k in keys}
        cbws, rbws, loads = [], [], []
        for r in range(args.rounds):  # every (format, system) once a round, order rotated
            cbws.append(copy_gbs(nt))
            rbws.append(read_gbs(nt))
            loads.append(load_avg())
            s = (r * 3) % len(keys)
            for k in keys[s:] + keys[:s]:
                torch.set_num_threads(nt)
                times[k].append(time_calls(calls[k], args.calls))
        cbw, rbw = statistics.median(cbws), statistics.median(rbws)
        profiles = {}
        if args.profile:
            for fmt, b in builds.items():
                profiles[fmt] = profile(b["pkg"], calls[(fmt, "kiln")], b["runner"],
                                        args.profile, b["stream_bytes"])
        for fmt, b in builds.items():
            roof_ms = b["stream_bytes"] / (rbw * 1e9) * 1e3
            row = {"dtype": fmt, "threads": nt, "weight_bytes": b["nbytes"],
                   "stream_bytes": b["stream_bytes"], "copy_gbs": cbw, "read_gbs": rbw,
                   "roofline_ms": roof_ms, "kiln_vs_eager_max_abs_logit_diff": b["diff"],
                   "loads": loads, "compile_s": b["compile_s"], "errors": b["errors"],
                   "profile": profiles.get(fmt), "ms": {}}
            for n in b["systems"]:
                ms = statistics.median(times[(fmt, n)]) * 1e3
                row["ms"][n] = {"median": ms, "rounds": [t * 1e3 for t in times[(fmt, n)]],
                                "pct_roofline": 100 * roof_ms / ms}
            results["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "loads"}, default=str),
                  flush=True)
    for b in builds.values():
        b["runner"].close()
    return results


def markdown(res: dict, command: str) -> str:
    c = res["config"]
    lines = [f"Llama-shaped decoder `{res['size']}` (hidden {c['hidden']}, {c['layers']} layers, "
             f"{c['heads']} heads / {c['kv_heads']} KV heads, MLP {c['intermediate']}, vocab "
             f"{c['vocab']}), HF static cache of {res['cache']} positions, one token decoded at "
             f"position {res['pos']}, {res['cpu']}. "
             f"Command: `{command}`.", "",
             "| format | threads | params | streamed | read GB/s | roofline ms | kiln ms "
             "| eager ms | torch.compile ms | kiln % roofline | kiln / eager "
             "| kiln / torch.compile | speed vs kiln bf16 | max abs logit diff "
             "| load (1/5/15 min) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- |"]
    bf16 = {r["threads"]: r["ms"]["kiln"]["median"] for r in res["rows"] if r["dtype"] == "bf16"}
    for r in res["rows"]:
        ms = r["ms"]
        k = ms["kiln"]["median"]

        def peer(name):
            if name in ms:
                return f"{ms[name]['median']:.1f}", f"{ms[name]['median'] / k:.2f}x"
            return r["errors"].get(name, "-").replace("|", "/"), "-"
        eg, eg_x = peer("eager")
        tc, tc_x = peer("torch.compile")
        vs = f"{bf16[r['threads']] / k:.2f}x" if r["threads"] in bf16 else "-"
        lines.append(
            f"| {r['dtype']} | {r['threads']} | {r['weight_bytes'] / 2**20:.0f} MiB "
            f"| {r['stream_bytes'] / 2**20:.0f} MiB | {r['read_gbs']:.1f} "
            f"| {r['roofline_ms']:.1f} | {k:.1f} | {eg} | {tc} "
            f"| {ms['kiln']['pct_roofline']:.0f}% | {eg_x} | {tc_x} | {vs} "
            f"| {r['kiln_vs_eager_max_abs_logit_diff']:.2g} "
            f"| {r['loads'][0]} ... {r['loads'][-1]} |")
    profiled = [r for r in res["rows"] if r.get("profile")]
    if profiled:
        lines += ["", "Per-step profile of one kiln decode step (`--profile N`: each step's "
                  "lowest time over N profiled calls; GEMMs' GB/s: streamed bytes over their "
                  "time; a qgemm step's: its stored weights over its time):",
                  "", "| format | threads | steps sum ms | GEMMs ms (GB/s) | attention ms "
                  "| other ms | slowest steps: ms (GB/s) |", "| --- | --- | --- | --- | --- "
                  "| --- | --- |"]
        for r in profiled:
            p = r["profile"]
            g = p["groups"]

            def ms(name):
                return f"{g[name]['ms']:.2f}" if name in g else "-"
            gemm = (f"{g['gemm']['ms']:.2f} ({g['gemm']['gbs']:.1f})" if "gemm" in g else "-")
            top = ", ".join(f"{t['step']} {t['ms']:.2f}" +
                            (f" ({t['gbs']:.0f})" if t["gbs"] else "") for t in p["top"])
            lines.append(f"| {r['dtype']} | {r['threads']} | {p['sum_ms']:.2f} | {gemm} "
                         f"| {ms('attention')} | {ms('other')} | {top} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8x1024", choices=sorted(SIZES))
    ap.add_argument("--dtypes", default="fp32,bf16,int8,int4")
    ap.add_argument("--threads", default="2", help="thread counts, comma-separated")
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--work", default="/tmp/kiln-llm-cpu")
    ap.add_argument("--profile", type=int, default=0,
                    help="also profile N kiln calls a format per step (kiln.runtime.profiling)")
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
