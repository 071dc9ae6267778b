"""How CPU kernels split their work over threads (kiln_pool.h) (issue 14, item 3): the direct
convolution
(dense tasks of output-channel groups x row blocks, depthwise rows, the flat 1x1 row split by
pixels), the prepacked GEMM (panel ranges, or row-block ranges when N has few panels) and the
generated kernels (the outer loop), each above the size at which it goes parallel and with sizes
that do not divide evenly among the tasks, compiled for up to 3 threads and run with budgets 1,
2 and 3 against eager (float64 references). Also: libkiln sets no OpenMP wait policy for a
package with kiln's own pool (kiln_pool.h)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import kiln
from difftest import Cases
from kiln.runtime.build import build_libkiln

THREADS = (1, 2, 3)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Convs(nn.Module):
    """Dense 3x3 (odd rows), stride 2, a 1x1 (the flat-row path), a depthwise 3x3 and a 5x5
    depthwise, with bias / relu / residual epilogues."""

    def __init__(self) -> None:
        super().__init__()
        g = _gen(0)
        self.c1 = nn.Conv2d(24, 80, 3, padding=1)
        self.c2 = nn.Conv2d(80, 48, 3, stride=2, padding=1)
        self.c3 = nn.Conv2d(48, 96, 1)
        self.dw = nn.Conv2d(96, 96, 3, padding=1, groups=96)
        self.dw5 = nn.Conv2d(96, 96, 5, padding=2, groups=96)
        self.c4 = nn.Conv2d(96, 96, 1, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        y = torch.relu(self.c2(y))
        y = self.c3(y)
        z = torch.relu(self.dw(y))
        z = self.dw5(z)
        return torch.relu(self.c4(z) + y)


class Linears(nn.Module):
    """Linear layers through the prepacked GEMM: a wide N (split by panels) and a narrow N
    (few panels: split by row blocks when M is large)."""

    def __init__(self, k: int, n_wide: int, n_narrow: int) -> None:
        super().__init__()
        g = _gen(1)
        self.a = nn.Linear(k, n_wide)
        self.b = nn.Linear(n_wide, n_narrow)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Pointwise(nn.Module):
    """Generated kernels: a pointwise chain and a row reduction."""

    def forward(self, x):
        y = torch.sigmoid(x) * 3 - x
        return y, torch.softmax(y, -1)


def _f64(module: nn.Module, args):
    m64 = module.to(torch.float64)
    try:
        with torch.no_grad():
            return m64(*[a.to(torch.float64) for a in args])
    finally:
        module.to(torch.float32)


def _run_all(tmp_path, module: nn.Module, args, rtol=1e-4, atol=1e-4) -> None:
    module = module.eval()
    want = _f64(module, args)
    path = kiln.compile(module, args, options=kiln.Options(num_threads=3)).save(
        tmp_path / "m.kiln")
    w_paths = pytree.tree_flatten_with_path(want)[0]
    for t in THREADS:
        with kiln.load(path, num_threads=t) as r:
            for _ in range(3):  # a few runs: tasks land on different threads each time
                gs = pytree.tree_leaves(r(*args))
                assert len(gs) == len(w_paths)
                for g, (where, w) in zip(gs, w_paths):
                    scale = w.abs().max().item()
                    err = (g.double() - w).abs().max().item()
                    assert err <= atol + rtol * scale, (pytree.keystr(where), t, err, scale)


def _cases(make, inputs: dict) -> tuple[nn.Module, tuple]:
    """The cases of `inputs` (name -> input), each a `make()` model of its own, in one
    program (difftest.Cases; outputs named "<case>..." in the error)."""
    mods = {k: (make(), 1) for k in inputs}
    return Cases(mods), tuple(inputs.values())


def test_direct_conv_at_1_2_3_threads(tmp_path):
    """Batch 1 at 27x19 and batch 3 at 14x15, in one program."""
    _run_all(tmp_path, *_cases(Convs, {
        f"b{batch}_{hw[0]}x{hw[1]}": torch.randn(batch, 24, *hw, generator=_gen(2))
        for batch, hw in [(1, (27, 19)), (3, (14, 15))]}))


def test_packed_gemm_at_1_2_3_threads(tmp_path):
    # N = 1000: 32 panels of 32 columns, not a multiple of the tasks; N = 64: 2 panels, so
    # M = 389 (33 row blocks of 12) is split by row blocks; M = 1 and 389 in one program
    _run_all(tmp_path, *_cases(lambda: Linears(300, 1000, 64), {
        f"m{m}": torch.randn(m, 300, generator=_gen(3)) for m in (1, 389)}))


def test_generated_kernels_at_1_2_3_threads(tmp_path):
    _run_all(tmp_path, *_cases(Pointwise, {
        "x".join(map(str, shape)): torch.randn(*shape, generator=_gen(4))
        for shape in [(37, 1031), (3, 5, 4099)]}), rtol=1e-5, atol=1e-6)


_CHILD = textwrap.dedent("""
    import ctypes, sys
    lib = ctypes.CDLL(sys.argv[1])
    if sys.argv[3] == "preload":
        ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
    h = ctypes.c_void_p()
    lib.kiln_model_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p]
    assert lib.kiln_model_load(sys.argv[2].encode(), b"cpu", ctypes.byref(h)) == 0
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    v = libc.getenv(b"GOMP_SPINCOUNT")
    print(v.decode() if v else "-")
""")


@pytest.fixture(scope="module")
def tiny_package(tmp_path_factory):
    x = torch.randn(64, 512)
    return kiln.compile(Pointwise(), (x,)).save(tmp_path_factory.mktemp("spin") / "p.kiln")


def _child_spin(package, mode: str, **env: str) -> str:
    e = {k: v for k, v in os.environ.items()
         if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(build_libkiln()), str(package),
                          mode], env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_no_openmp_settings_for_a_package_with_kilns_pool(tiny_package):
    # the package has its own pool (kiln_pool.h), no libgomp: libkiln leaves GOMP_SPINCOUNT
    # (which would reach a libgomp the process loads later, e.g. torch's) alone
    assert _child_spin(tiny_package, "fresh") == "-"
    assert _child_spin(tiny_package, "preload") == "-"
    assert _child_spin(tiny_package, "fresh", GOMP_SPINCOUNT="77") == "77"



def test_openblas_single_threaded_inside_kiln_pool(tmp_path):
    """A BLAS GEMM runs on each OpenMP thread's part of the problem: OpenBLAS's own pool
    must stay at one thread, or its threads and kiln's would compete for the cores."""
    blas = pytest.importorskip("scipy_openblas32")
    lib = ctypes.CDLL(os.path.join(blas.get_lib_dir(), f"lib{blas.get_library()}.so"))
    lib.scipy_openblas_set_num_threads(2)  # as a process that uses OpenBLAS itself may
    x = torch.randn(389, 300, generator=_gen(5))
    m = Linears(300, 1000, 24).eval()  # N = 24: the BLAS backend (heuristic)
    c = kiln.compile(m, (x,), options=kiln.Options(num_threads=2))
    assert "[blas" in c.sources["model.cpp"]
    with kiln.load(c.save(tmp_path / "b.kiln"), num_threads=2) as r:
        torch.testing.assert_close(r(x), m(x), rtol=1e-4, atol=1e-4)
    assert lib.scipy_openblas_get_num_threads() == 1


class Attn(nn.Module):
    """Batched GEMMs of two activations (the BLAS backend) around a softmax."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v


_BUSY_THREADS = r"""
import ctypes, os, sys, time
import torch
import kiln
import scipy_openblas32 as blas
lib = ctypes.CDLL(os.path.join(blas.get_lib_dir(), f"lib{blas.get_library()}.so"))
lib.scipy_openblas_set_num_threads(4)  # as a process that uses OpenBLAS itself may
# OpenBLAS's new workers spin-wait a while before they sleep (tens of ms); on a quiet machine
# that spin, the process's own, reached into the timed window
time.sleep(1.0)
torch.set_num_threads(1)
path, budget = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(3)
args = [torch.randn(2, 4, 128, 64, generator=g) for _ in range(3)]

def cpu():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[tid] = int(fields[11]) + int(fields[12])  # utime + stime, clock ticks
    return out

with kiln.load(path, num_threads=budget) as r:
    r(*args)
    before, t = cpu(), time.time()
    while time.time() - t < 1.5:
        r(*args)
    after = cpu()
busy = sorted((after[k] - before.get(k, 0) for k in after), reverse=True)
print(" ".join(map(str, busy)))
"""


@pytest.mark.parametrize("budget", [1, 2])
def test_no_oversubscription_with_blas_gemms(tmp_path, budget):
    """Issue 14 item 3: while a package runs at a budget of n threads, only n threads of the
    process use the CPU (the caller and kiln's pool workers), even with BLAS GEMMs in it and
    OpenBLAS set to 4 threads by the process beforehand."""
    pytest.importorskip("scipy_openblas32")
    g = _gen(4)
    args = tuple(torch.randn(2, 4, 128, 64, generator=g) for _ in range(3))
    c = kiln.compile(Attn(), args, options=kiln.Options(num_threads=2))
    assert "[blas" in c.sources["model.cpp"]
    path = c.save(tmp_path / "attn.kiln")
    with kiln.load(path, num_threads=budget) as r:  # the results first, at this budget
        torch.testing.assert_close(r(*args), Attn()(*args), rtol=1e-4, atol=1e-5)
    out = subprocess.run([sys.executable, "-c", _BUSY_THREADS, str(path), str(budget)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "4"})
    assert out.returncode == 0, out.stderr[-3000:]
    busy = [int(x) for x in out.stdout.split()]
    total = sum(busy)
    assert total > 0
    # threads beyond the budget: no more than a few clock ticks between them
    assert sum(busy[budget:]) <= max(3, total // 20), busy
