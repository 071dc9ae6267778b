"""Kernels per decode step on CUDA (issue 17.3), compiled without a GPU (autotune off):

- store-once of GEMM sums (passes/store_once.py): a residual add `x + linear(h)` read by
  several later ops is materialised, so the GEMV stores it as its epilogue and no reader
  recomputes it (and no row kernel stores it);
- tiny members gathered (schedule's `tiny`, CUDA): a small pointwise node joins the last
  kernel across GEMMs / library calls it does not read, even where the kernel's outer shrinks
  (a decode step's query rotary embedding joins the keys' one, across the cache writes);
- KV-cache writes fused (schedule/puts.py): the small `put` calls after a one-row kernel
  run in its program, after a barrier;
- the Llama decode step's kernels per layer: at most `PER_LAYER` (was 10: the residual sum's
  row kernel, the o projection on cuBLAS, the queries' rotary kernel and the two cache
  writes' launches are gone), counted from
  the manifest at 2 and 3 layers (the difference is one layer), and the whole step at most
  PER_LAYER * layers + 3 (rotary tables, head, position counters).

Each fused program is also run by Triton's interpreter through the Program IR against float64
torch math (fresh inputs, float32 and bfloat16)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.frontend.export import import_program  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.lowering import lower  # noqa: E402
from kiln.options import Options  # noqa: E402
from kiln.passes.dce import dce  # noqa: E402
from kiln.passes.store_once import gemm_sums  # noqa: E402
from kiln.schedule import Kernel, schedule  # noqa: E402
from kiln.schedule.steps import GemmKernel  # noqa: E402

OPTS = Options(cuda_archs=(90,), autotune=False)
TRITON_ONLY = Options(cuda_archs=(90,), autotune=False, gemm_backends=("triton",))

#: kernels per Llama layer in a decode step: q/k/v GEMV (RMSNorm prologue), attention with
#: the rotary of q and k and the two cache writes (targets/cuda/attention.py
#: `fuse_decode_puts`; before: a one-program kernel of its own), o GEMV (+ residual), gate/up
#: GEMV (RMSNorm prologue), down GEMV (silu*mul prologue, + residual)
PER_LAYER = 5


class ResTwice(torch.nn.Module):
    """h = x + W y read twice (a residual stream: the next norm and the next residual add)."""

    def __init__(self, k, n):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=False)

    def forward(self, x, y):
        h = x + self.lin(y)
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype), h + 1


class ResAlsoRaw(ResTwice):
    """The GEMM's raw result is read besides the sum: storing the sum fuses nothing."""

    def forward(self, x, y):
        z = self.lin(y)
        h = x + z
        return h * 2, h + 1, z * 3


class TinyAcross(torch.nn.Module):
    """Two small pointwise values with a GEMM between them; the second does not read it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x, y):
        a = torch.sin(x) * 2
        b = self.lin(a)
        c = torch.cos(y) + 1  # independent of b: joins a's kernel before the GEMM
        d = b * 3  # reads the GEMM: stays after it
        return b, c, d


class TwoWrites(torch.nn.Module):
    """A static cache written at two positions, the second write reading the first's
    output as its `self` (chained puts on one state: the second may not join the first's
    launch), then the row after both writes; and a second cache written once (joins)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.register_buffer("c", torch.randn(2, 8, 4, generator=g).to(dtype))
        self.register_buffer("d", torch.randn(2, 8, 4, generator=g).to(dtype))

    def forward(self, a, b, p, q):
        a = torch.sin(a)
        self.d[:, p] = a * 3
        self.c[:, p] = a
        self.c[:, q] = b
        return self.c * 1, self.d * 1


def _graph(m, args):
    return dce(import_program(torch.export.export(m, args), library_routines=False,
                              fused_attention=True).graph)


def _bf16(*shapes):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes)


def test_gemm_sums_picks_the_residual_read_twice():
    m = ResTwice(48, 32).to(torch.bfloat16)
    g = _graph(m, _bf16((1, 32), (1, 48)))
    sums = gemm_sums(g)
    nodes = {n.name: n for n in g.nodes}
    assert len(sums) == 1 and nodes[next(iter(sums))].op == "add", sums
    # lowering materialises it: a Compute writing the sum, the GEMM read by it alone
    prog = lower(g, sums)
    (gemm,) = [n for n in prog.nodes if isinstance(n, L.Gemm)]
    readers = [n for n in prog.nodes if gemm.name in L.node_reads(n)]
    assert [r.name for r in readers] == list(sums)
    before = lower(g)
    assert len([n for n in before.nodes if gemm.name in L.node_reads(n)]) > 1


def test_gemm_sums_refuses_a_gemm_read_elsewhere_and_single_users():
    g = _graph(ResAlsoRaw(48, 32).to(torch.bfloat16), _bf16((1, 32), (1, 48)))
    assert gemm_sums(g) == frozenset()

    class Once(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x, y):
            return (x + self.lin(y)) * 2

    assert gemm_sums(_graph(Once(), (torch.randn(1, 8), torch.randn(1, 8)))) == frozenset()


class Act(torch.nn.Module):
    """Activations that read the GEMM's biased result several times, all meeting again in
    one pointwise value (the whole expression is the GEMM's epilogue: nothing to store)."""

    def __init__(self, act):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.act = act

    def forward(self, x):
        t = self.fc1(x)
        h = {"where": lambda t: torch.where(t > 0, t, t * 0.1),
             "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
             "silu": lambda t: t * torch.sigmoid(t)}[self.act](t)
        return self.fc2(h)


@pytest.mark.parametrize("act", ["where", "gelu", "silu"])
def test_gemm_sums_leaves_activation_epilogues_whole(act):
    g = _graph(Act(act), (torch.randn(4, 16),))
    assert gemm_sums(g) == frozenset()


@pytest.mark.parametrize("rows", [(1,), (1, 1)], ids=["2d", "3d"])
def test_residual_sum_is_the_gemv_epilogue(rows):
    """Also for a [1, 1, C] row (a decode step's hidden state: the epilogue's index has the
    size-1 dims' variables, gemm/fuse.py `epilogue_of`)."""
    m = ResTwice(300, 70).to(torch.bfloat16)
    cm = kiln.compile(torch.export.export(m, _bf16((*rows, 70), (*rows, 300))), device="cuda",
                      options=OPTS)
    ks = cm.manifest["kernels"]
    (gv,) = [k for k in ks if k["kind"] == "triton_gemv"]
    assert any(s.startswith("add") for s in gv["source_ops"]), gv["source_ops"]
    assert not [k for k in ks if k["kind"] == "blas_gemm"], ks
    # no row kernel recomputes the sum from the GEMM's result: nothing else reads it
    rows = [k for k in ks if k["kind"] == "triton"]
    assert all("add" not in k["source_ops"] for k in rows), [k["source_ops"] for k in rows]


def _tiny_steps(tiny):
    m = TinyAcross()
    args = (torch.randn(1, 64), torch.randn(1, 16))
    return schedule(lower(_graph(m, args)), True, tiny=tiny)


def test_tiny_member_joins_the_kernel_across_a_gemm():
    plain, tiny = _tiny_steps(False), _tiny_steps(True)
    kinds = [type(s).__name__ for s in tiny]
    assert kinds == ["Kernel", "Gemm", "Kernel"], kinds
    assert [type(s).__name__ for s in plain] == ["Kernel", "Gemm", "Kernel"]
    # c = cos(y) + 1 (one node, "add") is computed before the GEMM, in a's kernel; d after
    assert "add" in tiny[0].source and tiny[2].source == ("mul_1",), (tiny[0].source,
                                                                      tiny[2].source)
    # without `tiny`, c stays after the GEMM (with d)
    assert "add" in plain[2].source and "add" not in plain[0].source, plain[2].source


def test_large_members_are_not_gathered():
    class Big(TinyAcross):
        def forward(self, x, y):
            a = torch.sin(x) * 2
            b = self.lin(a)
            return b, torch.cos(y) + 1

    args = (torch.randn(1, 64), torch.randn(64, 128))  # 8192 elements > TINY
    steps = schedule(lower(_graph(Big(), args)), True, tiny=True)
    assert [type(s).__name__ for s in steps] == ["Kernel", "Gemm", "Kernel"]
    assert isinstance(steps[2], Kernel) and steps[2].source == ("add",), steps[2].source


def _two_writes_args(dtype=torch.float32, p=1, q=5):
    g = torch.Generator().manual_seed(4)
    return (torch.randn(2, 1, 4, generator=g).to(dtype), torch.randn(2, 1, 4, generator=g)
            .to(dtype), torch.tensor([p]), torch.tensor([q]))


def test_chained_puts_are_not_fused_together():
    cm = kiln.compile(torch.export.export(TwoWrites(), _two_writes_args()), device="cuda",
                      options=OPTS)
    ks = cm.manifest["kernels"]
    fused = [k for k in ks if k["kind"] == "triton_put"]
    plain = [k for k in ks if k["kind"] == "lib.put"]
    # sin(a) * 3 -> d and a -> c after the kernel computing them; c's second write reads the
    # first's output as `self`: a launch of its own
    assert len(fused) == 1 and len(plain) == 1, [(k["kind"], k["source_ops"]) for k in ks]
    assert sum(s.startswith("index_put") for s in fused[0]["source_ops"]) == 2


def _decode_kernels(layers, dtype=torch.bfloat16, opts=OPTS):
    pytest.importorskip("transformers")
    from kiln.models.hf_decoder import export_step, llama
    model = llama(layers=layers, hidden=256, heads=4, kv_heads=2, vocab=512, inter=688)
    _, ep = export_step(model, 32, dtype=dtype)
    return kiln.compile(ep, device="cuda", options=opts).manifest["kernels"]


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_decode_step_kernels_per_layer():
    """The bound: PER_LAYER kernels per layer (the difference of the 3- and 2-layer steps),
    and what each layer's kernels compute."""
    k2, k3 = _decode_kernels(2), _decode_kernels(3)
    per_layer = len(k3) - len(k2)
    assert per_layer <= PER_LAYER, [(k["kind"], k["source_ops"]) for k in k3]
    assert len(k3) <= PER_LAYER * 3 + 3, len(k3)
    kinds = [k["kind"] for k in k3]
    assert kinds.count("blas_gemm") == 0 and kinds.count("triton_gemv") == 4 * 3 + 1, kinds
    # one launch per layer for the rotary embedding of the queries and of the keys, the key
    # and value rows written into the cache and the attention (attention.py
    # `fuse_decode_puts`, after schedule/puts.py)
    assert kinds.count("triton_put") == 3 and "lib.put" not in kinds, kinds
    assert "lib.attention" not in kinds, kinds
    for k in (k for k in k3 if k["kind"] == "triton_put"):
        src = k["source_ops"]
        assert k["name"].startswith("attn_"), k["name"]
        assert sum(s.startswith("index_put") for s in src) == 2, src
        assert any("attention" in s for s in src), src


def scheduled_steps(ep, opts=OPTS) -> list:
    """The CUDA steps of `ep` after the last fusion stage (the stages before "program": no
    Triton compile), each as (kind, name, source ops); kinds as the manifest's."""
    from kiln.pipeline import target_of
    target = target_of("cuda")
    st = target.state(options=opts, ep=ep)
    for stage in target.stages:
        if stage.name == "program":
            break
        if stage.when(st):
            st = stage.run(st)
    out = []
    for s in L.flat_steps(st.steps):
        kind = {"Kernel": "triton", "PutKernel": "triton_put"}.get(type(s).__name__)
        if isinstance(s, GemmKernel):
            kind = s.kind
        elif isinstance(s, L.Extern):
            kind = f"lib.{s.routine}"
        elif isinstance(s, L.Gemm):
            c = st.gemms.get(s.name)
            kind = f"{c.backend.value if c is not None else 'blas'}_gemm"
        out.append((kind or type(s).__name__, s.name, tuple(s.source)))
    return out


def _llama_16x2048():
    pytest.importorskip("transformers")
    from kiln.models.hf_decoder import export_step, llama
    model = llama(layers=16, hidden=2048, heads=32, kv_heads=4, vocab=32000, inter=5632,
                  init=0.02)
    return export_step(model, 256, dtype=torch.bfloat16)[1]


@pytest.mark.slow  # a 1.1 B-parameter export on the CPU (about a minute)
def test_llama_16x2048_decode_step_kernel_count():
    """bench/llm_gpu.py's model (16 layers x 2048, bf16, cache 256): 168 kernels per step
    before (10.5 per layer), now at most PER_LAYER * 16 + 3 (83; the attention's combine
    launch aside)."""
    steps = scheduled_steps(_llama_16x2048())
    kinds = [k for k, _, _ in steps]
    assert len(steps) <= PER_LAYER * 16 + 3, (len(steps), kinds)
    # every layer's cache writes in its attention's launch
    assert kinds.count("triton_put") == 16 and kinds.count("lib.attention") == 0, kinds
    assert all(n.startswith("attn_") for k, n, _ in steps if k == "triton_put")
    assert "blas_gemm" not in kinds and "lib.put" not in kinds, kinds


def _print_decode_kernels():  # the listing in the report (not a test)
    steps = scheduled_steps(_llama_16x2048())
    print(f"{len(steps)} kernels per decode step")
    for kind, name, src in steps:
        print(f"{kind:14s} {name:42s} {','.join(src)}")


_INTERP = textwrap.dedent("""
    import copy, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_decode_kernels import ResTwice, TinyAcross, OPTS, TRITON_ONLY
    import kiln
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels

    def cases():
        return [("res_bf16", ResTwice(300, 70), [(1, 70), (1, 300)], torch.bfloat16, OPTS),
                ("res3_bf16", ResTwice(300, 70), [(1, 1, 70), (1, 1, 300)], torch.bfloat16,
                 OPTS),
                ("res_fp32", ResTwice(100, 33), [(1, 33), (1, 100)], torch.float32,
                 TRITON_ONLY),
                ("tiny_fp32", TinyAcross(), [(1, 64), (1, 16)], torch.float32, TRITON_ONLY)]

    bad = []
    from test_decode_kernels import TwoWrites, _two_writes_args
    for dt, (p, q) in ((torch.float32, (1, 5)), (torch.float32, (7, -1)), (torch.float16, (0, 3))):
        args = _two_writes_args(dt, p, q)
        b = kiln.compile(torch.export.export(TwoWrites(dt), args), device="cuda",
                         options=OPTS).built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        bufs = {x.name: x for x in b.loop.buffers}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, {})}
        got = run_program(b.program, ks, mod, b.weights, list(args))
        want = TwoWrites(dt).double()(*[a.double() if a.is_floating_point() else a
                                       for a in args])
        for o, r in zip(got, want):
            err = (o.double().reshape(r.shape) - r).abs().max().item()
            print("two writes", dt, p, q, err)
            if not err <= (1e-6 if dt == torch.float32 else 3e-3):
                bad.append(f"two writes {dt} {p} {q}: {err}")
    try:  # a write past the cache: an error from the fused launch
        args = _two_writes_args(torch.float32, 9, 1)
        b = kiln.compile(torch.export.export(TwoWrites(), _two_writes_args()), device="cuda",
                         options=OPTS).built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        bufs = {x.name: x for x in b.loop.buffers}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, {})}
        run_program(b.program, ks, mod, b.weights, list(args))
        bad.append("position 9 of an 8-long cache was accepted")
    except IndexError as e:
        print("out of range:", e)
    for name, m, shapes, dtype, opts in cases():
        torch.manual_seed(0)
        m = m.to(dtype).eval()
        args = tuple(torch.randn(s).to(dtype) for s in shapes)
        b = kiln.compile(torch.export.export(m, args), device="cuda", options=opts).built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        bufs = {x.name: x for x in b.loop.buffers}
        hints = {s.name: s.example for s in b.graph.symbols}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            xs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
            got = run_program(b.program, ks, mod, b.weights, xs)
            with torch.no_grad():
                refs = copy.deepcopy(m).double()(*[x.double() for x in xs])
                mine = m(*xs)
            for o, r, e in zip(got, refs, mine):
                o = o.double().reshape(r.shape)
                scale = r.abs().max().item()
                err, eager = (o - r).abs().max().item(), (e.double() - r).abs().max().item()
                bound = 1e-4 * scale if dtype == torch.float32 else 2 * eager + 1e-2 * scale
                print(name, seed, f"err {err:.3g} bound {bound:.3g}")
                if not err <= bound:
                    bad.append(f"{name} seed {seed}: {err} > {bound}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


@pytest.mark.slow  # ~13 s in the Triton interpreter; the GPU decode tests run these kernels
def test_fused_programs_match_float64_in_triton_interpreter():
    """Residual GEMV epilogues, tiny kernels across a GEMM, fused cache writes (chained and
    joined ones, negative and out-of-range positions) against float64 torch."""
    for dt in (torch.float32, torch.float16):
        kiln.compile(torch.export.export(TwoWrites(dt), _two_writes_args(dt)), device="cuda",
                     options=OPTS)
    for m, shapes, dtype, opts in ((ResTwice(300, 70), [(1, 70), (1, 300)], torch.bfloat16,
                                    OPTS),
                                   (ResTwice(300, 70), [(1, 1, 70), (1, 1, 300)],
                                    torch.bfloat16, OPTS),
                                   (ResTwice(100, 33), [(1, 33), (1, 100)], torch.float32,
                                    TRITON_ONLY),
                                   (TinyAcross(), [(1, 64), (1, 16)], torch.float32,
                                    TRITON_ONLY)):
        torch.manual_seed(0)  # cubins first: the AOT compiler cannot run in interpreter mode
        m = m.to(dtype).eval()
        args = tuple(torch.randn(s).to(dtype) for s in shapes)
        kiln.compile(torch.export.export(m, args), device="cuda", options=opts)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


if __name__ == "__main__":  # PYTHONPATH=$PWD python tests/targets/cuda/test_decode_kernels.py
    _print_decode_kernels()
