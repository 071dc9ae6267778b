"""GPU timing shared by the bench scripts: the median of CUDA-event-timed calls after a
warm-up (device time of what `fn` enqueues, not the host's)."""

from __future__ import annotations

import statistics


def events_ms(fn, repeat: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
