"""Per-call cost of a CUDA package against its kernels' time (issue 15): for each dtype and zoo
model, the wall time per call of 200 calls enqueued without a sync (the host's cost when the
GPU keeps up), the back-to-back device time per call (bench/cuda_timing.stream_ms, 20 and 100
calls), and a CUPTI trace of 5 calls: every kernel, copy and memset of the first, with its
start offset, and per call the span from the first to the last event against the sum of their
durations (the difference is time the GPU waits).

    python bench/cuda_call_overhead.py bf16,fp32 gpt
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import kiln  # noqa: E402
from bench.cuda_timing import stream_ms  # noqa: E402
from bench.profile_gpu import DT, _cast, _model  # noqa: E402


def measure(name: str, dt: str) -> None:
    module, args = _model(name, DT[dt])
    module, args = module.to(DT[dt]), _cast(args, DT[dt])
    ep = torch.export.export(module, args)
    dargs = tuple(x.cuda() for x in args)
    g = kiln.compile(ep, device="cuda").load(Path(tempfile.mkdtemp()) / "g.kiln",
                                             device="cuda:0")
    for _ in range(5):
        g(*dargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        g(*dargs)
    host = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    s20 = stream_ms(lambda: g(*dargs), 20, 20) * 1e3
    s100 = stream_ms(lambda: g(*dargs), 100, 5) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g(*dargs)
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    n = len(evs) // 5
    spans = []
    for i in range(5):
        c = evs[i * n:(i + 1) * n]
        spans.append(f"{c[-1].time_range.end - c[0].time_range.start:.0f}/"
                     f"{sum(e.time_range.elapsed_us() for e in c):.0f}")
    print(f"== {name} {dt}: host us/call {host:.1f}; back to back {s20:.1f} us (20 calls), "
          f"{s100:.1f} us (100); events/call {n}; span/busy us per call {' '.join(spans)}")
    for e in evs[:n]:
        print(f"   {e.name[:70]:70s} {e.time_range.elapsed_us():7.1f} us at "
              f"+{e.time_range.start - evs[0].time_range.start:7.1f}")


if __name__ == "__main__":
    for dt in sys.argv[1].split(","):
        for name in (sys.argv[2] if len(sys.argv) > 2 else "gpt").split(","):
            measure(name, dt)
