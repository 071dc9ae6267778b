"""A/B timing of two runnable things (two loaded packages), interleaved, and which is faster.

Used by kiln.compile to keep the faster of a max_autotune package and the default one
(kiln/api.py; the default build: kiln/targets/cpu/never_lose.py). Each round runs A and B
once each, the order alternating between rounds, so that load on a shared machine and cache
state hit both alike; a side's time is the median of its calls. After `warmup` untimed calls
each, rounds continue until at least `min_rounds` ran and `budget_s` seconds passed (at most
`max_rounds`). The clock is a parameter so the decision can be tested deterministically."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ABResult:
    a_s: float  # median seconds per call of A
    b_s: float  # median seconds per call of B
    rounds: int  # timed calls of each

    @property
    def faster(self) -> str:
        """"a" or "b": the lower median; a tie keeps "a"."""
        return "b" if self.b_s < self.a_s else "a"

    def a_wins(self, margin: float) -> bool:
        """Whether A is faster than B by more than `margin` (relative to B's median): the
        test for replacing a safe default B by A when the difference may be noise."""
        return self.a_s < self.b_s * (1.0 - margin)

    def to_json(self) -> dict:
        return {"a_ms": self.a_s * 1e3, "b_ms": self.b_s * 1e3, "rounds": self.rounds}


def time_ab(run_a: Callable[[], object], run_b: Callable[[], object], *,
            clock: Callable[[], float] = time.perf_counter, warmup: int = 2,
            min_rounds: int = 10, max_rounds: int = 200, budget_s: float = 1.0) -> ABResult:
    if min_rounds < 1 or max_rounds < min_rounds:
        raise ValueError(f"time_ab: need 1 <= min_rounds <= max_rounds, got {min_rounds}, "
                         f"{max_rounds}")
    for _ in range(warmup):
        run_a()
        run_b()
    times: dict[str, list[float]] = {"a": [], "b": []}
    runs = {"a": run_a, "b": run_b}
    start = clock()
    for r in range(max_rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            t0 = clock()
            runs[side]()
            times[side].append(clock() - t0)
        if r + 1 >= min_rounds and clock() - start >= budget_s:
            break
    return ABResult(statistics.median(times["a"]), statistics.median(times["b"]),
                    len(times["a"]))
