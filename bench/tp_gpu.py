"""Tensor parallelism on GPUs: kiln's TP packages (kiln.models.tp, NCCL collectives) against
one GPU and against torch eager with the same functional collectives, and the bus bandwidth of
kiln's all-reduce against NCCL's all-reduce through torch.distributed's NCCL process group
(the same library; nccl-tests are not available).

    python bench/tp_gpu.py [--world 2] [--dtype bfloat16] [--layers 2] [--hidden 2048]
                           [--prefill 512] [--iters 30] [--sizes-mib 1,2,4,...,256]

Prints one table: decode latency (1 new token, the whole sequence of `--context` tokens
recomputed: no KV cache; batch 1), prefill tokens/s (`--prefill` tokens), all-reduce bus
bandwidth per size (busbw = bytes / time * 2 (n - 1) / n, as nccl-tests report it), and the
overlap of a collective with independent compute: y = all_reduce(a @ w1) while
z = relu(b @ w2) @ w3 runs, out = y + z (bfloat16, `--overlap-m` x `--overlap-k`), one package
timed with its collectives on the communication stream (overlapped) and with
KILN_NCCL_SERIAL=1 (on the compute stream: serial), interleaved, each its own communicator. Medians;
ranks run as one process per GPU (`--worker` is one rank), the NCCL ids made by the parent.
Each section that fails prints one line (its traceback goes to OUT/tracebacks.log) and the
others still run; a section whose package was not built is skipped with one line."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.testing._internal.distributed.fake_pg import FakeStore

import kiln
from kiln.models import tp
from kiln.options import Options
from kiln.runtime import nccl_unique_id


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sizes-mib", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--overlap-m", type=int, default=4096)
    p.add_argument("--overlap-k", type=int, default=4096)
    p.add_argument("--skip", default="", help="comma-separated sections to skip: model, "
                   "bandwidth, overlap")
    p.add_argument("--out", default="")
    p.add_argument("--autotune", action="store_true",
                   help="autotune launch configs at compile time (slower compiles; the same "
                        "option for the 1-GPU and the TP packages)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _loop_ms(fn, iters: int, warmup: int = 3) -> float:
    """Mean time per call of `iters` back-to-back calls (bandwidth: no sync between calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    text = " ".join(lines[:2])  # e.g. "Constraints violated (seq)! ... - Not all values ..."
    return f"{type(e).__name__}: {text[:400]}"


def _section(results: dict, name: str, fn, needs: tuple[pathlib.Path, ...] = (),
             log: pathlib.Path | None = None) -> None:
    """Run one section; a failure is one line on stderr, its traceback appended to `log`
    (default: beside the first of `needs`, else not kept). A section whose packages are
    missing (their compile failed) is skipped with one line."""
    missing = [p.name for p in needs if not p.exists()]
    if missing:
        results[name] = {"error": f"skipped: {', '.join(missing)} not built (see compile)"}
        print(f"tp_gpu: {name}: {results[name]['error']}", file=sys.stderr)
        return
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - report and go on with the other sections
        results[name] = {"error": _first_line(e)}
        log = log or (needs[0].with_name("tracebacks.log") if needs else None)
        if log is not None:
            with open(log, "a") as f:
                f.write(f"== {name} (pid {os.getpid()})\n{traceback.format_exc()}\n")
        print(f"tp_gpu: {name} failed: {results[name]['error']}"
              + (f" (traceback: {log})" if log is not None else ""), file=sys.stderr)


def worker(a) -> None:
    rank, world, work = a.rank, a.world, pathlib.Path(a.out)
    torch.cuda.set_device(rank)
    dev = f"cuda:{rank}"
    ids = json.loads((work / "ids.json").read_text())
    res: dict = {}
    ctx = torch.randint(0, a.vocab, (1, a.context), generator=torch.Generator().manual_seed(0))
    pre = torch.randint(0, a.vocab, (1, a.prefill), generator=torch.Generator().manual_seed(1))
    ctx, pre = ctx.to(dev), pre.to(dev)

    def kiln_tp():
        r = kiln.load(work / f"rank{rank}.kiln", dev, rank=rank, world_size=world,
                      comm_id=bytes.fromhex(ids["model"]))
        return {"decode_ms": _median_ms(lambda: r(ctx), a.iters),
                "prefill_ms": _median_ms(lambda: r(pre), max(a.iters // 3, 5))}
    if "model" not in a.skip:
        _section(res, "kiln_tp", kiln_tp, (work / f"rank{rank}.kiln",))

    def eager_tp():
        dist.init_process_group("nccl", init_method=f"file://{work / 'pg'}", rank=rank,
                                world_size=world, device_id=torch.device(dev))
        full = tp.Llama(_cfg(a))
        full.load_state_dict(torch.load(work / "model.pt"))
        m = tp.shard(full.to(getattr(torch, a.dtype)), world, rank).to(dev)
        with torch.no_grad():
            out = {"decode_ms": _median_ms(lambda: m(ctx), a.iters),
                   "prefill_ms": _median_ms(lambda: m(pre), max(a.iters // 3, 5))}
        return out
    if "model" not in a.skip:
        _section(res, "eager_tp", eager_tp, (work / "model.pt",))

    def bandwidth():
        r = kiln.load(work / "allreduce.kiln", dev, rank=rank, world_size=world,
                      comm_id=bytes.fromhex(ids["allreduce"]))
        if not dist.is_initialized():  # the eager TP section failed before making it
            dist.init_process_group("nccl", init_method=f"file://{work / 'pg'}", rank=rank,
                                    world_size=world, device_id=torch.device(dev))
        rows = []
        for mib in [int(s) for s in a.sizes_mib.split(",")]:
            n = mib * 2**20 // 4
            x = torch.randn(n, device=dev)
            out = x.clone()
            iters = max(5, min(50, 2048 // mib))
            t_kiln = _loop_ms(lambda: r(x), iters)
            t_nccl = _loop_ms(lambda: dist.all_reduce(out), iters)
            bus = 2 * (world - 1) / world
            rows.append({"mib": mib, "kiln_ms": t_kiln, "nccl_ms": t_nccl,
                         "kiln_busbw": mib * 2**20 / (t_kiln / 1e3) * bus / 1e9,
                         "nccl_busbw": mib * 2**20 / (t_nccl / 1e3) * bus / 1e9})
        return rows
    if "bandwidth" not in a.skip:
        _section(res, "bandwidth", bandwidth, (work / "allreduce.kiln",))

    def overlap():
        g = torch.Generator().manual_seed(rank)
        m, k = a.overlap_m, a.overlap_k
        xa = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
        xb = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
        runs = {}
        for mode, serial in (("serial", "1"), ("overlapped", "0")):
            os.environ["KILN_NCCL_SERIAL"] = serial  # read when the communicator is attached
            runs[mode] = kiln.load(work / "overlap.kiln", dev, rank=rank, world_size=world,
                                   comm_id=bytes.fromhex(ids["overlap_" + mode]))
        os.environ.pop("KILN_NCCL_SERIAL")
        outs = {mode: r(xa, xb) for mode, r in runs.items()}
        torch.cuda.synchronize()
        diff = (outs["serial"].float() - outs["overlapped"].float()).abs().max().item()
        times: dict[str, list[float]] = {mode: [] for mode in runs}
        for _ in range(5):  # interleaved A/B rounds
            for mode, r in runs.items():
                times[mode].append(_median_ms(lambda: r(xa, xb), max(a.iters // 2, 10)))
        out = {mode: statistics.median(t) for mode, t in times.items()}
        out["max_diff"] = diff
        out["bytes"] = m * k * 2
        return out
    if "overlap" not in a.skip:
        _section(res, "overlap", overlap, (work / "overlap.kiln",))
    if rank == 0:
        (work / "rank0.json").write_text(json.dumps(res))


def _cfg(a) -> tp.LlamaConfig:
    return tp.LlamaConfig(a.vocab, a.hidden, a.inter, a.layers, a.heads, a.kv_heads)


class AllReduce(torch.nn.Module):
    def forward(self, x):
        return fc.all_reduce(x, "sum", dist.group.WORLD)


class Overlap(torch.nn.Module):
    """y = all_reduce(a @ w1) and, independent of it, z = relu(b @ w2) @ w3; out = y + z."""

    def __init__(self, k: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for i in (1, 2, 3):
            w = (torch.randn(k, k, generator=g) / k ** 0.5).to(torch.bfloat16)
            setattr(self, f"w{i}", torch.nn.Parameter(w, requires_grad=False))

    def forward(self, a, b):
        y = fc.all_reduce(a @ self.w1, "sum", dist.group.WORLD)
        return y + torch.relu(b @ self.w2) @ self.w3


def _compile_overlap(a, work: pathlib.Path) -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.world)
    try:
        x = torch.zeros(a.overlap_m, a.overlap_k, dtype=torch.bfloat16)
        ep = torch.export.export(Overlap(a.overlap_k), (x, x))
        cm = kiln.compile(ep, device="cuda", options=Options(autotune=a.autotune))
        cm.save(work / "overlap.kiln")
    finally:
        dist.destroy_process_group()
    prog = cm.built.program.lines
    k = next(i for i, x in enumerate(prog) if getattr(getattr(x, "call", None), "routine",
                                                      "") == "all_reduce")
    w = next(i for i, x in enumerate(prog) if getattr(getattr(x, "call", None), "routine",
                                                      "") == "collective_wait")
    gemms = sum(type(x).__name__ == "CallGemm" for x in prog[k + 1:w])
    return {"gemms_in_window": gemms}


def _seq_range(a) -> tuple[int, int]:
    return 1, max(a.prefill, a.context)


def _model(a, work: pathlib.Path) -> tp.Llama:
    model = tp.random_llama(_cfg(a), seed=0, dtype=getattr(torch, a.dtype))
    if not (work / "model.pt").exists():
        torch.save(model.state_dict(), work / "model.pt")
    return model


def _compile_one(a, work: pathlib.Path) -> dict:
    model = _model(a, work)
    tok = torch.zeros(1, 8, dtype=torch.int64)
    seq = _seq_range(a)
    t0 = time.perf_counter()
    one = kiln.compile(tp.export_llama(model, tok, seq), device="cuda",
                       options=Options(autotune=a.autotune))
    one.save(work / "one.kiln")
    return {"compile_one_s": round(time.perf_counter() - t0, 1)}


def _compile_tp(a, work: pathlib.Path) -> dict:
    model = _model(a, work)
    tok = torch.zeros(1, 8, dtype=torch.int64)
    seq = _seq_range(a)
    t0 = time.perf_counter()
    tp.export_tp(model, a.world, work, tok, dynamic_seq=seq, device="cuda",
                 options=Options(autotune=a.autotune))
    return {"compile_tp_s": round(time.perf_counter() - t0, 1)}


def _compile_allreduce(a, work: pathlib.Path) -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.world)
    try:
        n = torch.export.Dim("n", min=2, max=256 * 2**20 // 4)
        ep = torch.export.export(AllReduce(), (torch.zeros(1024),), dynamic_shapes=({0: n},))
        kiln.compile(ep, device="cuda", options=Options(autotune=a.autotune)).save(
            work / "allreduce.kiln")
    finally:
        dist.destroy_process_group()
    return {}


def _inputs(a, dev):
    ctx = torch.randint(0, a.vocab, (1, a.context), generator=torch.Generator().manual_seed(0))
    pre = torch.randint(0, a.vocab, (1, a.prefill), generator=torch.Generator().manual_seed(1))
    return ctx.to(dev), pre.to(dev)


def _kiln_1gpu(a, work: pathlib.Path) -> dict:
    ctx, pre = _inputs(a, "cuda:0")
    r = kiln.load(work / "one.kiln", "cuda:0")
    return {"decode_ms": _median_ms(lambda: r(ctx), a.iters),
            "prefill_ms": _median_ms(lambda: r(pre), max(a.iters // 3, 5))}


def _eager_1gpu(a, work: pathlib.Path) -> dict:
    ctx, pre = _inputs(a, "cuda:0")
    m = tp.Llama(_cfg(a))
    m.load_state_dict(torch.load(work / "model.pt"))
    m = m.to(getattr(torch, a.dtype)).cuda().eval()
    with torch.no_grad():
        return {"decode_ms": _median_ms(lambda: m(ctx), a.iters),
                "prefill_ms": _median_ms(lambda: m(pre), max(a.iters // 3, 5))}


def main(argv=None) -> int:
    a = _args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if a.worker:
        worker(a)
        return 0
    if torch.cuda.device_count() < a.world:
        print(f"tp_gpu: needs {a.world} GPUs, this machine has {torch.cuda.device_count()}")
        return 1
    work = pathlib.Path(a.out or tempfile.mkdtemp(prefix="kiln_tp_"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {}
    (work / "model.pt").unlink(missing_ok=True)
    for f in ("one.kiln", "allreduce.kiln", "overlap.kiln",
              *[f"rank{r}.kiln" for r in range(a.world)]):
        (work / f).unlink(missing_ok=True)  # no stale package from an earlier run
    tb = work / "tracebacks.log"
    tb.unlink(missing_ok=True)
    if "model" not in a.skip:
        _section(res, "compile_one", lambda: _compile_one(a, work), log=tb)
        _section(res, "compile_tp", lambda: _compile_tp(a, work), log=tb)
    if "bandwidth" not in a.skip:
        _section(res, "compile_allreduce", lambda: _compile_allreduce(a, work), log=tb)
    if "overlap" not in a.skip:
        _section(res, "compile_overlap", lambda: _compile_overlap(a, work), log=tb)
    if "model" not in a.skip:
        _section(res, "kiln_1gpu", lambda: _kiln_1gpu(a, work), (work / "one.kiln",))
        _section(res, "eager_1gpu", lambda: _eager_1gpu(a, work), (work / "model.pt",))
    (work / "pg").unlink(missing_ok=True)  # torch's file rendezvous of the eager TP run
    (work / "rank0.json").unlink(missing_ok=True)
    (work / "ids.json").write_text(json.dumps({k: nccl_unique_id().hex() for k in
                                               ("model", "allreduce", "overlap_serial",
                                                "overlap_overlapped")}))
    argv_w = [sys.executable, __file__, "--worker", "--out", str(work),
              *[x for x in (argv or sys.argv[1:]) if x != "--worker"]]
    procs = [subprocess.Popen([*argv_w, "--rank", str(r)]) for r in range(a.world)]
    rcs = [p.wait(timeout=1800) for p in procs]
    ranks = json.loads((work / "rank0.json").read_text()) if (work / "rank0.json").exists() \
        else {"error": f"workers exited {rcs}"}
    _report(a, res, ranks)
    return 0 if all(rc == 0 for rc in rcs) else 1


def _fmt(d: dict, key: str, tokens: int = 0) -> str:
    if not isinstance(d, dict) or "error" in d or key not in d:
        return "failed"
    return f"{tokens / d[key] * 1e3:,.0f}" if tokens else f"{d[key]:.3f}"


def _report(a, res: dict, ranks: dict) -> None:
    name = torch.cuda.get_device_name(0)
    print(f"\nGPU: {a.world} x {name}; torch {torch.__version__}; model: Llama-shaped, "
          f"{a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.kv_heads} kv), "
          f"{a.dtype}")
    for key in ("compile_one", "compile_tp", "compile_allreduce", "compile_overlap"):
        if key not in res:
            continue
        d = res.get(key, {})
        print(f"{key}: " + (f"FAILED: {d['error']}" if "error" in d else
                             (", ".join(f"{k} {v}" for k, v in d.items()) or "ok")))
    lost = {"error": ranks.get("error", "?")}  # the workers wrote nothing
    rows = [] if "model" in a.skip else [("kiln, 1 GPU", res.get("kiln_1gpu", {"error": "?"})),
            (f"kiln TP, {a.world} GPUs", ranks.get("kiln_tp", lost)),
            ("eager, 1 GPU", res.get("eager_1gpu", {"error": "?"})),
            (f"eager TP, {a.world} GPUs", ranks.get("eager_tp", lost))]
    if rows:
        print(f"\n| run | decode ms ({a.context} tokens, batch 1) | prefill ms ({a.prefill} "
              "tokens) | prefill tokens/s |")
        print("| --- | ---: | ---: | ---: |")
    for label, d in rows:
        print(f"| {label} | {_fmt(d, 'decode_ms')} | {_fmt(d, 'prefill_ms')} | "
              f"{_fmt(d, 'prefill_ms', a.prefill)} |")
        if isinstance(d, dict) and "error" in d:
            print(f"|   error: {d['error']} | | | |")
    ov = ranks.get("overlap")
    if ov is not None:
        print(f"\noverlap: all_reduce of {a.overlap_m}x{a.overlap_k} bfloat16 "
              f"({a.overlap_m * a.overlap_k * 2 / 2**20:.0f} MiB) beside 2 independent "
              f"{a.overlap_m}x{a.overlap_k}x{a.overlap_k} GEMMs, rank 0, median of 5 "
              "interleaved rounds")
        print("| collectives | ms | vs serial |")
        print("| --- | ---: | ---: |")
        if "error" in ov:
            print(f"| failed: {ov['error']} | | |")
        else:
            print(f"| serial (KILN_NCCL_SERIAL=1, compute stream) | {ov['serial']:.3f} | 1.00 |")
            print(f"| overlapped (communication stream) | {ov['overlapped']:.3f} | "
                  f"{ov['serial'] / ov['overlapped']:.2f}x |")
            print(f"(max |serial - overlapped| = {ov['max_diff']:.3g}; saved "
                  f"{ov['serial'] - ov['overlapped']:.3f} ms)")
    bw = ranks.get("bandwidth")
    print(f"\nall-reduce (float32, sum), {a.world} ranks: bus bandwidth GB/s")
    print("| MiB | kiln ms | NCCL ms | kiln busbw | NCCL busbw | kiln / NCCL |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    if isinstance(bw, list):
        for r in bw:
            print(f"| {r['mib']} | {r['kiln_ms']:.3f} | {r['nccl_ms']:.3f} | "
                  f"{r['kiln_busbw']:.1f} | {r['nccl_busbw']:.1f} | "
                  f"{r['kiln_busbw'] / r['nccl_busbw']:.2f} |")
    else:
        err = bw.get("error") if isinstance(bw, dict) else ranks.get("error", "?")
        print(f"| failed: {err} |")


if __name__ == "__main__":
    sys.exit(main())
