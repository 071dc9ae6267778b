"""CUTLASS epilogue visitor trees (kiln/gemm/cutlass_evt.py): the epilogue description ->
EVT mapping for every kind (bias, relu, relu6 / clamp, erf and tanh GELU, scaled residual,
casts) and every refusal, without nvcc; the rendered types; the choice (fused candidates,
the report line), the fused step (gemm/fuse.py) and the wrapper's call; and the
rendered sources compiling with nvcc for sm_90a (one in the default suite, the rest slow)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import sympy
import torch

from kiln.gemm.cutlass_evt import Evt, EvtRefusal, from_epilogue, render_types
from kiln.ir import loop as L
from kiln.ir.dtypes import dtype
from kiln.ir.sym import ivars
from kiln.options import Options

cutlass = pytest.importorskip("kiln.gemm.cutlass")
if not cutlass.available():
    pytest.skip("nvidia-cutlass is not installed", allow_module_level=True)

i0, i1, i2 = ivars(3)
M, N, K = 64, 32, 48


def _gemm(dt="float16", batch=()):
    d = dtype(dt)
    bs = tuple(sympy.Integer(M * K) for _ in batch)
    return L.Gemm("mm", d, tuple(sympy.Integer(b) for b in batch), sympy.Integer(M),
                  sympy.Integer(N), sympy.Integer(K),
                  L.Operand("x", sympy.Integer(0), bs, sympy.Integer(K), sympy.Integer(1)),
                  L.Operand("w", sympy.Integer(0), tuple(0 for _ in batch), sympy.Integer(1),
                            sympy.Integer(K)), ("addmm",))


def _acc(g, batch=False):
    idx = (i0 * M * N + i1 * N + i2) if batch else (i0 * N + i1)
    return L.Load(g.name, idx, g.dtype)


def _c(v, dt="float16"):
    return L.Const(v, dtype(dt))


def _op(op, *args, dt="float16"):
    return L.Op(op, tuple(args), dtype(dt))


def _bias(dt="float16"):
    return L.Load("bias", i1, dtype(dt))


def _epi(g, body, dt="float16", shape=None):
    return L.Compute("out", dtype(dt), shape or g.shape, body, source=("epilogue",))


def _gelu(x):
    return _op("mul", _op("mul", _c(0.5), x),
               _op("add", _c(1.0), _op("erf", _op("mul", x, _c(0.7071067811865476)))))


def _gelu_tanh(x):
    cube = _op("mul", x, _op("mul", x, x))
    inner = _op("mul", _c(0.7978845608028654), _op("add", x, _op("mul", _c(0.044715), cube)))
    return _op("mul", _op("mul", _c(0.5), x), _op("add", _c(1.0), _op("tanh", inner)))


def test_every_epilogue_kind_maps_to_a_visitor_tree():
    g = _gemm()
    acc = _acc(g)
    x = _op("add", acc, _bias())
    res = L.Load("r", i0 * N + i1, dtype("float16"))
    cases = {
        "bias": (x, "evt add(identity(acc)->float16,col0:float16/8) -> float16"),
        "relu": (_op("relu", x), "evt relu(add(identity(acc)->float16,col0:float16/8)) -> "
                 "float16"),
        "relu6": (_op("minimum", _op("maximum", x, _c(0.0)), _c(6.0)),
                  "evt clamp[0.0,6.0](add(identity(acc)->float16,col0:float16/8)) -> float16"),
        "gelu": (_gelu(x), "evt gelu(add(identity(acc)->float16,col0:float16/8)) -> float16"),
        "gelu_tanh": (_gelu_tanh(x), "evt gelu_tanh(add(identity(acc)->float16,"
                      "col0:float16/8)) -> float16"),
        "residual": (_op("add", _op("mul", acc, _c(0.5)), _op("mul", res, _c(2.0))),
                     "evt add(mul(identity(acc)->float16,0.5),mul(src0:float16,2.0)) -> float16"),
    }
    for kind, (body, key) in cases.items():
        evt = from_epilogue(g, _epi(g, body))
        assert isinstance(evt, Evt), (kind, evt)
        assert evt.key == key, kind
    # casts: to float32 nothing rounds (float32 compute), the store writes float32; to
    # bfloat16 an explicit rounding node, then the float16 store
    evt = from_epilogue(g, _epi(g, _op("cast", _op("relu", x), dt="float32"), "float32"))
    assert evt.key == "evt relu(add(identity(acc)->float16,col0:float16/8)) -> float32"
    assert evt.out_dtype == "float32"
    evt = from_epilogue(g, _epi(g, _op("cast", _op("cast", x, dt="bfloat16"))))
    assert evt.key == ("evt identity(identity(add(identity(acc)->float16,col0:float16/8))"
                       "->bfloat16) -> float16")
    # the residual is CUTLASS's C operand; the bias goes through `ext`
    evt = from_epilogue(g, _epi(g, _op("add", _gelu(x), res)))
    assert evt.src.buf == "r" and [o.buf for o in evt.ext] == ["bias"]


def test_vectors_scalars_batches_and_regrouped_shapes():
    g = _gemm("bfloat16")
    acc = _acc(g)
    row = L.Load("rs", i0 + 3, dtype("float32"))  # one value per row, at an offset
    s = L.Load("scale", sympy.Integer(0), dtype("float32"))  # a 0-d tensor
    evt = from_epilogue(g, _epi(g, _op("mul", _op("add", acc, row, dt="bfloat16"), s,
                                       dt="bfloat16"), "bfloat16"))
    assert isinstance(evt, Evt), evt
    assert [(o.role, o.buf, int(o.offset), o.align) for o in evt.operands] == [
        ("row", "rs", 3, 1), ("scalar", "scale", 0, 1)]  # offset 3: scalar loads
    _, ty, args = render_types(evt, "cute::Shape<cute::_128, cute::_128, cute::_64>")
    assert "Sm90RowBroadcast<0, cute::Shape<cute::_128, cute::_128, cute::_64>, float, float, " \
        "cute::Stride<cute::_0, cute::_1, int64_t>, 1>" in ty
    assert "Sm90ScalarBroadcast<float, cute::Stride<cute::_0, cute::_0, int64_t>>" in ty
    assert "ext[0]" in args and "{{}, {static_cast<const float *>(ext[1])}}" in args
    # a batched GEMM: the residual per batch entry is C, the bias is shared
    gb = _gemm(batch=(3,))
    accb = _acc(gb, True)
    res = L.Load("r", i0 * M * N + i1 * N + i2, dtype("float16"))
    evt = from_epilogue(gb, _epi(gb, _op("add", _op("add", accb, L.Load("b", i2, dtype(
        "float16"))), res)))
    assert isinstance(evt, Evt) and [o.role for o in evt.operands] == ["col", "src"]
    # [M, N] read as [2, M / 2, N] (a reshape after the GEMM): the same element
    epi = L.Compute("out", dtype("float16"), (sympy.Integer(2), sympy.Integer(M // 2),
                                              sympy.Integer(N)),
                    _op("relu", _op("add", L.Load("mm", i0 * (M // 2) * N + i1 * N + i2,
                                                  dtype("float16")),
                                    L.Load("bias", i2, dtype("float16")))))
    assert isinstance(from_epilogue(g := _gemm(), epi), Evt)


def test_refusals_name_what_cutlass_cannot_express():
    g = _gemm()
    acc = _acc(g)
    res = L.Load("r", i0 * N + i1, dtype("float16"))
    cases = {
        "where": (_op("where", _op("gt", acc, _c(0.0), dt="bool"), acc, _c(1.0)),
                  "operator where has no CUTLASS epilogue functor"),
        "pow": (_op("pow", acc, _c(2.0)), "operator pow has no CUTLASS epilogue functor"),
        "two full operands": (_op("add", _op("add", acc, res), L.Load(
            "q", i0 * N + i1, dtype("float16"))), "two full [M, N] tensors"),
        "transposed read": (_op("add", acc, L.Load("t", i1 * M + i0, dtype("float16"))),
                            "neither the GEMM's element"),
        "gather": (_op("add", acc, L.Load("e", sympy.Symbol("j"), dtype("float16"), (
            L.Indirect(sympy.Symbol("j"), L.Load("idx", i1, dtype("int64")),
                       sympy.Integer(9)),))), "gathers from e"),
        "int cast": (_op("add", acc, _op("cast", L.Load("n", i1, dtype("int32")))),
                     "it casts from int32"),
        "int operand": (_op("add", acc, L.Load("n", i1, dtype("int32"))),
                        "reads n of dtype int32"),
    }
    for kind, (body, why) in cases.items():
        r = from_epilogue(g, _epi(g, body))
        assert isinstance(r, EvtRefusal), kind
        assert why in r.reason and "epilogue out stays a separate kernel" in r.reason, \
            (kind, r.reason)
    # dtype mismatch: an integer output; a float32 GEMM (CUTLASS takes 16-bit GEMMs)
    r = from_epilogue(g, _epi(g, _op("cast", acc, dt="int32"), "int32"))
    assert isinstance(r, EvtRefusal) and "output dtype is int32" in r.reason
    g32 = _gemm("float32")
    r = from_epilogue(g32, _epi(g32, _op("relu", _acc(g32), dt="float32"), "float32"))
    assert isinstance(r, EvtRefusal) and "the GEMM is float32" in r.reason
    # a tree over the node budget
    big = acc
    for _ in range(30):
        big = _op("add", _op("mul", big, _c(1.5)), _c(0.25))
    r = from_epilogue(g, _epi(g, big))
    assert isinstance(r, EvtRefusal) and "nodes" in r.reason


def test_fused_candidates_have_a_tma_epilogue_and_render_the_tree():
    from kiln.gemm.problem import GemmProblem
    g = _gemm()
    evt = from_epilogue(g, _epi(g, _op("cast", _gelu(_op("add", _acc(g), _bias())),
                                       dt="float32"), "float32"))
    p = GemmProblem("float16", (), M, N, K, "t", "n", 16, evt.key)
    cands = cutlass.enumerate_candidates(p, Options(), evt=evt)
    assert cands and all(c.evt is evt and "epi_tma" in c.name for c in cands)
    assert {c.schedule for c in cands} >= {"cooperative", "ping-pong"}
    src = cutlass.render(cands[0])
    assert "using KilnEvt = cutlass::epilogue::fusion::Sm90EVT<" in src
    assert "cutlass::epilogue::thread::GELU" in src and "Sm90ColBroadcast" in src
    assert "KilnEvt\n  >::CollectiveOp" in src  # the tree is the epilogue's fusion callbacks
    # D retyped to float32 (16-byte TMA alignment: 4 elements), C void (no residual)
    assert "    void, cutlass::layout::ColumnMajor, 0,\n" in src
    assert "    float, cutlass::layout::ColumnMajor, 4,\n" in src
    assert "const void *const *ext" in src and "args.epilogue.thread = {" in src
    # cp.async kernels (rows not 16-byte aligned) have no TMA epilogue: nothing to fuse into
    low = GemmProblem("float16", (), M, N, 66, "n", "n", 2, evt.key)
    assert not cutlass.enumerate_candidates(low, Options(), evt=evt)


class _Lin(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.l = torch.nn.Linear(64, 32)
        self.act = act

    def forward(self, x, r):
        y = self.l(x)
        y = {"gelu": torch.nn.functional.gelu, "relu6": lambda t: torch.clamp(t, 0, 6),
             "where": lambda t: torch.where(t > 0, t, t * 0.1)}[self.act](y)
        return (y + 0.5 * r).float()


def _built(tmp_path, act, dt=torch.float16):
    import kiln
    torch.manual_seed(0)
    b = torch.export.Dim("b", min=1, max=256)
    m = _Lin(act).to(dt)
    ep = torch.export.export(m, (torch.randn(16, 64, dtype=dt), torch.randn(16, 32, dtype=dt)),
                             dynamic_shapes={"x": {0: b}, "r": {0: b}})
    opts = Options(cuda_archs=(90,), gemm_backends=("blas",), cache_dir=str(tmp_path))
    return kiln.compile(ep, device="cuda", options=opts).built, m


@pytest.mark.parametrize("act,dt", [("gelu", torch.float16), ("relu6", torch.bfloat16)])
def test_fused_program_matches_eager(tmp_path, act, dt):
    """The fused step's semantics (the tree's torch twin, as the Python printer runs it)
    against eager: the frontend's GELU / clamp forms, bias as a column vector, the residual as
    C, the float32 cast."""
    from kiln.gemm.select import choose_gemms
    from kiln.targets.cuda.wrapper_py import run_program
    from kiln.gemm.fuse import fuse_gemms
    from kiln.schedule.steps import CutlassGemm
    from kiln.schedule.program import build_program
    b, module = _built(tmp_path, act, dt)
    keep = set(b.loop.outputs)
    opts = Options(cuda_archs=(90,), gemm_backends=("cutlass",), cache_dir=str(tmp_path))
    fused = fuse_gemms(b.steps, choose_gemms(b.steps, b.graph.symbols, opts, "cuda",
                                             outputs=keep), keep)
    assert [type(s) for s in fused] == [CutlassGemm]
    prog = build_program(b.graph, b.loop, fused, b.program.weights, False)
    torch.manual_seed(3)
    x, r = torch.randn(37, 64, dtype=dt) * 2, torch.randn(37, 32, dtype=dt)
    (got,) = run_program(prog, {}, None, b.weights, [x, r])
    want = module(x, r)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=2e-2, atol=2e-2)


def test_frontend_gelu_choice_fuses_and_wrapper_passes_operands(tmp_path):
    """The frontend's decomposed GELU maps to CUTLASS's GELU; the choice under ("cutlass",)
    names the tree, gemm_fuse makes the fused step, and the wrapper calls the fused entry
    with C = the residual, ext = {bias}, D = the epilogue's buffer (and compiles)."""
    from kiln.gemm.cutlass_link import entry, workspace_entry
    from kiln.gemm.select import choose_gemms
    from kiln.targets.cuda.wrapper import print_cuda_wrapper
    from tests.difftest import assert_host_compiles
    from kiln.gemm.fuse import fuse_gemms
    from kiln.schedule.steps import CutlassGemm
    from kiln.schedule.program import build_program
    b, _ = _built(tmp_path, "gelu")
    keep = set(b.loop.outputs)
    steps = [s for s in b.steps if not isinstance(s, CutlassGemm)]
    opts = Options(cuda_archs=(90,), gemm_backends=("cutlass",), cache_dir=str(tmp_path))
    got = choose_gemms(steps, b.graph.symbols, opts, "cuda", outputs=keep)
    (name, c), = got.items()
    assert c.backend == "cutlass" and c.config.evt.startswith("evt add(gelu(add(")
    assert c.epilogue == f"cutlass fuses {c.config.evt}" and "evt" in c.problem
    assert c.to_json()["epilogue"] == c.epilogue
    fused = fuse_gemms(tuple(steps), got, keep)
    cg = [s for s in fused if isinstance(s, CutlassGemm)]
    assert len(cg) == 1 and cg[0].out == "out0_to"
    prog = build_program(b.graph, b.loop, fused, b.program.weights, False)
    cpp = print_cuda_wrapper(prog, {}, {}, (90,), "/dev/null", {}, True, got)
    kern, key = c.config.name, c.config.evt
    assert f"{workspace_entry(kern, key)}(256, 32, 64, 1)" in cpp
    call = cpp[cpp.index(f"const int rc = {entry(kern, key)}("):]
    call = call[:call.index(";")]
    assert "(const void*)(buf_r + 2 * 0)" in call and "(void*)buf_out0_to" in call
    assert f"ext_{name}, " in call and "buf_addmm" not in call
    assert f"const void* ext_{name}[] = {{(const void*)(buf_p_l_bias + 2 * 0)}};" in cpp
    assert_host_compiles(tmp_path, cpp)


def test_unexpressible_epilogue_is_reported_and_stays_a_kernel(tmp_path):
    from kiln.gemm.select import choose_gemms
    from kiln.schedule import Kernel
    from kiln.gemm.fuse import fuse_gemms
    b, _ = _built(tmp_path, "where")
    keep = set(b.loop.outputs)
    opts = Options(cuda_archs=(90,), gemm_backends=("cutlass",), cache_dir=str(tmp_path))
    got = choose_gemms(b.steps, b.graph.symbols, opts, "cuda", outputs=keep)
    (c,) = got.values()
    assert c.backend == "cutlass" and c.config.evt is None and "evt" not in c.to_json()["config"]
    assert c.epilogue.startswith("cutlass: epilogue") and "stays a separate kernel" in \
        c.epilogue and "operator where" in c.epilogue
    from rich.console import Console

    from kiln.cli.commands import _gemm_table
    con = Console(width=400, record=True)
    con.print(_gemm_table([{"name": "g", **c.to_json()}]))
    assert "stays a separate kernel" in con.export_text()  # kiln inspect shows the reason
    fused = fuse_gemms(b.steps, got, keep)
    assert [type(s).__name__ for s in fused] == ["Gemm", "Kernel"]
    assert isinstance(fused[1], Kernel)
    # and with other backends allowed, CUTLASS's note is still there; without CUTLASS none
    both = choose_gemms(b.steps, b.graph.symbols, Options(
        cuda_archs=(90,), gemm_backends=("blas", "cutlass"), cache_dir=str(tmp_path)), "cuda",
        outputs=keep)
    assert next(iter(both.values())).epilogue == c.epilogue
    blas = choose_gemms(b.steps, b.graph.symbols, Options(
        cuda_archs=(90,), gemm_backends=("blas",), cache_dir=str(tmp_path)), "cuda",
        outputs=keep)
    assert next(iter(blas.values())).epilogue == ""


def test_gemm_chain_fuses_only_the_last_epilogue(tmp_path):
    """x @ w1 @ w2 + bias: the first GEMM's reader is a GEMM, so it has no epilogue."""
    import kiln
    from kiln.gemm.select import choose_gemms

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(64, 48))
            self.l2 = torch.nn.Linear(48, 32)

        def forward(self, x):
            return torch.relu(self.l2(x @ self.w1))
    ep = torch.export.export(Chain().half(), (torch.randn(16, 64).half(),))
    b = kiln.compile(ep, device="cuda", options=Options(
        cuda_archs=(90,), gemm_backends=("blas",), cache_dir=str(tmp_path))).built
    opts = Options(cuda_archs=(90,), gemm_backends=("cutlass",), cache_dir=str(tmp_path))
    got = choose_gemms(b.steps, b.graph.symbols, opts, "cuda", outputs=set(b.loop.outputs))
    first, last = [got[s.name] for s in b.steps if isinstance(s, L.Gemm)]
    assert first.config.evt is None and first.epilogue == ""
    assert last.config.evt == "evt relu(add(identity(acc)->float16,col0:float16/8)) -> " \
        "float16"


def test_layer_norm_after_a_gemm_is_not_an_epilogue(tmp_path):
    """A shape-dependent normalisation (a reduction over the row) is not absorbed."""
    import kiln
    from kiln.gemm.select import choose_gemms

    class LN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(64, 32)
            self.n = torch.nn.LayerNorm(32)

        def forward(self, x):
            return self.n(self.l(x))
    ep = torch.export.export(LN().half(), (torch.randn(16, 64).half(),))
    b = kiln.compile(ep, device="cuda", options=Options(
        cuda_archs=(90,), gemm_backends=("blas",), cache_dir=str(tmp_path))).built
    opts = Options(cuda_archs=(90,), gemm_backends=("cutlass",), cache_dir=str(tmp_path))
    got = choose_gemms(b.steps, b.graph.symbols, opts, "cuda", outputs=set(b.loop.outputs))
    c = next(iter(got.values()))
    assert c.config.evt is None


def _sources(kinds):
    """{kind: rendered .cu} for the nvcc checks: each a Linear-shaped fp16 / bf16 GEMM."""
    from kiln.gemm.problem import GemmProblem
    out = {}
    for kind in kinds:
        dt = "bfloat16" if kind in ("clamp_row_scalar_bf16", "kiln_functors_bf16") else "float16"
        g = _gemm(dt)
        acc, bias = _acc(g), _bias(dt)
        x = _op("add", acc, bias, dt=dt)
        res = L.Load("r", i0 * N + i1, dtype(dt))
        s_ = L.Load("s", sympy.Integer(0), dtype("float32"))
        body, odt = {
            # every node kind in one tree: bias (column vector), erf-GELU, a 0-d tensor, a
            # vector over rows, relu6 (Clamp), the residual (C) scaled, relu, cast to float32
            "all_kinds": (_op("cast", _op("add", _op("minimum", _op("maximum", _op(
                "add", _op("mul", _gelu(x), s_), L.Load("rv", i0, dtype(dt))), _c(0.0)),
                _c(6.0)), _op("relu", _op("mul", res, _c(0.5)))), dt="float32"), "float32"),
            # bias, erf-GELU, scaled residual (C), cast to float32
            "gelu_residual_cast": (_op("cast", _op("add", _gelu(x), _op("mul", res, _c(0.5))),
                                       dt="float32"), "float32"),
            # relu6 (Clamp), a vector over rows, a 0-d tensor, relu
            "clamp_row_scalar_bf16": (_op("relu", _op("mul", _op(
                "minimum", _op("maximum", _op("add", x, L.Load("rv", i0, dtype(dt)), dt=dt),
                               _c(0.0, dt)), _c(6.0, dt), dt=dt), L.Load(
                "s", sympy.Integer(0), dtype("float32")), dt=dt), dt=dt), dt),
            "relu_bias": (_op("relu", x), dt),
            "kiln_functors_bf16": (_op("add", _gelu_tanh(x), _op("sigmoid", _op("exp", _op(
                "neg", x, dt=dt), dt=dt), dt=dt), dt=dt), dt),
        }[kind]
        evt = from_epilogue(g, _epi(g, body, odt))
        assert isinstance(evt, Evt), (kind, evt)
        p = GemmProblem(dt, (), M, N, K, "t", "n", 16, evt.key)
        c = [c for c in cutlass.enumerate_candidates(p, Options(), evt=evt)
             if c.schedule == ("cooperative" if dt == "bfloat16" else "ping-pong")][0]
        out[kind] = cutlass.render(c)
    return out


def _compile(kinds, tmp: Path):
    out = cutlass.compile_all(_sources(kinds), tmp, jobs=2)
    for k in kinds:
        assert not isinstance(out[k], str), out[k]
        syms = subprocess.run(["nm", str(out[k])], capture_output=True, text=True).stdout
        assert "kiln_cutlass_run" in syms and "kiln_cutlass_workspace" in syms


@pytest.mark.slow  # nvcc compile of the CUTLASS visitor tree (~60 s): the GPU suite runs it
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_visitor_tree_compiles_with_nvcc(tmp_path):
    """One kernel whose tree has every node kind and the kinds of issue 6 (fp16 GEMM,
    float32 output): about a minute of nvcc on an idle core, so the only default one."""
    _compile(["all_kinds"], tmp_path)


@pytest.mark.slow  # four more kernels: minutes on a 2-core machine
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_more_visitor_trees_compile_with_nvcc(tmp_path):
    """bias + erf-GELU + scaled residual + cast (fp16); relu6 + row vector + 0-d tensor +
    relu (bf16); bias + relu; kiln's own functors (tanh-GELU, exp, sigmoid, neg; bf16)."""
    _compile(["gelu_residual_cast", "clamp_row_scalar_bf16", "relu_bias",
              "kiln_functors_bf16"], tmp_path)


def test_cached_fused_choice_is_keyed_by_the_tree(tmp_path):
    """A measurement of the fused kernel (as max_autotune stores it on the GPU) is found by a
    CPU-only compile of the same GEMM + epilogue, and the package step is the fused one; the
    same GEMM without that epilogue is another problem."""
    from kiln.gemm import cache as acache
    from kiln.gemm import gpu
    from kiln.gemm.problem import problem_of
    from kiln.gemm.select import choose_gemms
    from kiln.gemm.fuse import epilogue_member, fuse_gemms
    from kiln.schedule.steps import CutlassGemm
    b, _ = _built(tmp_path, "gelu")
    keep = set(b.loop.outputs)
    g = b.steps[0]
    evt = from_epilogue(g, epilogue_member(b.steps, 0, keep))
    ranges = {s.name: (s.min, s.max) for s in b.graph.symbols}
    kern = cutlass.enumerate_candidates(problem_of(g, ranges, evt.key), Options(), evt=evt)[-1]
    cfg = {"name": kern.name, "evt": evt.key}
    acache.store(tmp_path, problem_of(g, ranges, evt.key), gpu.device_id(90), {
        "winner": {"backend": "cutlass", "config": cfg},
        "results": [["blas", "blas", {}, 2e-5], [kern.name, "cutlass", cfg, 1e-5]]})
    opts = Options(cuda_archs=(90,), gemm_backends=("blas", "cutlass"), cache_dir=str(tmp_path))
    got = choose_gemms(b.steps, b.graph.symbols, opts, "cuda", outputs=keep)
    c = got[g.name]
    assert (c.backend, c.how, c.config.to_json()) == ("cutlass", "cache", cfg)
    assert [type(s) for s in fuse_gemms(b.steps, got, keep)] == [CutlassGemm]
    # no epilogue found (its result is an output): the plain problem, not in the cache
    plain = choose_gemms(b.steps, b.graph.symbols, opts, "cuda", outputs=keep | {g.name})
    assert plain[g.name].how == "heuristic" and plain[g.name].backend == "blas"
