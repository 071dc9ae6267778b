"""GEMM on the GPU: TFLOP/s of kiln's candidates - cuBLAS (torch.mm), the cuBLASLt
heuristic's algorithms (kiln/gemm/blaslt.py: the best index, through the helper library
that max_autotune times them with), the Triton template (every config of its space,
kiln/gemm/triton_gemm.py, printed as a package prints it, kiln/targets/cuda/gemm_template.py,
and run as max_autotune runs it, kiln/gemm/printed.py; its TMA configs, which load A and B
through device-side tensor descriptors, in a column of their own) and CUTLASS sm_90 kernels
(kiln/gemm/cutlass.py, shared libraries built ahead of time with nvcc) - for a sweep of square
and skinny fp16/bf16 shapes, and GEMM + epilogue chains fused into the Triton template (the
epilogue kiln absorbs from the chain's own program) and into CUTLASS kernels (the epilogue as
a visitor tree, kiln/gemm/cutlass_evt.py; the first kernel of --evt-configs schedules,
compiled with nvcc into --cache) vs unfused cuBLAS + eager pointwise. Every candidate's result
is checked (a wrong one is dropped): cuBLAS, cuBLASLt and plain CUTLASS against torch.mm, the
template's kernels against the float32 product (then the epilogue) of their own random
operands, fused CUTLASS kernels against the tree's torch twin; the pick is the fastest correct
candidate; autotuning time is the wall time to compile and time all candidates of one GEMM.

    python bench/gemm_gpu.py [--cutlass-dir DIR] [--evt-configs 2] [--json out.json]
                             [--markdown out.md]
    python bench/gemm_gpu.py --prebuild   # only compile the fused CUTLASS kernels (no GPU)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import time
from pathlib import Path

import sympy
import torch

import kiln
from kiln.gemm import printed as PR
from kiln.gemm import triton_gemm as T
from kiln.gemm.fuse import epilogue_member
from kiln.gemm.gpu_child import fused_cutlass, graphed
from kiln.ir import loop as L
from kiln.ir.dtypes import dtype as kdtype
from kiln.ir.sym import evaluate
from kiln.options import Options
from kiln.targets.cuda.gemm_candidates import build as build_candidates

SQUARE = [1024, 2048, 4096, 8192]
SKINNY = [(16, 4096, 4096), (64, 4096, 4096), (128, 8192, 1024), (64, 1024, 1024),
          (4096, 64, 4096), (512, 512, 512)]
# the zoo models' GEMMs (bench/gemm.py), as fp16 on the GPU: A @ W^T
ZOO = [(64, 1024, 1024, "nt"), (64, 256, 1024, "nt")]
CHAINS = [(4096, 4096, 4096, "gelu"), (2048, 8192, 2048, "relu"), (64, 4096, 4096, "gelu"),
          (1024, 1024, 1024, "relu6")]


def do_bench(fn):
    from triton.testing import do_bench as bench
    return bench(fn)


def chain_evt(act: str, dtype: str):
    """The visitor tree of `act(A @ B + bias) + 0.5 * R` (what kiln derives from the Loop IR
    of that chain: the product rounded to the GEMM's dtype, bias a vector over N, R as C)."""
    from kiln.gemm.cutlass_evt import Evt, Node, Operand
    x = Node("compute", "add", (Node("compute", "identity", (Node("acc"),), dtype),
                                Node("col", operand=0)))
    f = Node("compute", "clamp", (x,), params=(0.0, 6.0)) if act == "relu6" else \
        Node("compute", act, (x,))
    res = Node("compute", "mul", (Node("src", operand=1), Node("const", value=0.5)))
    return Evt(Node("compute", "add", (f, res), dtype),
               (Operand("col", "bias", 0, dtype, 8), Operand("src", "r", 0, dtype)), dtype,
               dtype)


def evt_kernels(acts, dtypes, configs: int, cache: Path) -> dict:
    """(act, dtype) -> [(kernel name, .so path or nvcc's error, tree)]: CUTLASS kernels fusing
    each chain's tree, one per schedule (ping-pong, cooperative, stream-K: the first
    `configs`), compiled in parallel (cached by content)."""
    from kiln.gemm import cutlass
    from kiln.gemm.problem import GemmProblem
    todo, srcs = {}, {}
    for act in acts:
        for dt in dtypes:
            evt = chain_evt(act, dt)
            p = GemmProblem(dt, (), 4096, 4096, 4096, "n", "n", 16, evt.key)
            by_schedule: dict = {}  # the first kernel of each schedule, ping-pong first
            for c in cutlass.enumerate_candidates(p, Options(), evt=evt):
                by_schedule.setdefault(c.schedule, c)
            cands = [by_schedule[s] for s in ("ping-pong", "cooperative", "stream-K")
                     if s in by_schedule][:configs]
            todo[(act, dt)] = [(f"{c.name}_{act}_{dt}", c.name, evt) for c in cands]
            srcs.update({key: cutlass.render(c) for (key, _, _), c in zip(todo[(act, dt)],
                                                                           cands)})
    built = cutlass.compile_all(srcs, cache / "cutlass_evt", shared=True) if srcs else {}
    return {k: [(name, built[key], evt) for key, name, evt in v] for k, v in todo.items()}


def plain_gemm(m: int, n: int, k: int, layout: str, dtype: str) -> L.Gemm:
    """The Loop IR GEMM C[m, n] = A[m, k] @ B: B is [k, n] row-major for "nn", a [n, k]
    Linear weight read transposed for "nt"."""
    i = sympy.Integer
    a = L.Operand("a", i(0), (), i(k), i(1))
    b = L.Operand("b", i(0), (), i(n), i(1)) if layout == "nn" else \
        L.Operand("b", i(0), (), i(1), i(k))
    return L.Gemm("c", kdtype(dtype), (), i(m), i(n), i(k), a, b)


def chain_gemm(m: int, n: int, k: int, act: str, dtype: torch.dtype, cache: Path):
    """(GEMM, epilogue member, buffers, sizes) of the chain `act(a @ b + bias) + 0.5 * r` as
    kiln schedules it for CUDA (its program compiled with cuBLAS for sm_90; no GPU needed):
    the epilogue is the member the template absorbs in a package (kiln/gemm/fuse.py)."""
    f = {"relu": torch.relu, "gelu": torch.nn.functional.gelu,
         "relu6": lambda x: torch.clamp(x, 0, 6)}[act]

    class Chain(torch.nn.Module):
        def forward(self, a, b, bias, r):
            return f(a @ b + bias) + 0.5 * r
    args = (torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype),
            torch.randn(n, dtype=dtype), torch.randn(m, n, dtype=dtype))
    built = kiln.compile(torch.export.export(Chain(), args), device="cuda", options=Options(
        cuda_archs=(90,), gemm_backends=("blas",), cache_dir=str(cache))).built
    steps = built.steps
    i = next(j for j, st in enumerate(steps) if isinstance(st, L.Gemm))
    epi = epilogue_member(steps, i, set(built.loop.outputs))
    return steps[i], epi, L.all_buffers(built.loop), {s.name: s.example for s in
                                                      built.graph.symbols}


class Template:
    """The Triton template's configs for one GEMM (and its epilogue), printed as a package
    prints them (kiln/targets/cuda/gemm_candidates.py) and run as max_autotune's child runs
    them (kiln/gemm/printed.py `Bench`: random operands, a check against the float32 product,
    then the epilogue). `configs`: the config space (TMA configs when the GEMM allows them)."""

    def __init__(self, g: L.Gemm, epi=None, buffers=None, env=None, device="cuda"):
        env = env or {}
        m, n, k = (int(evaluate(x, env)) for x in (g.m, g.n, g.k))
        self.configs = T.config_space(m, n, k, tma=T.tma_refusal(g) is None)
        printed = build_candidates(g, epi, buffers or PR.gemm_buffers(g, env), env,
                                   {c.name: c for c in self.configs})
        self.bench = PR.Bench(printed, device)

    def time(self, name: str) -> float:
        """Milliseconds of config `name` (captured in a CUDA graph, as packages run); raises
        on a wrong answer or a config Triton cannot build for this GPU."""
        err, tol = self.bench.check(name), self.bench.tolerance()
        if not err <= tol:
            raise ValueError(f"wrong answer: max error {err:g} > tolerance {tol:g}")
        return do_bench(graphed(self.bench.runner(name)))


class Cutlass:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.name = path.name.split("_0_")[0][-30:] + "..." + path.stem.split("align8_")[-1]
        f = self.lib.kiln_cutlass_run
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 \
            + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        w = self.lib.kiln_cutlass_workspace
        w.restype = ctypes.c_size_t
        w.argtypes = [ctypes.c_int64] * 4

    def __call__(self, a, b, c):
        M, K = a.shape
        N = b.shape[1]
        ws = torch.empty(max(1, self.lib.kiln_cutlass_workspace(M, N, K, 1)), dtype=torch.uint8,
                         device=a.device)
        rc = self.lib.kiln_cutlass_run(M, N, K, 1, a.data_ptr(), a.stride(0), 0, b.data_ptr(),
                                       b.stride(0), 0, None, c.data_ptr(), ws.data_ptr(),
                                       torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"kiln_cutlass_run returned {rc}")


def _ok(got, want):
    return torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * math.sqrt(
        want.shape[-1] if want.dim() else 1))


def lt_best(lt_so, a, b, c, want, dropped):
    """(ms, "algo i") of the fastest correct cuBLASLt heuristic algorithm, or None."""
    from kiln.gemm import blaslt
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")  # a package's workspace
    a3, b3, c3 = a[None], b[None], c[None]
    dt = str(a.dtype).split(".")[-1]
    best = None
    for i in range(blaslt.ALGOS):
        try:
            run, count = blaslt.runner(lt_so, i, dt, a3, b3, c3, ws)
            c.zero_()
            run()
            torch.cuda.synchronize()
            if i >= count():  # the heuristic offers fewer: index i would rerun result 0
                break
            if not _ok(c, want):
                dropped.append((f"blaslt_{i}", "wrong answer"))
                continue
            ms = do_bench(run)
        except Exception as e:  # noqa: BLE001 - an algorithm that cannot run this problem
            dropped.append((f"blaslt_{i}", f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        if best is None or ms < best[0]:
            best = (ms, f"algo {i}")
    return best


def tune(m, n, k, layout, dtype, cutlass, lt_so=None):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).t() if layout == "nt" else \
        torch.randn(k, n, device="cuda", dtype=dtype)
    want = torch.mm(a, b)
    c = torch.empty_like(want)
    flops = 2.0 * m * n * k
    t0 = time.perf_counter()
    res = {"cublas": (do_bench(lambda: torch.mm(a, b, out=c)), "torch.mm")}
    dropped = []
    lt = lt_best(lt_so, a, b, c, want, dropped) if lt_so else None
    if lt is not None:
        res["cublaslt"] = lt
    tpl = Template(plain_gemm(m, n, k, layout, str(dtype).split(".")[-1]))
    for cfg in tpl.configs:
        col = "triton_tma" if cfg.tma else "triton"
        try:
            ms = tpl.time(cfg.name)
        except Exception as e:  # a config Triton cannot build for this GPU (shared memory, ...)
            dropped.append((cfg.name, f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        if col not in res or ms < res[col][0]:
            res[col] = (ms, cfg.name)
    if dtype == torch.float16 and layout == "nn" and m % 8 == 0 and n % 8 == 0 and k % 8 == 0:
        for cl in cutlass:
            try:
                c.zero_()
                cl(a, b, c)
                torch.cuda.synchronize()
                if not _ok(c, want):
                    dropped.append((cl.name, "wrong answer"))
                    continue
                ms = do_bench(lambda: cl(a, b, c))
            except Exception as e:
                dropped.append((cl.name, str(e)[:80]))
                continue
            if "cutlass" not in res or ms < res["cutlass"][0]:
                res["cutlass"] = (ms, cl.name)
    tune_s = time.perf_counter() - t0
    pick = min(res, key=lambda b: res[b][0])
    return {"shape": f"{m}x{n}x{k} {layout}", "dtype": str(dtype).split(".")[-1],
            "tflops": {b: flops / (v[0] * 1e-3) / 1e12 for b, v in res.items()},
            "best_config": {b: v[1] for b, v in res.items()}, "pick": pick,
            "speedup_vs_cublas": res["cublas"][0] / res[pick][0], "tune_s": tune_s,
            "cublaslt_vs_cublas": res["cublas"][0] / lt[0] if lt else None,
            "dropped": dropped}


def _cutlass_fused(a, b, bias, r, evt, so):
    """(run, max error) of a CUTLASS kernel fusing the chain (the profiling child's
    fused-candidate runner, here fed the chain's own operands: `bias` as the column vector,
    `r` as C)."""
    m, k = a.shape
    n = b.shape[1]
    want = torch.matmul(a.float(), b.float())[None]
    run, check = fused_cutlass(str(so), evt.to_json(), a[None], b[None], want,
                               {"layout_a": "n", "layout_b": "n"}, 1, m, n, k,
                               operands=[bias, r[None]])
    run()
    torch.cuda.synchronize()
    return run, check()


def chain(m, n, k, act, dtype, cache: Path, evt_kernels=()):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    r = torch.randn(m, n, device="cuda", dtype=dtype)
    f = {"relu": torch.relu, "gelu": torch.nn.functional.gelu,
         "relu6": lambda x: torch.clamp(x, 0, 6)}[act]

    def unfused():
        return f(torch.addmm(bias, a, b)) + 0.5 * r
    want = unfused()
    best, best_tma = None, None
    tpl = Template(*chain_gemm(m, n, k, act, dtype, cache / "chains"))
    for cfg in tpl.configs:
        try:
            ms = tpl.time(cfg.name)
        except Exception:  # noqa: BLE001 - a wrong answer, or a config that cannot build
            continue
        if cfg.tma:
            if best_tma is None or ms < best_tma[0]:
                best_tma = (ms, cfg.name)
        elif best is None or ms < best[0]:
            best = (ms, cfg.name)
    base = do_bench(unfused)
    cl, dropped = None, []
    for name, so, evt in evt_kernels:
        if not isinstance(so, Path):
            dropped.append((name, so[-200:]))
            continue
        try:
            run, err = _cutlass_fused(a, b, bias, r, evt, so)
            if err > 2e-2 * math.sqrt(k) * max(1.0, float(want.abs().max()) ** 0.5):
                dropped.append((name, f"wrong answer: max error {err:g}"))
                continue
            ms = do_bench(run)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run this problem
            dropped.append((name, f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        if cl is None or ms < cl[0]:
            cl = (ms, name)
    return {"chain": f"{m}x{n}x{k} +bias {act} +0.5*res", "dtype": str(dtype).split(".")[-1],
            "unfused_ms": base, "fused_ms": best[0] if best else None,
            "config": best[1] if best else None,
            "speedup": base / best[0] if best else None,
            "tma_fused_ms": best_tma[0] if best_tma else None,
            "tma_config": best_tma[1] if best_tma else None,
            "cutlass_fused_ms": cl[0] if cl else None, "cutlass_config": cl[1] if cl else None,
            "cutlass_speedup": base / cl[0] if cl else None, "cutlass_dropped": dropped}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cutlass-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--cache", default="/tmp/kiln_gemm_gpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--evt-configs", type=int, default=2,
                    help="CUTLASS kernels fusing each chain's epilogue (0: none)")
    ap.add_argument("--no-cublaslt", action="store_true",
                    help="skip the cuBLASLt heuristic's algorithms")
    ap.add_argument("--prebuild", action="store_true",
                    help="only compile the fused CUTLASS kernels into --cache (no GPU needed)")
    args = ap.parse_args(argv)
    acts = sorted({c[3] for c in CHAINS})
    names = ("float16", "bfloat16")
    evts = evt_kernels(acts, names, args.evt_configs, Path(args.cache)) \
        if args.evt_configs else {}
    if args.prebuild:
        for key, ks in evts.items():
            print(key, [(n, str(so)) for n, so, _ in ks])
        return
    lt_so = None
    if not args.no_cublaslt:
        from kiln.gemm import blaslt
        lt_so = str(blaslt.build_helper(Options(cache_dir=args.cache)))
    cutlass = [Cutlass(p) for p in sorted(Path(args.cutlass_dir).glob("*.so"))] \
        if args.cutlass_dir else []
    rows, chains = [], []
    shapes = [(s, s, s, "nn") for s in SQUARE] + [(*s, "nn") for s in SKINNY] + ZOO
    if args.quick:
        shapes = shapes[:3]
    out = {"device": torch.cuda.get_device_name(0), "gemm": rows, "chains": chains}

    def dump():
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    for dtype in (torch.float16, torch.bfloat16):
        for m, n, k, lay in shapes:
            r = tune(m, n, k, lay, dtype, cutlass, lt_so)
            rows.append(r)
            print(json.dumps(r), flush=True)
            dump()
    for m, n, k, act in CHAINS:
        for dtype in (torch.float16, torch.bfloat16):
            r = chain(m, n, k, act, dtype, Path(args.cache),
                      evts.get((act, str(dtype).split(".")[-1]), ()))
            chains.append(r)
            print(json.dumps(r), flush=True)
            dump()
    sp = [r["speedup_vs_cublas"] for r in rows]
    tri = [r["tflops"].get("triton", 0) / r["tflops"]["cublas"] for r in rows]
    tma = [r["tflops"]["triton_tma"] / r["tflops"]["cublas"] for r in rows
           if "triton_tma" in r["tflops"]]
    tma_vs = [r["tflops"]["triton_tma"] / r["tflops"]["triton"] for r in rows
              if "triton_tma" in r["tflops"] and "triton" in r["tflops"]]
    ch = [r["speedup"] for r in chains if r["speedup"]]
    chc = [r["cutlass_speedup"] for r in chains if r.get("cutlass_speedup")]
    lts = [r["cublaslt_vs_cublas"] for r in rows if r.get("cublaslt_vs_cublas")]

    def geo(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs and all(xs) else 0.0
    out["geomean"] = {"pick_vs_cublas": geo(sp), "triton_alone_vs_cublas": geo(tri),
                      "triton_tma_vs_cublas": geo(tma), "triton_tma_vs_triton": geo(tma_vs),
                      "fused_chain_vs_unfused": geo(ch),
                      "cutlass_fused_chain_vs_unfused": geo(chc),
                      "cublaslt_best_vs_cublas": geo(lts)}
    print(json.dumps(out["geomean"]))
    dump()
    if args.markdown:
        lines = [f"Device: {out['device']}", "",
                 "| shape | dtype | cuBLAS TFLOP/s | cuBLASLt best (algo) | Triton (best config) "
                 "| Triton TMA (best config) | CUTLASS (best) | pick | pick / cuBLAS | tuning s |",
                 "|---" * 10 + "|"]
        for r in rows:
            t = r["tflops"]
            cfg = r["best_config"]
            cl = f" ({cfg['cutlass']})" if "cutlass" in cfg else ""
            lt = f"{t['cublaslt']:.0f} ({cfg['cublaslt']})" if "cublaslt" in t else "-"
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {t['cublas']:.0f} | {lt} | "
                f"{t.get('triton', 0):.0f} ({cfg.get('triton', '-')}) | "
                f"{t.get('triton_tma', 0):.0f} ({cfg.get('triton_tma', '-')}) | "
                f"{t.get('cutlass', 0):.0f}{cl} | {r['pick']} | {r['speedup_vs_cublas']:.2f}x | "
                f"{r['tune_s']:.1f} |")
        lines += ["", "| chain | dtype | unfused cuBLAS + eager ms | fused Triton ms | speedup "
                  "| fused Triton TMA ms | fused CUTLASS (EVT) ms | speedup |", "|---" * 8 + "|"]
        for r in chains:
            lines.append(f"| {r['chain']} | {r['dtype']} | {r['unfused_ms']:.3f} | "
                         f"{r['fused_ms'] or 0:.3f} | {r['speedup'] or 0:.2f}x | "
                         f"{r['tma_fused_ms'] or 0:.3f} | "
                         f"{r['cutlass_fused_ms'] or 0:.3f} | {r['cutlass_speedup'] or 0:.2f}x |")
        g = out["geomean"]
        lines += ["", f"Geometric means: pick / cuBLAS {g['pick_vs_cublas']:.2f}x, cuBLASLt "
                  f"best / cuBLAS {g['cublaslt_best_vs_cublas']:.2f}x, Triton alone / "
                  f"cuBLAS {g['triton_alone_vs_cublas']:.2f}x, Triton TMA / cuBLAS "
                  f"{g['triton_tma_vs_cublas']:.2f}x, Triton TMA / Triton "
                  f"{g['triton_tma_vs_triton']:.2f}x, fused chain / unfused "
                  f"{g['fused_chain_vs_unfused']:.2f}x (Triton), "
                  f"{g['cutlass_fused_chain_vs_unfused']:.2f}x (CUTLASS EVT)"]
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
