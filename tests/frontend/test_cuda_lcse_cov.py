"""Complex logcumsumexp on CUDA without ATen (issue 16: it went to the fallback there; the CPU
has kiln_lib.h's sequential complex scan): by doubling with ATen's log-add-exp rules on the
parts (aten_complex_linalg._log_add_exp_parts). Compiled here for sm_90; its Triton kernels run
in Triton's interpreter on the CPU and are compared with eager complex128: real parts within
2e-5, imaginary parts equal modulo 2 pi (another order of combination picks another branch;
eager's own CUDA scan has its own order too), NaN where eager has NaN; special values
(-inf, +inf, NaN real parts, -inf at the start) included; dynamic sizes built (no ATen)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch.export import Dim

from difftest import Fn, run_interpreted
from test_complex_native import OPTS_CUDA

import kiln


def lcse(x):
    return {"l1": torch.logcumsumexp(x, 1), "l0": torch.logcumsumexp(x, 0),
            "l_t": torch.logcumsumexp(x.t(), 1)}


DYN = ({1: Dim("n", min=2, max=64)},)


@pytest.mark.slow  # CUDA builds (Triton kernels and cubins for sm_90)
def test_cuda_complex_logcumsumexp_builds_without_aten():
    pytest.importorskip("triton")
    for dt in (torch.complex64, torch.complex128):
        x = torch.randn(6, 37, dtype=dt)
        for dyn in (None, DYN):
            cm = kiln.compile(torch.export.export(Fn(lcse), (x,), dynamic_shapes=dyn and (DYN,)),
                              device="cuda", options=OPTS_CUDA)
            assert cm.manifest["requires"]["aten_fallback_ops"] == [], (dt, dyn)


_INTERP = """
import math, sys, torch, kiln
from torch.export import Dim
from torch.utils import _pytree as pytree
sys.path.insert(0, sys.argv[1])
from test_cuda_lcse_cov import lcse, OPTS_CUDA, Fn, DYN
from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
from kiln.targets.cuda.build import triton_kernels
g = torch.Generator().manual_seed(0)
for dt in (torch.complex64, torch.complex128):
    for dyn, sizes in ((None, (37,)),):  # (dynamic sizes: built above, not interpreted)
        x = torch.randn(6, 37, dtype=dt, generator=g)
        ds = (DYN,) if dyn else None
        b = kiln.compile(torch.export.export(Fn(lcse), (x,), dynamic_shapes=ds), device="cuda",
                         options=OPTS_CUDA).built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        ks = {k.name: k for k in triton_kernels(b.steps, {x.name: x for x in b.loop.buffers}, {})}
        for n in sizes:
            x = torch.randn(6, n, dtype=dt, generator=g) * 3
            x[1, 3] = complex(-math.inf, 0)
            x[2, 4] = complex(math.nan, 1)
            x[3, 2], x[3, 4] = complex(math.inf, 2.0), complex(math.inf, -1.0)
            x[4, 0], x[4, 1] = complex(-math.inf, 3.0), complex(-math.inf, -2.0)
            x[5, 2] = complex(40, 1)
            outs = run_program(b.program, ks, mod, b.weights, [x])
            want = pytree.tree_leaves(lcse(x.to(torch.complex128)))
            for o, w in zip(outs, want, strict=True):
                o = o.reshape(w.shape).to(w.dtype)
                torch.testing.assert_close(o.real, w.real, rtol=2e-5, atol=2e-5, equal_nan=True)
                assert torch.equal(o.imag.isnan(), w.imag.isnan()), (dt, n)
                fin = torch.isfinite(o.imag) & torch.isfinite(w.imag)
                d = torch.remainder(o.imag - w.imag + math.pi, 2 * math.pi) - math.pi
                assert bool((d[fin].abs() < 2e-4).all()), (dt, n, d.abs().max())
print("ALL OK")
"""


@pytest.mark.slow  # CUDA builds and Triton's interpreter
def test_cuda_complex_logcumsumexp_in_interpreter():
    pytest.importorskip("triton")
    test_cuda_complex_logcumsumexp_builds_without_aten()  # (cubins built here, normal mode)
    run_interpreted(_INTERP, str(pathlib.Path(__file__).parent))
