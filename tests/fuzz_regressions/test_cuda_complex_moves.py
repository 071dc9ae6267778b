"""Fuzzer reproducer (fixed): complex values moved by a CUDA program's Triton kernels (the cat,
transposes, indexing and slices around the ATen calls that compute on them) crashed the
Triton printer: "KeyError: complex64 [targets/cuda/ops.py:51 in tl_compute]" (issue 16's
device run: `kiln fuzz --seed 17 --start 13 --n 1 --device cuda`, and programs 144, 254, 446,
568, 592, 724, 901, 913, 971). kiln/targets/cuda/kernel.py now moves a complex value as its two
parts' bits (a complex64 buffer is pairs of int32 to Triton: exact, NaN payloads included).

Checked here by compiling for sm_90 (the fuzz program and complex64 / complex128 moves), and
by running the generated kernels in Triton's interpreter against eager (a subprocess: the
AOT compiler cannot run in interpreter mode); the `gpu` test runs the fuzz program on a GPU."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln
from kiln.fuzz.runner import check
from kiln.options import Options

pytest.importorskip("triton")

OPTS = Options(cuda_archs=(90,), autotune=False, cuda_graphs=False)

# `--seed 17 --start 13` as generated (complex(x, x) + 2 * complex(x.imag...): ATen computes;
# kiln's kernels cat the complex results of two ATen calls, a `where` between complex values)
SPEC = {'device': 'cuda',
        'dim': 'bounded',
        'dynamic': True,
        'inputs': [{'dtype': 'float32', 'high': None, 'shape': ['B']},
                   {'dtype': 'float32', 'high': None, 'shape': ['B', 8]},
                   {'dtype': 'float32', 'high': None, 'shape': ['B', 8]},
                   {'dtype': 'int64', 'high': 8, 'shape': [4]},
                   {'dtype': 'float32', 'high': None, 'shape': [8, 2]},
                   {'dtype': 'float32', 'high': None, 'shape': [1, 1]}],
        'ops': [['complex', [1, 1], {'fn': 'add_real'}],
                ['binary', [2, 6], {'fn': 'add_alpha'}],
                ['adv_index', [7, 3], {'dim': 1}],
                ['matmul', [1, 4], {}],
                ['binary', [9, 5], {'fn': 'minimum'}],
                ['binary', [9, 10], {'fn': 'add'}],
                ['transpose', [11], {'d0': 1, 'd1': 0}],
                ['transpose', [12], {'d0': 0, 'd1': 1}]],
        'outputs': [13, 8, 12, 13],
        'params': {},
        'seed': 17000064}


class Moves(torch.nn.Module):
    """ATen makes complex values; kiln's kernels move them: cat (a `where` between two
    buffers), flip, transpose, slices, indexing and a broadcast copy."""

    def forward(self, a, b, idx):
        z = torch.complex(a, b)
        w = torch.cat([z, z.flip(0)], 1).transpose(0, 1)
        return w.contiguous(), w[idx], z[:, 1::2].unsqueeze(0).expand(2, -1, -1).contiguous()


def cases():
    torch.manual_seed(0)
    out = []
    for dt in (torch.float32, torch.float64):
        a, b = torch.randn(3, 6, dtype=dt), torch.randn(3, 6, dtype=dt)
        b[0, 0] = float("nan")
        a[1, 1] = -0.0
        out.append((str(dt), Moves(), (a, b, torch.tensor([5, 0, 11, 2]))))
    return out


def test_complex_moves_compile_for_cuda():
    for _, module, args in cases():
        cm = kiln.compile(module, args, device="cuda", options=OPTS)
        src = cm.sources["kernels_triton.py"]
        assert "tl.where(" in src and "(1 + (" in src  # the cat; imaginary parts at 2k + 1
        assert cm.library.exists()


def test_fuzz_complex_moves_compile_only(tmp_path):
    out = check(SPEC, tmp_path, interp=False, run=False)
    assert out.status in ("ok", "error"), out.detail


_INTERP = textwrap.dedent("""
    import sys, torch, kiln
    sys.path.insert(0, sys.argv[1])
    from test_cuda_complex_moves import cases, OPTS
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels
    bad = []
    for name, module, args in cases():
        b = kiln.compile(module, args, device="cuda", options=OPTS).built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        bufs = {x.name: x for x in b.loop.buffers}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, {})}
        outs = run_program(b.program, ks, mod, b.weights, list(args))
        for o, r in zip(outs, module(*args)):
            o = o.reshape(r.shape)
            if o.dtype != r.dtype or not torch.equal(torch.view_as_real(o).view(torch.int8),
                                                     torch.view_as_real(r).view(torch.int8)):
                bad.append(f"{name}: {o} != {r}")
        print(name, "checked", flush=True)
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
    sys.exit(1 if bad else 0)
""")


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_complex_moves_match_eager_bit_for_bit_in_interpreter():
    for _, module, args in cases():  # compile here (the subprocess only interprets)
        kiln.compile(module, args, device="cuda", options=OPTS)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP, str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fuzz_complex_moves_on_gpu(tmp_path):
    out = check(SPEC, tmp_path, interp=False)
    assert out.status == "ok", out.detail
