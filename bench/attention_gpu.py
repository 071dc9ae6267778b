"""GPU benchmark of kiln's flash-attention kernel (targets/cuda/attention.py) against
`torch.nn.functional.scaled_dot_product_attention` (eager: flash / cuDNN / efficient kernels).

Table 1: bf16 attention, B in {1, 8}, H in {8, 16}, L = S in {128 .. 4096}, E in {64, 128},
causal and not. One kiln package per (E, causal), autotuned at B=4, H=16, L=1024 and
dynamic in B, H and L. Columns: kiln's kernel alone (the package's cubin config, launched
through Triton from the package's Triton source: device time by CUDA events), the kiln package
call (inputs on the GPU, one call per timing, events around it: includes the loader's host
overhead) and eager; TFLOP/s of kiln's kernel (4 * B * H * L * S * E flops, halved when
causal). Table 2: the gpt zoo model (bf16 and fp32, batch 4 x seq 256) with the fused kernel
(default) and with attention decomposed (Options(fused_attention=False), the previous CUDA
lowering): median latency of one package call.

    python bench/attention_gpu.py [--quick] [--repeat 30]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.export import Dim  # noqa: E402

import kiln  # noqa: E402
from kiln.options import Options  # noqa: E402
from bench.cuda_timing import events_ms  # noqa: E402


class Sdpa(torch.nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _package(e, causal, d):
    dt = torch.bfloat16
    args = tuple(torch.randn(4, 16, 1024, e, dtype=dt) for _ in range(3))
    b, h, n = Dim("b", min=1, max=8), Dim("h", min=1, max=16), Dim("n", min=16, max=4096)
    dyn = ({0: b, 1: h, 2: n},) * 3
    cm = kiln.compile(torch.export.export(Sdpa(causal), args, dynamic_shapes=dyn),
                      device="cuda")
    runner = kiln.load(cm.save(d / f"attn_{e}_{int(causal)}.kiln"), device="cuda:0")
    (name, info), = cm.manifest["cuda"]["attention"].items()
    print(f"E={e} causal={int(causal)} autotune ms at 4x16x1024:",
          cm.manifest["cuda"]["autotuned"].get(name), flush=True)
    from kiln.targets.cuda.wrapper_py import import_triton_module
    mod = import_triton_module(cm.sources["kernels_triton.py"])
    return runner, getattr(mod, name), info


def attention_table(repeat, quick):
    d = Path(tempfile.mkdtemp())
    rows = []
    print("| E | causal | B | H | L=S | kiln kernel ms | kiln package ms | eager ms | "
          "kiln/eager | kiln TFLOP/s | config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for e in (64, 128):
        for causal in (False, True):
            runner, kern, info = _package(e, causal, d)
            cfg = f"m{info['block_m']}n{info['block_n']}w{info['num_warps']}s{info['num_stages']}"
            for b in ((1, 8) if not quick else (8,)):
                for h in ((8, 16) if not quick else (16,)):
                    for n in (128, 256, 512, 1024, 2048, 4096):
                        q, k, v = (torch.randn(b, h, n, e, device="cuda", dtype=torch.bfloat16)
                                   for _ in range(3))
                        out = torch.empty_like(q)
                        bm = info["block_m"]
                        grid = (b * h * -(-n // bm),)
                        # kernel parameters: out, q, k, v, then the size symbols it uses
                        dims = {"s0": b, "s1": h, "s2": n}
                        sizes = [dims[a] for a in kern.arg_names if a in dims]

                        def launch():
                            kern[grid](out, q, k, v, *sizes, XBLOCK=bm, RBLOCK=info["block_n"],
                                       num_warps=info["num_warps"],
                                       num_stages=info["num_stages"])
                        t_kernel = events_ms(launch, repeat)
                        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        err = (out.float() - want.float()).abs().max().item()
                        t_pkg = events_ms(lambda: runner(q, k, v), repeat)
                        t_eager = events_ms(lambda: F.scaled_dot_product_attention(
                            q, k, v, is_causal=causal), repeat)
                        flops = 4 * b * h * n * n * e / (2 if causal else 1)
                        row = (e, causal, b, h, n, t_kernel, t_pkg, t_eager,
                               t_kernel / t_eager, flops / t_kernel / 1e9, cfg, err)
                        rows.append(row)
                        print(f"| {e} | {int(causal)} | {b} | {h} | {n} | {t_kernel:.4f} | "
                              f"{t_pkg:.4f} | {t_eager:.4f} | {row[8]:.2f} | {row[9]:.0f} | "
                              f"{cfg} | err {err:.2g}", flush=True)
    return rows


def gpt_table(repeat):
    from kiln.models import ALL_MODELS
    from kiln.models.zoo import in_dtype
    d = Path(tempfile.mkdtemp())
    print("\n| gpt (4 x 256) | fused attention ms | decomposed ms | speedup |")
    print("|---|---|---|---|")
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        spec = ALL_MODELS["gpt"]()
        if dt != torch.float32:
            spec = in_dtype(spec, dt)
        (idx,) = spec.make_inputs(1, batch=4, seq=256)
        idx = idx.cuda()
        t = []
        for fused in (True, False):
            cm = kiln.compile(spec.export(), device="cuda",
                              options=Options(fused_attention=fused))
            r = kiln.load(cm.save(d / f"gpt_{name}_{fused}.kiln"), device="cuda:0")
            t.append(events_ms(lambda: r(idx), repeat))
        print(f"| {name} | {t[0]:.4f} | {t[1]:.4f} | {t[1] / t[0]:.2f}x |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    print("GPU:", torch.cuda.get_device_name(), "torch", torch.__version__)
    gpt_table(a.repeat)
    attention_table(a.repeat, a.quick)


if __name__ == "__main__":
    main()
