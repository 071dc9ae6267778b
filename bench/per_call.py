"""Per-call time of tiny programs: kiln's Python runner, kiln_model_run from C, ONNX Runtime's
session.run and eager PyTorch, in interleaved rounds (each round times every path once, so all
see the same machine load); medians of the rounds' mean microseconds per call.

    python bench/per_call.py [--rounds 15] [--calls 3000] [--threads 1] [--base REV]

--base REV adds a column: the Python loader of commit REV (kiln/runtime/loader.py as of REV,
as bench/loader_overhead.py does) on the same packages, for before/after in one table.

Measured on the development VM (2 shared x86-64 cores, torch 2.13 CPU, onnxruntime 1.2x from
pip; `uptime` noted with the table in PERCALL_NOTE.md). onnxruntime and onnx are
benchmark-only extras (`pip install onnxruntime onnx`); without them the ORT column is skipped.

Programs: `x + 1` on 4 floats; `a @ b` with a 2x3 and b 3x2 (4 output elements); and a 3-input
/ 2-output one on 8x8 floats (`x * y + z, (x - z).relu()`). The C path is bench/per_call.c,
built against this checkout's libkiln (kiln.runtime.build_libkiln) and run as its own process
once per round; its time is libkiln + the model (plus freeing outputs), so kiln Python minus
kiln C is the cost of the Python loader. ORT sessions use one intra-op and one inter-op
thread; kiln (Python and C: num_threads / kiln_model_set_num_threads) and eager
(torch.set_num_threads) run with --threads threads (default 1: these programs are far too
small to split).
"""

from __future__ import annotations

import argparse
import os
import shutil
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
import kiln.runtime as kr  # noqa: E402


def _add1(x):
    return x + 1


def _matmul(a, b):
    return a @ b


def _three(x, y, z):
    return x * y + z, (x - z).relu()


def _onnx_session(name: str, args: tuple[torch.Tensor, ...]):
    """An onnxruntime session for the named program, graph built by hand (no exporter)."""
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    f32 = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(f"i{k}", f32, list(a.shape)) for k, a in enumerate(args)]
    inits = []
    if name == "add1":
        inits = [helper.make_tensor("one", f32, [], [1.0])]
        nodes = [helper.make_node("Add", ["i0", "one"], ["o0"])]
        outs = [helper.make_tensor_value_info("o0", f32, list(args[0].shape))]
    elif name == "matmul":
        nodes = [helper.make_node("MatMul", ["i0", "i1"], ["o0"])]
        outs = [helper.make_tensor_value_info("o0", f32, [args[0].shape[0], args[1].shape[1]])]
    else:
        nodes = [helper.make_node("Mul", ["i0", "i1"], ["t0"]),
                 helper.make_node("Add", ["t0", "i2"], ["o0"]),
                 helper.make_node("Sub", ["i0", "i2"], ["t1"]),
                 helper.make_node("Relu", ["t1"], ["o1"])]
        outs = [helper.make_tensor_value_info(f"o{k}", f32, list(args[0].shape)) for k in (0, 1)]
    graph = helper.make_graph(nodes, name, ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    feeds = {f"i{k}": a.numpy() for k, a in enumerate(args)}
    onnx.checker.check_model(model)
    return lambda: sess.run(None, feeds)


def _build_c(work: Path) -> Path | None:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    lib = kr.build_libkiln()
    exe = work / "per_call"
    subprocess.run([cc, "-O2", "-I", str(kr.include_dir()), str(ROOT / "bench" / "per_call.c"),
                    "-L", str(lib.parent), "-lkiln", f"-Wl,-rpath,{lib.parent}", "-o", str(exe)],
                   check=True)
    return exe


def _base_runner(rev: str | None, path: Path, threads: int):
    if rev is None:
        return None
    from bench.loader_overhead import _loader_at
    return _loader_at(rev).Runner(path, num_threads=threads)


def _time(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--base", default=None, help="also time this commit's Python loader")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    work = Path(tempfile.mkdtemp())
    exe = _build_c(work)
    cases = [("x + 1, 4 floats", "add1", _add1, (torch.randn(4),)),
             ("a @ b, 2x3 @ 3x2", "matmul", _matmul, (torch.randn(2, 3), torch.randn(3, 2))),
             ("3 in / 2 out, 8x8", "three", _three, tuple(torch.randn(8, 8) for _ in range(3)))]
    print(f"rounds {a.rounds} x {a.calls} calls; median us per call "
          f"(load: {os.getloadavg()[0]:.2f})")
    print(f"{'program':<20} {'base py':>8} {'kiln py':>8} {'kiln C':>8} {'ORT':>8} "
          f"{'eager':>8} {'py/ORT':>7} {'py/eager':>8} {'py - C':>7}")
    for label, name, fn, args in cases:
        path = kiln.compile(fn, args).save(work / f"{name}.kiln")
        runner = kr.load(path, num_threads=a.threads)
        base = _base_runner(a.base, path, a.threads)
        sess = _onnx_session(name, args)
        shapes = ["x".join(str(d) for d in t.shape) for t in args]
        us: dict[str, list[float]] = {"base": [], "py": [], "c": [], "ort": [], "eager": []}
        for _ in range(a.rounds):
            if base is not None:
                us["base"].append(_time(lambda: base(*args), a.calls))
            us["py"].append(_time(lambda: runner(*args), a.calls))
            if exe is not None:
                out = subprocess.run([str(exe), str(path), str(a.threads), "1", str(a.calls),
                                      *shapes], capture_output=True, text=True, check=True)
                us["c"].append(float(out.stdout.split()[-1]))
            if sess is not None:
                us["ort"].append(_time(sess, a.calls))
            us["eager"].append(_time(lambda: fn(*args), a.calls))
        med = {k: statistics.median(v) if v else float("nan") for k, v in us.items()}
        print(f"{label:<20} {med['base']:8.2f} {med['py']:8.2f} {med['c']:8.2f} {med['ort']:8.2f} "
              f"{med['eager']:8.2f} {med['py'] / med['ort']:7.2f} "
              f"{med['py'] / med['eager']:8.2f} {med['py'] - med['c']:7.2f}")
        runner.close()


if __name__ == "__main__":
    main()
