"""Tensor-parallel CUDA packages: collectives through NCCL (kiln_comm_nccl.h).

Without a GPU (CI): the program with every collective compiles to a CUDA package whose
wrapper (compiled here against cuda.h, libnccl opened at run time) enqueues each collective
on the run's stream and exports the kiln_model_comm_v1 table.
With 2 or 4 GPUs (`-m gpu`; tests/runtime/tp_worker.py is one rank, one process per GPU, the
ncclUniqueId made here and passed on the command line): every collective against numpy, and
the tensor-parallel Llama decoder (kiln.models.tp) against the single-GPU package: logits
within float32 tolerance, the same greedy tokens."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.testing._internal.distributed.fake_pg import FakeStore

import kiln
from kiln.models import tp
from kiln.options import Options
from kiln.frontend.export import import_program
from kiln.ir import program as P
from kiln.runtime import nccl_unique_id
from kiln.targets import collectives
from test_tp import CFG, Collectives, _greedy, _rank_inputs, _reference

WORKER = pathlib.Path(__file__).resolve().parents[2] / "runtime" / "tp_worker.py"
OPTS = Options(cuda_archs=(90,))


def _collectives_package(dtype, n: int, tmp: pathlib.Path, device: str, options=None):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        x, y = torch.zeros(2 * n + 1, 3, dtype=dtype), torch.zeros(5, dtype=dtype)
        cm = kiln.compile(torch.export.export(Collectives(dtype), (x, y)), device=device,
                          options=options)
    finally:
        dist.destroy_process_group()
    path = tmp / f"collectives_{device}_{str(dtype).removeprefix('torch.')}.kiln"
    cm.save(path)
    return cm, path, x.shape, y.shape


def test_collectives_compile_to_nccl_calls_on_the_stream(tmp_path):
    cm, path, _, _ = _collectives_package(torch.float32, 2, tmp_path, "cuda", OPTS)
    src = cm.sources["model_cuda.cpp"]
    assert '#include "kiln_comm_nccl.h"' in src
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert f"kcn::{kind}<uint32_t>(e, self->comm," in src
    calls = [ln for ln in src.splitlines() if "if (kcn::" in ln and "kcn::wait" not in ln]
    # ncclFloat32, the run's stream (forked to the communication stream), the index of the
    # collective's events; inside the graph body
    assert len(calls) == 8 and all(ln.rstrip().endswith(f", 7, stream, {k})) return 1;")
                                   for k, ln in enumerate(calls))
    waits = [ln.strip() for ln in src.splitlines() if "kcn::wait(" in ln]
    assert sorted(waits) == sorted(f"if (kcn::wait(e, self->comm, {k}, stream)) return 1;"
                                   for k in range(8))
    assert "kiln_model_comm_v1" in src and '"nccl"' in src
    assert "self->comm.release();" in src
    assert "comm_id, comm_id_len, 8);" in src  # 8 event pairs made at attach


class Overlap(torch.nn.Module):
    """y = all_reduce(a @ w1) and work independent of it (two GEMMs on b), joined at the end:
    the collective's window holds the independent GEMMs."""

    def __init__(self, k: int = 64, dtype=torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for i in (1, 2, 3):
            setattr(self, f"w{i}", torch.nn.Parameter(
                (torch.randn(k, k, generator=g) / k ** 0.5).to(dtype), requires_grad=False))

    def forward(self, a, b):
        y = fc.all_reduce(a @ self.w1, "sum", dist.group.WORLD)
        z = torch.relu(b @ self.w2) @ self.w3
        return y + z


def _check_waits(prog: P.Program) -> list[tuple[int, int]]:
    """Every collective has one wait after it, before any line that reads its result; the
    operand is freed only after the wait. (collective line, wait line) per collective."""
    lines = list(P.walk(prog.lines))
    pairs = []
    for k, x in enumerate(lines):
        if not collectives.is_collective(x):
            continue
        r, src = x.call.name, x.call.args[0].buf
        waits = [i for i, y in enumerate(lines) if isinstance(y, P.CallLib)
                 and y.call.routine == collectives.WAIT and y.call.name == r]
        assert len(waits) == 1 and waits[0] > k, (r, waits, k)
        w = waits[0]
        readers = [i for i, y in enumerate(lines) if i != k and i != w and
                   r in P.line_buffers(y) and not isinstance(y, (P.Alloc, P.Free))]
        assert all(i > w for i in readers), (r, readers, w)
        frees = [i for i, y in enumerate(lines) if isinstance(y, P.Free) and y.buf in (r, src)]
        assert all(i > w for i in frees), (r, frees, w)
        pairs.append((k, w))
    return pairs


def test_async_window_keeps_independent_work_between_collective_and_wait():
    """The exported program waits right after the all_reduce; kiln's Program IR issues it after
    a @ w1 and waits only before the add that reads it: both GEMMs on b (and the relu) run in
    between, while the operand's bytes stay reserved (its Free after the wait, so no buffer of
    the window shares them)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ep = torch.export.export(Overlap(), (torch.zeros(32, 64), torch.zeros(32, 64)))
        nodes = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        assert "wait_tensor" in str(nodes[nodes.index(torch.ops._c10d_functional.all_reduce.
                                                      default) + 1])  # torch's own order
        cm = kiln.compile(ep, device="cuda", options=OPTS)
    finally:
        dist.destroy_process_group()
    prog = cm.built.program
    ((k, w),) = _check_waits(prog)
    lines = list(P.walk(prog.lines))
    window = lines[k + 1:w]
    gemms = [x.gemm.name for x in window if isinstance(x, P.CallGemm)]
    assert len(gemms) == 2, [type(x).__name__ for x in window]
    src = lines[k].call.args[0].buf
    alloc = {x.buf: x for x in lines if isinstance(x, P.Alloc)}
    nbytes = {b: int(a.numel) * a.dtype.itemsize for b, a in alloc.items()}
    for g in gemms:  # planned apart from the operand, which NCCL may still read
        a, b = alloc[src].offset, alloc[g].offset
        assert a + nbytes[src] <= b or b + nbytes[g] <= a, (src, g)
    src_text = cm.sources["model_cuda.cpp"]
    assert src_text.index("kcn::all_reduce<") < src_text.index("kcn::wait(e, self->comm, 0")


class LateWait(Overlap):
    """The raw functional ops with the wait placed late by the program itself."""

    def forward(self, a, b):
        group = dist.group.WORLD.group_name
        h = torch.ops._c10d_functional.all_reduce(a @ self.w1, "sum", group)
        z = torch.relu(b @ self.w2) @ self.w3
        return torch.ops._c10d_functional.wait_tensor(h) + z


def test_a_late_wait_in_the_export_keeps_its_window():
    """A program that waits late itself: the Graph IR keeps the wait after the independent
    GEMMs (the exported order), and the Program IR's window holds them."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ep = torch.export.export(LateWait(), (torch.zeros(32, 64), torch.zeros(32, 64)))
        graph = import_program(ep).graph
        cm = kiln.compile(ep, device="cuda", options=OPTS)
    finally:
        dist.destroy_process_group()
    ops = [n.op for n in graph.nodes]
    c, w = ops.index("collective"), ops.index("collective_wait")
    assert ops[c + 1:w].count("matmul") == 2, ops
    ((k, w),) = _check_waits(cm.built.program)
    lines = list(P.walk(cm.built.program.lines))
    assert sum(isinstance(x, P.CallGemm) for x in lines[k + 1:w]) == 2


def test_every_collective_waits_before_its_readers():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ep = torch.export.export(Collectives(torch.float32), (torch.zeros(5, 3), torch.zeros(5)))
        cm = kiln.compile(ep, device="cuda", options=OPTS)
        llama = tp.shard(tp.random_llama(CFG, seed=0), 2, 0)
        lp = kiln.compile(tp.export_llama(llama, torch.zeros(1, 5, dtype=torch.int64), (1, 16)),
                          device="cuda", options=OPTS)
    finally:
        dist.destroy_process_group()
    assert len(_check_waits(cm.built.program)) == 8
    # the TP decoder: 2 all_reduce a layer and the logits' all_gather; each result is read
    # right away (residual add, the gathered logits), so its window is empty
    assert len(_check_waits(lp.built.program)) == 2 * CFG.num_hidden_layers + 1


def test_bfloat16_collective_compiles_for_cuda(tmp_path):
    cm, _, _, _ = _collectives_package(torch.bfloat16, 2, tmp_path, "cuda", OPTS)
    assert "kcn::all_reduce<uint16_t>" in cm.sources["model_cuda.cpp"]


def spawn(n: int, *args: str, timeout: int = 600, env: dict | None = None) -> None:
    """One worker per GPU, joined by a fresh ncclUniqueId."""
    uid = nccl_unique_id().hex()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", **(env or {}))
    procs = [subprocess.Popen([sys.executable, str(WORKER), *args, "--device", f"cuda:{r}",
                               "--rank", str(r), "--world", str(n), "--id", uid], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(n)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"


def _gpus(n: int):
    return pytest.param(n, id=f"{n}gpus", marks=pytest.mark.skipif(
        torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs"))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [_gpus(2), _gpus(4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_nccl_collectives_match_numpy(dtype, n, tmp_path):
    _, pkg, xshape, yshape = _collectives_package(dtype, n, tmp_path, "cuda")
    for seed in (0, 1):
        xs, ys = _rank_inputs(dtype, xshape, yshape, n, seed)
        torch.save([[x, y] for x, y in zip(xs, ys)], tmp_path / "inputs.pt")
        spawn(n, "collectives", str(pkg), str(tmp_path / "inputs.pt"),
              str(tmp_path / "out{rank}.pt"), "--repeat", "3")
        want = _reference(xs, ys, dtype, n)
        for r in range(n):
            got = torch.load(tmp_path / f"out{r}.pt")
            for k, (g, w) in enumerate(zip(got, want[r])):
                assert g.dtype == dtype, (r, k)
                np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5,
                                           err_msg=f"rank {r}, output {k}, seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [_gpus(2), _gpus(4)])
def test_tp_llama_on_several_gpus_matches_one(n, tmp_path):
    steps = 4
    model = tp.random_llama(CFG, seed=3)
    prompt = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    tp.export_tp(model, n, tmp_path, prompt, dynamic_seq=(1, 32), device="cuda")
    torch.save(prompt, tmp_path / "prompt.pt")
    spawn(n, "llama", str(tmp_path), str(tmp_path / "out.pt"), "--steps", str(steps))
    got = torch.load(tmp_path / "out.pt")
    # the single-GPU run: the whole model as one package
    one = kiln.compile(tp.export_llama(model, prompt, (1, 32)), device="cuda").load(
        tmp_path / "one.kiln", "cuda:0")
    single = one(prompt.cuda()).cpu()
    with torch.no_grad():
        ref = model.double()(prompt)
        tokens = _greedy(model.float(), prompt, steps)
    torch.testing.assert_close(got["logits"].double(), ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got["logits"], single, rtol=2e-3, atol=2e-3)
    assert torch.equal(got["tokens"], tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [_gpus(2), _gpus(4)])
@pytest.mark.parametrize("serial", ["0", "1"], ids=["overlapped", "serial"])
def test_overlapped_collective_matches_numpy(serial, n, tmp_path):
    """The all_reduce on the communication stream while the GEMMs on b run, joined at the add:
    float64 reference, and runs 2 (graph capture) and 3 (replay) equal to run 1 (direct);
    KILN_NCCL_SERIAL=1 (collectives on the compute stream) alike."""
    k, m = 256, 128
    model = Overlap(k)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        ep = torch.export.export(model, (torch.zeros(m, k), torch.zeros(m, k)))
        kiln.compile(ep, device="cuda").save(tmp_path / "overlap.kiln")
    finally:
        dist.destroy_process_group()
    g = torch.Generator().manual_seed(5)
    xs = [[torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)] for _ in range(n)]
    torch.save(xs, tmp_path / "inputs.pt")
    spawn(n, "collectives", str(tmp_path / "overlap.kiln"), str(tmp_path / "inputs.pt"),
          str(tmp_path / "out{rank}.pt"), "--repeat", "3", env={"KILN_NCCL_SERIAL": serial})
    w1, w2, w3 = (getattr(model, f"w{i}").double() for i in (1, 2, 3))
    y = sum(a.double() @ w1 for a, _ in xs)
    for r in range(n):
        (got,) = torch.load(tmp_path / f"out{r}.pt")
        want = y + torch.relu(xs[r][1].double() @ w2) @ w3
        torch.testing.assert_close(got.double(), want, rtol=5e-3, atol=5e-3)
