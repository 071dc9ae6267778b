"""Fuzzer reproducer (fixed): `kiln fuzz --device cuda --compile-only --seed 23 --start 110
--n 1` failed to compile: sqrt of a float64 value was spelled `tl.sqrt_rn`, which Triton takes
for float32 only ("Expected dtype ['fp32'] but got fp64"). float64 now uses `tl.sqrt`
(sqrt.rn.f64, correctly rounded; kiln/targets/cuda/ops.py FLOAT64_OPS)."""

import pytest
import torch

from kiln.fuzz.runner import check
from kiln.ir import dtypes
from kiln.targets.cuda.ops import op_spelling

pytest.importorskip("triton")

SPEC = {'device': 'cuda',
        'dim': 'bounded',
        'dynamic': True,
        'inputs': [{'dtype': 'float64', 'high': None, 'shape': ['B', 64]},
                   {'dtype': 'float64', 'high': None, 'shape': [1, 64]}],
        'ops': [['unary', [0], {'fn': 'sqrt_s'}],
                ['reduce', [2], {'dims': [0, 1], 'fn': 'amax', 'keep': False}],
                ['binary', [1, 2], {'fn': 'mul'}],
                ['reduce', [2], {'dims': [0, 1], 'fn': 'mean', 'keep': True}],
                ['reduce', [4], {'dims': [0, 1], 'fn': 'amax', 'keep': True}],
                ['layer_norm', [1], {'b': None, 'rank': 1, 'w': None}],
                ['self_mm', [7], {}],
                ['cast', [6], {'dtype': 'float32'}],
                ['mm_w', [9], {'t': True, 'w': 'p0'}]],
        'outputs': [10],
        'params': {'p0': {'init': 'w', 'shape': [4, 1]}},
        'seed': 23000179}


def test_sqrt_spellings():
    assert op_spelling("sqrt", dtypes.float32) == "tl.sqrt_rn({0})"
    assert op_spelling("sqrt", dtypes.float64) == "tl.sqrt({0})"


def test_fuzz_float64_sqrt_compiles(tmp_path):
    out = check(SPEC, tmp_path, interp=False, run=False)
    assert out.status == "ok", out.detail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fuzz_float64_sqrt_on_gpu(tmp_path):
    out = check(SPEC, tmp_path, interp=False)
    assert out.status == "ok", out.detail
