"""CUDA GEMM candidates: cuBLAS ("blas": cuBLAS's own algorithm, and "blaslt_<i>", the
cuBLASLt heuristic's i-th algorithm, config {"algo": i}; kiln/gemm/blaslt.py), the Triton
template ("triton") and CUTLASS sm_90 kernels ("cutlass"); which apply to a problem, the
heuristic used without measurements, and profiling on the local GPU.

Applicability: the Triton template takes float16 / bfloat16 / float32 (fp32 with IEEE
products, as eager); CUTLASS takes float16 / bfloat16 with at most one batch dim, needs
`cutlass_library` and nvcc at compile time, and kernels from `cutlass.enumerate_candidates`.

Heuristic (no profiling, no cache entry): cuBLAS when allowed (the strongest single backend
over bench/gemm_gpu.py's sweep); else the Triton template with the first config of its space
trimmed to the example sizes (the largest tile that fits); else the first CUTLASS kernel. So
restricting `gemm_backends` to one backend always yields that backend, also on a machine
without a GPU.

Profiling (`Options.max_autotune` and a local GPU of the target architecture): the candidates
run in child processes (`python -m kiln.gemm.gpu`), one process for all candidates of a
GEMM; a candidate that crashes its process is dropped with the reason and the others run in a
fresh one. The child times each candidate (captured in a CUDA graph, as packages run) with
CUDA events at the example sizes and checks it against a float32 torch.matmul of the same
operands (profile.py's protocol, one `KILN_PROFILE <name> <seconds> <max error> <tolerance>`
line per candidate). Every candidate is timed on the same work, the GEMM and the epilogue
it absorbs in a package (gemm/fuse.py):
- the template's candidates are the kernels the package would contain (kiln/autotune/
  printed.py), epilogue, batch loop and int8 operands included, checked against the product
  followed by the epilogue;
- CUTLASS candidates fuse the epilogue when it maps to a visitor tree (kiln/autotune/
  cutlass_evt.py): they run with random operands of the tree and are checked against the tree
  evaluated by torch (`evaluate_torch`);
- cuBLASLt candidates run through the helper library's `kiln_lt_run` (the package's
  `kc::lt_blas_gemm`); one whose index is beyond what the heuristic offers is dropped;
- cuBLAS and plain CUTLASS kernels leave the epilogue to its own kernel in a package: the
  child times that kernel alone and the parent adds its time to theirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kiln.gemm import blaslt
from kiln.gemm import triton_gemm as T
from kiln.gemm.printed import EPILOGUE
from kiln.gemm.problem import GemmProblem
from kiln.ir import dtypes
from kiln.gemm import cutlass
from kiln.gemm.cutlass_evt import evaluate_torch
from kiln.gemm.printed import Bench, read
import ctypes
import torch

TRITON_DTYPES = ("float16", "bfloat16", "float32")


def device_id(arch: int) -> str:
    """The cache's device key: the architecture, so a choice measured on a GPU is reused by a
    compile for that architecture on a machine without one."""
    return f"cuda:sm_{arch}"


def _cutlass_ok(problem: GemmProblem, opts) -> bool:
    if problem.dtype not in ("float16", "bfloat16") or len(problem.batch) > 1:
        return False
    if not cutlass.available():
        return False
    try:
        cutlass.nvcc()
    except Exception:  # no nvcc here: CUTLASS kernels cannot be built for the package
        return False
    return True


def eligible(problem: GemmProblem, allowed, opts) -> list[str]:
    if problem.mixed:  # int8 x float: the Triton template converts tiles as it loads them
        return [b for b in allowed if b == "triton" and problem.dtype in TRITON_DTYPES]
    out = []
    for b in allowed:
        if b == "blas" or (b == "triton" and problem.dtype in TRITON_DTYPES) or \
                (b == "cutlass" and _cutlass_ok(problem, opts)):
            out.append(b)
    return out


def triton_configs(sizes, tma: bool = False) -> list[T.TritonConfig]:
    """The template's configs for a problem; `tma`: its operands allow TMA loads."""
    _, m, n, k = sizes
    return T.config_space(m, n, k, tma) or [T.TritonConfig(16, 64, 256, 8, 3, 4)]


def cutlass_candidates(problem: GemmProblem, opts, evt=None) -> list:
    """CUTLASS candidates; with `evt` (a cutlass_evt.Evt) those fusing it, or the plain ones
    when no kernel with a TMA epilogue fits the problem."""
    if evt is not None:
        fused = cutlass.enumerate_candidates(problem, opts, evt=evt)
        if fused:
            return fused
    return cutlass.enumerate_candidates(problem, opts)


def cutlass_config(c) -> dict:
    """A CUTLASS candidate's config as choices and the cache record it."""
    return {"name": c.name, **({"evt": c.evt.key} if c.evt is not None else {})}


def heuristic(problem: GemmProblem, backends: list[str], sizes, opts, evt=None
              ) -> tuple[str, dict]:
    for b in backends:
        if b == "blas":
            return "blas", {}
    if "triton" in backends:
        c = triton_configs(sizes)[0]
        return "triton", _cfg_json(c)
    cands = cutlass_candidates(problem, opts, evt)
    if cands:
        return "cutlass", cutlass_config(cands[0])
    return "", {}


def _cfg_json(c: T.TritonConfig) -> dict:
    return {"name": c.name, "block_m": c.block_m, "block_n": c.block_n, "block_k": c.block_k,
            "group_m": c.group_m, "num_stages": c.num_stages, "num_warps": c.num_warps,
            **({"tma": True} if c.tma else {})}


def candidates(problem: GemmProblem, backends: list[str], sizes, opts, work: Path, evt=None,
               tma: bool = False) -> tuple[list[tuple[str, str, dict]], list]:
    """(name, backend, config) to profile, and (name, reason) of those that could not be
    built (a CUTLASS kernel nvcc rejected). With `evt`, the CUTLASS candidates fuse it (their
    config holds its key, and `profile` runs them with the tree's operands). `tma`: the
    GEMM's operands allow TMA loads, so the template's TMA configs are candidates too (the
    template's candidates are printed as the package would by select.py through
    kiln/gemm/printed.py)."""
    out, dropped = [], []
    if "blas" in backends:
        out.append(("blas", "blas", {}))
        lt = blaslt.candidates(problem.dtype)  # cuBLASLt's heuristic results, timed as linked
        if lt:
            try:
                so = str(blaslt.build_helper(opts))
                out += [(name, "blas", {**cfg, "so": so}) for name, cfg in lt]
            except Exception as e:  # noqa: BLE001 - no helper: cuBLAS's own choice only
                dropped += [(name, f"helper library: {str(e)[-200:]}") for name, _ in lt]
    if "triton" in backends:
        out += [(c.name, "triton", _cfg_json(c)) for c in triton_configs(sizes, tma)]
    if "cutlass" in backends:
        cands = cutlass_candidates(problem, opts, evt)
        built = cutlass.compile_all({c.name: cutlass.render(c) for c in cands}, work,
                                    jobs=opts.jobs, shared=True)
        for c in cands:
            r = built[c.name]
            if isinstance(r, Path):
                cfg = {**cutlass_config(c), "so": str(r)}
                if c.evt is not None:
                    cfg["evt_tree"] = c.evt.to_json()
                out.append((c.name, "cutlass", cfg))
            else:
                dropped.append((c.name, r[-200:]))
    return out, dropped


def profile(problem: GemmProblem, sizes, cands, timeout_s: float, printed: Path | None = None
            ) -> tuple[list[tuple[str, str, dict, float]], list]:
    """Runs the candidates on the local GPU: (name, backend, config, seconds) of those that
    gave the right answer, and (name, reason) of those dropped. `printed`: the pickled
    `printed.Printed` of the template's candidates (required when there are any) and of the
    GEMM's epilogue, whose own kernel's time is added to the candidates that do not fuse it."""
    results, dropped = [], []
    todo = list(cands)
    epilogue_s = 0.0
    while todo:
        spec = {"dtype": problem.dtype, "sizes": list(sizes), "layout_a": problem.layout_a,
                "layout_b": problem.layout_b, "mixed": problem.mixed,
                "printed": str(printed) if printed else "",
                "cands": [[n, b, c] for n, b, c in todo]}
        try:
            proc = subprocess.run([sys.executable, "-m", "kiln.gemm.gpu", json.dumps(spec)],
                                  capture_output=True, text=True,
                                  timeout=timeout_s * len(todo))
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = "hang", -9
        seen = set()
        for line in out.splitlines():
            p = line.split()
            if len(p) == 5 and p[0] == "KILN_PROFILE":
                name, sec, e_, tol = p[1], float(p[2]), float(p[3]), float(p[4])
                if name == EPILOGUE:
                    epilogue_s = max(sec, 0.0)
                    continue
                seen.add(name)
                cand = next(c for c in todo if c[0] == name)
                if sec < 0:
                    dropped.append((name, "failed: " + err.strip()[-160:]))
                elif not e_ <= tol:
                    dropped.append((name, f"wrong answer: max error {e_:g} > tolerance {tol:g}"))
                else:
                    results.append((name, cand[1], {k: v for k, v in cand[2].items()
                                                    if k != "evt_tree"}, sec))
        rest = [c for c in todo if c[0] not in seen]
        if rest and rc == 0:
            dropped += [(c[0], "no result line") for c in rest]
            break
        if rest:  # the first one without a result crashed the process
            dropped.append((rest[0][0], f"crash (exit {rc}): {err.strip()[-200:]}"))
            rest = rest[1:]
        todo = rest
    results = [(n, b, c, s + (epilogue_s if _unfused(b, c) else 0.0))
               for n, b, c, s in results]
    return results, dropped


def _unfused(backend: str, cfg: dict) -> bool:
    """A candidate whose package leaves the GEMM's epilogue to a kernel of its own."""
    return backend == "blas" or (backend == "cutlass" and "evt" not in cfg)


def _child(spec: dict) -> None:

    # deferred: Triton is optional (GPU builds only)
    from triton.testing import do_bench
    dt = getattr(torch, spec["dtype"])
    nb, m, n, k = spec["sizes"]
    g = torch.Generator(device="cuda").manual_seed(0)
    mixed = spec.get("mixed", "").split(":") if spec.get("mixed") else ["", "", ""]
    quant, scaled = mixed[0], mixed[-1] == "scaled"

    def operand(rows, cols, side):
        if side == quant:  # int8 / uint8 integers (mixed-dtype GEMM)
            qt = getattr(torch, mixed[1])
            info = torch.iinfo(qt)
            x = torch.randint(info.min, info.max + 1, (max(nb, 1), rows, cols), device="cuda",
                              dtype=qt, generator=g)
        else:
            x = torch.randn(max(nb, 1), rows, cols, device="cuda", dtype=dt, generator=g)
        if spec[f"layout_{side}"] == "t":
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x
    a, b = operand(m, k, "a"), operand(k, n, "b")
    # a per-column scale of the size that keeps results of order 1
    scale = (torch.rand(n, device="cuda", generator=g) / 64).to(dt) if scaled else None
    want = torch.matmul(a.float(), b.float())
    if scale is not None:
        want = want * scale.float()
    tol = (2e-2 if dt != torch.float32 else 1e-4) * max(1.0, k ** 0.5) * \
        max(1.0, float(want.abs().max()) ** 0.5)
    c = torch.empty(max(nb, 1), m, n, device="cuda", dtype=dt)
    bench = None
    if spec.get("printed"):
        bench = Bench(read(spec["printed"]))
        if bench.p.epilogue_kernel is not None:  # what an unfused candidate adds
            sec = do_bench(_graphed(bench.epilogue), warmup=5, rep=20) * 1e-3
            print(f"KILN_PROFILE {EPILOGUE} {sec:.9g} 0 1", flush=True)
    ws = None  # cuBLASLt candidates share a workspace of a package's size (kc::kWorkspaceBytes)
    for name, backend, cfg in spec["cands"]:
        try:
            algos = None
            if backend == "blas" and "algo" in cfg:
                if ws is None:
                    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
                run, algos = blaslt.runner(cfg["so"], cfg["algo"], spec["dtype"], a, b, c, ws)
            elif backend == "blas":
                def run():
                    torch.matmul(a, b, out=c)
            elif backend == "triton":
                if bench is None:
                    raise RuntimeError("no printed kernels were given for the template")
                run, err, tol_t = bench.runner(name), bench.check(name), bench.tolerance()
            elif "evt_tree" in cfg:  # a CUTLASS kernel with its epilogue fused
                run, check = _fused_cutlass(cfg, a, b, want, spec, nb, m, n, k)
            else:
                run = _cutlass_runner(cfg["so"], a, b, c, spec)
            if backend == "triton":
                pass  # checked by the printed-kernel bench
            elif "evt_tree" in cfg:
                run()
                torch.cuda.synchronize()
                err = check()
            else:
                c.zero_()
                run()
                torch.cuda.synchronize()
                err = float((c.float() - want).abs().max())
                if algos is not None and cfg["algo"] >= algos():  # would run result 0 again
                    raise RuntimeError(f"the cuBLASLt heuristic offers {algos()} algorithms")
            sec = do_bench(_graphed(run), warmup=5, rep=20) * 1e-3
        except Exception as e:  # this candidate fails; the others still run
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            sec, err = -1.0, 0.0
        limit = tol_t if backend == "triton" and sec >= 0 else tol
        print(f"KILN_PROFILE {name} {sec:.9g} {err:.6g} {limit:.6g}", flush=True)


def _fused_cutlass(cfg, a, b, want, spec, nb, m, n, k, operands=None):
    """(run, check) for a CUTLASS kernel fusing visitor tree `cfg["evt_tree"]`: `operands`,
    else random ones, of the tree's roles (C: [B, M, N], col: [N], row: [M], scalar: [1]);
    check returns the largest error against the tree evaluated by torch on the float32
    product `want`."""

    tree = cfg["evt_tree"]
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = {"src": (max(nb, 1), m, n), "col": (n,), "row": (m,), "scalar": (1,)}
    ops = list(operands) if operands is not None else [
        torch.randn(*shape[role], device="cuda", dtype=dtypes.dtype(d).torch, generator=g)
        for role, d in tree["operands"]]
    out = torch.empty(max(nb, 1), m, n, device="cuda", dtype=dtypes.dtype(tree["out"]).torch)
    src = next((t for (role, _), t in zip(tree["operands"], ops) if role == "src"), None)
    ext = [t for (role, _), t in zip(tree["operands"], ops) if role != "src"]
    ref = evaluate_torch(tree, want, ops, m, n).float()
    run = _cutlass_runner(cfg["so"], a, b, out, spec, src, ext)

    def check():
        return float((out.float() - ref).abs().max())
    return run, check


def _cutlass_runner(so: str, a, b, out, spec: dict, src=None, ext=None):
    """run() calling the `kiln_cutlass_run` entry of CUTLASS shared library `so` (kiln/autotune/
    cutlass.py) on the current stream: out[B] = A[B] @ B[B] (3-D tensors, the problem's
    layouts in `spec`), with C = `src` and the visitor tree's other operands `ext` (tensors)
    for a kernel fusing its epilogue; its workspace sized by the library. run() holds every
    tensor whose address it passes."""

    nb, m, k = a.shape
    n = b.shape[2]
    lib = ctypes.CDLL(so)
    f = lib.kiln_cutlass_run
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 \
        + [ctypes.c_void_p] * (4 if ext is None else 5)
    w = lib.kiln_cutlass_workspace
    w.restype = ctypes.c_size_t
    w.argtypes = [ctypes.c_int64] * 4
    ws = torch.empty(max(1, w(m, n, k, nb)), dtype=torch.uint8, device="cuda")
    lda = a.stride(1) if spec["layout_a"] == "n" else a.stride(2)
    ldb = b.stride(1) if spec["layout_b"] == "n" else b.stride(2)
    ptrs = None if ext is None else \
        (ctypes.c_void_p * max(1, len(ext)))(*[t.data_ptr() for t in ext])

    def run():
        tail = [] if ext is None else [ctypes.addressof(ptrs)]
        rc = f(m, n, k, nb, a.data_ptr(), lda, a.stride(0), b.data_ptr(), ldb, b.stride(0),
               src.data_ptr() if src is not None else None, out.data_ptr(), *tail,
               ws.data_ptr(), torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"kiln_cutlass_run returned {rc}")
    return run


def _graphed(run):
    """`run` captured in a CUDA graph (as packages run by default), so per-launch host cost,
    e.g. the template's one launch per batch entry here, does not decide the choice; `run`
    itself when capture fails."""
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        return g.replay
    except Exception:  # not capturable: time the plain launches
        torch.cuda.synchronize()
        return run


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
