"""Memory stays flat over many runs and many load/unload cycles of a compiled package.

RSS is read from /proc/self/statm after a warm-up (allocator pools, the plan cache and lazily
mapped pages settle first), then again after the loop; the growth must stay under a small
slack. The default suite runs 1,000 runs / 100 cycles; the `slow` version the full 10,000 runs /
1,000 cycles (`.venv/bin/python -m pytest tests/runtime/test_leaks.py -m slow -s`). Each test prints
its before/after figures (docs/reliability.md quotes them)."""

from __future__ import annotations

import gc
import os

import pytest

import kiln
from kiln.models import ALL_MODELS

PAGE = os.sysconf("SC_PAGE_SIZE")
SLACK = 8 << 20  # bytes of RSS growth tolerated (allocator noise, torch caches)


def rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    spec = ALL_MODELS["demo"]()
    c = kiln.compile(spec.module, spec.example_args, dynamic_shapes=spec.dynamic_shapes)
    return spec, c.save(tmp_path_factory.mktemp("leaks") / "demo.kiln")


def _runs(package, n: int) -> None:
    spec, path = package
    # several sizes: the dynamic plan is recomputed whenever the batch changes
    cases = [spec.make_inputs(seed=k, batch=1 + 13 * k) for k in range(4)]
    with kiln.load(path) as runner:
        for k in range(200):
            runner(*cases[k % 4])
        before = rss()
        for k in range(n):
            out = runner(*cases[k % 4])
            del out
        after = rss()
    print(f"\n{n} runs: RSS {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB "
          f"({(after - before) / 2**10:+.0f} KiB)")
    assert after - before < SLACK


def _cycles(package, n: int) -> None:
    spec, path = package
    args = spec.example_args
    for _ in range(20):
        with kiln.load(path) as runner:
            runner(*args)
    before, fds = rss(), _fds()
    for _ in range(n):
        with kiln.load(path) as runner:
            runner(*args)
    after = rss()
    print(f"\n{n} load/run/unload cycles: RSS {before / 2**20:.1f} MiB -> "
          f"{after / 2**20:.1f} MiB ({(after - before) / 2**10:+.0f} KiB); fds {fds} -> {_fds()}")
    assert after - before < SLACK
    assert _fds() == fds


def test_runs_do_not_leak(package):
    _runs(package, 1000)


def test_load_unload_does_not_leak(package):
    _cycles(package, 100)


@pytest.mark.slow
def test_runs_do_not_leak_long(package):
    _runs(package, 10_000)


@pytest.mark.slow
def test_load_unload_does_not_leak_long(package):
    _cycles(package, 1000)
