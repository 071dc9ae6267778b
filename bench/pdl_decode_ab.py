"""Programmatic dependent launch on a whole decode step (issue 17 item 3): the Llama-shaped
decoder of bench/llm_gpu.py compiled three ways and timed interleaved (back-to-back device
time per token, CUDA graphs, median of --rounds rounds of 20 tokens):

  early   each kernel lets the next one launch as it starts (griddepcontrol.launch_dependents),
          then waits for the previous one
  exit    Options(cuda_pdl=True): each kernel only waits (`_kl_pdl()`), the next one
          launching as this one's programs exit: the launch latency hidden
  off     Options(cuda_pdl=False)

    python bench/pdl_decode_ab.py [--layers 16] [--hidden 2048] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.cuda_timing import stream_ms  # noqa: E402
from bench.llm_gpu import add_model_args  # noqa: E402


def main() -> None:
    import kiln
    from kiln.models.llm import llama, static_cache_module
    from kiln.targets.cuda import kernel as K

    p = argparse.ArgumentParser()
    add_model_args(p, cache=256)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    model = llama(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                  vocab=a.vocab, inter=a.inter, init=0.02, device="cuda")
    _, ep = static_cache_module(model, a.cache, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[11]], device="cuda")
    pos = torch.tensor([a.cache // 2], device="cuda")
    built = K.PDL_LINES
    early = ("    tl.extra.cuda.gdc_launch_dependents()",) + built
    steps, outs = {}, {}
    for name, lines, on in (("early", early, True), ("exit", built, True),
                            ("off", built, False)):
        K.PDL_LINES = lines
        try:
            cm = kiln.compile(ep, device="cuda", options=kiln.Options(cuda_pdl=on))
        finally:
            K.PDL_LINES = built
        r = cm.load(Path(tempfile.mkdtemp()) / f"{name}.kiln", device="cuda:0")
        steps[name] = (lambda r=r: r(input_ids=ids, cache_position=pos))
        o = steps[name]()
        outs[name] = (o[0] if isinstance(o, (tuple, list)) else o).float().clone()
    times = {k: [] for k in steps}
    for _ in range(a.rounds):
        for k, f in steps.items():
            times[k].append(stream_ms(f, 20, 3))
    print(f"GPU: {torch.cuda.get_device_name(0)}; llama {a.layers}x{a.hidden} bf16, cache "
          f"{a.cache}; ms per token, back-to-back device time, median of {a.rounds} "
          "interleaved rounds (min)")
    print("| launch | ms/token | min | vs off | max |logits - off| |")
    print("|---|---:|---:|---:|---:|")
    off = statistics.median(times["off"])
    for k, v in times.items():
        med = statistics.median(v)
        d = (outs[k] - outs["off"]).abs().max().item()
        print(f"| {k} | {med:.3f} | {min(v):.3f} | {med / off:.3f} | {d:.2e} |")


if __name__ == "__main__":
    main()
