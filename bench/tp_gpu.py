"""Tensor parallelism on GPUs: kiln's TP packages (kiln.models.tp, NCCL collectives) against
one GPU and against torch eager with the same functional collectives, and the bus bandwidth of
kiln's all-reduce against NCCL called directly (ctypes; nccl-tests are not available).

    python bench/tp_gpu.py [--world 2] [--dtype bfloat16] [--layers 2] [--hidden 2048]
                           [--prefill 512] [--iters 30] [--sizes-mib 1,2,4,...,256]

Prints one table: decode latency (1 new token, the whole sequence of `--context` tokens
recomputed: no KV cache; batch 1), prefill tokens/s (`--prefill` tokens), and all-reduce bus
bandwidth per size (busbw = bytes / time * 2 (n - 1) / n, as nccl-tests report it). Medians;
ranks run as one process per GPU (`--worker` is one rank), the NCCL ids made by the parent.
Each section that fails prints its error and the others still run."""

from __future__ import annotations

import argparse
import ctypes
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
from kiln.runtime.comm import nccl_library_path


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


class _Uid(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class _Nccl:
    """NCCL through ctypes: the baseline all-reduce."""

    def __init__(self, uid: bytes, rank: int, world: int) -> None:
        self.lib = ctypes.CDLL(nccl_library_path(), mode=ctypes.RTLD_GLOBAL)
        self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _Uid,
                                              ctypes.c_int]
        self.lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_void_p]
        self.comm = ctypes.c_void_p()
        u = _Uid()
        u.internal = uid
        rc = self.lib.ncclCommInitRank(ctypes.byref(self.comm), world, u, rank)
        if rc:
            raise RuntimeError(f"ncclCommInitRank: {rc}")

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rc = self.lib.ncclAllReduce(x.data_ptr(), out.data_ptr(), x.numel(), 7, 0, self.comm,
                                    torch.cuda.current_stream().cuda_stream)  # float32, sum
        if rc:
            raise RuntimeError(f"ncclAllReduce: {rc}")


def _section(results: dict, name: str, fn) -> None:
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - report and go on with the other sections
        results[name] = {"error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()


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
    _section(res, "kiln_tp", kiln_tp)

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
    _section(res, "eager_tp", eager_tp)

    def bandwidth():
        r = kiln.load(work / "allreduce.kiln", dev, rank=rank, world_size=world,
                      comm_id=bytes.fromhex(ids["allreduce"]))
        nccl = _Nccl(bytes.fromhex(ids["nccl"]), rank, world)
        rows = []
        for mib in [int(s) for s in a.sizes_mib.split(",")]:
            n = mib * 2**20 // 4
            x = torch.randn(n, device=dev)
            out = torch.empty_like(x)
            iters = max(5, min(50, 2048 // mib))
            t_kiln = _loop_ms(lambda: r(x), iters)
            t_nccl = _loop_ms(lambda: nccl.all_reduce(x, out), iters)
            bus = 2 * (world - 1) / world
            rows.append({"mib": mib, "kiln_ms": t_kiln, "nccl_ms": t_nccl,
                         "kiln_busbw": mib * 2**20 / (t_kiln / 1e3) * bus / 1e9,
                         "nccl_busbw": mib * 2**20 / (t_nccl / 1e3) * bus / 1e9})
        return rows
    _section(res, "bandwidth", bandwidth)
    if rank == 0:
        (work / "rank0.json").write_text(json.dumps(res))


def _cfg(a) -> tp.LlamaConfig:
    return tp.LlamaConfig(a.vocab, a.hidden, a.inter, a.layers, a.heads, a.kv_heads)


class AllReduce(torch.nn.Module):
    def forward(self, x):
        return fc.all_reduce(x, "sum", dist.group.WORLD)


def _compile(a, work: pathlib.Path) -> dict:
    dt = getattr(torch, a.dtype)
    model = tp.random_llama(_cfg(a), seed=0, dtype=dt)
    torch.save(model.state_dict(), work / "model.pt")
    tok = torch.zeros(1, 8, dtype=torch.int64)
    t0 = time.perf_counter()
    seq = (1, max(a.prefill, a.context))
    dyn = ({1: torch.export.Dim("seq", min=seq[0], max=seq[1])},)
    opts = Options(autotune=a.autotune)
    one = kiln.compile(torch.export.export(model, (tok,), dynamic_shapes=dyn), device="cuda",
                       options=opts)
    one.save(work / "one.kiln")
    t1 = time.perf_counter()
    tp.export_tp(model, a.world, work, tok, dynamic_seq=seq, device="cuda", options=opts)
    t2 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.world)
    try:
        n = torch.export.Dim("n", min=2, max=256 * 2**20 // 4)
        ep = torch.export.export(AllReduce(), (torch.zeros(1024),), dynamic_shapes=({0: n},))
        kiln.compile(ep, device="cuda", options=opts).save(work / "allreduce.kiln")
    finally:
        dist.destroy_process_group()
    return {"compile_one_s": t1 - t0, "compile_tp_s": t2 - t1}


def _single(a, work: pathlib.Path) -> dict:
    dt = getattr(torch, a.dtype)
    ctx = torch.randint(0, a.vocab, (1, a.context), generator=torch.Generator().manual_seed(0))
    pre = torch.randint(0, a.vocab, (1, a.prefill), generator=torch.Generator().manual_seed(1))
    ctx, pre = ctx.cuda(), pre.cuda()
    r = kiln.load(work / "one.kiln", "cuda:0")
    out = {"kiln_1gpu": {"decode_ms": _median_ms(lambda: r(ctx), a.iters),
                         "prefill_ms": _median_ms(lambda: r(pre), max(a.iters // 3, 5))}}
    m = tp.Llama(_cfg(a))
    m.load_state_dict(torch.load(work / "model.pt"))
    m = m.to(dt).cuda().eval()
    with torch.no_grad():
        out["eager_1gpu"] = {"decode_ms": _median_ms(lambda: m(ctx), a.iters),
                             "prefill_ms": _median_ms(lambda: m(pre), max(a.iters // 3, 5))}
    return out


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
    _section(res, "compile", lambda: _compile(a, work))
    _section(res, "single", lambda: _single(a, work))
    (work / "pg").unlink(missing_ok=True)  # torch's file rendezvous of the eager TP run
    (work / "rank0.json").unlink(missing_ok=True)
    (work / "ids.json").write_text(json.dumps({k: nccl_unique_id().hex() for k in
                                               ("model", "allreduce", "nccl")}))
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
          f"{a.dtype}; compile {res.get('compile')}")
    single = res.get("single", {})
    rows = [("kiln, 1 GPU", single.get("kiln_1gpu", {"error": single.get("error")})),
            (f"kiln TP, {a.world} GPUs", ranks.get("kiln_tp", {"error": "?"})),
            ("eager, 1 GPU", single.get("eager_1gpu", {"error": single.get("error")})),
            (f"eager TP, {a.world} GPUs", ranks.get("eager_tp", {"error": "?"}))]
    print(f"\n| run | decode ms ({a.context} tokens, batch 1) | prefill ms ({a.prefill} tokens) "
          "| prefill tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    for label, d in rows:
        print(f"| {label} | {_fmt(d, 'decode_ms')} | {_fmt(d, 'prefill_ms')} | "
              f"{_fmt(d, 'prefill_ms', a.prefill)} |")
        if isinstance(d, dict) and "error" in d:
            print(f"|   error: {d['error']} | | | |")
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
        print(f"| failed: {bw} |")


if __name__ == "__main__":
    sys.exit(main())
