"""GPU timing shared by the bench scripts: the median of CUDA-event-timed calls after a
warm-up (device time of what `fn` enqueues, not the host's)."""

from __future__ import annotations

import statistics


def sync_ms(fn, repeat: int, warmup: int = 3) -> float:
    """Wall time of one call followed by a device synchronise (median over `repeat` calls):
    what one request waits for, host overhead included."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def events_ms(fn, repeat: int, warmup: int = 3) -> float:
    return stream_ms(fn, 1, repeat, warmup)


def stream_ms(fn, calls: int, repeat: int, warmup: int = 3) -> float:
    """Device time per call when `calls` calls are enqueued back to back (median over `repeat`
    batches): the GPU stays busy while the host prepares the next call, so this is what the
    kernels take, host overhead hidden, as when a model runs in a loop. Compare with a
    synchronised per-call wall time to see the host's share."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)
