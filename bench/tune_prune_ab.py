"""Run time and compile time of the pruned compile-time tuning (the default,
kiln/targets/cuda/tune_plan.py) against the full search (Options(tune_prune=False): every
candidate the size thresholds admit), on one GPU.

Per model and dtype: two compiles, each with its own empty kiln and Triton caches (so both tune
from scratch; their seconds and tuning counts are printed), then both packages timed back to back
(`bench/cuda_timing.stream_ms`, device time, medians over --repeat batches), interleaved over
--rounds rounds, and checked against each other. The pruning keeps run time when `pruned /
full` stays within a few percent of 1.

    python bench/tune_prune_ab.py [--models resnet18,mobilenet_v2,ln_softmax,gpt]
                                  [--dtypes bf16,fp32] [--repeat 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.compile_time import _MODEL  # noqa: E402
from bench.cuda_timing import stream_ms  # noqa: E402

_NS: dict = {}
exec(_MODEL, _NS)


def _compile(module, args, dyn, prune: bool, tmp: Path):
    import kiln
    cache = tmp / f"cache_{prune}"
    os.environ["TRITON_CACHE_DIR"] = str(tmp / f"triton_{prune}")  # cold for each compile
    t0 = time.perf_counter()
    cm = kiln.compile(module, args, dynamic_shapes=dyn, device="cuda",
                      options=kiln.Options(tune_prune=prune, cache_dir=str(cache)))
    seconds = time.perf_counter() - t0
    runner = cm.load(tmp / f"m_{prune}.kiln", device="cuda:0")
    st = cm.report["stages"]
    counts = (f"{int(st.get('launch_autotune.timed', 0))}/"
              f"{int(st.get('launch_autotune.candidates', 0))}")
    return runner, seconds, st.get("launch_autotune", 0.0), counts


def one(model: str, dtype: str, a) -> None:
    module, args, dyn = _NS["model_of"](model, dtype)
    module = module.eval().to("cuda")
    args = tuple(x.to("cuda") if isinstance(x, torch.Tensor) else x for x in args)
    tmp = Path(tempfile.mkdtemp(prefix="kiln_ab_"))
    with torch.no_grad():
        full = _compile(module, args, dyn, False, tmp)
        pruned = _compile(module, args, dyn, True, tmp)
        a_out, b_out = (o[0] if isinstance(o, (tuple, list)) else o
                        for o in (full[0](*args), pruned[0](*args)))
        diff = float((a_out.float() - b_out.float()).abs().max() /
                     b_out.float().abs().max().clamp_min(1e-30))
        times: dict[str, list[float]] = {"full": [], "pruned": []}
        for _ in range(a.rounds):
            for key, run in (("full", full[0]), ("pruned", pruned[0])):
                times[key].append(stream_ms(lambda: run(*args), 10, a.repeat))
    f, p = (statistics.median(times[k]) for k in ("full", "pruned"))
    print(f"| {model} | {dtype} | {f:.4f} | {p:.4f} | {p / f:.3f} | {full[1]:.1f} "
          f"({full[2]:.1f}, {full[3]}) | {pruned[1]:.1f} ({pruned[2]:.1f}, {pruned[3]}) | "
          f"{diff:.1e} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18,mobilenet_v2,ln_softmax,gpt")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_prune_ab: needs a CUDA GPU")
        return 1
    print(f"GPU: {torch.cuda.get_device_name(0)}; ms per call (device time, back to back, "
          f"median of {a.rounds} interleaved rounds); compile s (launch_autotune s, steps "
          "timed/candidates)\n")
    print("| model | dtype | full ms | pruned ms | pruned / full | full compile s | "
          "pruned compile s | max rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for model in a.models.split(","):
        for dtype in a.dtypes.split(","):
            try:
                one(model, dtype, a)
            except Exception as e:  # noqa: BLE001 - the row says why, the others go on
                print(f"| {model} | {dtype} | {type(e).__name__}: {e} |"[:300], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
