"""TMA loads in the Triton GEMM template (configs and rule in kiln/gemm/triton_gemm.py,
printed for packages by kiln/targets/cuda/gemm_template.py): which GEMMs may take them
(`tma_refusal`, over the whole Dim range), the config space, the package kernels (device-side
descriptors, compiled for sm_90 to PTX with bulk tensor copies), the wrapper's global scratch
block, the fallback for a refused GEMM, and the kernels against eager in Triton's interpreter
(no GPU). The GPU tests run the packages on the device against eager."""

from __future__ import annotations

import os
import textwrap
import types

import pytest
import sympy
import torch

triton = pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.gemm import triton_gemm as T  # noqa: E402
from kiln.errors import CompileError  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.ir.dtypes import dtype as kdtype  # noqa: E402
from kiln.options import GemmBackend, Options  # noqa: E402
from tests.difftest import run_interpreted  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
S = sympy.Symbol("s0", integer=True, positive=True)


class Layouts(torch.nn.Module):
    """One GEMM per layout: nt + bias + relu (a Linear; dynamic M), nn (dynamic M), tn (A read
    transposed), batched with B transposed (dynamic M inside the batch), batched with a
    broadcast B (batch stride 0); and a Linear with K = 20 (a 40-byte row: TMA refused)."""

    def __init__(self, dtype=torch.float16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = torch.nn.Linear(64, 96)
        self.w = torch.nn.Parameter(torch.randn(64, 80, generator=g) / 8)
        self.v = torch.nn.Parameter(torch.randn(48, 72, generator=g) / 8)
        self.wb = torch.nn.Parameter(torch.randn(3, 40, 64, generator=g) / 8)
        self.wk = torch.nn.Parameter(torch.randn(64, 24, generator=g) / 8)
        self.odd = torch.nn.Linear(20, 16)
        with torch.no_grad():  # the same weights for every dtype (eager float32 is the reference)
            for p in (*self.lin.parameters(), *self.odd.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) / 8)
        self.to(dtype)

    def forward(self, x, u, y, z):
        return (torch.relu(self.lin(x)), x @ self.w, u.t() @ self.v,
                torch.bmm(y, self.wb.transpose(1, 2)), torch.bmm(y, self.wk.expand(3, 64, 24)),
                self.odd(z))


def _inputs(dtype, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 64, generator=g).to(dtype), torch.randn(48, 24, generator=g).to(dtype),
            torch.randn(3, m, 64, generator=g).to(dtype), torch.randn(m, 20, generator=g).to(dtype))


def _export(dtype):
    m = torch.export.Dim("m", min=1, max=512)
    return torch.export.export(Layouts(dtype), _inputs(dtype, 37),
                               dynamic_shapes={"x": {0: m}, "u": None, "y": {1: m}, "z": {0: m}})


def _compile(ep, cache_dir, cfg: T.TritonConfig):
    """A CUDA package with every GEMM on the Triton template at `cfg` (the no-profiling choice
    replaced by it)."""
    from kiln.gemm import gpu as agpu
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(agpu, "heuristic", lambda *a, **k: (GemmBackend.TRITON, cfg))
        return kiln.compile(ep, device="cuda", options=Options(
            cuda_archs=(90,), gemm_backends=("triton",), cache_dir=str(cache_dir)))


TMA_CFG = T.TritonConfig(64, 128, 64, 8, 5, 4, True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _compile(_export(torch.float16), tmp_path_factory.mktemp("tma"), TMA_CFG)


def _kernel_sources(src: str) -> dict[str, str]:
    """Generated GEMM kernel name -> its text."""
    out = {}
    for part in src.split("@triton.jit\n")[1:]:
        name = part.split("(", 1)[0].removeprefix("def ")
        if name.startswith("gemm_"):
            out[name] = part
    return out


def _gemm(a: L.Operand, b: L.Operand, dt="float16", batch=(), **kw) -> L.Gemm:
    return L.Gemm("g", kdtype(dt), batch, S, sympy.Integer(64), sympy.Integer(64), a, b, **kw)


def _op(offset=0, rows=64, cols=1, batch=()):
    return L.Operand("x", sympy.sympify(offset), tuple(map(sympy.sympify, batch)),
                     sympy.sympify(rows), sympy.sympify(cols))


def test_refusal_covers_the_whole_dim_range():
    ok = _op()
    assert T.tma_refusal(_gemm(ok, ok)) is None
    assert T.tma_refusal(_gemm(_op(rows=1, cols=64), _op(rows=1, cols=8 * S))) is None  # tt
    assert T.tma_refusal(_gemm(_op(offset=64 * S + 8), ok)) is None  # 16 bytes for every s0
    # batched: nonzero batch strides must be aligned too; stride 0 (broadcast) is left out
    assert T.tma_refusal(_gemm(_op(batch=(64 * S,)), _op(batch=(0,)), batch=(3,))) is None
    for a, b, why in [(_op(offset=4), ok, "offset 4"), (_op(offset=S * 64 + S), ok, "offset"),
                      (ok, _op(rows=20), "leading dimension 20"),
                      (ok, _op(rows=8 * S + 4), "leading dimension"),
                      (_op(batch=(36 * S,)), ok, "batch stride 0"),
                      (_op(rows=64, cols=2), ok, "no unit stride"),
                      (ok, _op(rows=0), "leading dimension 0")]:
        got = T.tma_refusal(_gemm(a, b, batch=(3,) if a.batch_strides else ()))
        assert got is not None and why in got, (why, got)
    assert "float32" in T.tma_refusal(_gemm(ok, ok, "float32"))
    mixed = L.MixedGemm("b", kdtype("int8"))
    assert "mixed" in T.tma_refusal(_gemm(ok, ok, mixed=mixed))
    four = _op(batch=(64, 64, 64, 64))
    assert "more than 3 batch dims" in T.tma_refusal(_gemm(four, ok, batch=(1, 1, 1, 1)))


def test_config_space_offers_tma_after_the_plain_configs():
    plain = T.config_space(4096, 4096, 4096)
    both = T.config_space(4096, 4096, 4096, tma=True)
    assert not any(c.tma for c in plain) and both[:len(plain)] == plain
    extra = both[len(plain):]
    assert extra and all(c.tma and c.name.endswith("_tma") for c in extra)
    assert len({c.name for c in both}) == len(both)
    assert all(c.block_m <= 64 for c in T.config_space(40, 4096, 4096, tma=True))


def test_package_kernels_read_operands_through_descriptors(built):
    src = built.sources["kernels_triton.py"]
    ks = _kernel_sources(src)
    assert len(ks) == 6, list(ks)
    tma = {n: k for n, k in ks.items() if "tl.make_tensor_descriptor" in k}
    refused = {n: k for n, k in ks.items() if n not in tma}
    assert len(tma) == 5 and len(refused) == 1
    (odd,) = refused.values()
    assert "# a TMA config, but operand A (z): leading dimension 20 x 2 bytes" in odd
    assert "tl.load(pa + rm[:, None]" in odd
    for k in tma.values():  # only the loads change: the masked store stays
        assert "desc_a.load(" in k and "desc_b.load(" in k and "tl.store(" in k
        assert "tl.load(pa" not in k and "rk = " not in k
    text = "\n".join(tma.values())
    # tn: A described transposed; nt: B transposed; batched: 3-D descriptors, or 2-D for the
    # broadcast weight (batch stride 0)
    assert "desc_b.load([tn, tk]).T" in text and "desc_a.load([tk, tm]).T" in text
    assert ".reshape(BLOCK_N, BLOCK_K).T" in text and "desc_b.load([tk, tn])" in text
    assert "[3, M, K], [(64*s0), 64, 1], [1, BLOCK_M, BLOCK_K]" in text.replace(" * ", "*")
    assert "tl.make_tensor_descriptor(buf_p_wk, [K, N], [24, 1], [BLOCK_K, BLOCK_N])" in text
    assert text.count(".reshape(") == 3


def test_tma_kernel_compiles_to_bulk_tensor_copies(built):
    """The printed kernels compile for sm_90 with TMA loads (PTX cp.async.bulk.tensor fed by
    tensormaps in global scratch); the refused one has none and needs no scratch."""
    from kiln.targets.cuda.gemm_template import print_gemm_kernel
    from kiln.schedule.steps import GemmKernel
    from kiln.toolchain.triton_aot import _to_cubin, compile_kernel, import_module
    b = built.built
    bufs = {x.name: x for x in b.loop.buffers}
    gks = {s.name: s for s in b.steps if isinstance(s, GemmKernel)}
    mod = import_module(b.sources["kernels_triton.py"], b.library.parent)
    bmm = next(n for n, s in gks.items() if s.gemm.batch and
               all(sympy.sympify(x) != 0 for x in s.gemm.b.batch_strides))
    odd = next(n for n, s in gks.items() if s.gemm.k == 20)
    for name, uses in ((bmm, True), (odd, False)):
        k = print_gemm_kernel(gks[name], bufs)
        ck = compile_kernel(mod, k, 90)
        ptx = ck.asm["ptx"]
        assert ("cp.async.bulk.tensor" in ptx) == uses, name
        assert ("tensormap" in ptx) == uses
        assert (ck.metadata.global_scratch_size > 0) == uses
        assert _to_cubin(ck, k, 90).scratch == ck.metadata.global_scratch_size
    assert ck.metadata.shared <= 232448  # fits sm_90's shared memory


def test_wrapper_owns_the_scratch_block(built, tmp_path):
    from tests.difftest import assert_host_compiles
    cpp = built.sources["model_cuda.cpp"]
    per = [int(x) for x in cpp.split("kScratchPerProgram[] = {")[1].split("}")[0].split(",")]
    assert len(per) == 1 and per[0] >= 256  # two 128-byte tensormaps per program
    assert "cuMemAlloc(&self->global_scratch, static_cast<size_t>(kScratchPerProgram[pick]) " \
           "* self->sms)" in cpp
    assert "d.cuMemFree(self->global_scratch)" in cpp
    assert cpp.count("&self->global_scratch, &scratch};") == 5  # the TMA kernels
    assert cpp.count("&self->sms, &scratch, &scratch};") == 1  # the refused one
    assert_host_compiles(tmp_path, cpp)


def test_scratch_only_for_persistent_kernels(tmp_path):
    from kiln.toolchain import triton_aot as A
    md = types.SimpleNamespace(global_scratch_size=256, global_scratch_align=128,
                               profile_scratch_size=0, name="k", num_warps=4, shared=0)
    ck = types.SimpleNamespace(metadata=md, asm={"cubin": b"\x7fELF"})
    row = types.SimpleNamespace(name="k", signature={"x": "*fp16"}, tiles=None)
    with pytest.raises(CompileError, match="only to persistent kernels"):
        A._to_cubin(ck, row, 90)
    c = A._to_cubin(ck, types.SimpleNamespace(name="k", signature={"x": "*fp16"}, tiles=S), 90)
    assert c.scratch == 256
    A._store(tmp_path / "e", c)
    assert A._load_cached(tmp_path / "e", row, 90).scratch == 256
    md.profile_scratch_size = 64
    with pytest.raises(CompileError, match="profiling scratch"):
        A._to_cubin(ck, row, 90)


_INTERP = textwrap.dedent("""
    import sys, pathlib, torch
    sys.path.insert(0, sys.argv[1])
    from test_gemm_tma import _export, _inputs, _compile, Layouts, TMA_CFG
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.kernel import print_triton_kernel, choose_config
    from kiln.targets.cuda.gemm_template import print_gemm_kernel
    from kiln.schedule.steps import GemmKernel
    b = _compile(_export(torch.float16), pathlib.Path(sys.argv[2]), TMA_CFG).built
    src = b.sources["kernels_triton.py"]
    assert src.count("tl.make_tensor_descriptor") == 10
    mod = import_triton_module(src)
    hints = {s.name: s.example for s in b.graph.symbols}
    bufs = {x.name: x for x in b.loop.buffers}
    ks = {s.name: print_gemm_kernel(s, bufs) if isinstance(s, GemmKernel) else
          print_triton_kernel(s, bufs, hints, choose_config(s, hints)) for s in b.steps}
    model = Layouts(torch.float16)
    for m in (1, 70):
        args = _inputs(torch.float16, m, seed=m)
        outs = run_program(b.program, ks, mod, b.weights, list(args))
        want = Layouts(torch.float32)(*[a.float() for a in args])
        for o, w in zip(outs, want):
            err = (o.reshape(w.shape).float() - w).abs().max().item()
            print("m", m, "err", err)
            assert err < 2e-2 * max(1.0, w.abs().max().item()), err
    # the autotuner's printed candidates (kiln/gemm/printed.py) with a TMA config: the
    # linear with its bias + relu epilogue, the batched GEMM with B transposed
    from kiln.gemm import printed as PR
    from kiln.targets.cuda.gemm_candidates import build as build_candidates
    from kiln.ir import loop as L
    from kiln.targets.cuda.gemm_candidates import build
    cfgs = {TMA_CFG.name: TMA_CFG}
    allbufs = L.all_buffers(b.loop)
    for name in ("gemm_linear_matmul_2", "gemm_bmm"):
        gk = next(s for s in b.steps if s.name == name)
        p = build_candidates(gk.gemm, gk.epilogue, allbufs, {"s0": 70}, cfgs)
        assert "tl.make_tensor_descriptor" in p.kernels[TMA_CFG.name].source
        bench = PR.Bench(p, device="cpu")
        err, tol = bench.check(TMA_CFG.name), bench.tolerance()
        print("printed", name, err, tol)
        assert err <= tol, (name, err, tol)
    print("ALL OK")
""")


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_tma_kernels_match_eager_in_interpreter(built, tmp_path):
    """Triton's interpreter runs the descriptor loads (zero fill outside the shape), so the
    printed TMA kernels are checked against eager float32 on the CPU, at M = 1 and 70 (a
    partial tile, past the example size); so are two of the autotuner's printed candidates
    (kiln/gemm/printed.py) given a TMA config."""
    _compile(_export(torch.float16), tmp_path, TMA_CFG)  # the child then hits the cache
    run_interpreted(_INTERP, os.path.dirname(__file__), str(tmp_path))


def _check_outputs(outs, args, dtype, what):
    want = Layouts(torch.float32)(*[a.float() for a in args])
    for i, (o, w) in enumerate(zip(outs, want)):
        o = o.cpu().float().reshape(w.shape)
        tol = (1e-2 if dtype == torch.float16 else 4e-2) * max(1.0, w.abs().max().item())
        err = (o - w).abs().max().item()
        assert err <= tol, f"{what} output {i}: max error {err:g} > {tol:g}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,cfg", [(torch.float16, T.TMA_SPACE[1]),
                                       (torch.bfloat16, T.TMA_SPACE[3])], ids=["fp16", "bf16"])
def test_gpu_tma_package_matches_eager(dtype, cfg, tmp_path):
    """Each layout (nn, nt + bias + relu, tn, batched, broadcast batch, refused) on a TMA
    config, run by the package (CUDA graphs; M = 1, 37, 200, 511: odd and partial tiles)."""
    cm = _compile(_export(dtype), tmp_path / "cache", cfg)
    assert cm.sources["kernels_triton.py"].count("tl.make_tensor_descriptor") == 10
    r = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    for m in (1, 37, 200, 511, 37):
        args = _inputs(dtype, m, seed=m)
        outs = r(*[a.cuda() for a in args])
        _check_outputs(outs, args, dtype, f"{dtype} m={m}")


@pytest.mark.gpu
@gpu
def test_gpu_tma_python_printer_sets_the_allocator(built):
    """The Python runner launches TMA kernels through Triton's launcher, which takes the
    global scratch from an allocator that the runner sets for each launch only."""
    from triton.runtime import _allocation

    from kiln.targets.cuda.gemm_template import print_gemm_kernel
    from kiln.targets.cuda.kernel import choose_config, print_triton_kernel
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.schedule.steps import GemmKernel
    b = built.built
    mod = import_triton_module(b.sources["kernels_triton.py"])
    hints = {s.name: s.example for s in b.graph.symbols}
    bufs = {x.name: x for x in b.loop.buffers}
    ks = {s.name: print_gemm_kernel(s, bufs) if isinstance(s, GemmKernel) else
          print_triton_kernel(s, bufs, hints, choose_config(s, hints)) for s in b.steps}
    args = _inputs(torch.float16, 45, seed=3)
    outs = run_program(b.program, ks, mod, b.weights, [a.cuda() for a in args], device="cuda")
    _check_outputs(outs, args, torch.float16, "python runner m=45")
    assert _allocation._allocator.get() is _allocation._NULL_ALLOCATOR  # nothing outlived it


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["nn", "nt"])
def test_gpu_bench_tma_column(layout):
    """bench/gemm_gpu.py's TMA column: every TMA config of the template (printed as a package
    prints it) gives the right answer (none dropped) on a 2048^3 fp16 GEMM and one skinny
    one; prints TFLOP/s."""
    from bench.gemm_gpu import tune
    for shape in ((2048, 2048, 2048), (64, 4096, 4096)):
        r = tune(*shape, layout, torch.float16, [])
        print(r["shape"], {b: round(t) for b, t in r["tflops"].items()}, r["best_config"])
        assert "triton_tma" in r["tflops"], r
        assert not [d for d in r["dropped"] if d[0].endswith("_tma")], r["dropped"]


def test_autotuner_offers_tma_configs_only_for_gemms_that_allow_them(tmp_path):
    """gpu.candidates lists the TMA configs (config key "tma") when select.py found the
    GEMM's operands TMA-ready, and never otherwise; skinny problems also get narrow tiles."""
    from kiln.gemm import gpu
    from kiln.gemm.problem import problem_of
    ok = _op()
    g = _gemm(ok, ok)
    p = problem_of(g, {"s0": (1, 4096)})
    opts = Options(cuda_archs=(90,), cache_dir=str(tmp_path))
    sizes = (1, 4096, 4096, 4096)
    with_tma, _ = gpu.candidates(p, ["triton"], sizes, opts, tmp_path, None, T.tma_refusal(g)
                                 is None)
    tma = [c.config for c in with_tma if c.config.tma]
    assert tma and all(c.name.endswith("_tma") and c.to_json()["tma"] is True for c in tma)
    without, _ = gpu.candidates(p, ["triton"], sizes, opts, tmp_path, None, False)
    assert not [c for c in without if c.config.tma or c.name.endswith("_tma")]
    skinny, _ = gpu.candidates(p, ["triton"], (1, 16, 4096, 4096), opts, tmp_path)
    assert "triton_16x32x256_g8_s5_w4" in [c.name for c in skinny]
    assert "triton_16x32x256_g8_s5_w4" not in [c.name for c in without]
