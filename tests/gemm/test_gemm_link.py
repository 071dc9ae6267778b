"""CUDA packages link the GEMM backend the autotuner picks (no GPU needed): with
`gemm_backends=("triton",)` the package holds the Triton template kernel (a cubin in the
blob) with bias / activation / residual / cast absorbed, the wrapper launches it on a
persistent grid and calls no cuBLAS; the fused kernels compute what eager computes (Triton's
interpreter, in a subprocess); with ("cutlass",) the wrapper calls the renamed CUTLASS entry
and the model library links the nvcc object (slow: nvcc builds a CUTLASS kernel in minutes on
a small machine); the choice order (profiled > cache > heuristic) on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

triton = pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.gemm import cache as acache  # noqa: E402
from kiln.gemm import gpu  # noqa: E402
from kiln.gemm.problem import problem_of  # noqa: E402
from kiln.gemm.select import choose_gemms  # noqa: E402
from kiln.errors import UnsupportedError  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.options import Options  # noqa: E402
from tests.difftest import run_interpreted  # noqa: E402


class Block(torch.nn.Module):
    """Two linears: bias + gelu, then bias + residual + a cast; and a plain matmul output."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(24, 20)
        self.l2 = torch.nn.Linear(20, 12)

    def forward(self, x, r, y):
        h = torch.nn.functional.gelu(self.l1(x))
        return (self.l2(h) + r).to(torch.float16), torch.bmm(y, y.transpose(1, 2)).relu()


def _export(dtype=torch.float32):
    torch.manual_seed(0)
    m = Block().to(dtype)
    x, r, y = torch.randn(10, 24, dtype=dtype), torch.randn(10, 12, dtype=dtype), \
        torch.randn(3, 5, 24, dtype=dtype)
    b = torch.export.Dim("b", min=2, max=64)
    return m, torch.export.export(m, (x, r, y), dynamic_shapes={"x": {0: b}, "r": {0: b},
                                                                 "y": None})


def _opts(tmp_path, backends, **kw):
    return Options(cuda_archs=(90,), gemm_backends=backends, cache_dir=str(tmp_path), **kw)


def test_triton_backend_links_template_with_epilogues(tmp_path):
    _, ep = _export(torch.float16)
    cm = kiln.compile(ep, device="cuda", options=_opts(tmp_path, ("triton",)))
    gk = [k for k in cm.manifest["kernels"] if k["kind"] == "triton_gemm"]
    assert len(gk) == 3 and not [k for k in cm.manifest["kernels"] if k["kind"] == "blas_gemm"]
    # every epilogue was absorbed: gelu(l1) + bias, l2 + bias + r + cast, bmm + relu
    assert all(len(k["members"]) == 2 for k in gk), gk
    assert not [k for k in cm.manifest["kernels"] if k["kind"] == "triton"]
    src = cm.sources["kernels_triton.py"]
    for k in gk:
        assert f"def {k['name']}(" in src
        assert k["gemm"]["backend"] == "triton" and k["gemm"]["how"] == "heuristic"
    assert "tl.erf" in src and "range(tl.program_id(0), tiles, NUM_SMS)" in src
    cpp = cm.sources["model_cuda.cpp"]
    assert "kc::gemm<" not in cpp and "kc::blas().create" not in cpp  # no cuBLAS at all
    assert cpp.count("tiles < self->sms ? tiles : self->sms") == 3
    assert "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT" in cpp
    # one cubin per kernel in the blob; the GEMM results are never allocated
    assert cm.manifest["cuda"]["kernels"].keys() == {k["name"] for k in gk}
    assert not any(f"buf_{k['members'][0]} = self->arena" in cpp for k in gk)
    path = cm.save(tmp_path / "m.kiln")
    with zipfile.ZipFile(path) as z:
        assert z.read("lib/model.so").count(b"\x7fELF") >= 1 + len(gk)


def test_epilogue_left_alone_when_the_gemm_result_is_read_twice(tmp_path):
    class Two(torch.nn.Module):
        def forward(self, x, w):
            h = x @ w
            return torch.relu(h), h.sum(0)
    ep = torch.export.export(Two(), (torch.randn(8, 16), torch.randn(16, 32)))
    cm = kiln.compile(ep, device="cuda", options=_opts(tmp_path, ("triton",)))
    gk = [k for k in cm.manifest["kernels"] if k["kind"] == "triton_gemm"]
    assert [len(k["members"]) for k in gk] == [1]


_INTERP = textwrap.dedent("""
    import sys, torch, kiln
    sys.path.insert(0, sys.argv[1])
    from test_gemm_link import _export, _opts
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.kernel import print_triton_kernel, choose_config
    from kiln.targets.cuda.gemm_template import print_gemm_kernel
    from kiln.schedule import Kernel
    from kiln.schedule.steps import GemmKernel
    import pathlib
    m, ep = _export()
    b = kiln.compile(ep, device="cuda", options=_opts(pathlib.Path(sys.argv[2]),
                                                       ("triton",))).built
    mod = import_triton_module(b.sources["kernels_triton.py"])
    hints = {s.name: s.example for s in b.graph.symbols}
    bufs = {x.name: x for x in b.loop.buffers}
    ks = {s.name: print_gemm_kernel(s, bufs) if isinstance(s, GemmKernel) else
          print_triton_kernel(s, bufs, hints, choose_config(s, hints)) for s in b.steps}
    torch.manual_seed(5)
    args = (torch.randn(37, 24), torch.randn(37, 12), torch.randn(3, 5, 24))
    outs = run_program(b.program, ks, mod, b.weights, list(args))
    for o, w in zip(outs, m(*args)):
        err = (o.reshape(w.shape).double() - w.double()).abs().max().item()
        print("err", err)
        assert err < 2e-3, err
    print("ALL OK")
""")


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_triton_gemm_kernels_match_eager_in_interpreter(tmp_path):
    _, ep = _export()  # compile in this process (normal mode) so the child hits the cache
    kiln.compile(ep, device="cuda", options=_opts(tmp_path, ("triton",)))
    run_interpreted(_INTERP, os.path.dirname(__file__), str(tmp_path))


def _steps(tmp_path, ep):
    b = kiln.compile(ep, device="cuda", options=_opts(tmp_path, ("blas",))).built
    return b, [g for g in b.steps if isinstance(g, L.Gemm)]


def test_cuda_choice_heuristic_cache_and_restriction(tmp_path):
    _, ep = _export(torch.float16)
    b, gemms = _steps(tmp_path, ep)
    syms = b.graph.symbols
    got = choose_gemms(gemms, syms, _opts(tmp_path, ("blas", "triton")), "cuda")
    assert {c.backend for c in got.values()} == {"blas"}  # the heuristic prefers cuBLAS
    got = choose_gemms(gemms, syms, _opts(tmp_path, ("triton",)), "cuda")
    assert {c.backend for c in got.values()} == {"triton"}
    # a cache entry (as max_autotune writes on the GPU) wins over the heuristic, per arch
    g = gemms[0]
    problem = problem_of(g, {s.name: (s.min, s.max) for s in syms})
    cfg = {"name": "triton_64x64x64_g8_s4_w4", "block_m": 64, "block_n": 64, "block_k": 64,
           "group_m": 8, "num_stages": 4, "num_warps": 4}
    acache.store(tmp_path, problem, gpu.device_id(90), {
        "winner": {"backend": "triton", "config": cfg},
        "results": [["blas", "blas", {}, 2e-5], [cfg["name"], "triton", cfg, 1e-5]]})
    got = choose_gemms(gemms, syms, _opts(tmp_path, ("blas", "triton")), "cuda")
    assert got[g.name].backend == "triton" and got[g.name].how == "cache"
    assert got[g.name].config.to_json() == cfg
    got = choose_gemms(gemms, syms, _opts(tmp_path, ("blas",)), "cuda")
    assert got[g.name].backend == "blas" and got[g.name].how == "cache"


def test_cuda_choice_rejects_impossible_restriction(tmp_path):
    class IntMM(torch.nn.Module):
        def forward(self, x):
            return x.double() @ x.double().t()
    ep = torch.export.export(IntMM(), (torch.randn(4, 4),))
    with pytest.raises(UnsupportedError, match="float64.*none of Options.gemm_backends"):
        kiln.compile(ep, device="cuda", options=_opts(tmp_path, ("triton",)))


def test_cutlass_wrapper_calls_renamed_entry_and_compiles(tmp_path):
    """Fast structural check: the CUTLASS choice prints a call of the kernel's own entry
    (declared extern "C", workspace sized at the Dim maxima), and the wrapper compiles."""
    pytest.importorskip("cutlass_library")
    from kiln.gemm import cutlass
    from kiln.gemm.cutlass_link import entry, source_for, workspace_entry
    from kiln.gemm.configs import CutlassConfig
    from kiln.gemm.select import Choice
    from kiln.targets.cuda.wrapper import print_cuda_wrapper
    from tests.difftest import assert_host_compiles

    class MM(torch.nn.Module):
        def forward(self, x, w):
            return x @ w
    b = torch.export.Dim("b", min=1, max=512)
    ep = torch.export.export(MM(), (torch.randn(16, 64).half(), torch.randn(64, 32).half()),
                             dynamic_shapes={"x": {0: b}, "w": None})
    built, gemms = _steps(tmp_path, ep)
    problem = problem_of(gemms[0], {s.name: (s.min, s.max) for s in built.graph.symbols})
    kern = cutlass.enumerate_candidates(problem, Options())[0].name
    choice = {gemms[0].name: Choice("cutlass", CutlassConfig(kern))}
    cpp = print_cuda_wrapper(built.program, {}, {}, (90,), "/dev/null", {}, True, choice)
    assert f"{entry(kern)}(" in cpp and f"{workspace_entry(kern)}(512, 32, 64, 1)" in cpp
    assert "kc::gemm<" not in cpp
    src = source_for(kern)
    assert f'extern "C" int {entry(kern)}(' in src
    assert f'extern "C" size_t {workspace_entry(kern)}(' in src
    assert_host_compiles(tmp_path, cpp)


class Lin2(torch.nn.Module):
    """Two linears whose sizes fit CUTLASS's 16-byte aligned TMA kernels."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(64, 32)
        self.l2 = torch.nn.Linear(32, 16)

    def forward(self, x, r):
        return self.l2(torch.relu(self.l1(x))) + r


@pytest.mark.slow
def test_cutlass_backend_links_object(tmp_path):
    """(nvcc takes minutes per CUTLASS kernel on a small machine; objects are cached in the
    default cache directory, so a second run is fast.)"""
    pytest.importorskip("cutlass_library")
    m = Lin2().half()
    b = torch.export.Dim("b", min=1, max=256)
    ep = torch.export.export(m, (torch.randn(8, 64).half(), torch.randn(8, 16).half()),
                             dynamic_shapes={"x": {0: b}, "r": {0: b}})
    cm = kiln.compile(ep, device="cuda", options=Options(cuda_archs=(90,),
                                                         gemm_backends=("cutlass",)))
    kinds = [k["kind"] for k in cm.manifest["kernels"] if k["kind"].endswith("gemm")]
    assert kinds.count("cutlass_gemm") == 2
    # the epilogues (bias + relu; bias + residual) are fused as visitor trees
    fused = [k for k in cm.manifest["kernels"] if k["kind"] == "cutlass_gemm"]
    assert all(len(k["members"]) == 2 and k["epilogue"].startswith("evt ") for k in fused)
    assert not [k for k in cm.manifest["kernels"] if k["kind"] == "triton"]
    assert cm.manifest["cuda"]["cutlass_objects"]
    assert any(n.startswith("cutlass_") and n.endswith(".cu") for n in cm.sources)
    nm = subprocess.run(["nm", "-D", "--defined-only", str(cm.library)], capture_output=True,
                        text=True)
    if nm.returncode == 0:
        assert "kiln_cutlass_run_" in nm.stdout
    # no run-time dependency on libcudart or nvcc: only the driver (opened at load)
    ldd = subprocess.run(["readelf", "-d", str(cm.library)], capture_output=True, text=True)
    if ldd.returncode == 0:
        assert "libcudart" not in ldd.stdout
    assert json.dumps(cm.manifest)  # the manifest stays serialisable


@pytest.mark.slow
def test_absorbed_epilogues_read_only_what_exists_at_the_gemm(tmp_path):
    """On gpt (fp16, every GEMM through the template): each absorbed epilogue reads only
    buffers written before its GEMM (or inputs / weights), the GEMM's result has no other
    reader, and no kernel still computes an absorbed member."""
    from kiln.models import ALL_MODELS
    from kiln.models.zoo import in_dtype
    from kiln.schedule import Kernel
    from kiln.schedule.steps import GemmKernel
    spec = in_dtype(ALL_MODELS["gpt"](), torch.float16)
    # attention decomposed, so that its score GEMMs (and their causal mask) are GEMMs too
    opts = _opts(tmp_path, ("triton",), fused_attention=False)
    b = kiln.compile(spec.export(), device="cuda", options=opts).built
    written: set[str] = set()
    absorbed = 0
    for i, s in enumerate(b.steps):
        if isinstance(s, GemmKernel) and s.epilogue is not None:
            absorbed += 1
            kinds = {x.name: x.kind for x in b.loop.buffers}
            for r in s.reads():
                assert r in written or kinds[r] in ("input", "weight", "state"), (s.name, r)
            for t in b.steps:
                if isinstance(t, Kernel):
                    assert s.epilogue.name not in {m.name for m in t.members}
                    assert s.gemm.name not in {ld.buf for m in t.members
                                               for ld in L.loads(m.body)}
        if isinstance(s, Kernel):
            written |= {m.name for m in s.members}
        elif isinstance(s, GemmKernel):
            written.add(s.out)
        else:
            written |= set(L.node_writes(s))
    # bias + gelu, bias + residual (the embedding gathered again inside the tile), the causal
    # mask of the attention scores; q/k/v and the attention output are read through views
    assert absorbed >= 6


_GPT_INTERP = textwrap.dedent("""
    import sys, torch, kiln, pathlib
    from kiln.models import ALL_MODELS
    from kiln.options import Options
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels
    spec = ALL_MODELS["gpt"]()
    opts = Options(cuda_archs=(90,), gemm_backends=("triton",), cache_dir=sys.argv[1])
    b = kiln.compile(spec.export(), device="cuda", options=opts).built
    if len(sys.argv) > 2:
        mod = import_triton_module(b.sources["kernels_triton.py"])
        hints = {s.name: s.example for s in b.graph.symbols}
        bufs = {x.name: x for x in b.loop.buffers}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
        args = spec.make_inputs(1, batch=1, seq=5)
        out = run_program(b.program, ks, mod, b.weights, list(args))[0]
        want = spec.module(*args)
        err = (out.reshape(want.shape).double() - want.double()).abs().max().item()
        print("err", err)
        assert err < 1e-4, err
        print("ALL OK")
""")


@pytest.mark.slow
def test_gpt_with_triton_gemms_matches_eager_in_interpreter(tmp_path):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    first = subprocess.run([sys.executable, "-c", _GPT_INTERP, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    out = subprocess.run([sys.executable, "-c", _GPT_INTERP, str(tmp_path), "run"],
                         env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout[-2000:] + \
        out.stderr[-3000:]
