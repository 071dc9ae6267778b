"""CUDA code generation without a GPU (CI): every zoo model compiles to a CUDA package (one
cubin per kernel for sm_90, embedded in model.so; the wrapper compiles against cuda.h only and
links no CUDA library), the Triton source of a small fused kernel matches its golden file, and
the generated Triton kernels compute what eager computes, run by Triton's interpreter (numpy)
in a subprocess through the Program IR (kiln/targets/cuda/wrapper_py.py).

Regenerate the golden file with KILN_UPDATE_GOLDEN=1."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import zipfile

import pytest
import torch

triton = pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.errors import PackageError  # noqa: E402
from kiln.models import ALL_MODELS  # noqa: E402
from kiln.models.zoo import in_dtype  # noqa: E402
from kiln.options import Options  # noqa: E402
from tests.difftest import assert_golden  # noqa: E402

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "golden"
OPTS = Options(cuda_archs=(90,))


@pytest.fixture(scope="module", params=sorted(ALL_MODELS))
def zoo_cuda(request, tmp_path_factory):
    spec = ALL_MODELS[request.param]()
    cm = kiln.compile(spec.export(), device="cuda", options=OPTS)
    path = cm.save(tmp_path_factory.mktemp("cuda") / f"{spec.name}.kiln")
    return spec, cm, path


def test_zoo_compiles_to_cuda_package(zoo_cuda):
    spec, cm, path = zoo_cuda
    m = cm.manifest
    assert m["device"] == "cuda" and m["cuda"]["archs"] == [90]
    kernels = [k for k in m["kernels"] if k["kind"] == "triton"]
    assert len(kernels) == len(m["cuda"]["kernels"]) > 0
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        so = z.read("lib/model.so")
        man = json.loads(z.read("manifest.json"))
    assert {"src/kernels_triton.py", "src/model_cuda.cpp", "lib/model.so"} <= names
    assert man["device"] == "cuda"
    # one ELF header for model.so itself plus cubins (kernels that compile to the same code
    # share one when they were compiled together: toolchain/triton_aot.py compile_cubins, so
    # on a cold cache the demo's two gelu kernels are one cubin)
    assert so.count(b"\x7fELF") >= 2
    src = cm.sources["kernels_triton.py"]
    assert all(f"def {k['name']}(" in src for k in kernels)
    out = subprocess.run(["readelf", "-d", str(cm.library)], capture_output=True, text=True)
    if out.returncode == 0:
        needed = [ln for ln in out.stdout.splitlines() if "NEEDED" in ln]
        assert not any("cuda" in ln or "cublas" in ln for ln in needed), needed
    nm = subprocess.run(["nm", "-D", "--defined-only", str(cm.library)], capture_output=True,
                        text=True)
    if nm.returncode == 0:
        syms = {ln.split()[-1] for ln in nm.stdout.splitlines()}
        assert "kiln_model_abi_v1" in syms and not any(s.startswith("cu") for s in syms)


def test_cuda_package_loading_errors(zoo_cuda, tmp_path):
    spec, cm, path = zoo_cuda
    if spec.name != "mlp":
        pytest.skip("one model is enough")
    with pytest.raises(PackageError, match='compiled for device "cuda"'):
        kiln.load(path, device="cpu")
    cpu = kiln.compile(spec.export()).save(tmp_path / "cpu.kiln")
    with pytest.raises(PackageError, match='compiled for device "cpu"'):
        kiln.load(cpu, device="cuda")
    with pytest.raises(kiln.errors.UnsupportedError, match="unsupported device"):
        kiln.load(path, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(PackageError, match="libcuda|CUDA"):
            kiln.load(path, device="cuda:0")


class LnSoftmax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(40)

    def forward(self, x):
        return torch.softmax(self.ln(x) * 2, -1) + x.amax(-1, keepdim=True)


def _golden_kernel() -> str:
    from kiln.targets.cuda.kernel import print_triton_kernel
    from kiln.frontend.export import import_program
    from kiln.lowering import lower
    from kiln.passes.dce import dce
    from kiln.schedule import Kernel, schedule

    torch.manual_seed(0)
    ep = torch.export.export(LnSoftmax(), (torch.randn(6, 40),))
    loop = lower(dce(import_program(ep).graph))
    steps = [s for s in schedule(loop) if isinstance(s, Kernel)]
    assert len(steps) == 1, "the layer norm, softmax and amax fuse into one kernel"
    return print_triton_kernel(steps[0], {b.name: b for b in loop.buffers}, {}).source


def test_triton_source_golden():
    got = _golden_kernel()
    assert_golden(GOLDEN / "triton_ln_softmax.py", got)


_INTERP = textwrap.dedent("""
    import copy, sys, torch, kiln
    from torch.utils import _pytree as pytree
    sys.path.insert(0, sys.argv[1])
    from test_cuda_codegen import interp_cases, OPTS
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels
    bad = []
    for name, module, args, dyn, call, tol in interp_cases():
        b = kiln.compile(torch.export.export(module, args, dynamic_shapes=dyn), device="cuda",
                         options=OPTS).built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        hints = {s.name: s.example for s in b.graph.symbols}
        bufs = {x.name: x for x in b.loop.buffers}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}  # attention's too
        flat = [a for a in pytree.tree_leaves(call) if isinstance(a, torch.Tensor)]
        outs = run_program(b.program, ks, mod, b.weights, flat)
        half = [a for a in flat if a.dtype in (torch.float16, torch.bfloat16)]
        if half:  # the reference computes in float64 on the same 16-bit values
            module = copy.deepcopy(module).double()
            call = pytree.tree_map(lambda a: a.double() if isinstance(a, torch.Tensor) and
                                   a.is_floating_point() else a, call)
        for o, r in zip(outs, pytree.tree_leaves(module(*call))):
            o = o.reshape(r.shape)
            if not torch.allclose(o.double(), r.double(), rtol=tol, atol=tol, equal_nan=True):
                bad.append(f"{name}: max error {(o.double() - r.double()).abs().max().item()}")
        print(name, "checked", flush=True)
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
    sys.exit(1 if bad else 0)
""")


class Reductions(torch.nn.Module):
    def forward(self, x):
        return (x.sum(1), x.argmax(1), x.max(0).values, (x > 0).any(1), x.prod(-1),
                x.argmin(-1))


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(50, 16)

    def forward(self, i):
        return torch.relu(self.e(i)).sum(-1) / 3


class SmallConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = torch.nn.BatchNorm2d(8).eval()

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.c(x))), 2)
        return torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)


def interp_cases():
    """(name, module, export args, dynamic_shapes, call args, tolerance): small sizes, since
    the interpreter runs every program of the grid in numpy."""
    torch.manual_seed(0)
    mlp, inter, gpt = (ALL_MODELS[n]() for n in ("mlp", "intermediates", "gpt"))
    x = torch.randn(6, 40)
    r = torch.randn(5, 7, 3)
    i = torch.randint(0, 50, (4, 9))
    c = torch.randn(2, 3, 9, 9)
    from test_mutation import Stateful
    slot = torch.tensor([2.0])
    return [
        ("state_buffers", Stateful().train(), (x[:3, :4], slot), None, (x[:3, :4], slot),
         1e-4),
        ("ln_softmax_small", LnSoftmax(), (x,), None, (x,), 1e-4),
        ("reductions", Reductions(), (r,), None, (r,), 1e-4),
        ("embedding", Embed(), (i,), None, (i,), 1e-4),
        ("small_conv", SmallConv(), (c,), None, (c,), 1e-4),
        ("mlp", mlp.module, mlp.example_args, mlp.dynamic_shapes, mlp.make_inputs(1, batch=3),
         mlp.rtol),
        ("intermediates", inter.module, inter.example_args, inter.dynamic_shapes,
         inter.make_inputs(1, n=5), inter.rtol),
        ("gpt", gpt.module, gpt.example_args, gpt.dynamic_shapes,
         gpt.make_inputs(1, batch=1, seq=5), gpt.rtol),
    ] + half_cases()


def half_cases():
    """16-bit float programs (loads/stores in 16 bits, math in float32), against eager in
    float64 on the same 16-bit inputs and weights."""
    torch.manual_seed(1)
    out = []
    for dt in (torch.bfloat16, torch.float16):
        tol = 2e-2 if dt == torch.bfloat16 else 4e-3
        x = torch.randn(6, 40).to(dt)
        r = torch.randn(5, 7, 3).to(dt)
        mlp = in_dtype(ALL_MODELS["mlp"](), dt)
        out.append((f"mlp_{dt}", mlp.module, mlp.example_args, mlp.dynamic_shapes,
                    mlp.make_inputs(1, batch=3), tol))
        if dt == torch.bfloat16:
            out += [(f"ln_softmax_{dt}", LnSoftmax().to(dt), (x,), None, (x,), tol),
                    (f"reductions_{dt}", Reductions(), (r,), None, (r,), tol)]
    return out


def test_half_precision_on_cuda_keeps_16_bit_gemms():
    spec = in_dtype(ALL_MODELS["mlp"](), torch.bfloat16)
    # the CPU widens to float32 (passes/widen_half.py); CUDA keeps bf16 operands for cuBLAS
    assert "widen_half" in kiln.compile(spec.export()).report["stages"]
    cm = kiln.compile(spec.export(), device="cuda", options=OPTS)
    src = cm.sources["model_cuda.cpp"]
    assert "kc::gemm<kc::bf16>" in src  # cublasGemmStridedBatchedEx, float accumulation
    tri = cm.sources["kernels_triton.py"]
    assert ").to(tl.float32)" in tri  # 16-bit loads widened to float32
    with zipfile.ZipFile(cm.save(pathlib.Path(tempfile.mkdtemp()) / "m.kiln")) as z:
        header = z.read("weights.safetensors")[8:4000]
    assert b'"BF16"' in header  # weights ship in their dtype


def test_cuda_graphs_option_changes_the_wrapper():
    spec = ALL_MODELS["mlp"]()
    on = kiln.compile(spec.export(), device="cuda", options=OPTS).sources["model_cuda.cpp"]
    off = kiln.compile(spec.export(), device="cuda",
                       options=Options(cuda_archs=(90,), cuda_graphs=False))
    assert "kc::run_graph(" in on and "kc::run_graph(" not in off.sources["model_cuda.cpp"]
    assert off.manifest["cuda"]["graphs"] is False
    assert off.library.exists()  # the direct wrapper builds too


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_triton_kernels_match_eager_in_interpreter():
    # compile here first (the AOT compiler cannot run in interpreter mode; the subprocess then
    # finds every cubin and library in the cache and only interprets the kernels)
    for name, module, args, dyn, _, _ in interp_cases():
        kiln.compile(torch.export.export(module, args, dynamic_shapes=dyn), device="cuda",
                     options=OPTS)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


def test_autotune_candidates_are_neighbours_of_the_heuristic():
    from kiln.targets.cuda.kernel import Config
    from kiln.targets.cuda.launch_tune import candidates
    base = Config(8, 256, 8)
    cands = candidates(base)
    assert cands[0] == base and len(set(cands)) == len(cands) == 6
    assert all(1 <= c.num_warps <= 16 and c.xblock * c.rblock <= 2**16 for c in cands)
    assert candidates(Config(1, 1, 1)) == [Config(1, 1, 1), Config(1, 1, 2), Config(2, 1, 1)]
    wide = candidates(Config(2, 1024, 8), width=4096)  # a norm over rows of 4096
    assert wide[-1] == Config(1, 4096, 16) and len(wide) == 7
    assert Config(1, 16384, 16) not in candidates(Config(2, 1024, 8), width=16384)


def test_int_inputs_are_host_values_in_cuda_packages():
    """A dynamic int input travels as a 0-d int64 host tensor: the CUDA wrapper checks it as a
    CPU tensor, reads its value on the host and never copies it to the device."""
    from test_io import _int_input_export

    cm = kiln.compile(_int_input_export(), device="cuda", options=OPTS)
    src = cm.sources["model_cuda.cpp"]
    assert "= *kr::data_of<int64_t>(inputs[1]);" in src
    assert "buf_n = in[1]" not in src and "in_ptr[1] =" not in src
    assert "input sizes: aten.reshape" in src
    assert cm.library.exists()


class _LibraryOps(torch.nn.Module):
    """Ops kiln does not lower on CUDA (frexp, two results from one call; special.i1): they
    call ATen on the device. (cumsum was one until session 15, scatter_add and sort / topk of
    32-bit values until session 16, sort / topk of float64 until session 17: CUDA scans,
    scatters and sorts are Triton kernels, tests/targets/cuda/test_cuda_scan_cov.py,
    test_cuda_put_reduce.py, test_cuda_sort_cov.py, test_cuda_sort_merge.py.)"""

    def forward(self, x, idx):
        m, e = torch.frexp(x)
        y = torch.special.i1(x) + m * torch.topk(x.double(), 5, -1).values.float()
        return y.scatter_add(1, idx, torch.ones_like(x)) * 2, e


def test_cuda_aten_fallback_wrapper():
    x, idx = torch.randn(4, 5), torch.randint(0, 5, (4, 5))
    cm = kiln.compile(_LibraryOps(), (x, idx), device="cuda", options=OPTS)
    req = cm.manifest["requires"]
    assert req["libtorch"] and req["aten_fallback_ops"] == [
        "aten::frexp.Tensor", "aten::special_i1.default"]
    assert cm.manifest["cuda"]["graphs"] is False  # torch's allocator cannot be captured
    src = cm.sources["model_cuda.cpp"]
    # two calls: frexp's mantissa and exponent come from one; topk and scatter_add are Triton
    # kernels
    assert src.count("c.on_cuda(self->device_id, static_cast<void*>(stream))") == 2
    assert "put_scatter_add" in cm.sources["kernels_triton.py"]
    assert "kr_aten::require(e, " in src and "kc::run_graph(" not in src
    assert cm.library.exists()
    with pytest.raises(kiln.errors.UnsupportedError, match="frexp"):
        kiln.compile(_LibraryOps(), (x, idx), device="cuda",
                     options=Options(cuda_archs=(90,), aten_fallback=False))


def test_compile_cubins_in_workers_gives_the_same_cubins(tmp_path, monkeypatch):
    """triton_aot.compile_cubins: worker processes (Triton only) give the same cubins as a
    compile in this process; too few kernels start no worker."""
    from kiln.targets.cuda.build import triton_kernels
    from kiln.targets.cuda.ops import PRELUDE
    from kiln.toolchain import triton_aot as A

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    cm = kiln.compile(ALL_MODELS["mlp"]().export(), device="cuda",
                      options=Options(cuda_archs=(90,), cache_dir=str(tmp_path / "a")))
    b = cm.built
    tks = triton_kernels(b.steps, {x.name: x for x in b.loop.buffers},
                         {s.name: s.example for s in b.graph.symbols})
    src = cm.sources["kernels_triton.py"]
    cold, _ = A.compile_cubins(src, tks, (90,), tmp_path / "d", workers=1, prelude=PRELUDE)
    warm, t = A.compile_cubins(src, tks, (90,), tmp_path / "e", workers=8, prelude=PRELUDE)
    assert {k: c.cubin for k, c in cold.items()} == {k: c.cubin for k, c in warm.items()}
    # 3 kernels, two of one code (compiled once): too few for a worker (PER_PROCESS)
    assert (t["compiled"], t["shared"], t["workers"]) == (2, 1, 0)
