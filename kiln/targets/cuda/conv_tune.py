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
(torch, channels-last, without the epilogue) beside the candidates', as a reference."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kiln.ir.sym import evaluate
from kiln.targets.cuda.conv_template import conv_candidates, print_conv_kernel
from kiln.targets.cuda.kernel import Config
from kiln.targets.cuda.launch_tune import (_add, _args, _cached, _compile_candidates, _store,
                                           _time_ms)
from kiln.targets.cuda.ops import PRELUDE
from kiln.toolchain import triton_aot


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
            def run():
                torch.nn.functional.conv2d(xt, wt, None, (a["sh"], a["sw"]), (a["ph"], a["pw"]),
                                           (a["dh"], a["dw"]), g)
            for _ in range(3):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            for _ in range(20):
                run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 20
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
    """({call name: best config}, {kernel name: {config text: ms}} of what ran)."""
    # deferred: Triton is optional (GPU builds only)
    import triton

    device = torch.cuda.get_device_name()
    root = cache / "autotune"
    best: dict[str, Config] = {}
    report: dict = {}
    todo = []
    copies: dict[str, list[str]] = {}
    for c in calls:
        if not worth_tuning(c, buffers, hints):
            continue
        cands = conv_candidates(c, buffers, hints)
        tks = [print_conv_kernel(c, buffers, hints, x) for x in cands]
        path, hit = _cached(root, tks, cands, hints, device, triton.__version__)
        if hit is not None:
            best[c.name] = hit
            continue
        _add(todo, copies, c, tks, path)
    if not todo:
        return best, report
    compiled = _compile_candidates(todo, cache, arch, workers)
    prelude = hashlib.sha256(PRELUDE.encode()).hexdigest()
    for i, (c, tks, path) in enumerate(todo):
        args = _args(tks[0], buffers, hints, torch)
        times = {}
        for j, tk in enumerate(tks):
            if (i, j) not in compiled:
                continue
            rows = max(1, evaluate(tk.rows, hints))  # depends on the tile
            grid = (-(-rows // tk.config.xblock), 1, 1)
            try:
                times[j] = _time_ms(compiled[(i, j)], grid,
                                    args + [tk.config.xblock, tk.config.rblock], torch)
            except Exception:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                if j == 0:
                    raise
        win = min(times, key=lambda j: (times[j], j))
        cfg = tks[win].config
        best[c.name] = cfg
        best.update({name: cfg for name in copies[c.name]})
        report[f"conv_{c.name}"] = {
            f"m{tks[j].config.xblock}n{tks[j].config.rblock}w{tks[j].config.num_warps}"
            f"s{tks[j].config.num_stages}": round(ms, 5) for j, ms in times.items()}
        peer = cudnn_ms(c, buffers, hints)
        if peer is not None:  # for the report only: packages do not call cuDNN
            report[f"conv_{c.name}"]["cudnn_reference"] = round(peer, 5)
        triton_aot.store_compiled(compiled[(i, win)], tks[win], arch, prelude, cache)
        _store(path, cfg, f"conv_{c.name}", device, report[f"conv_{c.name}"])
        del args
    return best, report
