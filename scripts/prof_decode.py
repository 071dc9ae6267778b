import sys, tempfile, time, collections
from pathlib import Path
sys.path.insert(0, ".")
import torch, kiln
from kiln.models.llm import llama, static_cache_module
L = int(sys.argv[1]) if len(sys.argv) > 1 else 16
model = llama(layers=L, hidden=2048, heads=32, kv_heads=4, vocab=32000, inter=5632, init=0.02, device="cuda")
w, ep = static_cache_module(model, 256, device="cuda", dtype=torch.bfloat16)
t0 = time.perf_counter(); cm = kiln.compile(ep, device="cuda"); print("compile s", time.perf_counter()-t0)
r = cm.load(Path(tempfile.mkdtemp()) / "d.kiln", device="cuda:0")
ids = torch.tensor([[11]], device="cuda"); pos = torch.tensor([128], device="cuda")
for _ in range(10): r(input_ids=ids, cache_position=pos)
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
    for _ in range(10): r(input_ids=ids, cache_position=pos)
    torch.cuda.synchronize()
agg = collections.defaultdict(lambda: [0, 0.0])
for e in p.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        a = agg[e.name]; a[0] += 1; a[1] += e.device_time_total if hasattr(e,'device_time_total') else e.cuda_time_total
tot = sum(v[1] for v in agg.values()); n = sum(v[0] for v in agg.values())
print(f"kernels/token {n/10:.0f}  device us/token {tot/10:.0f}")
for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])[:30]:
    print(f"{v[0]/10:6.1f} x {v[1]/v[0]:8.2f} us = {v[1]/10:8.1f} us/token  {k[:110]}")
