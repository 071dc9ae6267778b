"""The transformer encoders' GEMM shapes on the CPU, kiln against OpenVINO (issue 14): one
`Linear(K, N)` (bias; optionally an exact GELU after it) on an [M, K] input per shape, compiled
by kiln (default options, 2 threads) and by OpenVINO (LATENCY hint, float32 inference
precision, as bench/cpu_paired.py), timed in ONE process in rotating bursts (median over
rounds of wall time per call; GFLOP/s = 2 M N K / time; ratios: the median over rounds of each
round's ratio to OpenVINO's burst in that round). Several kiln trees compare in the same
process: `--build NAME` compiles the shapes' packages with the kiln on PYTHONPATH into
DIR/NAME_*.kiln (run it once per tree), `--time NAME,...` loads them next to OpenVINO.
OpenVINO's runtime model is read back per shape: the precision its FullyConnected node ran in
(`runtimePrecision`, `outputPrecisions`), to show the comparison is float32 against float32.

    PYTHONPATH=$PWD python bench/gemm_encoders_cpu.py DIR --build new
    taskset -c 0,1 python bench/gemm_encoders_cpu.py DIR --time old,new [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

# (model, M, N, K): BERT base at seq 128, ViT base (197 tokens), Whisper tiny's encoder (750)
SHAPES = [("bert", 128, 768, 768), ("bert", 128, 3072, 768), ("bert", 128, 768, 3072),
          ("vit", 197, 768, 768), ("vit", 197, 3072, 768), ("vit", 197, 768, 3072),
          ("whisper", 750, 384, 384), ("whisper", 750, 1536, 384),
          ("whisper", 750, 384, 1536)]


def _module(n: int, k: int, gelu: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n)
    return torch.nn.Sequential(lin, torch.nn.GELU()) if gelu else torch.nn.Sequential(lin)


def _tag(m: int, n: int, k: int) -> str:
    return f"{m}x{n}x{k}"


def build(d: str, name: str, gelu: bool) -> None:
    import kiln

    os.makedirs(d, exist_ok=True)
    for _, m, n, k in SHAPES:
        x = torch.randn(m, k)
        ep = torch.export.export(_module(n, k, gelu).eval(), (x,))
        kiln.compile(ep, options=kiln.Options(num_threads=2)).save(
            os.path.join(d, f"{name}_{_tag(m, n, k)}.kiln"))
        if not os.path.exists(os.path.join(d, f"ov_{_tag(m, n, k)}.xml")):
            import openvino as ov

            ov.save_model(ov.convert_model(ep), os.path.join(d, f"ov_{_tag(m, n, k)}.xml"),
                          compress_to_fp16=False)
        print("built", name, _tag(m, n, k), flush=True)


def _ov_precisions(cm) -> set[str]:
    """Runtime precisions of OpenVINO's FullyConnected / MatMul nodes."""
    out = set()
    for op in cm.get_runtime_model().get_ops():
        rt = {k: v.astype(str) for k, v in op.get_rt_info().items()}
        if rt.get("layerType") in ("FullyConnected", "MatMul", "Gemm"):
            out.add(f"{rt['layerType']} {rt['primitiveType']}")
    return out


def time_all(d: str, names: list[str], rounds: int, burst: float, threads: int) -> None:
    import openvino as ov

    import kiln

    torch.set_num_threads(threads)
    print(f"| shape (M x N x K) | OpenVINO | {' | '.join(names)} | "
          + " | ".join(f"{n} / OV" for n in names) + " | OV precision |")
    print("|---|" + "---:|" * (1 + 2 * len(names)) + "---|")
    ratios = {n: [] for n in names}
    for model, m, n, k in SHAPES:
        tag = _tag(m, n, k)
        x = torch.randn(m, k)
        cm = ov.Core().compile_model(os.path.join(d, f"ov_{tag}.xml"), "CPU", {
            "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": "f32"})
        req = cm.create_infer_request()
        xa = x.numpy()
        fns = {"ov": lambda req=req: req.infer([xa], share_inputs=True)}
        ref = torch.from_numpy(np.asarray(req.infer([xa])[0]).copy())
        for nm in names:
            r = kiln.load(os.path.join(d, f"{nm}_{tag}.kiln"), num_threads=threads)
            got = r(x)
            got = got[0] if isinstance(got, (list, tuple)) else got
            err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            if err > 1e-4:
                raise SystemExit(f"{nm} {tag}: differs from OpenVINO by {err:.2e} (relative)")
            fns[nm] = lambda r=r, x=x: r(x)
        per = {k_: [] for k_ in fns}
        keys = list(fns)
        for f in fns.values():
            f()
            f()
        for rd in range(rounds):
            for key in keys[rd % len(keys):] + keys[:rd % len(keys)]:
                t0, c = time.perf_counter(), 0
                while time.perf_counter() - t0 < burst or c < 3:
                    fns[key]()
                    c += 1
                per[key].append((time.perf_counter() - t0) / c)
        med = {k_: statistics.median(v) * 1e6 for k_, v in per.items()}
        # each round's ratio to OpenVINO's burst of the same round, median over rounds
        rr = {nm: statistics.median([a / b for a, b in zip(per[nm], per["ov"])])
              for nm in names}
        for nm in names:
            ratios[nm].append(rr[nm])
        gf = 2 * m * n * k / 1e3
        cells = " | ".join(f"{med[nm]:.0f} us ({gf / med[nm]:.0f})" for nm in names)
        rat = " | ".join(f"{rr[nm]:.3f}" for nm in names)
        print(f"| {model} {tag} | {med['ov']:.0f} us ({gf / med['ov']:.0f}) | {cells} | {rat} | "
              f"{', '.join(sorted(_ov_precisions(cm)))} |", flush=True)
    geo = " | ".join(f"{np.exp(np.mean(np.log(ratios[nm]))):.2f}" for nm in names)
    print(f"| geomean | | {' | '.join('' for _ in names)} | {geo} | |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--build")
    p.add_argument("--gelu", action="store_true")
    p.add_argument("--time")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--burst", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.build:
        build(a.dir, a.build, a.gelu)
    if a.time:
        time_all(a.dir, a.time.split(","), a.rounds, a.burst, a.threads)


if __name__ == "__main__":
    main()
