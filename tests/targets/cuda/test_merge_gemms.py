"""Merged projections (passes/merge_gemms.py, CUDA builds): Linears sharing their input become
one GEMM on concatenated weights; a Linear on another input, a weight read twice and builds
without constant folding are left alone; the merged weight is a fold (`<folded ...>` FQN). The
program's values are checked against eager with Triton's interpreter (no GPU)."""

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

OPTS = Options(cuda_archs=(90,))


class Projections(torch.nn.Module):
    """q / k / v of different widths on one input (with and without bias), a gated MLP (two
    on another input), a Linear whose weight is also read elsewhere, and one on its own."""

    def __init__(self, d=24):
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, 8, bias=False)
        self.v = torch.nn.Linear(d, 8)
        self.gate = torch.nn.Linear(d, 40, bias=False)
        self.up = torch.nn.Linear(d, 40, bias=False)
        self.shared = torch.nn.Linear(d, 16, bias=False)
        self.solo = torch.nn.Linear(40, d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = torch.nn.functional.silu(self.gate(q)) * self.up(q)
        s = self.shared(x) + x[..., :16] * self.shared.weight[:, 0]  # two readers of W
        return self.solo(h) + k.sum(-1, keepdim=True) * v.mean(-1, keepdim=True), s


def _gemms(cm) -> list[tuple[int, int]]:
    """(n, k) of each GEMM the program calls."""
    return [(int(x.gemm.n), int(x.gemm.k)) for x in cm.built.program.lines
            if type(x).__name__ == "CallGemm"]


def test_linears_sharing_input_become_one_gemm():
    torch.manual_seed(0)
    ep = torch.export.export(Projections(), (torch.randn(2, 5, 24),))
    cm = kiln.compile(ep, device="cuda", options=OPTS)
    gemms = _gemms(cm)
    # q+k+v (24+8+8 = 40 wide), gate+up (80 wide), shared, solo: 4 GEMMs instead of 7
    assert len(gemms) == 4, gemms
    assert sorted(gemms) == [(16, 24), (24, 40), (40, 24), (80, 24)]
    folded = [w["fqn"] for w in cm.manifest["weights"] if w["fqn"].startswith("<folded")]
    assert len(folded) == 2 and "q.weight, k.weight, v.weight" in " ".join(folded)
    off = kiln.compile(ep, device="cuda", options=Options(cuda_archs=(90,),
                                                          fold_constants=False))
    assert len(_gemms(off)) == 7
    # more rows than merge_gemms.MAX_ROWS: each GEMM stays separate, with its own epilogue
    big = torch.export.export(Projections(), (torch.randn(4, 20, 24),))
    assert len(_gemms(kiln.compile(big, device="cuda", options=OPTS))) == 7


_INTERP = textwrap.dedent("""
    import sys, torch, kiln
    sys.path.insert(0, sys.argv[1])
    from test_merge_gemms import OPTS, Projections
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels

    torch.manual_seed(0)
    m = Projections()
    ep = torch.export.export(m, (torch.randn(2, 5, 24),))
    b = kiln.compile(ep, device="cuda", options=OPTS).built
    mod = import_triton_module(b.sources["kernels_triton.py"])
    hints = {s.name: s.example for s in b.graph.symbols}
    bufs = {x.name: x for x in b.loop.buffers}
    ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
    x = torch.randn(2, 5, 24)
    got = run_program(b.program, ks, mod, b.weights, [x])
    bad = []
    for g, r in zip(got, m(x)):
        err = (g.reshape(r.shape).double() - r.double()).abs().max().item()
        if err > 1e-4:
            bad.append(f"max error {err}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


def test_merged_program_matches_eager_in_triton_interpreter():
    torch.manual_seed(0)
    kiln.compile(torch.export.export(Projections(), (torch.randn(2, 5, 24),)), device="cuda",
                 options=OPTS)  # cubins first: the AOT compiler cannot run in interpreter mode
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]
