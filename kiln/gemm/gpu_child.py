"""The CUDA profiling child (`python -m kiln.gemm.gpu_child SPEC`): runs a GEMM's candidates
(kiln/gemm/gpu.py `Candidate`s, as `gpu.profile` hands them over in the JSON spec) on the local
GPU and prints one `KILN_PROFILE <name> <seconds> <max error> <tolerance>` line each.

Every candidate runs captured in a CUDA graph (as packages run), timed by Triton's do_bench at
the example sizes, and is checked against a float32 torch.matmul of the same operands:
- cuBLAS through torch.matmul; cuBLASLt algorithms through the helper library's `kiln_lt_run`
  (kiln/gemm/blaslt.py); an index beyond what the heuristic offers fails;
- the template's kernels as the package prints them (the pickled `printed.Printed` named in
  the spec, run and checked by `printed.Bench`), and the GEMM's epilogue alone as its own
  kernel (its time printed under `printed.EPILOGUE`);
- CUTLASS kernels through their `kiln_cutlass_run` entry; one fusing a visitor tree with
  random operands of the tree, checked against the tree evaluated by torch.
A candidate that raises prints a negative time (dropped); one that crashes the process takes
the candidates after it along, and the parent runs those in a fresh child."""

from __future__ import annotations

import ctypes
import json
import sys

import torch

from kiln.gemm import blaslt
from kiln.gemm.configs import BlasLtConfig
from kiln.gemm.cutlass_evt import evaluate_torch
from kiln.gemm.gpu import Candidate
from kiln.gemm.printed import EPILOGUE, Bench, read
from kiln.ir import dtypes
from kiln.options import GemmBackend


def main(spec: dict) -> None:
    """Runs every candidate of `spec` (`gpu.profile`'s) and prints its line."""
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
            sec = do_bench(graphed(bench.epilogue), warmup=5, rep=20) * 1e-3
            print(f"KILN_PROFILE {EPILOGUE} {sec:.9g} 0 1", flush=True)
    ws = None  # cuBLASLt candidates share a workspace of a package's size (kc::kWorkspaceBytes)
    for cand in map(Candidate.from_json, spec["cands"]):
        name, backend, cfg = cand.name, cand.backend, cand.config
        try:
            algos = None
            if isinstance(cfg, BlasLtConfig):
                if ws is None:
                    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
                run, algos = blaslt.runner(cand.so, cfg.algo, spec["dtype"], a, b, c, ws)
            elif backend is GemmBackend.BLAS:
                def run():
                    torch.matmul(a, b, out=c)
            elif backend is GemmBackend.TRITON:
                if bench is None:
                    raise RuntimeError("no printed kernels were given for the template")
                run, err, tol_t = bench.runner(name), bench.check(name), bench.tolerance()
            elif cand.evt_tree is not None:  # a CUTLASS kernel with its epilogue fused
                run, check = fused_cutlass(cand.so, cand.evt_tree, a, b, want, spec, nb, m, n,
                                           k)
            else:
                run = _cutlass_runner(cand.so, a, b, c, spec)
            if backend is GemmBackend.TRITON:
                pass  # checked by the printed-kernel bench
            elif cand.evt_tree is not None:
                run()
                torch.cuda.synchronize()
                err = check()
            else:
                c.zero_()
                run()
                torch.cuda.synchronize()
                err = float((c.float() - want).abs().max())
                if algos is not None and cfg.algo >= algos():  # would run result 0 again
                    raise RuntimeError(f"the cuBLASLt heuristic offers {algos()} algorithms")
            sec = do_bench(graphed(run), warmup=5, rep=20) * 1e-3
        except Exception as e:  # this candidate fails; the others still run
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            sec, err = -1.0, 0.0
        limit = tol_t if backend is GemmBackend.TRITON and sec >= 0 else tol
        print(f"KILN_PROFILE {name} {sec:.9g} {err:.6g} {limit:.6g}", flush=True)


def fused_cutlass(so: str, tree: dict, a, b, want, spec, nb, m, n, k, operands=None):
    """(run, check) for the CUTLASS kernel of shared library `so` fusing visitor tree `tree`
    (`cutlass_evt.Evt.to_json()`): `operands`, else random ones, of the tree's roles (C:
    [B, M, N], col: [N], row: [M], scalar: [1]); check returns the largest error against the
    tree evaluated by torch on the float32 product `want`."""
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = {"src": (max(nb, 1), m, n), "col": (n,), "row": (m,), "scalar": (1,)}
    ops = list(operands) if operands is not None else [
        torch.randn(*shape[role], device="cuda", dtype=dtypes.dtype(d).torch, generator=g)
        for role, d in tree["operands"]]
    out = torch.empty(max(nb, 1), m, n, device="cuda", dtype=dtypes.dtype(tree["out"]).torch)
    src = next((t for (role, _), t in zip(tree["operands"], ops) if role == "src"), None)
    ext = [t for (role, _), t in zip(tree["operands"], ops) if role != "src"]
    ref = evaluate_torch(tree, want, ops, m, n).float()
    run = _cutlass_runner(so, a, b, out, spec, src, ext)

    def check():
        return float((out.float() - ref).abs().max())
    return run, check


def _cutlass_runner(so: str, a, b, out, spec: dict, src=None, ext=None):
    """run() calling the `kiln_cutlass_run` entry of CUTLASS shared library `so` (kiln/gemm/
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


def graphed(run):
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
    main(json.loads(sys.argv[1]))
