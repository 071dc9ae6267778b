"""The GEMV template (M = 1 on CUDA; issue 17.3): kiln/gemm/gemv.py, kiln/gemm/prologue.py,
kiln/targets/cuda/gemv_template.py. Compiled for CUDA without a GPU (autotune off), the
heuristic picks the GEMV for M = 1 GEMMs that fuse a prologue (RMSNorm, silu(gate) * up of a
merged gate/up GEMM) or an epilogue (bias, residual), and (Triton only) for plain ones; the
programs run by Triton's interpreter through the Program IR against float64 torch math of
the same module: K not a multiple of the block, N not a multiple of 16, float32 / bfloat16 /
float16. The bf16 decode step of a Llama loses its norm and silu*mul kernels to the GEMVs'
prologues (the manifest's kernel list), and its logits match eager in the interpreter."""

from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import sympy
import torch

pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.options import Options  # noqa: E402

OPTS = Options(cuda_archs=(90,), autotune=False)
TRITON_ONLY = Options(cuda_archs=(90,), autotune=False, gemm_backends=("triton",))


class NormLin(torch.nn.Module):
    """RMSNorm (computed in float32, as Llama's) then a linear layer: the GEMV's prologue."""

    def __init__(self, k, n):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(k))
        self.lin = torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.lin(self.w * h.to(x.dtype))


class GluLin(torch.nn.Module):
    """gate / up (merged into one GEMM) then down of silu(gate) * up: the down GEMV's
    prologue reads the merged GEMM's output at two offsets."""

    def __init__(self, k, inter, n):
        super().__init__()
        self.gate = torch.nn.Linear(k, inter, bias=False)
        self.up = torch.nn.Linear(k, inter, bias=False)
        self.down = torch.nn.Linear(inter, n, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class ResLin(torch.nn.Module):
    """A linear layer with bias plus a residual: the GEMV's epilogue."""

    def __init__(self, k, n):
        super().__init__()
        self.lin = torch.nn.Linear(k, n)

    def forward(self, x, r):
        return r + self.lin(x)


class Lin(torch.nn.Module):
    def __init__(self, k, n, relu=False):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=relu)
        self.relu = relu

    def forward(self, x):
        y = self.lin(x)
        return torch.relu(y) if self.relu else y


# (name, module, input shapes (rows of 1), dtype, options, source ops a GEMV must name)
def cases():
    return [
        ("norm_bf16", NormLin(100, 37), [(1, 100)], torch.bfloat16, OPTS, {"mean"}),
        ("norm_fp16", NormLin(300, 70), [(1, 300)], torch.float16, OPTS, {"mean"}),
        ("norm_fp32", NormLin(100, 37), [(1, 100)], torch.float32, TRITON_ONLY, {"mean"}),
        ("glu_bf16", GluLin(48, 80, 24), [(1, 48)], torch.bfloat16, OPTS, set()),
        ("res_bf16", ResLin(300, 70), [(1, 300), (1, 70)], torch.bfloat16, OPTS, {"add"}),
        ("lin_fp16", Lin(64, 16), [(1, 64)], torch.float16, TRITON_ONLY, set()),
        ("relu_fp32", Lin(130, 33, relu=True), [(1, 130)], torch.float32, TRITON_ONLY,
         {"relu"}),
    ]


def build(name, m, shapes, dtype, opts, seed=0):
    torch.manual_seed(seed)
    m = m.to(dtype).eval()
    args = tuple(torch.randn(s).to(dtype) for s in shapes)
    return m, args, kiln.compile(torch.export.export(m, args), device="cuda", options=opts)


def gemv_kernels(cm) -> list[dict]:
    return [k for k in cm.manifest["kernels"] if k["kind"] == "triton_gemv"]


_INTERP = textwrap.dedent("""
    import copy, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_gemv import build, cases
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels

    bad = []
    for name, m, shapes, dtype, opts, _ in cases():
        m, args, cm = build(name, m, shapes, dtype, opts)
        b = cm.built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        bufs = {x.name: x for x in b.loop.buffers}
        hints = {s.name: s.example for s in b.graph.symbols}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
        for seed in (1, 2):  # fresh inputs
            g = torch.Generator().manual_seed(seed)
            xs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
            got = run_program(b.program, ks, mod, b.weights, xs)[0].double()
            with torch.no_grad():
                ref = copy.deepcopy(m).double()(*[x.double() for x in xs])
                mine = m(*xs).double()
            got = got.reshape(ref.shape)
            scale = ref.abs().max().item()
            err, eager = (got - ref).abs().max().item(), (mine - ref).abs().max().item()
            bound = 1e-4 * scale if dtype == torch.float32 else 2 * eager + 1e-2 * scale
            print(name, seed, f"err {err:.3g} eager {eager:.3g} bound {bound:.3g}")
            if not err <= bound:
                bad.append(f"{name} seed {seed}: {err} > {bound}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


def test_gemv_choices_and_fusions():
    """Each case's package has a GEMV whose source ops name the fused producer/consumer, and
    fewer row kernels than the cuBLAS compile of the same program."""
    for name, m, shapes, dtype, opts, ops in cases():
        _, _, cm = build(name, m, shapes, dtype, opts)
        gv = gemv_kernels(cm)
        assert gv, (name, [k["kind"] for k in cm.manifest["kernels"]])
        assert all(k["gemm"]["config"]["gemv"] for k in gv)
        src = {s for k in gv for s in k["source_ops"]}
        assert all(any(s.startswith(o) for s in src) for o in ops), (name, src)
        assert "(GEMV)" in cm.sources["kernels_triton.py"]
    # the prologue removes the norm's own kernel: only the GEMV is left
    _, _, cm = build(*cases()[0][:5])
    assert [k["kind"] for k in cm.manifest["kernels"]] == ["triton_gemv"]
    # silu(gate) * up is the down GEMV's prologue: the merged gate/up GEMM (cuBLAS, nothing
    # to fuse) and the GEMV are the whole program
    _, _, cm = build(*cases()[3][:5])
    assert [k["kind"] for k in cm.manifest["kernels"]] == ["blas_gemm", "triton_gemv"]
    _, _, blas = build("blas", NormLin(100, 37), [(1, 100)], torch.bfloat16,
                       Options(cuda_archs=(90,), autotune=False, gemm_backends=("blas",)))
    assert [k["kind"] for k in blas.manifest["kernels"]] == ["triton", "blas_gemm"]


class NormLinOut(NormLin):
    """The normed row is also returned (an output) or also added to another input (a second
    reader): no prologue (it must be stored anyway), so no GEMV by the heuristic."""

    def __init__(self, k, n, returned):
        super().__init__(k, n)
        self.returned = returned

    def forward(self, x, r):
        h = x.float()
        h = (self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype))
        y = self.lin(h)
        return (y, h) if self.returned else (y, h + r)


@pytest.mark.parametrize("returned", [True, False], ids=["output", "second_reader"])
def test_prologue_refused_when_the_row_is_needed_elsewhere(returned):
    torch.manual_seed(0)
    m = NormLinOut(64, 40, returned).to(torch.bfloat16)
    args = (torch.randn(1, 64).to(torch.bfloat16), torch.randn(1, 64).to(torch.bfloat16))
    cm = kiln.compile(torch.export.export(m, args), device="cuda", options=OPTS)
    kinds = [k["kind"] for k in cm.manifest["kernels"]]
    assert "triton_gemv" not in kinds and "blas_gemm" in kinds, kinds
    # Triton only: a GEMV, but reading the stored row (no prologue)
    cm = kiln.compile(torch.export.export(m, args), device="cuda", options=TRITON_ONLY)
    gv = gemv_kernels(cm)
    assert len(gv) == 1 and "prologue" not in cm.sources["kernels_triton.py"], kinds


def test_gemv_not_chosen_for_larger_m():
    torch.manual_seed(0)
    m = NormLin(64, 32).to(torch.bfloat16)
    ep = torch.export.export(m, (torch.randn(3, 64).to(torch.bfloat16),))
    cm = kiln.compile(ep, device="cuda", options=OPTS)
    assert not gemv_kernels(cm)


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_gemv_programs_match_float64_in_triton_interpreter():
    for c in cases():  # cubins first: the AOT compiler cannot run in interpreter mode
        build(*c[:5])
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


def _decode_step(dtype=torch.bfloat16):
    pytest.importorskip("transformers")
    from kiln.models.hf_decoder import export_step, llama
    model = llama(layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, inter=256)
    return export_step(model, 16, dtype=dtype)


def test_decode_step_kernels_fuse_norms_into_gemvs():
    """The bf16 decode step (autotune off): per layer the q/k/v and gate/up GEMVs recompute
    their RMSNorm (a mean of squares and the scaling) and the down GEMV silu(gate) * up; the
    norm and silu*mul kernels are gone; the o and down projections store the residual sum in
    their epilogue (passes/store_once.py: stored once, not recomputed by its readers), so no
    GEMM is left to cuBLAS; the head's GEMV takes the final norm."""
    _, ep = _decode_step()
    cm = kiln.compile(ep, device="cuda", options=OPTS)
    ks = cm.manifest["kernels"]
    kinds = [k["kind"] for k in ks]
    gv = [k for k in ks if k["kind"] == "triton_gemv"]
    assert len(gv) == 4 * 2 + 1 and kinds.count("blas_gemm") == 0, kinds
    # o_proj (every layer) and down_proj (all but the last, whose sum only the final norm
    # reads: recomputed in the head's prologue) add the residual in their epilogue
    residual = [k for k in gv if any(s.startswith("add") for s in k["source_ops"])]
    assert len(residual) == 2 * 2 - 1, [k["source_ops"] for k in gv]
    norms = [k for k in gv if any(s.startswith("mean") for s in k["source_ops"])]
    assert len(norms) == 2 * 2 + 1, [k["source_ops"] for k in gv]  # qkv, gate/up, head
    assert all(k["gemm"]["config"]["gemv"] and k["gemm"]["how"] == "heuristic" for k in gv)
    # no row kernel computes a mean any more: each norm lives in the GEMVs that read it
    rows = [k for k in ks if k["kind"] == "triton"]
    assert not [k for k in rows if any(s.startswith("mean") for s in k["source_ops"])], rows
    blas = kiln.compile(ep, device="cuda", options=Options(
        cuda_archs=(90,), autotune=False, gemm_backends=("blas",)))
    assert len(ks) <= len(blas.manifest["kernels"]) - 4, (len(ks), len(blas.manifest["kernels"]))


_DECODE = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_gemv import TRITON_ONLY, _decode_step
    import kiln
    from kiln.models.hf_decoder import eager_step
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels

    w, ep = _decode_step(torch.float32)
    b = kiln.compile(ep, device="cuda", options=TRITON_ONLY).built
    assert sum(type(s).__name__ == "GemmKernel" and s.prologue is not None
               for s in b.steps) == 2 * 3 + 1
    mod = import_triton_module(b.sources["kernels_triton.py"])
    bufs = {x.name: x for x in b.loop.buffers}
    hints = {s.name: s.example for s in b.graph.symbols}
    ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
    ids, cp = torch.tensor([[7]]), torch.tensor([0])
    got = run_program(b.program, ks, mod, b.weights, [ids, cp])[0].double()
    with torch.no_grad():
        want = eager_step(w)(ids, cp).double()
    got = got.reshape(want.shape)
    err, bound = (got - want).abs().max().item(), 1e-4 * want.abs().max().item()
    print(f"err {err:.3g} bound {bound:.3g}")
    print("ALL OK" if err <= bound else "BAD")
""")


@pytest.mark.slow
def test_decode_step_with_gemvs_matches_eager_in_triton_interpreter():
    """The float32 decode step with every GEMM a GEMV (Triton only): q/k/v, gate/up and the
    head recompute their RMSNorm, down silu(gate) * up (7 prologues), one step from an empty
    cache against eager. (The bfloat16 step computes other logits than eager in the
    interpreter with cuBLAS GEMMs as well: not a GEMV matter; the GPU test checks bf16.)"""
    _, ep = _decode_step(torch.float32)
    kiln.compile(ep, device="cuda", options=TRITON_ONLY)  # cubins first (not interpreted)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _DECODE, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


# -- on a GPU (-m gpu) --------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c[0] for c in cases()] + ["norm_big", "glu_big", "res_big"])
@pytest.mark.gpu
def test_gemv_modules_match_float64_on_gpu(tmp_path, case):
    """The interpreter's cases, and decoder-sized ones (K 2048 / 5632, N 3072 / 2048: BLOCK_N
    > 1, several K steps), compiled for the local GPU (autotune on: GEMV configs measured
    where max_autotune is) against float64 math, 2x eager's own error + 1e-2 of the scale."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    big = {"norm_big": ("norm_big", NormLin(2048, 3072), [(1, 2048)], torch.bfloat16, None,
                        {"mean"}),
           "glu_big": ("glu_big", GluLin(2048, 5632, 2048), [(1, 2048)], torch.bfloat16, None,
                       set()),
           "res_big": ("res_big", ResLin(5632, 2048), [(1, 5632), (1, 2048)], torch.float16,
                       None, {"add"})}
    name, m, shapes, dtype, opts, ops = big.get(case) or next(c for c in cases()
                                                                if c[0] == case)
    opts = Options(gemm_backends=("triton",)) if opts is TRITON_ONLY else Options()
    torch.manual_seed(0)
    m = m.to("cuda", dtype).eval()
    args = tuple(torch.randn(s, device="cuda").to(dtype) for s in shapes)
    cm = kiln.compile(torch.export.export(m, args), device="cuda", options=opts)
    assert gemv_kernels(cm), [k["kind"] for k in cm.manifest["kernels"]]
    runner = cm.load(tmp_path / "g.kiln", device="cuda:0")
    ref_m = copy.deepcopy(m).double()
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        xs = [torch.randn(s, device="cuda", generator=g).to(dtype) for s in shapes]
        with torch.no_grad():
            ref = ref_m(*[x.double() for x in xs])
            mine = m(*xs).double()
        got = runner(*xs).double().reshape(ref.shape)
        scale = ref.abs().max().item()
        err, eager = (got - ref).abs().max().item(), (mine - ref).abs().max().item()
        bound = 1e-4 * scale if dtype == torch.float32 else 2 * eager + 1e-2 * scale
        assert err <= bound, (case, seed, err, eager, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_steps_with_gemvs_match_eager_on_gpu(tmp_path, dtype):
    """A Llama of hidden 256 (GQA, 2 layers) stepped token by token on the GPU: the package's
    GEMVs (norm / silu*mul prologues) against a float32 eager reference, kiln's error at most
    twice eager's own plus 1e-2 of the logits' scale (test_decode_gpu.py's bound)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    from kiln.models.hf_decoder import eager_step, export_step, llama
    cache = 16

    def make(dt):
        return export_step(llama(layers=2, hidden=256, heads=4, kv_heads=2, vocab=512,
                                 inter=688, device="cuda"), cache, device="cuda", dtype=dt)
    w, ep = make(dtype)
    ref_w, _ = make(torch.float32)
    cm = kiln.compile(ep, device="cuda")
    kinds = [k["kind"] for k in cm.manifest["kernels"]]
    assert kinds.count("triton_gemv") == 4 * 2 + 1, kinds
    runner = cm.load(tmp_path / "d.kiln", device="cuda:0")
    eager, ref = eager_step(w), eager_step(ref_w)
    tokens = torch.randint(0, 512, (cache,), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        for start in range(cache):
            ids, pos = tokens[start:start + 1][None], torch.tensor([start], device="cuda")
            want = ref(ids, pos).double()
            mine = eager(ids, pos).double()
            got = runner(input_ids=ids, cache_position=pos).double().reshape(want.shape)
            scale = want.abs().max().item()
            err, eager_err = (got - want).abs().max().item(), (mine - want).abs().max().item()
            assert err <= 2 * eager_err + 1e-2 * scale, (start, err, eager_err, scale)


def test_gemv_configs_and_json():
    """The heuristic's config keeps >= 2 programs per H100 SM where it can, reads about 1 KiB
    of each weight row a step; configs round-trip through the manifest's / cache's JSON."""
    from kiln.gemm import gemv as GV
    from kiln.gemm.configs import GemvConfig, TritonConfig, config_from_json
    for n, k, item in ((2560, 2048, 2), (2048, 5632, 2), (11264, 2048, 2), (32000, 2048, 2),
                       (37, 100, 4)):
        cs = GV.configs(n, k, item)
        first = cs[0]
        assert -(-n // first.block_n) >= 2 * GV.SMS or first.block_n == 1, (n, first)
        assert first.block_k * item <= 1024 and len(set(cs)) == len(cs) >= 4
        for c in cs:
            assert config_from_json("triton", c.to_json()) == c
    t = TritonConfig(64, 64, 32)
    assert config_from_json("triton", t.to_json()) == t
    assert isinstance(config_from_json("triton", GemvConfig(8, 512).to_json()), GemvConfig)


def test_gemv_launch_configs_are_a_tuning_family():
    """With tuning on, the GEMV kernels are a template family of the launch tuner ("gemv"):
    each with its own config first, then kiln/gemm/gemv.py's variations, all printed as the
    same kernel; the pruned plan leaves GEMVs predicted under a few microseconds (this tiny
    decoder's) alone; a decoder-sized GEMV is tuned; the tuner's pick reaches the printed
    kernel."""
    import dataclasses
    import types

    from kiln.ir import loop as L
    from kiln.targets.cuda import build as B
    from kiln.targets.cuda import tune_plan as TP
    from kiln.targets.cuda.kernel import Config
    from kiln.pipeline import target_of
    target = target_of("cuda")
    b = target.state(options=OPTS, ep=_decode_step()[1])
    for s in target.stages:  # up to where launch_autotune would run
        if s.name == "check_routines":
            break
        if s.when(b):
            b = s.run(b)
    full = dataclasses.replace(b, options=dataclasses.replace(b.options, tune_prune=False))
    fams = [f for f in B.tuning_families(full) if f.label == "gemv"]
    assert len(fams) == 1 and len(fams[0].items) == 4 * 2 + 1, fams
    bufs, hints = L.all_buffers(b.loop), B._hints(b)
    for gk in fams[0].items:
        cands, tks = fams[0].kernels_of(gk)
        c0 = gk.config
        assert cands[0] == Config(c0.block_n, c0.block_k, c0.num_warps, c0.num_stages)
        assert len(set(cands)) == len(cands) >= 6
        assert {tk.name for tk in tks} == {gk.name}
        assert [tk.config for tk in tks] == cands
        picked = B.triton_kernels([gk], bufs, hints, {gk.name: cands[-1]}, B._pdl(b.options))[0]
        assert picked.config == cands[-1] and picked.source == tks[-1].source
    assert not [f for f in B.tuning_families(b) if f.label == "gemv"]  # tiny: pruned
    big = types.SimpleNamespace(gemm=types.SimpleNamespace(n=11264, k=2048,
                                                           dtype=torch.bfloat16),
                                config=types.SimpleNamespace(block_n=16))
    assert TP.tune_kernel(TP.gemv_us(big, {}))  # 46 MB of weights: ~15 us


def test_cold_operand_sets_exceed_the_l2():
    """A GEMV is timed over copies of its operands that together exceed twice an L2 cache, so
    that the candidates stream weights from memory as in the model; scalars are shared."""
    from kiln.targets.cuda.launch_tune import COLD_BYTES, _cold_sets
    w = torch.randn(1 << 20)  # 4 MiB
    sets = _cold_sets([w, 7], torch)
    assert len(sets) == COLD_BYTES // (4 << 20) and sets[0][0] is w
    assert all(s[1] == 7 for s in sets)
    assert len({s[0].data_ptr() for s in sets}) == len(sets)
    assert torch.equal(sets[-1][0], w)
    assert len(_cold_sets([torch.zeros(4)], torch)) == 64  # at most 64 copies
    assert len(_cold_sets([torch.zeros(COLD_BYTES)], torch)) == 1


def test_cold_timings_are_cached_by_how_they_were_taken(monkeypatch):
    """The GEMV family is timed with its launches queued on the device (launch_tune.py
    `queued_cold`); results timed at the host's launch rate (KILN_TUNE_QUEUED=0) live under
    another autotune cache key, so neither method reads the other's picks."""
    from kiln.targets.cuda import launch_tune as LT
    monkeypatch.delenv("KILN_TUNE_QUEUED", raising=False)
    assert LT.queued_cold() and LT.timed_as("gemv", "3.6") == "3.6-queued"
    assert LT.timed_as("", "3.6") == "3.6" and LT.timed_as("attention", "3.6") == "3.6"
    monkeypatch.setenv("KILN_TUNE_QUEUED", "0")
    assert not LT.queued_cold() and LT.timed_as("gemv", "3.6") == "3.6"


@pytest.mark.gpu
def test_queued_timing_is_the_device_time_not_the_launch_rate():
    """`event_ms(..., queued=True)` times calls that cost the host 300 us each but the device
    a few us at the device's rate; without `queued` they are timed at the host's rate."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import time as _time

    from kiln.targets.cuda.launch_tune import event_ms
    x = torch.zeros(1024, device="cuda")

    def run():
        _time.sleep(3e-4)
        x.add_(1)

    slow, fast = event_ms(run, 10), event_ms(run, 10, queued=True)
    assert slow > 0.25 and fast < 0.05, (slow, fast)


def test_rmsnorm_factor_leaves_the_k_loop():
    """RMSNorm's row factors as rsqrt(mean + eps) times w[k] * cast(x[k]) (gemm/prologue.py
    `factor_row`): its sum of squares accumulates in the GEMV's own K loop and the factor
    scales the dot product; LayerNorm's x - mean does not factor; a row without reductions
    has nothing to factor. In the decode step every norm prologue (q/k/v, gate/up, head) is
    factored; the programs match float64 in the interpreter
    (test_gemv_programs_match_float64_in_triton_interpreter, NormLin)."""
    from kiln.gemm.prologue import factor_row
    from kiln.ir import dtypes as D
    from kiln.ir import loop as L
    f32, bf16 = D.float32, D.DTYPES["bfloat16"]
    k = sympy.Symbol("r0")
    x = L.Load("x", k, f32)
    mean = L.Op("div", (L.Load("ss", sympy.Integer(0), f32), L.Const(64.0, f32)), f32)
    r = L.Op("rsqrt", (L.Op("add", (mean, L.Const(1e-6, f32)), f32),), f32)
    w = L.Load("w", k, bf16)
    rms = L.Op("mul", (w, L.Op("cast", (L.Op("mul", (x, r), f32),), bf16)), bf16)
    scale, rest = factor_row(rms, {"ss"})
    assert scale == r and not any(ld.buf == "ss" for ld in L.loads(rest))
    assert rest == L.Op("mul", (w, L.Op("cast", (x,), bf16)), bf16)
    ln = L.Op("mul", (L.Op("sub", (x, mean), f32), r), f32)
    assert factor_row(ln, {"ss"}) is None
    assert factor_row(L.Op("exp", (rms,), bf16), {"ss"}) is None
    assert factor_row(L.Op("mul", (w, x), f32), {"ss"}) is None
    _, ep = _decode_step()
    src = kiln.compile(ep, device="cuda", options=OPTS).built.sources["kernels_triton.py"]
    gemvs = [b for b in src.split("@triton.jit") if "(GEMV)" in b]
    normed = [b for b in gemvs if "prologue mean" in b]
    assert len(normed) == 2 * 2 + 1, len(normed)
    assert all("accumulated in the K loop" in b and "* t" in b.split("dot = ")[1].split("\n")[0]
               for b in normed)
    assert not any("(whole row, in registers)" in b for b in gemvs)
