"""Fuzzer reproducers (fixed): Triton refused kernels where a load's index was a scalar while
its mask was a block ("Mask argument cannot be block type if pointer argument is not a
block"): 15 of issue 16's 1,000 CUDA programs (`kiln fuzz --seed 17 --device cuda`, programs 5,
134, 188, 216, 263, 272, 352, 385, 408, 413, 437, 581, 697, 782, 926). The row-kernel printer
(kiln/targets/cuda/kernel.py) took any index variable for a block, but two kinds are scalars:
the index of a dim of size 1 (`i1_m2 = 0`: a bias of one element read in a tile) and indices
unravelled from the loop counter of a reduction with extra inner dims (`i0_m2 = jj_m2`: a
softmax over dim 0, a norm's statistics read back). It now knows which variables are blocks
and gives a scalar index `+ xidx * 0`, as stores already had.

Checked here by compiling the fuzz programs for sm_90, and by running small programs of both
kinds in Triton's interpreter against eager (a subprocess); the `gpu` tests run the programs."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from kiln.fuzz.runner import check

pytest.importorskip("triton")

# program 5: linear to one feature, its bias (one element) read at the constant index 0
BIAS_OF_ONE = {'device': 'cuda',
               'dynamic': False,
               'inputs': [{'dtype': 'float32', 'high': None, 'shape': [16, 5]},
                          {'dtype': 'float32', 'high': None, 'shape': [6]},
                          {'dtype': 'int64', 'high': 2, 'shape': [6]}],
               'ops': [['linear', [0], {'b': 'p0', 'w': 'p1'}],
                       ['unary', [0], {'fn': 'round'}],
                       ['repeat_interleave', [1, 2], {}],
                       ['reduce', [2], {'dims': [0], 'fn': 'sum', 'keep': False}],
                       ['binary', [2, 2], {'fn': 'mul'}],
                       ['cast', [7], {'dtype': 'float32'}],
                       ['mm_w', [8], {'t': True, 'w': 'p2'}]],
               'outputs': [9, 4, 3, 7],
               'params': {'p0': {'init': 'w', 'shape': [1]},
                          'p1': {'init': 'w', 'shape': [1, 5]},
                          'p2': {'init': 'w', 'shape': [8, 6]}},
               'seed': 17000056}

# program 216: softmax over dim 0 (a reduction with extra inner dims: a loop over them, whose
# counter gives scalar indices)
SOFTMAX_DIM0 = {'device': 'cuda',
                'dynamic': False,
                'inputs': [{'dtype': 'float32', 'high': None, 'shape': [12, 12, 16, 4]}],
                'ops': [['conv2d', [0], {'b': 'p1', 'dilation': 1, 'groups': 12, 'padding': 1,
                                         'stride': 1, 'w': 'p0'}],
                        ['var', [1], {'corr': 1, 'dims': [0, 1, 2, 3], 'keep': False}],
                        ['softmax', [1], {'dim': 0, 'log': False}]],
                'outputs': [3, 2],
                'params': {'p0': {'init': 'w', 'shape': [36, 1, 3, 3]},
                           'p1': {'init': 'w', 'shape': [36]}},
                'seed': 17000267}

# program 134: a layer norm's statistics read back in a loop over a dynamic dim
NORM_LOOP = {'device': 'cuda',
             'dim': 'no_max',
             'dynamic': True,
             'export_layout': 'offset',
             'inputs': [{'dtype': 'float32', 'high': None, 'shape': ['B', 16]},
                        {'dtype': 'bool', 'high': None, 'shape': ['B', 5]}],
             'ops': [['reduce', [1], {'dims': [1], 'fn': 'any', 'keep': False}],
                     ['reduce', [2], {'dims': [0], 'fn': 'any', 'keep': False}],
                     ['layer_norm', [0], {'b': 'p1', 'rank': 1, 'w': 'p0'}],
                     ['var', [4], {'corr': 0, 'dims': [1], 'keep': False}],
                     ['softmax', [5], {'dim': 0, 'log': False}],
                     ['transpose', [4], {'d0': 0, 'd1': 1}],
                     ['slice', [7], {'dim': 0, 'end': None, 'start': 6, 'step': 1}]],
             'outputs': [8, 3, 5, 7, 8],
             'params': {'p0': {'init': 'ln', 'shape': [16]},
                        'p1': {'init': 'w', 'shape': [16]}},
             'seed': 17000185}

SPECS = {"bias_of_one": BIAS_OF_ONE, "softmax_dim0": SOFTMAX_DIM0, "norm_loop": NORM_LOOP}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_compiles_for_cuda(name, tmp_path):
    out = check(SPECS[name], tmp_path, interp=False, run=False)
    assert out.status == "ok", out.detail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(SPECS))
def test_runs_on_gpu(name, tmp_path):
    out = check(SPECS[name], tmp_path, interp=False)
    assert out.status == "ok", out.detail


class VarSoftmax0(torch.nn.Module):
    """softmax over dim 0 fused with a full reduction (the kernel has no rows: its members
    loop over the inner dims, whose counter gives scalar indices)."""

    def forward(self, y):
        return y.var(), torch.softmax(y, 0)


class NormOfOne(torch.nn.Module):
    """A layer norm over a dim of size 1 fused with a sum: the weight and bias of one element
    are read at the constant index 0 in a tile."""

    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.tensor([0.5])), torch.nn.Parameter(
            torch.tensor([0.1]))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (1,), self.w, self.b), x.sum()


def cases():
    """Programs Triton refused before the fix (each failed to compile for sm_90)."""
    torch.manual_seed(0)
    return [(VarSoftmax0(), (torch.randn(6, 3, 4),)), (NormOfOne(), (torch.randn(6, 1),))]


_INTERP = textwrap.dedent("""
    import sys, torch, kiln
    sys.path.insert(0, sys.argv[1])
    from test_triton_scalar_index import cases
    from kiln.options import Options
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels
    bad = []
    for module, args in cases():
        b = kiln.compile(module, args, device="cuda", options=Options(cuda_archs=(90,))).built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        bufs = {x.name: x for x in b.loop.buffers}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, {})}
        outs = run_program(b.program, ks, mod, b.weights, list(args))
        with torch.no_grad():
            want = module.double()(*[a.double() for a in args])
        for k, (o, r) in enumerate(zip(outs, want)):
            if not torch.allclose(o.reshape(r.shape).double(), r, rtol=1e-4, atol=1e-5):
                bad.append(f"output {k}: {o} != {r}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
    sys.exit(1 if bad else 0)
""")


def test_scalar_indices_match_eager_in_interpreter():
    import kiln
    from kiln.options import Options
    for module, args in cases():  # compile here (the subprocess only interprets)
        kiln.compile(module, args, device="cuda", options=Options(cuda_archs=(90,)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]
