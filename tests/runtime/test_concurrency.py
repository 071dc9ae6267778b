"""Concurrency of compiled packages: one handle per thread over the same package runs in
parallel with results bit-identical to a single thread at the same thread budget; one handle
shared by several threads is serialised by libkiln and never corrupted. With the automatic
budget (concurrent runs share the cores, so a run's OpenMP team size depends on what else is
running) results may differ from a lone run in the last bits: a GEMM split over fewer threads
sums in another order; they are compared with a tolerance far below any corruption.
Throughput with 1 vs 2 handles/threads on the zoo models is measured and printed (`-s`
shows it; never asserted: the machine is shared).

    .venv/bin/python -m pytest tests/runtime/test_concurrency.py -s -q
"""

from __future__ import annotations

import threading

import pytest
import torch

import kiln
from kiln.models import ALL_MODELS
from bench.throughput import throughput  # runs/s, CPU ms per run

THREADS, RUNS = 4, 25


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    out = {}
    d = tmp_path_factory.mktemp("conc")
    for name in ("demo", "gpt"):
        spec = ALL_MODELS[name]()
        c = kiln.compile(spec.module, spec.example_args, dynamic_shapes=spec.dynamic_shapes)
        out[name] = (spec, c.save(d / f"{name}.kiln"))
    return out


def _inputs(spec, n: int) -> list[tuple]:
    """n argument tuples at varying sizes (the dynamic-size plan cache changes between runs)."""
    if spec.name == "gpt":
        return [spec.make_inputs(seed=k, batch=1 + k % 2, seq=4 + 9 * (k % 3)) for k in range(n)]
    return [spec.make_inputs(seed=k, batch=1 + 7 * (k % 4)) for k in range(n)]


def _leaves(out) -> list[torch.Tensor]:
    return list(torch.utils._pytree.tree_leaves(out))


def _same(got, want, exact: bool) -> bool:
    if exact or not got.is_floating_point():
        return torch.equal(got, want)
    return torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _hammer(runners, cases, expect, rounds: int, exact: bool = True) -> list[str]:
    """Each thread t uses runners[t % len(runners)] on all cases, in a thread-specific order."""
    errors: list[str] = []
    barrier = threading.Barrier(THREADS)

    def work(t: int) -> None:
        runner = runners[t % len(runners)]
        barrier.wait()
        for r in range(rounds):
            for k in range(len(cases)):
                j = (k * (t + 1) + r) % len(cases)
                got = _leaves(runner(*cases[j]))
                if any(not _same(g, w, exact) for g, w in zip(got, expect[j])):
                    errors.append(f"thread {t}, case {j}: result differs from single-threaded")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors


@pytest.mark.parametrize("name", ["demo", "gpt"])
@pytest.mark.parametrize("budget", [2, 0], ids=["two_threads", "automatic"])
@pytest.mark.parametrize("shared", [False, True], ids=["handle_per_thread", "shared_handle"])
def test_threads_match_single_thread(packages, name, budget, shared):
    spec, path = packages[name]
    cases = _inputs(spec, 8)
    with kiln.load(path, num_threads=budget) as single:
        expect = [_leaves(single(*a)) for a in cases]
    runners = [kiln.load(path, num_threads=budget) for _ in range(1 if shared else THREADS)]
    try:
        errors = _hammer(runners, cases, expect, rounds=RUNS // 8 + 1, exact=budget > 0)
    finally:
        for r in runners:
            r.close()
    assert not errors, errors[:5]


def test_throughput_report(packages):
    """Prints runs/s for 1 and 2 handles (one thread each); asserts only that both ran
    (bench/throughput.py measures 1, 2 and 4 handles with repeats and medians)."""
    for name, (spec, path) in packages.items():
        args = spec.example_args
        one, two = (throughput(path, args, h, 1.0, 0)[0] for h in (1, 2))
        print(f"\nthroughput {name}: 1 handle {one:.0f} runs/s, 2 handles {two:.0f} runs/s "
              f"({two / one:.2f}x)")
        assert one > 0 and two > 0
