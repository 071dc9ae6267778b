"""The GEMV template (M = 1 on CUDA; issue 17.3): kiln/gemm/gemv.py, kiln/gemm/prologue.py,
kiln/targets/cuda/gemv_template.py. Compiled for CUDA without a GPU (autotune off), the
heuristic picks the GEMV for M = 1 GEMMs that fuse a prologue (RMSNorm, silu(gate) * up of a
merged gate/up GEMM) or an epilogue (bias, residual), and (Triton only) for plain ones; the
programs run by Triton's interpreter through the Program IR against float64 torch math of
the same module: K not a multiple of the block, N not a multiple of 16, float32 / bfloat16 /
float16. The bf16 decode step of a Llama loses its norm and silu*mul kernels to the GEMVs'
prologues (the manifest's kernel list), and its logits match eager in the interpreter."""

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


def test_gemv_not_chosen_for_larger_m():
    torch.manual_seed(0)
    m = NormLin(64, 32).to(torch.bfloat16)
    ep = torch.export.export(m, (torch.randn(3, 64).to(torch.bfloat16),))
    cm = kiln.compile(ep, device="cuda", options=OPTS)
    assert not gemv_kernels(cm)


def test_gemv_programs_match_float64_in_triton_interpreter():
    for c in cases():  # cubins first: the AOT compiler cannot run in interpreter mode
        build(*c[:5])
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]
