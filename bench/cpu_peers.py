"""kiln against ONNX Runtime, OpenVINO, AOTInductor and eager PyTorch on the CPU (issue 14).

For every model (bench/cpu_peers_models.py: zoo models and Hugging Face models built from
configs with random weights) and system, all with 2 threads:

  eager          torch.inference_mode(), torch.set_num_threads(2)
  aoti           torch._inductor.aoti_compile_and_package, run through aoti_load_package
  ort            torch.onnx.export (dynamo) -> onnxruntime, ORT_ENABLE_ALL, sequential,
                 intra_op_num_threads=2
  openvino       ov.convert_model (from the ONNX file when there is one, else from the
                 ExportedProgram), PERFORMANCE_HINT=LATENCY, INFERENCE_NUM_THREADS=2,
                 INFERENCE_PRECISION_HINT=f32 (kiln and the others compute in float32)
  kiln           kiln.compile(ep, Options(num_threads=2)), run through kiln.load
  kiln_autotune  the same with max_autotune=True

Each model is built, run in eager (the reference output) and exported once (torch.export,
strict=False) in a "prepare" process; each system then compiles in its own process (compile
time measured there, caches empty), and the timing runs in R interleaved rounds: every round
starts a fresh process per system (rotating the order), which loads the artifact, warms up and
times calls for --min-time seconds (at least --min-calls); a round's figure is the median call,
the reported latency the median over rounds. Every timed process checks its output against
eager (MISMATCH in the table otherwise) and reports its peak RSS (ORT and OpenVINO processes
import numpy only, no torch). kiln's package is also run from C (bench/per_call.c) for the peak
RSS of a process without Python or torch. `uptime` load is sampled every round. A failure of one
(model, system) fills its cell with the error's first line; every process has a timeout.

    python bench/cpu_peers.py [--models mlp,hf_bert_base] [--systems ort,openvino,kiln]
        [--rounds 5] [--quick] [--taskset 0,1] [--json out.json] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_name  # noqa: E402
from bench.markdown import splice  # noqa: E402

THREADS = int(os.environ.get("KILN_BENCH_THREADS", "2"))  # --threads sets it for the workers
SYSTEMS = ("eager", "aoti", "ort", "openvino", "kiln", "kiln_autotune")
TORCH_SYSTEMS = {"eager", "aoti", "kiln", "kiln_autotune"}
LABELS = {"eager": "eager", "aoti": "AOTInductor", "ort": "ORT", "openvino": "OpenVINO",
          "kiln": "kiln", "kiln_autotune": "kiln max_autotune"}
PEERS = ("ort", "openvino")  # "best peer": the faster of these two
BEGIN, END = "<!-- cpu-peers:begin -->", "<!-- cpu-peers:end -->"
OV_CONFIG = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": THREADS,
             "INFERENCE_PRECISION_HINT": "f32"}


# =============================================================================== workers

def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _load_arrays(path: Path) -> list:
    import numpy as np

    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _load_ep(model: str, d: Path):
    """The ExportedProgram the prepare step saved (re-exported if it does not load back)."""
    import torch

    try:
        return torch.export.load(str(d / "ep.pt2")), "saved"
    except Exception as e:  # some programs do not round-trip; export again, same settings
        from bench.cpu_peers_models import build

        case = build(model)
        return torch.export.export(case.module, case.args, strict=False), f"re-exported ({e})"


def _flat_np(out: Any) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t.detach().numpy() if isinstance(t, torch.Tensor) else t
            for t in tree_flatten(out)[0]]


def w_prepare(model: str, d: Path) -> dict:
    """Build the model, save its inputs and eager outputs, export it once."""
    import numpy as np
    import torch

    from bench.cpu_peers_models import build

    torch.set_num_threads(THREADS)
    case = build(model)
    with torch.no_grad():
        want = _flat_np(case.module(*case.args))
    t = time.perf_counter()
    ep = torch.export.export(case.module, case.args, strict=False)
    export_s = time.perf_counter() - t
    saved = True
    try:
        torch.export.save(ep, str(d / "ep.pt2"))
    except Exception:
        saved = False
    np.savez(d / "inputs.npz", *[a.numpy() for a in case.args])
    np.savez(d / "expected.npz", *want)
    params = sum(p.numel() for p in case.module.parameters())
    return {"export_s": export_s, "ep_saved": saved, "rtol": case.rtol, "atol": case.atol,
            "note": case.note, "params": params,
            "float_inputs": all(a.dtype == torch.float32 for a in case.args),
            "input_shapes": [list(a.shape) for a in case.args]}


def w_compile(model: str, system: str, d: Path) -> dict:
    """Compile (or convert) the exported model for one system; the time is the result."""
    import numpy as np  # noqa: F401  (ORT/OpenVINO need it anyway)
    import torch

    torch.set_num_threads(THREADS)
    ep, ep_source = _load_ep(model, d)
    res: dict[str, Any] = {"ep": ep_source}
    if system == "aoti":
        import torch._inductor as ind  # the peer under test (kiln itself never imports it)

        t = time.perf_counter()
        ind.aoti_compile_and_package(ep, package_path=str(d / "aoti.pt2"))
        res["compile_s"] = time.perf_counter() - t
    elif system in ("kiln", "kiln_autotune"):
        import kiln

        opts = kiln.Options(num_threads=THREADS, max_autotune=system == "kiln_autotune")
        t = time.perf_counter()
        cm = kiln.compile(ep, options=opts)
        cm.save(str(d / f"{system}.kiln"))
        res["compile_s"] = time.perf_counter() - t
        rep = cm.report or {}
        res.update(kernels=rep.get("kernels"), extern_calls=rep.get("extern_calls"),
                   arena_bytes=rep.get("arena_bytes"))
    elif system == "ort":
        import onnxruntime as ort

        args = tuple(torch.from_numpy(a) for a in _load_arrays(d / "inputs.npz"))
        t = time.perf_counter()
        torch.onnx.export(ep, args, str(d / "model.onnx"), dynamo=True, external_data=True)
        res["export_onnx_s"] = time.perf_counter() - t
        t2 = time.perf_counter()
        ort.InferenceSession(str(d / "model.onnx"), _ort_options(),
                             providers=["CPUExecutionProvider"])
        res["session_s"] = time.perf_counter() - t2
        res["compile_s"] = time.perf_counter() - t
    elif system == "openvino":
        import openvino as ov

        onnx = d / "model.onnx"
        t = time.perf_counter()
        if onnx.exists() and not hasattr(ov, "convert_model"):
            # a trimmed OpenVINO (no model conversion tools): its ONNX front end reads the file
            m, res["source"] = ov.Core().read_model(str(onnx)), "ONNX (read_model)"
        elif onnx.exists():
            m, res["source"] = ov.convert_model(str(onnx)), "ONNX"
        else:
            m, res["source"] = ov.convert_model(ep), "ExportedProgram"
        res["convert_s"] = time.perf_counter() - t
        t2 = time.perf_counter()
        ov.Core().compile_model(m, "CPU", OV_CONFIG)
        res["compile_model_s"] = time.perf_counter() - t2
        res["compile_s"] = time.perf_counter() - t
        ov.save_model(m, str(d / "ov.xml"), compress_to_fp16=False)
    else:
        raise ValueError(f"nothing to compile for system {system!r}")
    return res


def _ort_options():
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    return so


def _runner(model: str, system: str, d: Path, arrays: list) -> tuple[Callable, Callable]:
    """(call, outputs-as-numpy) for one system, from the artifact its compile step left."""
    if system == "ort":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(d / "model.onnx"), _ort_options(),
                                    providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        if len(names) != len(arrays):
            raise RuntimeError(f"ONNX model has {len(names)} inputs, the program {len(arrays)}")
        feeds = dict(zip(names, arrays))
        return (lambda: sess.run(None, feeds)), list
    if system == "openvino":
        import openvino as ov

        cm = ov.Core().compile_model(str(d / "ov.xml"), "CPU", OV_CONFIG)
        req = cm.create_infer_request()
        return (lambda: req.infer(arrays, share_inputs=True)), \
            (lambda out: [out[o] for o in cm.outputs])
    import torch

    torch.set_num_threads(THREADS)
    args = tuple(torch.from_numpy(a) for a in arrays)
    if system == "eager":
        from bench.cpu_peers_models import build

        fn = build(model).module
    elif system == "aoti":
        import torch._inductor as ind

        fn = ind.aoti_load_package(str(d / "aoti.pt2"))
    elif system in ("kiln", "kiln_autotune"):
        import kiln

        fn = kiln.load(str(d / f"{system}.kiln"), num_threads=THREADS)
    else:
        raise ValueError(f"unknown system {system!r}")

    def call():
        with torch.inference_mode():
            return fn(*args)
    return call, _flat_np


def w_time(model: str, system: str, d: Path, warmup: int, min_calls: int, max_calls: int,
           min_time: float) -> dict:
    """Load the artifact, warm up, time calls; check the last output against eager."""
    import numpy as np

    arrays = _load_arrays(d / "inputs.npz")
    want = _load_arrays(d / "expected.npz")
    meta = json.loads((d / "prepare.json").read_text())
    t = time.perf_counter()
    call, as_np = _runner(model, system, d, arrays)
    load_s = time.perf_counter() - t
    out = None
    for _ in range(warmup):
        out = call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_calls and (len(times) < min_calls
                                      or time.perf_counter() - start < min_time):
        t = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t)
    got = [np.asarray(g) for g in as_np(out)]
    err, scale = math.inf, 0.0
    if len(got) == len(want) and all(g.shape == w.shape for g, w in zip(got, want)):
        err = max((float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
                   for g, w in zip(got, want) if w.size), default=0.0)
        scale = max((float(np.max(np.abs(w))) for w in want if w.size), default=0.0)
    return {"latency_s": statistics.median(times), "min_s": min(times), "calls": len(times),
            "load_s": load_s, "max_abs_err": err,
            "matches": bool(err <= meta["atol"] + meta["rtol"] * scale),
            "peak_rss_bytes": _peak_rss(), "load1": os.getloadavg()[0]}


def worker_main(a: argparse.Namespace) -> None:
    """One subprocess: runs one step and writes its result (or error) as JSON to --worker-out."""
    d = Path(a.dir)
    try:
        if a.worker == "prepare":
            res = w_prepare(a.model, d)
            (d / "prepare.json").write_text(json.dumps(res))
        elif a.worker == "compile":
            res = w_compile(a.model, a.system, d)
        else:
            res = w_time(a.model, a.system, d, a.warmup, a.min_calls, a.max_calls, a.min_time)
        res["step_rss_bytes"] = _peak_rss()  # this step's process (compile: the compiler)
    except BaseException as e:  # reported in the table cell
        lines = str(e).strip().splitlines()
        res = {"error": f"{type(e).__name__}: {lines[0] if lines else ''}",
               "traceback": traceback.format_exc()}
    Path(a.worker_out).write_text(json.dumps(res, default=str))


# ================================================================================ driver

class Driver:
    """Starts the worker processes (pinned with taskset when asked), with timeouts."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.prefix = ["taskset", "-c", a.taskset] if a.taskset else []
        # compiles may take more CPUs than the timing (AOTInductor's C++ builds on 2 pinned
        # cores take minutes per model); kiln's max_autotune still times its candidates with
        # the package's 2 threads
        cpus = getattr(a, "compile_taskset", None)
        self.compile_prefix = ["taskset", "-c", cpus] if cpus else self.prefix

    def env(self, d: Path, system: str | None) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS),
                   OPENBLAS_NUM_THREADS=str(THREADS), TRANSFORMERS_VERBOSITY="error",
                   TORCHINDUCTOR_CACHE_DIR=str(d / "inductor-cache"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        if system in ("kiln", "kiln_autotune"):  # cold kernel/autotuning caches per system
            env["KILN_CACHE_DIR"] = str(d / f"kiln-cache-{system}")
        return env

    def run(self, step: str, model: str, system: str | None, d: Path, timeout: float) -> dict:
        out = d / f"{step}-{system}-{time.monotonic_ns()}.json"
        prefix = self.compile_prefix if step in ("prepare", "compile") else self.prefix
        cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), "--worker", step,
               "--model", model, "--dir", str(d), "--worker-out", str(out)]
        if system:
            cmd += ["--system", system]
        if step == "time":
            cmd += ["--warmup", str(self.a.warmup), "--min-calls", str(self.a.min_calls),
                    "--max-calls", str(self.a.max_calls), "--min-time", str(self.a.min_time)]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env=self.env(d, system), check=False)
            if out.exists() and out.stat().st_size:
                res = json.loads(out.read_text())
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
                res = {"error": f"worker exited {proc.returncode}: {tail[0]}"}
        except subprocess.TimeoutExpired:
            res = {"error": f"{step} timed out after {timeout:.0f} s"}
        res["wall_s"] = time.perf_counter() - t
        return res

    def c_peak_rss(self, d: Path, exe: Path | None, shapes: list[list[int]],
                   window: float) -> dict:
        """Peak RSS (the child's ru_maxrss from wait4) of bench/per_call.c running kiln's
        package: stopped after `window` seconds (enough for the load and a few calls; its
        200 warm-up calls take long on large models) unless it finished before."""
        if exe is None:
            return {"error": "no C compiler / per_call build"}
        args = [str(exe), str(d / "kiln.kiln"), str(THREADS), "1", "1",
                *("x".join(map(str, s)) for s in shapes)]
        proc = subprocess.Popen([*self.prefix, *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=self.env(d, "kiln"))
        deadline = time.monotonic() + window
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if proc.returncode not in (0, -9):
            return {"error": f"per_call exited {proc.returncode}"}
        return {"c_peak_rss_bytes": ru.ru_maxrss * 1024,
                "c_exit": "stopped after window" if proc.returncode else 0}


def _build_per_call(work: Path) -> Path | None:
    """bench/per_call.c built against this checkout's libkiln (as bench/per_call.py does)."""
    try:
        code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
                "from bench.per_call import _build_c; print(_build_c(Path(sys.argv[2])))")
        out = subprocess.run([sys.executable, "-c", code, str(ROOT), str(work)],
                             capture_output=True, text=True, check=True, timeout=600)
        exe = Path(out.stdout.strip().splitlines()[-1])
        return exe if exe.exists() else None
    except (subprocess.SubprocessError, OSError, IndexError):
        return None


def _seed_kiln_runtime(d: Path) -> None:
    """Copy the already-built libkiln into the per-system cold caches (a one-time install
    cost, not a per-model compile cost)."""
    root = os.environ.get("KILN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln")
    src = Path(root) / "runtime"
    if src.is_dir():
        for s in ("kiln", "kiln_autotune"):
            shutil.copytree(src, d / f"kiln-cache-{s}" / "runtime", dirs_exist_ok=True)


def _importable(system: str) -> str | None:
    mod = {"ort": "onnxruntime", "openvino": "openvino"}.get(system)
    if mod is None:
        return None
    if importlib.util.find_spec(mod) is None:
        return f"{mod} not installed (pip install kiln[bench])"
    if system == "ort" and importlib.util.find_spec("onnxscript") is None:
        return "onnxscript not installed (pip install kiln[bench])"
    return None


def bench_model(drv: Driver, model: str, systems: list[str], exe: Path | None,
                log: Callable[[str], None]) -> dict:
    """Prepare, compile every system, time them in interleaved rounds; one model's results."""
    a = drv.a
    d = Path(tempfile.mkdtemp(prefix=f"kiln-peers-{model}-"))
    row: dict[str, Any] = {"model": model, "systems": {}, "loads": []}
    try:
        prep = drv.run("prepare", model, None, d, a.timeout)
        row["prepare"] = prep
        if "error" in prep:
            log(f"{model}: prepare failed: {prep['error']}")
            for s in systems:
                row["systems"][s] = {"error": f"prepare: {prep['error']}"}
            return row
        row["note"] = prep.get("note", "")
        _seed_kiln_runtime(d)
        alive = []
        for s in systems:  # ort before openvino: OpenVINO reads the ONNX file ORT used
            missing = _importable(s)
            if missing:
                row["systems"][s] = {"error": missing}
                continue
            if s == "eager":
                row["systems"][s] = {}
                alive.append(s)
                continue
            r = drv.run("compile", model, s, d, a.compile_timeout)
            row["systems"][s] = r
            log(f"{model:20s} {s:14s} compile "
                + (r["error"] if "error" in r else f"{r['compile_s']:.1f} s"))
            if "error" not in r:
                alive.append(s)
        rounds: dict[str, list[dict]] = {s: [] for s in alive}
        for k in range(a.rounds):
            row["loads"].append(os.getloadavg()[0])
            order = alive[k % len(alive):] + alive[:k % len(alive)] if alive else []
            for s in order:
                r = drv.run("time", model, s, d, a.timeout)
                rounds[s].append(r)
                log(f"{model:20s} {s:14s} round {k + 1}/{a.rounds} "
                    + (r["error"] if "error" in r else
                       f"{r['latency_s'] * 1e3:.3f} ms ({r['calls']} calls)"
                       + ("" if r["matches"] else f" MISMATCH err {r['max_abs_err']:.2e}")))
        for s, rs in rounds.items():
            row["systems"][s].update(_aggregate(rs))
        kl = row["systems"].get("kiln", {})
        if "latency_s" in kl:
            if prep.get("float_inputs"):
                window = max(4.0, 6 * kl["latency_s"] + 2 * kl.get("load_s", 1.0))
                kl.update(drv.c_peak_rss(d, exe, prep["input_shapes"], window))
            else:
                kl["c_rss_note"] = "n/a (integer inputs; per_call.c feeds float32)"
        row["loads"].append(os.getloadavg()[0])
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
        else:
            row["dir"] = str(d)
    return row


def _aggregate(rs: list[dict]) -> dict:
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return {"error": rs[0]["error"] if rs else "not timed"}
    lat = [r["latency_s"] for r in ok]
    return {"latency_s": statistics.median(lat), "round_latencies_s": lat,
            "min_s": min(r["min_s"] for r in ok), "calls": sum(r["calls"] for r in ok),
            "load_s": statistics.median(r["load_s"] for r in ok),
            "max_abs_err": max(r["max_abs_err"] for r in ok),
            "matches": all(r["matches"] for r in ok),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
            "failed_rounds": len(rs) - len(ok)}


# ================================================================================ report

def machine_info(taskset: str | None) -> dict[str, Any]:
    cpu = cpu_name()
    vers = {}
    for mod in ("torch", "onnxruntime", "openvino", "transformers"):
        try:  # the installed distributions' versions, without importing them here
            vers[mod] = importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            vers[mod] = "-"
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(),
            "python": platform.python_version(), "threads": THREADS, "taskset": taskset,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            **vers}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        l1, l5, l15 = os.getloadavg()
        return f"load average: {l1:.2f}, {l5:.2f}, {l15:.2f}"


def _ok(r: dict | None) -> float | None:
    """The latency of a result that ran and matched eager, else None."""
    if r and "latency_s" in r and r.get("matches"):
        return r["latency_s"]
    return None


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.2f}" if s < 1 else f"{s * 1e3:.0f}"


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        msg = str(r["error"]).replace("|", "/").replace("\n", " ")
        return f"error: {msg[:60]}{'...' if len(msg) > 60 else ''}"
    if "latency_s" not in r:
        return "-"
    cell = _ms(r["latency_s"])
    rounds = r.get("round_latencies_s") or []
    if len(rounds) > 1:  # the spread of the rounds' medians: how noisy the machine was
        cell += f" ({_ms(min(rounds))}-{_ms(max(rounds))})"
    if not r.get("matches", True):
        cell += f" **MISMATCH** ({r.get('max_abs_err', float('nan')):.1e})"
    return cell


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def ratios(rows: list[dict]) -> dict[str, Any]:
    """Per-model kiln/best peer, kiln/AOTI, autotune/default and their geomeans."""
    per: dict[str, dict[str, float | None]] = {}
    for row in rows:
        s = row["systems"]
        kl, at = _ok(s.get("kiln")), _ok(s.get("kiln_autotune"))
        peers = [x for x in (_ok(s.get(p)) for p in PEERS) if x is not None]
        best = min(peers) if peers else None
        ao = _ok(s.get("aoti"))
        per[row["model"]] = {
            "kiln/best_peer": kl / best if kl and best else None,
            "kiln/aoti": kl / ao if kl and ao else None,
            "autotune/default": at / kl if kl and at else None,
            "autotune/best_peer": at / best if at and best else None}
    geo = {k: _geomean([v[k] for v in per.values() if v[k]])
           for k in ("kiln/best_peer", "kiln/aoti", "autotune/default", "autotune/best_peer")}
    return {"per_model": per, "geomean": geo}


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def markdown(rows: list[dict], systems: list[str], info: dict, command: str,
             load_start: str, load_end: str, loads: list[float]) -> str:
    rat = ratios(rows)
    lines = [f"Measured {info['date']} on {info['cpu']} ({info['cores']} cores"
             + (f", each process pinned to CPUs {info['taskset']}" if info.get("taskset") else "")
             + (f" (export and compiles on CPUs {info['compile_taskset']})"
                if info.get("compile_taskset") else "")
             + f"), {info['threads']} threads per system, torch {info.get('torch')}, "
             f"onnxruntime {info.get('onnxruntime')}, OpenVINO {info.get('openvino')}, "
             f"transformers {info.get('transformers')}, Python {info['python']}.", "",
             f"Command: `{command}`", "",
             f"Load: start `{load_start}`; end `{load_end}`"
             + (f"; 1-min load sampled each round: min {min(loads):.2f}, median "
                f"{statistics.median(loads):.2f}, max {max(loads):.2f}" if loads else "") + ".",
             "", "Median latency in ms over the rounds (lower is better), in brackets the "
             "lowest and highest round; ratios below 1 mean kiln is faster. Best peer: the "
             "faster of ORT and OpenVINO (results that matched eager only).", "",
             "| model | " + " | ".join(LABELS[s] for s in systems)
             + " | kiln / best peer | kiln / AOTI | max_autotune / default |",
             "| --- | " + " | ".join("---" for _ in systems) + " | --- | --- | --- |"]
    for row in rows:
        r = rat["per_model"][row["model"]]
        lines.append(f"| {row['model']} | "
                     + " | ".join(_cell(row["systems"].get(s)) for s in systems)
                     + f" | {_x(r['kiln/best_peer'])} | {_x(r['kiln/aoti'])} "
                     f"| {_x(r['autotune/default'])} |")
    g = rat["geomean"]
    lines += ["", f"Geomean: kiln / best peer {_x(g['kiln/best_peer'])} (target <= 0.91x, i.e. "
              f">= 1.1x faster), kiln / AOTInductor {_x(g['kiln/aoti'])} (target <= 0.5x), "
              f"max_autotune / default {_x(g['autotune/default'])} (target <= 1.00x; "
              f"max_autotune / best peer {_x(g['autotune/best_peer'])}).", ""]
    slower = [m for m, r in rat["per_model"].items()
              if r["kiln/best_peer"] and r["kiln/best_peer"] > 1.0]
    if slower:
        lines += [f"kiln slower than the best peer on: {', '.join(slower)}.", ""]
    # compile times and memory
    comp = [s for s in systems if s != "eager"]
    lines += ["Compile / convert time in s (from the ExportedProgram, cold caches; ORT: ONNX "
              "export + session; OpenVINO: convert + compile_model) and peak RSS in MiB of the "
              "timing process (ORT and OpenVINO processes do not import torch; kiln C: "
              "bench/per_call.c running the package, no Python).", "",
              "| model | " + " | ".join(f"{LABELS[s]} compile" for s in comp) + " | "
              + " | ".join(f"{LABELS[s]} RSS" for s in systems) + " | kiln C RSS |",
              "| --- | " + " | ".join("---" for _ in comp) + " | "
              + " | ".join("---" for _ in systems) + " | --- |"]
    for row in rows:
        s = row["systems"]
        cc = [f"{s[x]['compile_s']:.1f}" if "compile_s" in s.get(x, {}) else "-" for x in comp]
        rss = [f"{s[x]['peak_rss_bytes'] / 2**20:.0f}" if "peak_rss_bytes" in s.get(x, {})
               else "-" for x in systems]
        kl = s.get("kiln", {})
        crss = (f"{kl['c_peak_rss_bytes'] / 2**20:.0f}" if kl.get("c_peak_rss_bytes")
                else "n/a" if kl.get("c_rss_note") else "-")
        lines.append(f"| {row['model']} | " + " | ".join(cc) + " | " + " | ".join(rss)
                     + f" | {crss} |")
    notes = [f"`{row['model']}`: {row['note']}" for row in rows if row.get("note")]
    if notes:
        lines += ["", "Models: " + "; ".join(notes) + "."]
    return "\n".join(lines) + "\n"


# ================================================================================== main

def main(argv: list[str] | None = None) -> int:
    global THREADS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help="comma-separated (default: all); see cpu_peers_models.py")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--rounds", "--repeat", type=int,
                   help="interleaved timing rounds, a fresh process per system each (5)")
    p.add_argument("--min-time", type=float, help="timed seconds per round (1.0)")
    p.add_argument("--min-calls", type=int, help="timed calls per round at least (5)")
    p.add_argument("--max-calls", type=int, default=20000)
    p.add_argument("--warmup", type=int, help="untimed calls first (3)")
    p.add_argument("--timeout", type=float, default=600, help="s per prepare/timing process")
    p.add_argument("--compile-timeout", type=float, default=1800, help="s per compile")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 rounds of 0.2 s / 3 calls, 1 warm-up (explicit options win)")
    p.add_argument("--taskset", metavar="CPUS", help="pin every process (taskset -c CPUS)")
    p.add_argument("--compile-taskset", metavar="CPUS",
                   help="pin the export and compile processes to these CPUs instead")
    p.add_argument("--threads", type=int, help=f"threads per system ({THREADS})")
    p.add_argument("--keep", action="store_true", help="keep the work directories")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--from-json", metavar="PATH",
                   help="measure nothing: render the tables of an earlier --json file")
    p.add_argument("--markdown", metavar="PATH",
                   help=f"rewrite the section between {BEGIN} and {END} of this file")
    for hidden in ("--worker", "--worker-out", "--model", "--system", "--dir"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.threads:  # read by every worker process at import (KILN_BENCH_THREADS)
        THREADS = a.threads
        os.environ["KILN_BENCH_THREADS"] = str(a.threads)
    if a.worker:
        worker_main(a)
        return 0
    quick = {"rounds": 2, "min_time": 0.2, "min_calls": 3, "warmup": 1}
    full = {"rounds": 5, "min_time": 1.0, "min_calls": 5, "warmup": 3}
    for k, v in (quick if a.quick else full).items():  # explicit options win over --quick
        if getattr(a, k) is None:
            setattr(a, k, v)

    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        rows = saved["rows"]
        systems = [s for s in SYSTEMS if any(s in r["systems"] for r in rows)]
        loads = [x for r in rows for x in r.get("loads", [])]
        a.json = None
        print(_write(a, rows, systems, saved["machine"], saved.get("command", "?"),
                     saved["load_start"], saved["load_end"], loads))
        return 0
    names = _model_names()
    models = a.models.split(",") if a.models else names
    systems = [s for s in SYSTEMS if s in a.systems.split(",")]  # canonical order
    bad = [m for m in models if m not in names] + \
        [s for s in a.systems.split(",") if s not in SYSTEMS]
    if bad:
        p.error(f"unknown model or system: {', '.join(bad)} (models: {', '.join(names)}; "
                f"systems: {', '.join(SYSTEMS)})")
    if a.taskset and shutil.which("taskset") is None:
        p.error("--taskset needs the taskset tool (util-linux)")
    command = "python bench/cpu_peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    log = lambda msg: print(f"[cpu-peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    load_start = _uptime()
    log(load_start)
    info = machine_info(a.taskset)
    info["compile_taskset"] = a.compile_taskset
    drv = Driver(a)
    work = Path(tempfile.mkdtemp(prefix="kiln-peers-c-"))
    exe = _build_per_call(work) if "kiln" in systems else None
    rows: list[dict] = []
    loads: list[float] = []
    try:
        for m in models:
            rows.append(bench_model(drv, m, systems, exe, log))
            loads += rows[-1]["loads"]
            _write(a, rows, systems, info, command.strip(), load_start, _uptime(), loads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_end = _uptime()
    log(load_end)
    md = _write(a, rows, systems, info, command.strip(), load_start, load_end, loads)
    print()
    print(md)
    return 0


def _model_names() -> list[str]:
    """The model names, read without importing torch (the driver stays light)."""
    import ast

    src = (ROOT / "bench" / "cpu_peers_models.py").read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "MODELS":
            return [k.value for k in node.value.keys]
    raise RuntimeError("no MODELS in bench/cpu_peers_models.py")


def _write(a, rows, systems, info, command, load_start, load_end, loads) -> str:
    md = markdown(rows, systems, info, command, load_start, load_end, loads)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": info, "command": command,
                                            "load_start": load_start,
                                            "load_end": load_end, "rows": rows,
                                            "ratios": ratios(rows)}, indent=1, default=str))
    if a.markdown:
        splice(Path(a.markdown), BEGIN, END, md, heading="## CPU: kiln against ONNX Runtime, "
               "OpenVINO, AOTInductor and eager (issue 14)")
    return md


if __name__ == "__main__":
    sys.exit(main())
