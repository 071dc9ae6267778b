"""The CUDA NHWC convolution (passes/conv_nhwc.py, targets/cuda/conv_template.py) against kiln's
im2col + GEMM path and eager cuDNN, per model and per convolution, on one GPU.

Per model, dtype and batch (zoo models, random weights, eval mode): kiln with the default
Options.cuda_conv ("implicit": conv tiles measured on this GPU at compile time) and with
cuda_conv="im2col", and eager in channels-last (cuDNN), timed back to back
(`bench/cuda_timing.stream_ms`, device time, medians over --repeat batches), the three
interleaved round by round. Then, per convolution of the implicit package, what the compile-time
tuner measured: the best tile, its time, and cuDNN's time for the same convolution without its
epilogue (torch, channels-last; float32 without TF32, as kiln computes it).

    python bench/conv_gpu.py [--models resnet18,mobilenet_v2] [--dtypes bf16,fp32]
                             [--batches 1,8] [--repeat 20] [--per-conv] [--full-search]

cuDNN's per-convolution reference (--per-conv) is measured only with --full-search (the
default compile times the tiles the cost model keeps, kiln/targets/cuda/tune_plan.py).
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

from bench.cuda_timing import stream_ms  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _compile(module, x, conv: str, tmp: Path, full: bool = False):
    import kiln
    t0 = time.perf_counter()
    cm = kiln.compile(torch.export.export(module, (x,)), device="cuda",
                      options=kiln.Options(cuda_conv=conv, tune_prune=not full))
    runner = cm.load(tmp / f"{conv}.kiln", device="cuda:0")
    return cm, runner, time.perf_counter() - t0


def one(model: str, dtype: str, batch: int, a) -> None:
    from kiln.models import ALL_MODELS
    dt = DT[dtype]
    spec = ALL_MODELS[model]()
    torch.manual_seed(0)
    m = spec.module.eval().to("cuda", dt)
    x = torch.randn(batch, *spec.example_args[0].shape[1:], device="cuda").to(dt)
    tmp = Path(tempfile.mkdtemp())
    with torch.no_grad():
        want = m(x).float()
        cl = m.to(memory_format=torch.channels_last)
        xcl = x.to(memory_format=torch.channels_last)
        imp, r_imp, s_imp = _compile(m, x, "implicit", tmp, a.full_search)
        old, r_old, s_old = _compile(m, x, "im2col", tmp)
        err = {k: float((r(x).float() - want).abs().max() / want.abs().max())
               for k, r in (("implicit", r_imp), ("im2col", r_old))}
        fns = {"eager_cl": lambda: cl(xcl), "kiln_im2col": lambda: r_old(x),
               "kiln_implicit": lambda: r_imp(x)}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(3):  # interleaved rounds
            for k, f in fns.items():
                times[k].append(stream_ms(f, 10, a.repeat))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"| {model} | {dtype} | {batch} | {med['eager_cl']:.3f} | {med['kiln_im2col']:.3f} | "
          f"{med['kiln_implicit']:.3f} | {med['kiln_implicit'] / med['kiln_im2col']:.2f} | "
          f"{err['implicit']:.1e} / {err['im2col']:.1e} | {s_imp:.0f} / {s_old:.0f} |",
          flush=True)
    slow = sorted(((k, v) for k, v in imp.report["stages"].items() if "." not in k),
                  key=lambda kv: -kv[1])[:6]  # ("cubins.compiled" and the like are counts)
    print("    implicit compile, slowest stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in slow))
    if a.per_conv:
        tuned = imp.manifest["cuda"].get("autotuned", {})
        for name, cfg in imp.manifest["cuda"]["conv"].items():
            t = tuned.get(name, {})
            cands = {k: v for k, v in t.items() if k != "cudnn_reference"}
            best = min(cands.items(), key=lambda kv: kv[1]) if cands else ("-", float("nan"))
            ref = t.get("cudnn_reference", float("nan"))
            src = imp.sources["kernels_triton.py"]
            i = src.find(f"def {name}(")
            geo = src[i:].split("#   kernel ", 1)[1].split(";")[0] if i >= 0 else ""
            print(f"    {name}: {geo}; best {best[0]} {best[1]:.4f} ms, cuDNN {ref:.4f} ms, "
                  f"ratio {best[1] / ref if ref == ref and ref else float('nan'):.2f}; "
                  f"{cfg['source_ops'][0] if cfg['source_ops'] else ''}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18,mobilenet_v2")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--per-conv", action="store_true")
    p.add_argument("--full-search", action="store_true",
                   help="Options(tune_prune=False): every tile candidate timed, with cuDNN's "
                        "time per convolution (the --per-conv reference)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv_gpu: needs a CUDA GPU")
        return 1
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; ms per call, back "
          "to back; eager in channels-last (cuDNN, no TF32); kiln im2col = "
          "Options(cuda_conv='im2col'), implicit = the default\n")
    print("| model | dtype | batch | eager cl | kiln im2col | kiln implicit | implicit / im2col "
          "| err (implicit / im2col) | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in a.models.split(","):
        for dtype in a.dtypes.split(","):
            for batch in (int(b) for b in a.batches.split(",")):
                try:
                    one(model, dtype, batch, a)
                except Exception as e:  # noqa: BLE001 - the row says why, the others go on
                    print(f"| {model} | {dtype} | {batch} | {type(e).__name__}: {e} |"[:300],
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
