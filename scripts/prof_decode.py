"""Decode attention and KV-cache writes of a Llama-shaped decoder on the GPU (issue 17.3): per
kernel device time (torch.profiler) of one decode step at several filled lengths of one static
cache, for one or more compile modes in one process (A/B on one machine).

    python scripts/prof_decode.py [--layers 2] [--hidden 4096] [--inter 14336] [--heads 32]
        [--kv-heads 8] [--vocab 128256] [--cache 8192[,512]] [--positions 32,512,4096]
        [--modes new,legacy] [--autotune 0] [--calls 20]

A mode is a name, optionally with environment variables set while it compiles: `legacy`
is `KILN_DECODE_SPLIT=legacy` (the twelfth session's split heuristic), `new` the tree's
defaults, `t64k` the defaults with key / value tiles of up to 64 KiB, `static` the
defaults with the splits over the whole cache (not over the mask's live range), `unfused`
the defaults with the KV-cache writes in a launch of their own (before the fifteenth session),
`launch` the defaults with the key splits merged by a combine kernel (not by the last split),
`NAME:VAR=VALUE[+VAR=VALUE]` anything else. Per layer: attention (the decode kernel
`attn_*`), its combine (`attn_*_combine`, when the keys are split), the kernel that writes
the new key / value rows (`puts_*`: the keys' and queries' rotary embedding, the mask
and the two cache writes in one program; schedule/puts.py); GB/s = the K and V bytes of the
filled positions (layer's kv heads x (position + 1) x head dim x 2 x itemsize) over attention
+ combine. `step` is the sum of every kernel's device time of a step; `wall` the host's time
per call (CUDA events around `--calls` calls, Python included). Logits of the modes are
compared with the first mode's at each position (same calls in the same order: the same
cache contents)."""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import kiln  # noqa: E402
from kiln.models.llm import llama, static_cache_module  # noqa: E402

MODES = {"new": {}, "legacy": {"KILN_DECODE_SPLIT": "legacy"},
         "t64k": {"KILN_DECODE_SPLIT": "64,512,65536"},
         "static": {"KILN_DECODE_SPLIT": "64,512,32768,0"},
         "unfused": {"KILN_DECODE_FUSED_PUTS": "0"},
         "launch": {"KILN_DECODE_COMBINE": "launch"}}


def parse_mode(spec: str) -> tuple[str, dict[str, str]]:
    name, _, env = spec.partition(":")
    if not env:
        return name, MODES[name]
    return name, dict(kv.split("=", 1) for kv in env.split("+"))


def profile_step(r, ids, cp, calls: int, layers: int) -> tuple[dict, float, float, dict]:
    """({attn, combine, puts: us a layer}, step device us, wall us a call, {kernel: [count,
    us]}) of `calls` decode calls at cache position tensor `cp`."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls):
        r(input_ids=ids, cache_position=cp)
    e1.record()
    torch.cuda.synchronize()
    wall = e0.elapsed_time(e1) * 1e3 / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            r(input_ids=ids, cache_position=cp)
        torch.cuda.synchronize()
    agg: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            x = agg[e.name]
            x[0] += 1
            x[1] += getattr(e, "device_time_total", 0) or e.cuda_time_total
    per = {"attn": 0.0, "combine": 0.0, "puts": 0.0}
    for k, (_, us) in agg.items():
        kind = ("combine" if k.startswith("attn_") and k.endswith("_combine") else
                "attn" if k.startswith("attn_") else "puts" if k.startswith("puts_") else None)
        if kind:
            per[kind] += us / calls / layers
    return per, sum(us for _, us in agg.values()) / calls, wall, agg


def main() -> None:
    p = argparse.ArgumentParser()
    for k, d in (("layers", 2), ("hidden", 4096), ("inter", 14336), ("heads", 32),
                 ("kv-heads", 8), ("vocab", 128256), ("autotune", 0), ("calls", 20)):
        p.add_argument(f"--{k}", type=int, default=d)
    p.add_argument("--cache", default="8192", help="static cache lengths")
    p.add_argument("--positions", default="32,512,4096", help="those below each cache length")
    p.add_argument("--modes", default="new,legacy")
    a = p.parse_args()
    model = llama(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                  vocab=a.vocab, inter=a.inter, init=0.02, device="cuda")
    hd = a.hidden // a.heads
    ids = torch.tensor([[11]], device="cuda")
    rows = []
    for cache in [int(x) for x in a.cache.split(",")]:
        _, ep = static_cache_module(model, cache, device="cuda", dtype=torch.bfloat16)
        positions = [int(x) for x in a.positions.split(",") if int(x) < cache]
        first: dict = {}
        for spec in a.modes.split(","):
            name, env = parse_mode(spec)
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            t0 = time.perf_counter()
            cm = kiln.compile(ep, device="cuda", options=kiln.Options(autotune=bool(a.autotune)))
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
            cfg = next(iter(cm.manifest.get("cuda", {}).get("attention", {}).values()), {})
            print(f"\n== cache {cache}, {name} {env}: compile {time.perf_counter() - t0:.0f} s; "
                  f"attention splits {cfg.get('block_m')}, keys a tile {cfg.get('block_n')}, "
                  f"warps {cfg.get('num_warps')}, shared {cfg.get('shared')}", flush=True)
            r = cm.load(Path(tempfile.mkdtemp()) / f"{name}.kiln", device="cuda:0")
            for pos in positions:
                cp = torch.tensor([pos], device="cuda")
                for _ in range(5):
                    out = r(input_ids=ids, cache_position=cp)
                logits = (out[0] if isinstance(out, (tuple, list)) else out).float().clone()
                diff = (logits - first[pos]).abs().max().item() if pos in first else None
                first.setdefault(pos, logits)
                per, step, wall, agg = profile_step(r, ids, cp, a.calls, a.layers)
                kv_bytes = 2 * a.kv_heads * (pos + 1) * hd * 2
                gbs = kv_bytes / ((per["attn"] + per["combine"]) * 1e3)
                rows.append(dict(cache=cache, mode=name, pos=pos, **per, step=step, wall=wall,
                                 gbs=gbs, diff=diff))
                print(f"pos {pos:5d}: attn {per['attn']:6.2f} + combine {per['combine']:5.2f} "
                      f"us ({gbs:6.0f} GB/s), puts {per['puts']:5.2f} us a layer; step "
                      f"{step:7.1f} us device, {wall:7.1f} us wall; logits vs first mode {diff}",
                      flush=True)
                for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:10]:
                    print(f"    {n / a.calls:5.1f} x {us / n:8.2f} us  {k[:90]}", flush=True)
            r.close()
    print(f"\nGPU {torch.cuda.get_device_name(0)}; {a.layers} layers, hidden {a.hidden}, heads "
          f"{a.heads} / {a.kv_heads}, bf16, autotune {a.autotune}; us a layer\n")
    print("| cache | mode | position | attention us | combine us | K/V GB/s | puts us | "
          "step us (device) | step us (wall) | logits diff |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for x in rows:
        d = "-" if x["diff"] is None else f"{x['diff']:.2g}"
        print(f"| {x['cache']} | {x['mode']} | {x['pos']} | {x['attn']:.2f} | "
              f"{x['combine']:.2f} | {x['gbs']:.0f} | {x['puts']:.2f} | {x['step']:.1f} | "
              f"{x['wall']:.1f} | {d} |")


if __name__ == "__main__":
    main()
