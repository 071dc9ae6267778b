"""End-to-end tests of memory planning: models whose intermediates only fit with reuse, in-place
reuse visible in Program IR and still correct, dynamic models at many sizes (run-time plans),
and `kiln inspect --memory`. Every model runs through `kiln.load` and is compared with eager."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import kiln
from kiln.ir import program as P
from kiln.memory import naive_bytes
from kiln.memory.assign import intervals, plan_sizes
from kiln.options import Options


class Chain(nn.Module):
    """`depth` x (Linear -> GELU): 2 * depth intermediates of [batch, width], 2 live at once."""

    def __init__(self, width: int = 64, depth: int = 24) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(width, width, generator=g) / width ** 0.5)
            for _ in range(depth))
        self.bs = nn.ParameterList(nn.Parameter(0.1 * torch.randn(width, generator=g))
                                   for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, b in zip(self.ws, self.bs):
            x = F.gelu(x @ w + b)
        return x.sum(dim=-1)


class Attention(nn.Module):
    """Softmax over a product, then another product: the softmax kernel (max, sum, divide over a
    row) reads its dying input in earlier members (row-local) and writes in place of it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = torch.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1)
        return F.layer_norm(s @ v, (v.shape[-1],)) * 2.0


class RowChain(nn.Module):
    """softmax and layer norm over GEMM outputs, each fused into one kernel whose reduction
    members (max, sum / sum, sum of squares) read the row before the last member overwrites it
    in place (condition (4) of kiln/memory/inplace.py)."""

    def forward(self, x, w, w2):
        s = torch.softmax(x @ w, dim=-1)
        return F.layer_norm(s @ w2, (w2.shape[-1],)) @ w2


def _reuses(compiled) -> list[P.Alloc]:
    return [x for x in compiled.built.program.lines if isinstance(x, P.Alloc) and x.reuse]


def _check(model, args, compiled, tol=1e-4):
    runner = compiled.load()
    with torch.no_grad():
        want = model(*args)
        got = runner(*args)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def opts() -> Options:
    # GEMM epilogues unfused: these tests exercise the planner's in-place reuse of kernels
    # (a GEMM's pointwise consumer in place of its output); fused, the GEMM stores in place
    # itself (tests/gemm/test_gemm_epilogue_cpu.py). The session's build cache (objects are
    # keyed by their source and flags): a cache of its own made each worker precompile the
    # runtime headers again for this file.
    return Options(verify=True, cpu_gemm_epilogue=False)


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_long_chain_needs_reuse_and_matches_eager(opts):
    model = Chain().eval()
    x = torch.randn(32, 64)
    compiled = kiln.compile(model, (x,), options=opts)
    prog = compiled.built.program
    plan = compiled.manifest["plan"]
    naive = naive_bytes(intervals(prog, inplace=False), prog.alignment)
    assert naive >= 20 * plan["arena_bytes"], (naive, plan["arena_bytes"])
    assert plan["arena_bytes"] <= 1.05 * plan["lower_bound_bytes"]
    reuses = _reuses(compiled)
    assert len(reuses) >= 20  # every GELU (with its bias) runs in place of its GEMM's output
    assert plan["inplace"]["pairs"]
    # in place: one storage per chain, the same offset for both buffers of a pair
    offsets = {x.buf: x.offset for x in prog.lines if isinstance(x, P.Alloc)}
    assert all(offsets[a.buf] == offsets[a.reuse] for a in reuses)
    _check(model, (x,), compiled)
    _check(model, (torch.randn(32, 64),), compiled)


def test_inplace_drops_restrict_only_on_the_pair(opts):
    compiled = kiln.compile(Chain(depth=2).eval(), (torch.randn(4, 64),), options=opts)
    a = _reuses(compiled)[0]
    kernel = next(x for x in compiled.built.program.lines
                  if isinstance(x, P.CallKernel) and ("out", a.buf) in x.args)
    src = "\n".join(v for k, v in compiled.sources.items() if k.startswith("kernels_"))
    sig = next(line for line in src.splitlines() if f" {kernel.kernel}(" in line)
    assert f"float* buf_{a.buf}" in sig and f"float* buf_{a.reuse}" in sig
    assert f"__restrict__ buf_{a.buf}" not in sig and f"__restrict__ buf_{a.reuse}" not in sig
    others = [n for kind, n in kernel.args if kind != "size" and n not in (a.buf, a.reuse)]
    assert others and all(f"__restrict__ buf_{n}" in sig for n in others)


def test_softmax_in_place_with_row_reads(opts):
    model = Attention().eval()
    g = torch.Generator().manual_seed(1)
    args = tuple(torch.randn(2, 4, 48, 16, generator=g) for _ in range(3))
    compiled = kiln.compile(model, args, options=opts)
    assert _reuses(compiled)
    _check(model, args, compiled)


def test_in_place_after_row_reductions_in_one_kernel(opts):
    model = RowChain().eval()
    g = torch.Generator().manual_seed(2)
    args = (torch.randn(96, 40, generator=g), torch.randn(40, 40, generator=g),
            torch.randn(40, 40, generator=g))
    compiled = kiln.compile(model, args, options=opts)
    prog = compiled.built.program
    fused = {x.kernel: x.members for x in prog.lines if isinstance(x, P.CallKernel)}
    pairs = 0
    for a in _reuses(compiled):
        kernel = next(k for k, members in fused.items() if members[-1] == a.buf)
        pairs += len(fused[kernel]) >= 3  # reductions first, the in-place member last
    assert pairs == 2
    _check(model, args, compiled)
    _check(model, tuple(torch.randn_like(a) for a in args), compiled)


def test_dynamic_chain_many_sizes(opts):
    model = Chain(width=48, depth=6).eval()
    x = torch.randn(8, 48)
    compiled = kiln.compile(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=300)},),
                            options=opts)
    prog = compiled.built.program
    assert prog.dynamic and _reuses(compiled)
    sizes = compiled.manifest["plan"]["sizes"]
    assert [s["sizes"]["s0"] for s in sizes][0] == 1 and sizes[-1]["sizes"]["s0"] == 300
    assert all(s["arena_bytes"] >= s["lower_bound_bytes"] for s in sizes)
    runner = compiled.load()
    for n in (8, 1, 300, 2, 37, 8, 255, 64, 3, 300, 1):  # grow, shrink, repeat: re-plans
        xi = torch.randn(n, 48)
        with torch.no_grad():
            torch.testing.assert_close(runner(xi), model(xi), rtol=1e-4, atol=1e-4)
    assert all(r["ratio"] <= 1.10 for r in plan_sizes(prog, verify=True))


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_inspect_memory_json_and_png(opts, tmp_path, capsys):
    from kiln.cli.main import main

    model = Chain(width=32, depth=3).eval()
    pkg = tmp_path / "chain.kiln"
    kiln.compile(model, (torch.randn(4, 32),), dynamic_shapes=({0: Dim("b", min=1, max=64)},),
                 options=opts).save(pkg)
    png = tmp_path / "timeline.png"
    assert main(["inspect", str(pkg), "--memory", "--json", "--png", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("arena_bytes", "lower_bound_bytes", "planning_seconds", "ratio", "sizes",
                "largest_buffers"):
        assert key in data, key
    assert data["arena_bytes"] >= data["lower_bound_bytes"] > 0
    assert len(data["sizes"]) >= 3 and "planning_seconds" in data["sizes"][0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["inspect", str(pkg), "--memory"]) == 0
    text = capsys.readouterr().out
    assert "lower bound" in text and "in place" in text
