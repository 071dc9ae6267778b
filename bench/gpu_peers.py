"""kiln against torch's fastest GPU modes, one fresh process per model (issue 15's table).

Per model, dtype and batch, one worker process builds the model (bench/cpu_peers_models.py:
the zoo models and Hugging Face models built from configs with random weights), moves it to
the GPU in the dtype, and times, in this order: eager, kiln (default options, CUDA graphs on),
torch.compile default, mode="reduce-overhead" and mode="max-autotune". The row is saved after
each system, so a worker stopped at its limit (max-autotune's autotuning, mostly) keeps the
cells it timed and marks the one it was in. Each system is timed two ways after a warm-up:

- back to back (`bench/cuda_timing.stream_ms`): `--calls` calls enqueued between two CUDA
  events, median over `--repeat` batches: device time, host overhead hidden (as do_bench);
- synchronised: the wall time of one call followed by a device synchronise, median over
  `--repeat` calls: what one request waits for, host overhead included.

kiln's output is checked against eager's in the same dtype (max abs error / max |eager|).
A system that fails has its error in its cell; the others go on. Compile times are the first
call (torch.compile) and kiln.compile + load (export excluded), with whatever cache the
machine has.

    python bench/gpu_peers.py [--models gpt,hf_llama,...] [--dtypes bf16,fp32] [--batches 1,8]
                              [--modes default,reduce-overhead,max-autotune] [--markdown FILE]

Batch B scales an example whose first dimension is 1 (images, token ids) to B; a model whose
example already has another batch (mlp 64, gpt 2, bert_like 4) runs at its own batch only.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.cuda_timing import stream_ms, sync_ms  # noqa: E402
from bench.markdown import splice  # noqa: E402

BEGIN, END = "<!-- gpu-peers:begin -->", "<!-- gpu-peers:end -->"
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MODELS = ("mlp,gpt,bert_like_b4,resnet18,mobilenet_v2,ln_softmax,hf_llama,hf_qwen2,"
                  "hf_bert_base,hf_vit_base,hf_whisper_tiny_enc,hf_t5_encoder,hf_resnet50,"
                  "hf_mobilenet_v2")
MODE_KEYS = {"default": "tc", "reduce-overhead": "ro", "max-autotune": "ma"}


def _timed(row: dict, key: str, fn, a) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    row[f"{key}_ms"] = stream_ms(fn, a.calls, a.repeat)
    row[f"{key}_sync_ms"] = sync_ms(fn, a.repeat, warmup=0)


def _inputs(case_args: tuple, batch: int, dtype: torch.dtype) -> tuple:
    out = []
    for t in case_args:
        if batch > 1:
            t = t.expand(batch, *t.shape[1:]).contiguous()
        out.append(t.to("cuda", dtype if t.is_floating_point() else t.dtype))
    return tuple(out)


def _first(x):
    while isinstance(x, (tuple, list)):
        x = x[0]
    return x


def worker(a) -> dict:
    from bench.cpu_peers_models import build

    torch.manual_seed(0)
    # float32 is float32 for every system (issue 15's "TF32 off"): cuDNN's convolutions in
    # eager and torch.compile otherwise run on TF32 tensor cores (cudnn.allow_tf32 defaults to
    # True), 10 mantissa bits, while kiln computes float32 (until the sixteenth session this
    # worker left cuDNN's default: its float32 convolution rows favoured the peers)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    case = build(a.one)
    dtype = DT[a.dtype]
    if a.batch > 1 and any(t.shape[0] != 1 for t in case.args):
        return {"skip": f"example batch is {case.args[0].shape[0]}, not 1"}
    module = case.module.to("cuda", dtype).eval()
    args = _inputs(case.args, a.batch, dtype)
    row: dict = {"note": case.note, "batch_actual": int(args[0].shape[0]) if args[0].dim() else 1}
    with torch.no_grad():
        want = _first(module(*args)).float()
        _timed(row, "eager", lambda: module(*args), a)
        _kiln(row, module, args, want, a)
        _save(row, a)
        for mode in a.modes.split(","):
            key = MODE_KEYS[mode]
            row["running"] = key  # what a timed-out worker was doing
            _save(row, a)
            try:
                torch._dynamo.reset()
                compiled = torch.compile(module, mode=mode)
                t0 = time.perf_counter()
                compiled(*args)
                torch.cuda.synchronize()
                row[f"{key}_compile_s"] = time.perf_counter() - t0
                _timed(row, key, lambda c=compiled: c(*args), a)
            except Exception as e:  # noqa: BLE001 - reported in the cell, the others go on
                row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:160]
        row.pop("running", None)
    return row


def _save(row: dict, a) -> None:
    """The row so far, so that a worker killed at its limit (max-autotune's compile, mostly)
    still reports the systems it timed."""
    Path(a.out).write_text(json.dumps(row))


def _kiln(row: dict, module, args, want, a) -> None:
    """kiln right after eager, before torch.compile's modes: a mode whose compile runs past
    the worker's limit then costs only its own cell."""
    import kiln

    torch._dynamo.reset()
    try:
        t0 = time.perf_counter()
        ep = torch.export.export(module, args)
        row["kiln_export_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        cm = kiln.compile(ep, device="cuda")
        runner = cm.load(Path(tempfile.mkdtemp()) / f"{a.one}.kiln", device="cuda:0")
        row["kiln_compile_s"] = time.perf_counter() - t0
        # where the compile went (the report's stages, the slowest ten), for compiles
        # that take longer here than in a fresh process
        stages = sorted(cm.report["stages"].items(), key=lambda kv: -kv[1])[:10]
        row["kiln_stages"] = {k: round(v, 2) for k, v in stages}
        got = _first(runner(*args)).float()
        row["kiln_err"] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        _timed(row, "kiln", lambda: runner(*args), a)
    except Exception as e:  # noqa: BLE001
        row["kiln_error"] = f"{type(e).__name__}: {e}"[:160]
        traceback.print_exc()


def _cell(row: dict, key: str, suffix: str = "_ms") -> str:
    if f"{key}_error" in row:
        return "fail"
    v = row.get(f"{key}{suffix}")
    return f"{v:.3f}" if isinstance(v, float) else "-"


def _best(row: dict, keys, suffix: str) -> float | None:
    vals = [row[f"{k}{suffix}"] for k in keys if isinstance(row.get(f"{k}{suffix}"), float)]
    return min(vals) if vals else None


def table(rows: list[dict], modes: list[str]) -> str:
    peers = ["eager", *[MODE_KEYS[m] for m in modes]]
    head = ["model", "dtype", "batch", *peers, "kiln", "kiln / best", "sync: best peer",
            "sync: kiln", "sync ratio", "kiln err", "kiln compile s", "ro compile s"]
    lines = [f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; ms per call; "
             f"back to back (device time) unless 'sync' (one call + synchronise); "
             f"tc = torch.compile default, ro = reduce-overhead, ma = max-autotune.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios, sync_ratios = [], []
    for r in rows:
        if "skip" in r:
            continue
        cells = [r["model"], r["dtype"], str(r.get("batch_actual", r["batch"]))]
        if "error" in r:
            lines.append("| " + " | ".join(cells + [r["error"][:80]]) + " |")
            continue
        best, best_sync = _best(r, peers, "_ms"), _best(r, peers, "_sync_ms")
        kiln, kiln_sync = r.get("kiln_ms"), r.get("kiln_sync_ms")
        ratio = kiln / best if kiln and best else None
        sync = kiln_sync / best_sync if kiln_sync and best_sync else None
        if ratio:
            ratios.append(ratio)
        if sync:
            sync_ratios.append(sync)
        cells += [_cell(r, k) for k in peers] + [_cell(r, "kiln")]
        cells += [f"{ratio:.2f}" if ratio else "-", f"{best_sync:.3f}" if best_sync else "-",
                  _cell(r, "kiln", "_sync_ms"), f"{sync:.2f}" if sync else "-",
                  f"{r['kiln_err']:.1e}" if "kiln_err" in r else "-",
                  _cell(r, "kiln", "_compile_s"), _cell(r, "ro", "_compile_s")]
        lines.append("| " + " | ".join(cells) + " |")
    for label, rs in (("back to back", ratios), ("synchronised", sync_ratios)):
        if rs:
            g = math.exp(sum(map(math.log, rs)) / len(rs))
            lines.append(f"\nkiln / best peer, geometric mean ({label}): {g:.2f} over {len(rs)} "
                         f"rows; kiln slower on {sum(x > 1.0 for x in rs)}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--modes", default="default,reduce-overhead,max-autotune")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--calls", type=int, default=10, help="calls per back-to-back batch")
    p.add_argument("--timeout", type=float, default=900, help="s per worker process")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        try:
            row = worker(a)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = {"error": f"{type(e).__name__}: {e}"[:200]}
        Path(a.out).write_text(json.dumps(row))
        return 0
    if not torch.cuda.is_available():
        print("gpu_peers: needs a CUDA GPU")
        return 1
    rows = []
    for model in a.models.split(","):
        for dtype in a.dtypes.split(","):
            for batch in (int(b) for b in a.batches.split(",")):
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    cmd = [sys.executable, __file__, "--one", model, "--dtype", dtype,
                           "--batch", str(batch), "--out", f.name, "--repeat", str(a.repeat),
                           "--calls", str(a.calls), "--modes", a.modes]
                    try:
                        subprocess.run(cmd, timeout=a.timeout, check=False)
                        row = json.loads(Path(f.name).read_text() or '{"error": "no result"}')
                    except subprocess.TimeoutExpired:
                        text = Path(f.name).read_text()
                        row = json.loads(text) if text else {"error": "timed out"}
                        what = row.pop("running", None)
                        if what:  # the systems timed before the limit keep their cells
                            row[f"{what}_error"] = f"timed out after {a.timeout:.0f} s"
                        else:
                            row = {"error": f"timed out after {a.timeout:.0f} s"}
                row.update(model=model, dtype=dtype, batch=batch)
                rows.append(row)
                print(json.dumps(row), flush=True)
                _write(rows, a)  # after every row: a run stopped at its limit keeps the rest
    print("\n" + table(rows, a.modes.split(",")))
    return 0


def _write(rows: list[dict], a) -> None:
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.markdown:
        splice(a.markdown, BEGIN, END, table(rows, a.modes.split(",")),
               "## GPU: kiln against torch.compile's modes")


if __name__ == "__main__":
    sys.exit(main())
