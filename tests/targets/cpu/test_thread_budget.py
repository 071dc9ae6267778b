"""Per-handle thread budget (`kiln.load(..., num_threads=)`, `kiln_model_set_num_threads`) and
the automatic budget (OMP_NUM_THREADS, else the CPUs, divided by the kiln runs in flight):
team sizes observed through the worker threads of the instance's pool (kiln_pool.h), torch's
OpenMP setting untouched by a run, results against eager at every budget, hostile budgets
refused, and one handle hammered by many threads while another thread keeps changing its
budget. Thread counting runs in child processes."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import KilnError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '../../../'))


class Wide(nn.Module):
    """One big pointwise kernel and a row reduction: parallel at any team size."""

    def forward(self, x):
        y = torch.tanh(x) * 2 + 1
        return y, y.sum(-1)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    x = torch.randn(256, 512)
    c = kiln.compile(Wide(), (x,))
    return c.save(tmp_path_factory.mktemp("budget") / "wide.kiln")


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """Compiled with Options(num_threads=3): kernels' teams capped at 3, and at the budget."""
    x = torch.randn(256, 512)
    c = kiln.compile(Wide(), (x,), options=kiln.Options(num_threads=3))
    return c.save(tmp_path_factory.mktemp("budget") / "wide3.kiln")


def _check(out, x):
    want = Wide()(x)
    for g, w in zip(out, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [None, 0, 1, 2, 3])
def test_results_at_every_budget(package, n):
    x = torch.randn(256, 512)
    with kiln.load(package, num_threads=n) as r:
        assert r.num_threads == (n or 0)
        _check(r(x), x)


_CHILD = textwrap.dedent("""
    import json, os, sys
    import torch
    import kiln
    def tasks():
        return len(os.listdir("/proc/self/task"))
    x = torch.randn(256, 512)
    with kiln.load(sys.argv[1], num_threads=1) as r:
        r(x)  # one-time threads (if any) outside kiln's pool
    res = []
    for path in sys.argv[1:]:
        out = {}
        for n in (1, 2, 0):
            base = tasks()
            with kiln.load(path, num_threads=n) as r:
                for _ in range(3):
                    r(x)
                out[str(n)] = tasks() - base
            out[f"closed {n}"] = tasks() - base  # the instance's pool joined its workers
        res.append(out)
    print(json.dumps(res))
""")


@pytest.mark.parametrize("which", ["default", "compiled_with_3"])
def test_team_sizes_follow_the_budget(package, capped, which):
    """Automatic budget from OMP_NUM_THREADS=4 (one run in flight): budget 1 starts no pool
    worker, budget 2 one, automatic three, or two for a package compiled with num_threads=3.
    Closing a runner joins its pool's workers. Threads counted in a child process."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "4"}
    path = package if which == "default" else capped
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    auto = 3 if which == "default" else 2
    assert got == [{"1": 0, "2": 1, "0": auto, "closed 1": 0, "closed 2": 0, "closed 0": 0}], got


def test_hostile_budgets(package):
    from kiln.runtime import loader

    lib = loader.libkiln()
    assert lib.kiln_abi_minor() >= 1
    assert lib.kiln_model_set_num_threads(None, 2) != 0
    assert "model is NULL" in loader.last_error()
    assert lib.kiln_model_num_threads(None) == -1
    assert "model is NULL" in loader.last_error()
    x = torch.randn(256, 512)
    with kiln.load(package, num_threads=2) as r:
        for bad in (-1, -2**31, 4097, 2**31 - 1):
            assert lib.kiln_model_set_num_threads(r._handle, bad) != 0
            assert f"must be in [0, 4096] (0: automatic), got {bad}" in loader.last_error()
            assert r.num_threads == 2  # a refused budget leaves the old one
        for bad in (-1, 10**12):
            with pytest.raises(KilnError, match=f"got {bad}"):
                r.num_threads = bad
        for bad in (1.5, "2", True, None):
            with pytest.raises(TypeError, match="num_threads must be an int"):
                r.num_threads = bad
        _check(r(x), x)  # still runs
        r.num_threads = 4096  # large budgets are allowed (kiln's pool caps the team at 256)
        _check(r(x), x)
    with pytest.raises(KilnError, match="must be in"):
        kiln.load(package, num_threads=-3)
    with pytest.raises(KilnError, match="is closed"):
        r.num_threads = 1


def test_shared_handle_under_budget_changes(package):
    """8 threads share one handle while another thread keeps changing its budget: every
    result right (runs are serialised; a budget change applies from the next run)."""
    xs = [torch.randn(256, 512, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    want = [Wide()(x) for x in xs]
    errors: list[str] = []
    stop = threading.Event()
    with kiln.load(package) as r:
        def flip() -> None:
            k = 0
            while not stop.is_set():
                r.num_threads = k % 4
                k += 1

        def work(t: int) -> None:
            for i in range(12):
                j = (t + i) % len(xs)
                for g, w in zip(r(xs[j]), want[j]):
                    if not torch.allclose(g, w, rtol=1e-5, atol=1e-5):
                        errors.append(f"thread {t}, run {i}: wrong result")

        flipper = threading.Thread(target=flip)
        flipper.start()
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        stop.set()
        flipper.join()
    assert not errors, errors[:5]


def test_python_omp_setting_untouched(package):
    """A run leaves the calling thread's OpenMP team size (torch's libgomp, found by soname)
    alone whatever its budget: kiln's packages have their own pool."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
    except OSError:
        pytest.skip("no libgomp")
    before = gomp.omp_get_max_threads()
    x = torch.randn(256, 512)
    for n in (1, before + 1, 0):
        with kiln.load(package, num_threads=n) as r:
            r(x)
        assert gomp.omp_get_max_threads() == before, n
