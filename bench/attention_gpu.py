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

Table 3 (--decode: only this one): the decode path (few query rows: a kv head's query heads
in one program, keys split among programs, masked key tiles skipped), bf16, L = 1, 32 query
heads / 4 kv heads, head dim 64 / 128, S in {256, 2048, 8192}, a static cache's bool mask
filled to half (and whole). Each side captured in a CUDA graph and timed by events over
replays (microseconds a call): kiln's kernels (attention, then the combine when split, from
the package's Triton source, the package's configs), eager's SDPA with the mask (what HF
runs), eager's SDPA on the filled keys only without a mask (flash-decoding's peer), and the
memory floor of the filled keys and values at 3.35 TB/s.

    python bench/attention_gpu.py [--quick] [--repeat 30] [--decode]
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


class Gqa(torch.nn.Module):
    """SDPA over Hugging Face's repeat_kv copies (what kiln folds into the grouped kernel)."""

    def forward(self, q, k, v, m):
        b, hkv, s, e = k.shape
        g = q.shape[1] // hkv
        k = k[:, :, None].expand(b, hkv, g, s, e).reshape(b, hkv * g, s, e)
        v = v[:, :, None].expand(b, hkv, g, s, e).reshape(b, hkv * g, s, e)
        return F.scaled_dot_product_attention(q, k, v, m)


def _graph_us(fn, repeat):
    """Microseconds one replay of `fn` captured in a CUDA graph takes (events over 20 x
    `repeat` replays, after warm-up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20 * repeat):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (20 * repeat)


def decode_table(repeat, quick):
    from kiln.targets.cuda.attention import attention_kernels
    from kiln.targets.cuda.kernel import Config
    from kiln.targets.cuda.wrapper_py import import_triton_module, launch_kernel
    dt, hkv, h = torch.bfloat16, 4, 32
    print("\n| E | S | filled | kiln us | config | eager SDPA + mask us | eager SDPA filled us "
          "| floor us | kiln / eager+mask | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in (64, 128):
        for s in ((256, 8192) if quick else (256, 2048, 8192)):
            ex = (torch.randn(1, h, 1, e, dtype=dt), torch.randn(1, hkv, s, e, dtype=dt),
                  torch.randn(1, hkv, s, e, dtype=dt), torch.ones(1, 1, 1, s, dtype=torch.bool))
            cm = kiln.compile(torch.export.export(Gqa(), ex), device="cuda")
            b = cm.built
            mod = import_triton_module(cm.sources["kernels_triton.py"])
            bufs_ir = {x.name: x for x in b.loop.buffers}
            (call,) = [x for x in b.steps if getattr(x, "routine", None) == "attention"]
            info = cm.manifest["cuda"]["attention"][f"attn_{call.name}"]
            ks = attention_kernels(call, bufs_ir, {}, Config(
                info["block_m"], info["block_n"], info["num_warps"], info["num_stages"]))
            names = [i.name for i in b.graph.user_inputs]
            for filled in (s // 2, s):
                q, k, v = (torch.randn(*x.shape, dtype=dt, device="cuda") for x in ex[:3])
                m = torch.zeros(1, 1, 1, s, dtype=torch.bool, device="cuda")
                m[..., :filled] = True
                bufs = {n: t.reshape(-1) for n, t in zip(names, (q, k, v, m))}
                for k_ in ks:  # outputs and the split scratch
                    for kind, n in k_.params:
                        if kind == "out" and n not in bufs:
                            bb = bufs_ir[n]
                            bufs[n] = torch.empty(int(bb.numel), dtype=bb.dtype.torch,
                                                  device="cuda")
                status = torch.zeros(1, dtype=torch.int32, device="cuda")

                def run_kiln():
                    for k_ in ks:
                        launch_kernel(mod, k_, {}, bufs, status, "cuda")
                t_kiln = _graph_us(run_kiln, repeat)
                want = Gqa()(q.double(), k.double(), v.double(), m)
                got = bufs[ks[0].params[0][1]].reshape(want.shape)
                err = (got.double() - want).abs().max().item()
                t_mask = _graph_us(lambda: Gqa()(q, k, v, m), repeat)
                kf, vf = k[:, :, :filled], v[:, :, :filled]
                t_filled = _graph_us(lambda: F.scaled_dot_product_attention(
                    q, kf, vf, enable_gqa=True), repeat)
                floor = 2 * hkv * filled * e * 2 / 3.35e6
                cfg = ks[0].config
                print(f"| {e} | {s} | {filled} | {t_kiln:.2f} | splits {cfg.xblock} keys/step "
                      f"{cfg.rblock} w{cfg.num_warps}{' +combine' if len(ks) > 1 else ''} | "
                      f"{t_mask:.2f} | {t_filled:.2f} | {floor:.2f} | {t_kiln / t_mask:.2f} | "
                      f"{err:.2g} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode", action="store_true", help="only the decode table")
    a = ap.parse_args()
    print("GPU:", torch.cuda.get_device_name(), "torch", torch.__version__)
    if a.decode:
        decode_table(a.repeat, a.quick)
        return
    gpt_table(a.repeat)
    attention_table(a.repeat, a.quick)


if __name__ == "__main__":
    main()
