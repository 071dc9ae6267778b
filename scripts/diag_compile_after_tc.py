"""Why kiln's CUDA compile is slow after torch.compile ran in the same process (issue 15 item
3; bench/gpu_peers.py saw launch tuning's "load" at 18-43 s). On a GPU machine:

    python scripts/diag_compile_after_tc.py MODEL DTYPE [--before none|ro]

Runs what gpu_peers' worker runs (eager, torch.compile(mode="reduce-overhead") timed, then
kiln.compile with an empty kiln cache) and prints the environment variables torch.compile
changed, the compile's launch-tuning seconds, and per tuned candidate the seconds waited and
loaded here and what its worker left (done / failed / nothing). Before the fix in
triton_aot.load_compiled: after torch.compile, load 20.8 s (every candidate compiled again
here); without it, 0.2 s."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln_diag_cache_")
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("dtype")
    p.add_argument("--before", default="ro", choices=["none", "ro"])
    a = p.parse_args()
    import kiln
    from bench.cpu_peers_models import build
    from bench.gpu_peers import DT, _inputs, _timed
    from kiln.targets.cuda import launch_tune

    events = []
    orig_get = launch_tune._Compiling._get

    def get(self, key):
        fresh = key not in self.done
        w0, l0 = self.waited, self.loaded
        out_state = None
        r = orig_get(self, key)
        if fresh:
            t = self.task.get(key)
            if t in self.pool.where:
                _, out, i = self.pool.where[t]
                out_state = ("done" if (out / f"{i}.json").exists() else
                             "failed" if (out / f"{i}.failed").exists() else "nothing")
            else:
                out_state = "no worker"
            events.append({"key": list(key), "wait": round(self.waited - w0, 3),
                           "load": round(self.loaded - l0, 3), "worker": out_state,
                           "kernel": self.todo[key[0]][1][key[1]].name})
        return r

    launch_tune._Compiling._get = get
    env0 = dict(os.environ)
    torch.manual_seed(0)
    case = build(a.model)
    module = case.module.to("cuda", DT[a.dtype]).eval()
    args = _inputs(case.args, 1, DT[a.dtype])
    ns = argparse.Namespace(calls=10, repeat=10)
    with torch.no_grad():
        _timed({}, "eager", lambda: module(*args), ns)
        if a.before == "ro":
            compiled = torch.compile(module, mode="reduce-overhead")
            compiled(*args)
            _timed({}, "ro", lambda: compiled(*args), ns)
            torch._dynamo.reset()
        changed = {k: (env0.get(k), v) for k, v in os.environ.items() if env0.get(k) != v}
        changed.update({k: (v, None) for k, v in env0.items() if k not in os.environ})
        print("environment changed by torch.compile:", json.dumps(changed, indent=1))
        ep = torch.export.export(module, args)
        t0 = time.perf_counter()
        cm = kiln.compile(ep, device="cuda")
        total = time.perf_counter() - t0
    st = cm.report["stages"]
    la = {k: st.get(f"launch_autotune{k}", 0.0) for k in ("", ".load", ".wait")}
    print(f"{a.model} {a.dtype} before={a.before}: kiln.compile {total:.1f} s; "
          f"launch_autotune {la['']:.2f} s, load {la['.load']:.2f} s, wait {la['.wait']:.2f} s")
    slow = sorted(events, key=lambda e: -e["load"])[:8]
    print("slowest loads:", json.dumps(slow))
    print("worker states:", collections.Counter(e["worker"] for e in events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
