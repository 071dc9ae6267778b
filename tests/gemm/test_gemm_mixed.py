"""Mixed-dtype GEMMs: float16 / bfloat16 activations x int8 weights (weight-only quantisation,
`x @ (w_q.to(dtype) * scale).t()` and its variants).

- Folding never widens a weight (frontend/fold.py counts bytes): packages ship the int8 tensor.
- CPU: the dequantised weight is computed once per run by a generated kernel, then BLAS; outputs
  against a float64 reference computed from eager's dequantised weight.
- CUDA (no GPU needed): passes/mixed_gemm.py turns the pattern into one `Gemm` with `mixed` set
  (checked at the Loop IR level with the numpy interpreter, fallbacks included); the package's
  Triton template loads int8 tiles and scales the accumulator (cubin built here; the kernels
  run in Triton's interpreter against eager).
- GPU (`-m gpu`): the packages against eager CUDA.

Tolerance (elementwise, `_tol`): with u the output type's unit roundoff (2^-11 float16, 2^-8
bfloat16), every form rounds at most three times a value bounded by |x| @ |W|^T (+ |b|): the
dequantised weight (eager rounds q * s to the type; kiln's kernel scales the float32
accumulator instead, so the two differ by at most u |x| @ |W|^T), the GEMM result, and the
epilogue's scale / bias add. Float32 accumulation adds at most K * 2^-24 relative. So
|out - ref| <= (3u + K 2^-24) |x| @ |W|^T + 2u |b|, ref computed in float64 from eager's
dequantised weight W. Eager itself is checked against the same bound."""

from __future__ import annotations

import json
import os
import textwrap
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontend.export import import_program
from kiln.ir import loop as L
from kiln.ir.interp import run_loop
from kiln.lowering import lower
from kiln.options import Options
from kiln.passes.dce import dce
from kiln.passes.mixed_gemm import mixed_gemms
from tests.difftest import run_interpreted

N, K, BATCH = 48, 40, 3
SCALAR = 3 / 256  # exactly representable in float16 and bfloat16
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}


class QModel(torch.nn.Module):
    """Int8 weights with float scales, in the forms users write. `forms`: which outputs."""

    FORMS = ("linear_relu", "matmul_scalar", "post_scale_bias", "bmm", "a_side")

    def __init__(self, dtype, forms=FORMS, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.forms = tuple(forms)
        self.register_buffer("wq", torch.randint(-128, 128, (N, K), dtype=torch.int8,
                                                 generator=g))
        self.register_buffer("s", ((torch.rand(N, generator=g) + 0.5) / 64).to(dtype))
        self.register_buffer("b", torch.randn(N, generator=g).to(dtype))
        self.register_buffer("wq3", torch.randint(-128, 128, (BATCH, K, N), dtype=torch.int8,
                                                  generator=g))
        self.register_buffer("s3", ((torch.rand(BATCH, 1, N, generator=g) + 0.5) / 64).to(dtype))
        self.register_buffer("sk", ((torch.rand(K, generator=g) + 0.5) / 64).to(dtype))

    def forward(self, x, x3):
        dt = x.dtype
        out = []
        for f in self.forms:
            if f == "linear_relu":  # nn.Linear-style, per-output-channel scale, bias, relu
                out.append(torch.relu(F.linear(x, self.wq.to(dt) * self.s[:, None], self.b)))
            elif f == "matmul_scalar":  # one scale for the whole tensor
                out.append(x @ (self.wq.to(dt) * SCALAR).t())
            elif f == "post_scale_bias":  # scale applied after the GEMM, then a bias
                out.append((x @ self.wq.to(dt).t()) * self.s + self.b)
            elif f == "bmm":  # a batch of weights [B, K, N] with scales [B, 1, N]
                out.append(torch.bmm(x3, self.wq3.to(dt) * self.s3))
            elif f == "a_side":  # the int8 operand on the left, scaled per row
                out.append((self.wq.to(dt) * self.s[:, None]) @ x.t())
            elif f == "k_scale":  # a scale along K: not a scale of the output (fallback)
                out.append(x @ (self.wq.to(dt) * self.sk).t())
            elif f == "bmm_expand":  # one weight for every batch entry, through expand
                w = (self.wq.to(dt) * self.s[:, None]).t()
                out.append(torch.bmm(x3, w.expand(BATCH, K, N)))
            elif f == "both_sides":  # B scaled along K (materialised), A per row (mixed)
                out.append((self.wq.to(dt) * self.s[:, None]) @ (self.wq.to(dt) * self.sk).t())
        return tuple(out)

    def reference(self, x, x3):
        """(float64 reference, elementwise tolerance) per output; see the module docstring."""
        dt = x.dtype
        u = UNIT[dt]
        xd, x3d = x.double(), x3.double()
        w = (self.wq.to(dt) * self.s[:, None]).double()
        refs = []
        for f in self.forms:
            if f == "linear_relu":
                refs.append((torch.relu(xd @ w.t() + self.b.double()), xd.abs() @ w.abs().t(),
                             self.b.double().abs()))
            elif f == "matmul_scalar":
                ws = (self.wq.to(dt) * SCALAR).double()
                refs.append((xd @ ws.t(), xd.abs() @ ws.abs().t(), 0.0))
            elif f == "post_scale_bias":
                ref = (xd @ self.wq.double().t()) * self.s.double() + self.b.double()
                refs.append((ref, xd.abs() @ w.abs().t(), self.b.double().abs()))
            elif f == "bmm":
                w3 = (self.wq3.to(dt) * self.s3).double()
                refs.append((torch.bmm(x3d, w3), torch.bmm(x3d.abs(), w3.abs()), 0.0))
            elif f == "a_side":
                refs.append((w @ xd.t(), w.abs() @ xd.abs().t(), 0.0))
            elif f == "k_scale":
                wk = (self.wq.to(dt) * self.sk).double()
                refs.append((xd @ wk.t(), xd.abs() @ wk.abs().t(), 0.0))
            elif f == "bmm_expand":
                refs.append((x3d @ w.t(), x3d.abs() @ w.abs().t(), 0.0))
            elif f == "both_sides":
                wk = (self.wq.to(dt) * self.sk).double()
                refs.append((w @ wk.t(), w.abs() @ wk.abs().t(), 0.0))
        return [(r, (3 * u + K * 2.0 ** -24) * mag + 2 * u * bias + 1e-30)
                for r, mag, bias in refs]


def _inputs(dtype, m, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, K, generator=g).to(dtype),
            torch.randn(BATCH, m, K, generator=g).to(dtype))


def _check(outs, model, args, what):
    for f, o, (ref, tol) in zip(model.forms, outs, model.reference(*args)):
        o = o.cpu()
        assert o.shape == ref.shape and o.dtype == args[0].dtype, (what, f)
        excess = ((o.double() - ref).abs() - tol).max().item()
        assert excess <= 0, f"{what} {f}: error exceeds the bound by {excess:g}"


def _export(model, m=7):
    mdim = torch.export.Dim("m", min=1, max=256)
    return torch.export.export(model, _inputs(model.s.dtype, m),
                               dynamic_shapes=({0: mdim}, {1: mdim}))


def _stored_dtypes(path) -> dict[str, str]:
    """Tensor name -> dtype as weights.safetensors stores it (its JSON header)."""
    with zipfile.ZipFile(path) as z:
        data = z.read("weights.safetensors")
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8:8 + n])
    return {k: v["dtype"] for k, v in head.items() if k != "__metadata__"}


def test_eager_meets_the_bound():
    """The tolerance is not vacuous: eager fits it, and scales applied to the wrong channels
    (rolled by one) do not."""
    for dt in (torch.float16, torch.bfloat16):
        m = QModel(dt)
        args = _inputs(dt, 9)
        _check(m(*args), m, args, f"eager {dt}")
        wrong = QModel(dt)
        wrong.s.copy_(wrong.s.roll(1))
        with pytest.raises(AssertionError, match="exceeds the bound"):
            _check(wrong(*args), m, args, "wrong scale")


# -- CPU packages -------------------------------------------------------------------------


class Both(torch.nn.Module):
    """The float16 and the bfloat16 model in one package (one C++ build)."""

    def __init__(self):
        super().__init__()
        self.h, self.bf = QModel(torch.float16), QModel(torch.bfloat16, seed=1)

    def forward(self, x, x3, y, y3):
        return self.h(x, x3) + self.bf(y, y3)


def test_cpu_package_keeps_int8_weights_and_matches(tmp_path):
    model = Both()
    mdim = torch.export.Dim("m", min=1, max=256)
    args = _inputs(torch.float16, 7) + _inputs(torch.bfloat16, 7)
    ep = torch.export.export(model, args, dynamic_shapes=({0: mdim}, {1: mdim}, {0: mdim},
                                                          {1: mdim}))
    cm = kiln.compile(ep, options=Options(cache_dir=str(tmp_path / "cache")))
    path = cm.save(tmp_path / "m.kiln")
    stored = _stored_dtypes(path)
    weights = {w["fqn"]: w for w in cm.manifest["weights"]}
    for sub in ("h", "bf"):
        assert weights[f"{sub}.wq"]["dtype"] == "int8" and weights[f"{sub}.wq3"]["dtype"] == "int8"
        assert weights[f"{sub}.wq"]["nbytes"] == N * K  # one byte per element
        assert stored[weights[f"{sub}.wq"]["name"]] == "I8"
    assert not any(w.startswith("<folded") for w in weights), weights  # nothing widened
    # the dequantised weights are computed once per run (one kernel each), then BLAS
    loop = cm.built.loop
    ints = {b.name for b in loop.buffers if b.dtype.name == "int8"}
    deq = [n for n in loop.nodes if isinstance(n, L.Compute)
           and any(ld.buf in ints for ld in L.loads(n.body))]
    assert len(deq) == 2 * len(QModel.FORMS) and all(n.reduce is None for n in deq), deq
    r = kiln.load(path)
    for m in (7, 1, 33):  # a dynamic M
        xs = _inputs(torch.float16, m, seed=m) + _inputs(torch.bfloat16, m, seed=m + 1)
        outs = r(*xs)
        n = len(QModel.FORMS)
        _check(outs[:n], model.h, xs[:2], f"cpu float16 m={m}")
        _check(outs[n:], model.bf, xs[2:], f"cpu bfloat16 m={m}")


# -- CUDA: the pass and lowering, checked by the Loop IR interpreter ----------------------


def _lowered(model):
    ep = _export(model)
    imp = import_program(ep, library_routines=False)
    graph = mixed_gemms(dce(imp.graph))
    return graph, lower(graph), imp.weights


def _interp(prog, graph, weights, args):
    feeds = {i.name: a.numpy() for i, a in zip(graph.user_inputs, args)}
    feeds.update({k: v.numpy() for k, v in weights.items()})
    outs = run_loop(prog, feeds, {"s0": args[0].shape[0]})
    return [torch.from_numpy(np.array(o)) for o in outs]


def test_pass_makes_mixed_gemms_that_compute_the_model():
    model = QModel(torch.float16)
    graph, prog, weights = _lowered(model)
    gemms = [n for n in prog.nodes if isinstance(n, L.Gemm)]
    assert len(gemms) == 5 and all(g.mixed is not None for g in gemms)
    sides = {g.source[0]: (g.mixed.side, g.mixed.qdtype.name) for g in gemms}
    assert sorted(s for s, _ in sides.values()) == ["a", "b", "b", "b", "b"]
    assert {q for _, q in sides.values()} == {"int8"}
    for g in gemms:  # the int8 operand is the weight itself, read in place
        q = g.a if g.mixed.side == "a" else g.b
        assert q.buf in ("b_wq", "b_wq3")
    # per-column scales read the [N] vector with stride 0 along M; the scalar has stride 0 only
    scales = [g.mixed.scale for g in gemms if g.mixed.scale is not None]
    assert len(scales) == 4  # post_scale_bias multiplies after the GEMM (its epilogue)
    assert any(s.rows == 0 and s.cols == 0 for s in scales)
    assert any(s.rows == 0 and s.cols == 1 and s.buf == "b_s" for s in scales)
    assert any(s.rows == 1 and s.cols == 0 and s.buf == "b_s" for s in scales)  # a_side
    # no float16 copy of a weight anywhere
    assert not [b for b in prog.buffers if b.kind == "temp" and b.dtype.name == "float16"
                and str(b.numel) in (str(N * K), str(BATCH * N * K))]
    for m in (7, 20):
        args = _inputs(torch.float16, m, seed=m)
        _check(_interp(prog, graph, weights, args), model, args, f"interp m={m}")


def test_scale_along_k_and_other_patterns_keep_the_present_path():
    model = QModel(torch.float16, forms=("k_scale", "linear_relu"))
    graph, prog, weights = _lowered(model)
    gemms = {g.source[0]: g for g in prog.nodes if isinstance(g, L.Gemm)}
    assert [g.mixed is None for g in gemms.values()] == [True, False]
    args = _inputs(torch.float16, 11)
    _check(_interp(prog, graph, weights, args), model, args, "interp k_scale")


def test_expanded_weight_and_second_operand():
    model = QModel(torch.float16, forms=("bmm_expand", "both_sides"))
    graph, prog, weights = _lowered(model)
    g1, g2 = [g for g in prog.nodes if isinstance(g, L.Gemm)]
    assert g1.mixed.side == "b" and g1.b.buf == "b_wq" and g1.b.batch_strides == (0,)
    assert g1.mixed.scale.batch_strides == (0,) and g1.mixed.scale.rows == 0
    assert g2.mixed.side == "a" and g2.a.buf == "b_wq" and g2.mixed.scale.cols == 0
    assert prog.buffer(g2.b.buf).dtype.name == "float16"  # B scaled along K: materialised
    args = _inputs(torch.float16, 6)
    _check(_interp(prog, graph, weights, args), model, args, "interp expand / both")


def test_autotune_problem_and_backends():
    """Mixed GEMMs have their own cache key (plain keys are those recorded before) and only
    the Triton template is eligible."""
    from dataclasses import replace

    from kiln.gemm import gpu as G
    from kiln.gemm.problem import GemmProblem
    plain = GemmProblem("float16", (), 8, 64, 32, "n", "t", 8)
    assert plain.key("cuda:sm_90") == "655ab14e2fb30c0329b9cdec"  # as before mixed GEMMs
    mixed = replace(plain, mixed="b:int8:scaled")
    assert mixed.key("cuda:sm_90") != plain.key("cuda:sm_90")
    assert "mixed=b:int8:scaled" in mixed.describe()
    opts = Options(cuda_archs=(90,))
    assert G.eligible(mixed, ("blas", "triton", "cutlass"), opts) == ["triton"]
    assert G.eligible(mixed, ("blas",), opts) == []


# -- CUDA packages (compiled here, no GPU) ------------------------------------------------


def _cuda_opts(tmp_path, backends=("blas", "triton", "cutlass"), **kw):
    return Options(cuda_archs=(90,), gemm_backends=backends, cache_dir=str(tmp_path), **kw)


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory):
    """(cache dir, compiled model) of QModel(float16) for CUDA with the default backends."""
    pytest.importorskip("triton")
    cache = tmp_path_factory.mktemp("cuda")
    return cache, kiln.compile(_export(QModel(torch.float16)), device="cuda",
                               options=_cuda_opts(cache))


def test_cuda_package_links_the_int8_template(cuda_build, tmp_path):
    _, cm = cuda_build
    gk = [k for k in cm.manifest["kernels"] if k["kind"] == "triton_gemm"]
    assert len(gk) == 5, cm.manifest["kernels"]
    assert all(k["gemm"]["backend"] == "triton" and "mixed=" in k["gemm"]["problem"]
               for k in gk), gk
    src = cm.sources["kernels_triton.py"]
    assert src.count("other=0).to(tl.float16)  # int8 -> float16, exact") == 5
    assert src.count("# dequantisation scale") == 4
    # bias + relu, and the post-GEMM scale + bias, are the templates' epilogues
    assert sorted(len(k["members"]) for k in gk) == [1, 1, 1, 2, 2], gk
    cpp = cm.sources["model_cuda.cpp"]
    assert "kc::gemm<" not in cpp  # no cuBLAS call, no float16 weight copy
    assert not [b for b in cm.built.loop.buffers if b.kind == "temp"
                and b.dtype.name == "float16" and str(b.numel) in (str(N * K), str(BATCH * N * K))]
    assert cm.manifest["cuda"]["kernels"].keys() >= {k["name"] for k in gk}  # cubins
    path = cm.save(tmp_path / "m.kiln")
    assert _stored_dtypes(path)["b_wq"] == "I8"
    with zipfile.ZipFile(path) as z:
        assert z.read("lib/model.so").count(b"\x7fELF") >= 1 + len(gk)


def test_cuda_without_triton_materialises_the_weight(tmp_path):
    """cuBLAS only: the present path, a kiln kernel writes the float16 weight per run into
    the arena and cuBLAS multiplies it."""
    pytest.importorskip("triton")
    model = QModel(torch.float16, forms=("linear_relu",))
    cm = kiln.compile(_export(model), device="cuda", options=_cuda_opts(tmp_path, ("blas",)))
    (g,) = [s for s in cm.built.loop.nodes if isinstance(s, L.Gemm)]
    assert g.mixed is None and cm.built.loop.buffer(g.b.buf).dtype.name == "float16"
    assert "kc::gemm<" in cm.sources["model_cuda.cpp"]
    assert "mixed_gemm" not in cm.built.timings


_INTERP = textwrap.dedent("""
    import pathlib, sys, torch, kiln
    sys.path.insert(0, sys.argv[1])
    from test_gemm_mixed import QModel, _export, _cuda_opts, _inputs, _check
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.kernel import print_triton_kernel, choose_config
    from kiln.targets.cuda.gemm_template import print_gemm_kernel
    from kiln.schedule.steps import GemmKernel
    model = QModel(torch.float16)
    b = kiln.compile(_export(model), device="cuda",
                     options=_cuda_opts(pathlib.Path(sys.argv[2]))).built
    mod = import_triton_module(b.sources["kernels_triton.py"])
    hints = {s.name: s.example for s in b.graph.symbols}
    bufs = {x.name: x for x in b.loop.buffers}
    ks = {s.name: print_gemm_kernel(s, bufs) if isinstance(s, GemmKernel) else
          print_triton_kernel(s, bufs, hints, choose_config(s, hints)) for s in b.steps}
    for m in (37, 2):  # not the example size, nor a multiple of a block
        args = _inputs(torch.float16, m, seed=m)
        outs = run_program(b.program, ks, mod, b.weights, list(args))
        outs = [o.reshape(r.shape) for o, r in zip(outs, model(*args))]
        _check(outs, model, args, f"triton interpreter m={m}")
    print("ALL OK")
""")


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_template_kernels_match_eager_in_triton_interpreter(cuda_build):
    """The package's Triton kernels (the GEMM template specialised to each mixed GEMM, with
    its epilogue) in Triton's interpreter, in a child process (TRITON_INTERPRET must hold
    when Triton is imported); its compile finds the cubins the fixture built in the cache."""
    cache, _ = cuda_build
    run_interpreted(_INTERP, os.path.dirname(__file__), str(cache))


# -- GPU ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_run(model, tmp_path, ms=(1, 7, 37, 200), **opts):
    """Compile `model` for CUDA, run it on the GPU at several M, check every output against
    the float64 bound; returns the manifest."""
    cm = kiln.compile(_export(model), device="cuda",
                      options=Options(cache_dir=str(tmp_path / "cache"), **opts))
    r = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    dt = model.s.dtype
    for m in ms:
        args = _inputs(dt, m, seed=m)
        outs = r(*[a.cuda() for a in args])
        _check([o.cpu() for o in outs], model, args, f"gpu {dt} m={m}")
    return cm.manifest


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_mixed_package_matches_reference(dtype, tmp_path):
    man = _gpu_run(QModel(dtype), tmp_path)
    gk = [k for k in man["kernels"] if k["kind"] == "triton_gemm"]
    assert len(gk) == 5 and all("mixed=" in k["gemm"]["problem"] for k in gk)


@pytest.mark.gpu
@gpu
def test_gpu_mixed_max_autotune_profiles_int8_template(tmp_path):
    man = _gpu_run(QModel(torch.float16, forms=("linear_relu", "bmm")), tmp_path, (5, 130),
                   max_autotune=True)
    gk = [k for k in man["kernels"] if k["kind"] == "triton_gemm"]
    assert len(gk) == 2 and all(k["gemm"]["how"] == "profiled" for k in gk), gk
    assert all(not k["gemm"]["dropped"] for k in gk), gk  # every config gave the right answer


@pytest.mark.gpu
@gpu
def test_gpu_cublas_only_materialises_the_weight(tmp_path):
    man = _gpu_run(QModel(torch.bfloat16, forms=("linear_relu", "post_scale_bias", "a_side")),
                   tmp_path, (3, 64), gemm_backends=("blas",))
    assert not [k for k in man["kernels"] if k["kind"] == "triton_gemm"]
