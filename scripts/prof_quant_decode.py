"""Per-kernel device time of one decode step of a Llama-shaped decoder (issue 17), bf16 and
weight-only int8 / int4 (Options.weight_quant), from torch.profiler over 10 calls of each
package, with each GEMV kernel's launch config from the manifest: where a quantised decode
step spends its time.

    python scripts/prof_quant_decode.py [layers 2] [hidden 4096] [inter 14336] [heads 32]
                                        [kv_heads 8] [vocab 128256] [modes none,int8,int4]

A mode may carry environment variables for its compile, e.g. `int4:KILN_GEMV_PREFETCH=0` or
`int4:KILN_GEMV_PREFETCH=2:PROF_WIDE=1`. PROF_WIDE=1 (this script's own) adds a grid of GEMV
launch configs (BLOCK_N 8-64, BLOCK_K 512-4096, 4 / 8 warps) to the tuner's candidates; each
mode prints the tuner's cold time of every GEMV candidate (the manifest's "autotuned").
"""
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")
import torch  # noqa: E402

import kiln  # noqa: E402
from kiln.models.llm import llama, static_cache_module  # noqa: E402

argv = sys.argv[1:] + [None] * 7
L, H, INTER, NH, KV, V = (int(a) if a else d for a, d in
                      zip(argv[:6], (2, 4096, 14336, 32, 8, 128256)))
modes = (argv[6] or "none,int8,int4").split(",")
model = llama(layers=L, hidden=H, heads=NH, kv_heads=KV, vocab=V, inter=INTER, init=0.02,
              device="cuda")
w, ep = static_cache_module(model, 256, device="cuda", dtype=torch.bfloat16)
ids = torch.tensor([[11]], device="cuda")
pos = torch.tensor([128], device="cuda")
summary = []

from kiln.targets.cuda import gemv_template as GT  # noqa: E402

_configs = GT.configs


def _wide(n, k, itemsize, min_k=16):
    """The tuner's GEMV candidates, then a grid of larger / smaller tiles (PROF_WIDE=1)."""
    out = list(_configs(n, k, itemsize, min_k))
    if os.environ.get("PROF_WIDE") == "1":
        from kiln.gemm.configs import GemvConfig
        for bn in (8, 16, 32, 64):
            for bk in (512, 1024, 2048, 4096):
                for w in (4, 8):
                    c = GemvConfig(bn, max(bk, min_k), w, 1)
                    if bk <= max(k, min_k) and c not in out:
                        out.append(c)
    return out


GT.configs = _wide
for spec in modes:  # a mode, or mode:NAME=VALUE[:NAME=VALUE] (environment for its compile)
    mode, *envs = spec.split(":")
    olds = {}
    for env in envs:
        name, _, value = env.partition("=")
        olds[name] = os.environ.get(name)
        os.environ[name] = value
    t0 = time.perf_counter()
    cm = kiln.compile(ep, device="cuda", options=kiln.Options(weight_quant=mode))
    for name, old in olds.items():
        os.environ.pop(name) if old is None else os.environ.__setitem__(name, old)
    cs = time.perf_counter() - t0
    r = cm.load(Path(tempfile.mkdtemp()) / f"{mode}.kiln", device="cuda:0")
    for _ in range(10):
        r(input_ids=ids, cache_position=pos)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            r(input_ids=ids, cache_position=pos)
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name]
            a[0] += 1
            a[1] += getattr(e, "device_time_total", 0) or e.cuda_time_total
    tot = sum(v[1] for v in agg.values())
    cfg = cm.manifest.get("cuda", {}).get("kernels", {})
    launches = sum(v[0] for v in agg.values()) / 10
    print(f"\n== {spec}: compile {cs:.0f} s; kernels/token {launches:.0f}; "
          f"device us/token {tot / 10:.0f}", flush=True)
    for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])[:24]:
        c = cfg.get(k, {})
        cs_ = f"[{c.get('xblock')}x{c.get('rblock')} w{c.get('num_warps')}]" if c else ""
        print(f"{v[0] / 10:5.1f} x {v[1] / v[0]:8.2f} us = {v[1] / 10:8.1f} us/token {cs_:18s} "
              f"{k[:90]}", flush=True)
    for k, ms in sorted(cm.manifest.get("cuda", {}).get("autotuned", {}).items()):
        if k.startswith("gemv_"):
            best = sorted(ms.items(), key=lambda kv: kv[1])
            print(f"  tuner {k[5:50]}: " + ", ".join(f"{c} {v * 1000:.1f}" for c, v in best[:6])
                  + f" ({len(best)} candidates, us cold)", flush=True)
    summary.append((spec, tot / 10))
    r.close()
print("\n| weights | device us/token |")
print("|---|---|")
for m, t in summary:
    print(f"| {m} | {t:.0f} |")
