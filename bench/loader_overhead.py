"""Per-call host time of the Python loader, this checkout's against another commit's, on the
same packages in one process (interleaved rounds, so both see the same machine load).

    python bench/loader_overhead.py [--base 315c86b] [--rounds 15] [--calls 3000]

Prints the median microseconds per call of each loader for a 1-input / 1-output package
(`x + 1` on 4 floats) and a 3-input / 2-output one (8x8 floats): the work around the model
call (argument checks, DLTensors, output adoption), the model's own run being tiny.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kiln  # noqa: E402
from kiln.runtime import loader as current  # noqa: E402


def _loader_at(rev: str):
    """kiln/runtime/loader.py as of `rev`, imported as a module of the kiln package."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kiln/runtime/loader.py"],
                          capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "loader_base.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("kiln.runtime._loader_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _one(x):
    return x + 1


def _three(x, y, z):
    return x * y + z, (x - z).relu()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="315c86b", help="commit whose loader to compare with")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args()
    base = _loader_at(a.base)
    cases = [("1 in, 1 out", _one, (torch.randn(4),)),
             ("3 in, 2 out", _three, tuple(torch.randn(8, 8) for _ in range(3)))]
    for name, fn, args in cases:
        path = kiln.compile(fn, args).save(Path(tempfile.mkdtemp()) / "m.kiln")
        runners = {"base": base.Runner(path), "this": current.Runner(path)}
        us: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(a.rounds):
            for k, run in runners.items():
                for _ in range(200):
                    run(*args)
                t = time.perf_counter()
                for _ in range(a.calls):
                    run(*args)
                us[k].append((time.perf_counter() - t) / a.calls * 1e6)
        b, c = statistics.median(us["base"]), statistics.median(us["this"])
        print(f"{name}: {a.base} {b:.1f} us, this checkout {c:.1f} us per call ({b / c:.2f}x)")


if __name__ == "__main__":
    main()
