"""Compile-time tiles of the NHWC convolution kernels (targets/cuda/conv_template.py), measured on
the local GPU: every candidate of `conv_candidates` (the heuristic's first) printed, compiled
for the device in worker processes, timed with CUDA events at the example sizes on random
operands, the fastest kept (ties: the heuristic). A candidate Triton cannot compile or the
device cannot launch is skipped. Calls of the same code up to names at the same sizes (the
repeated blocks of a ResNet stage) are timed once; results are cached on disk with the
launch autotuner's (launch_tune.py: the key covers the code up to names, candidates, sizes,
device and Triton version), so a second build measures nothing.

Not among the candidates yet: im2col + GEMM (a different lowering of the whole node) and
cuDNN (packages do not load it); the report records cuDNN's time for the same convolution
(torch, channels-last, without the epilogue) beside the candidates', as a reference.

A build's stage (targets/cuda/build.py `launch_autotune`) uses `worth_tuning` and `cudnn_ms`
here, the cost model of tune_plan.py on top (which convolutions, which tiles), and times the
convolutions with every other tuned step in one pass (launch_tune.tune_all); `tune_conv` is
the convolutions alone with every candidate."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.ir.sym import evaluate
from kiln.targets.cuda.conv_template import conv_candidates, print_conv_kernel
from kiln.targets.cuda.kernel import Config
from kiln.targets.cuda.launch_tune import event_ms, time_candidates


def cudnn_ms(call, buffers, hints: dict[str, int]) -> float | None:
    """The same convolution (without its epilogue) through torch's cuDNN in channels-last,
    timed like the candidates: a reference figure for the report (float32 without TF32, as
    kiln computes it); None where torch cannot run it."""
    try:
        a = dict(call.attrs)
        x, w = call.args[0], call.args[1]
        dt = buffers[x.buf].dtype.torch
        n, h, wd, c = (int(evaluate(d, hints)) for d in x.shape)
        g = a["groups"]
        if a["depthwise"]:
            oc = c
        else:
            oc = int(w.shape[0]) * int(w.shape[2])
        xt = torch.randn(n, c, h, wd, device="cuda", dtype=dt).to(
            memory_format=torch.channels_last)
        wt = torch.randn(oc, c // g, a["kh"], a["kw"], device="cuda", dtype=dt).to(
            memory_format=torch.channels_last)
        old = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        try:
            return event_ms(lambda: torch.nn.functional.conv2d(
                xt, wt, None, (a["sh"], a["sw"]), (a["ph"], a["pw"]), (a["dh"], a["dw"]), g))
        finally:
            torch.backends.cudnn.allow_tf32 = old
    except Exception:  # noqa: BLE001 - a reference only
        return None


MIN_MACS = 2**22  # below this a convolution runs in a few microseconds whatever its tile


def worth_tuning(call, buffers, hints: dict[str, int]) -> bool:
    """Whether a call's multiply-adds at the example sizes (depthwise: its reads) pay for
    compiling its candidates: the small late layers of a network at batch 1 keep the
    heuristic's tile, which is sized to their few output tiles."""
    try:
        a = dict(call.attrs)
        out = buffers[call.name].shape
        pixels = evaluate(out[-4] * out[-3] * out[-2], hints)
        oc = int(out[-1])
        if a["depthwise"]:
            return pixels * oc * a["kh"] * a["kw"] >= MIN_MACS // 4
        c = int(call.args[0].shape[3])
        return pixels * oc * c // a["groups"] * a["kh"] * a["kw"] >= MIN_MACS
    except Exception:  # noqa: BLE001 - sizes unknown: tune
        return True


def tune_conv(calls, buffers, hints: dict[str, int], arch: int, cache: Path,
              workers: int = 1) -> tuple[dict[str, Config], dict]:
    """({call name: best config}, {kernel name: {config text: ms}} of what ran): the calls
    worth it timed by launch_tune.time_candidates (report keys `conv_<call>`, with cuDNN's
    time as "cudnn_reference" where torch runs it)."""

    def reference(c) -> dict[str, float]:
        peer = cudnn_ms(c, buffers, hints)  # for the report only: packages do not call cuDNN
        return {} if peer is None else {"cudnn_reference": round(peer, 5)}

    return time_candidates([c for c in calls if worth_tuning(c, buffers, hints)],
                           conv_candidates, print_conv_kernel, buffers, hints, arch, cache,
                           workers, label="conv", reference=reference)
