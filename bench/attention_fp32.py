"""float32 attention on the GPU: decomposed (bmm, softmax kernel, bmm: the default) vs kiln's
fused flash-attention kernel with each tl.dot input precision (kiln/targets/cuda/attention.py
`DOT_PRECISION`), on the gpt zoo model in float32: median latency of one package call and the
largest error against the model run in float64 (eager float32's error alongside). Decides
whether float32 attention should be fused by default (`Options.fused_attention`).

    python bench/attention_fp32.py [--precisions ieee,tf32x3] [--repeat 50]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

import kiln  # noqa: E402
from bench.gpu import _cuda, _median_ms  # noqa: E402
from kiln.targets.cuda import attention as triton_attention  # noqa: E402
from kiln.models import get  # noqa: E402
from kiln.options import Options  # noqa: E402


def _err(got, ref) -> float:
    return max((g.double() - r).abs().max().item()
               for g, r in zip(pytree.tree_leaves(got), pytree.tree_leaves(ref)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="ieee,tf32x3")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--batch", type=int, default=0, help="0: the model's default inputs")
    a = ap.parse_args()
    spec = get("gpt")
    kw = {"batch": a.batch, "seq": 256} if a.batch else {}
    args = _cuda(spec.make_inputs(7, **kw))
    ep = spec.export()
    with torch.no_grad():
        ref = pytree.tree_map(lambda t: t.double(), copy.deepcopy(spec.module).double().cuda()(
            *args))
        module = copy.deepcopy(spec.module).cuda()
        rows = [("eager fp32", _median_ms(lambda: module(*args), a.repeat),
                 _err(module(*args), ref))]
        modes = [("decomposed", None)] + [(f"fused {p}", p) for p in a.precisions.split(",")]
        for label, prec in modes:
            if prec is not None:
                triton_attention.DOT_PRECISION["float32"] = prec
            cm = kiln.compile(ep, device="cuda", options=Options(fused_attention=prec is not None))
            run = cm.load(Path(tempfile.mkdtemp()) / "gpt.kiln", device="cuda:0")
            rows.append((f"kiln {label}", _median_ms(lambda: run(*args), a.repeat),
                         _err(run(*args), ref)))
            run = None  # unload before the next package
    print(f"gpt fp32 on {torch.cuda.get_device_name(0)}, inputs "
          f"{[tuple(t.shape) for t in pytree.tree_leaves(args)]}")
    print("| system | ms | max abs err vs float64 |\n| --- | --- | --- |")
    for label, ms, err in rows:
        print(f"| {label} | {ms:.3f} | {err:.2e} |")


if __name__ == "__main__":
    main()
