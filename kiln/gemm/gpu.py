"""CUDA GEMM candidates: cuBLAS ("blas": cuBLAS's own algorithm, `BlasConfig`, and
"blaslt_<i>", the cuBLASLt heuristic's i-th algorithm, `BlasLtConfig(i)`; kiln/gemm/blaslt.py),
the Triton template ("triton", `TritonConfig`) and CUTLASS sm_90 kernels ("cutlass",
`CutlassConfig`); which apply to a problem, the heuristic used without measurements, and
profiling on the local GPU (the child's side is kiln/gemm/gpu_child.py).

Applicability: the Triton template takes float16 / bfloat16 / float32 (fp32 with IEEE
products, as eager); CUTLASS takes float16 / bfloat16 with at most one batch dim, needs
`cutlass_library` and nvcc at compile time, and kernels from `cutlass.enumerate_candidates`.

Heuristic (no profiling, no cache entry): cuBLAS when allowed (the strongest single backend
over bench/gemm_gpu.py's sweep); else the Triton template with the first config of its space
trimmed to the example sizes (the largest tile that fits); else the first CUTLASS kernel. So
restricting `gemm_backends` to one backend always yields that backend, also on a machine
without a GPU.

Profiling (`Options.max_autotune` and a local GPU of the target architecture): the candidates
run in child processes (`python -m kiln.gemm.gpu_child`), one process for all candidates of a
GEMM; a candidate that crashes its process is dropped with the reason and the others run in a
fresh one. The child times each candidate (captured in a CUDA graph, as packages run) with
CUDA events at the example sizes and checks it against a float32 torch.matmul of the same
operands (profile.py's protocol, one `KILN_PROFILE <name> <seconds> <max error> <tolerance>`
line per candidate). Every candidate is timed on the same work, the GEMM and the epilogue
it absorbs in a package (gemm/fuse.py):
- the template's candidates are the kernels the package would contain (kiln/gemm/
  printed.py), epilogue, batch loop and int8 operands included, checked against the product
  followed by the epilogue;
- CUTLASS candidates fuse the epilogue when it maps to a visitor tree (kiln/gemm/
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
from dataclasses import dataclass
from pathlib import Path

from kiln.gemm import blaslt
from kiln.gemm import triton_gemm as T
from kiln.gemm.configs import (BlasConfig, CutlassConfig, GemmConfig, TritonConfig,
                               config_from_json)
from kiln.gemm.printed import EPILOGUE
from kiln.gemm.problem import GemmProblem
from kiln.gemm import cutlass
from kiln.gemm import gemv as GV
from kiln.options import GemmBackend
from kiln.toolchain.cuda import default_archs, shared_per_block

TRITON_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Candidate:
    """A candidate to profile: its name, backend and config (what a choice and the cache
    record), and what the profiling child runs it with: `so`, the shared library (the
    cuBLASLt helper, or the CUTLASS kernel's build), and `evt_tree`, the visitor tree a
    CUTLASS kernel fuses (`cutlass_evt.Evt.to_json()`)."""

    name: str
    backend: GemmBackend  # (a backend's name is accepted and converted)
    config: GemmConfig
    so: str = ""
    evt_tree: dict | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", GemmBackend(self.backend))

    def to_json(self) -> dict:
        """The child's spec of the candidate."""
        return {"name": self.name, "backend": self.backend.value,
                "config": self.config.to_json(), "so": self.so, "evt_tree": self.evt_tree}

    @classmethod
    def from_json(cls, d: dict) -> Candidate:
        b = GemmBackend(d["backend"])
        return cls(d["name"], b, config_from_json(b, d["config"]), d["so"], d["evt_tree"])


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


def eligible(problem: GemmProblem, allowed, opts) -> list[GemmBackend]:
    allowed = [GemmBackend(b) for b in allowed]
    if problem.mixed:  # int8 x float: the Triton template converts tiles as it loads them
        return [b for b in allowed if b is GemmBackend.TRITON and problem.dtype in TRITON_DTYPES]
    out = []
    for b in allowed:
        if b is GemmBackend.BLAS or \
                (b is GemmBackend.TRITON and problem.dtype in TRITON_DTYPES) or \
                (b is GemmBackend.CUTLASS and _cutlass_ok(problem, opts)):
            out.append(b)
    return out


def triton_configs(problem: GemmProblem, sizes, opts, tma: bool = False) -> list[TritonConfig]:
    """The template's configs for a problem, each fitting the shared memory of a block on
    every target architecture; `tma`: its operands allow TMA loads."""
    _, m, n, k = sizes
    item = 4 if problem.dtype == "float32" else 2
    limit = shared_per_block(tuple(opts.cuda_archs) or default_archs())
    return (T.config_space(m, n, k, tma, item, limit)
            or [T.fit(TritonConfig(16, 64, 256, 8, 3, 4), item, limit)
                or TritonConfig(16, 64, 64, 8, 2, 4)])


def cutlass_candidates(problem: GemmProblem, opts, evt=None) -> list:
    """CUTLASS candidates; with `evt` (a cutlass_evt.Evt) those fusing it, or the plain ones
    when no kernel with a TMA epilogue fits the problem."""
    if evt is not None:
        fused = cutlass.enumerate_candidates(problem, opts, evt=evt)
        if fused:
            return fused
    return cutlass.enumerate_candidates(problem, opts)


def cutlass_config(c) -> CutlassConfig:
    """A CUTLASS candidate's config as choices and the cache record it."""
    return CutlassConfig(c.name, c.evt.key if c.evt is not None else None)


def heuristic(problem: GemmProblem, backends: list[GemmBackend], sizes, opts, evt=None
              ) -> tuple[GemmBackend | None, GemmConfig | None]:
    """(backend, config) without measurements (see the module docstring); (None, None) when
    no CUTLASS kernel fits and no other backend is allowed."""
    if GemmBackend.BLAS in backends:
        return GemmBackend.BLAS, BlasConfig()
    if GemmBackend.TRITON in backends:
        return GemmBackend.TRITON, triton_configs(problem, sizes, opts)[0]
    cands = cutlass_candidates(problem, opts, evt)
    if cands:
        return GemmBackend.CUTLASS, cutlass_config(cands[0])
    return None, None


def candidates(problem: GemmProblem, backends: list[GemmBackend], sizes, opts, work: Path,
               evt=None, tma: bool = False, gemv: bool = False
               ) -> tuple[list[Candidate], list]:
    """The candidates to profile, and (name, reason) of those that could not be built (a
    CUTLASS kernel nvcc rejected). With `evt`, the CUTLASS candidates fuse it (their config
    holds its key, and `profile` runs them with the tree's operands). `tma`: the GEMM's
    operands allow TMA loads, so the template's TMA configs are candidates too (the
    template's candidates are printed as the package would by select.py through
    kiln/gemm/printed.py). `gemv`: the GEMM is an M = 1 GEMV (gemm/gemv.py `applies`), so
    the GEMV template's configs are "triton" candidates too (timed with the epilogue, without
    the prologue it may fuse in the package)."""
    out, dropped = [], []
    if GemmBackend.BLAS in backends:
        out.append(Candidate("blas", GemmBackend.BLAS, BlasConfig()))
        lt = blaslt.candidates(problem.dtype)  # cuBLASLt's heuristic results, timed as linked
        if lt:
            try:
                so = str(blaslt.build_helper(opts))
                out += [Candidate(name, GemmBackend.BLAS, cfg, so) for name, cfg in lt]
            except Exception as e:  # noqa: BLE001 - no helper: cuBLAS's own choice only
                dropped += [(name, f"helper library: {str(e)[-200:]}") for name, _ in lt]
    if GemmBackend.TRITON in backends:
        out += [Candidate(c.name, GemmBackend.TRITON, c)
                for c in triton_configs(problem, sizes, opts, tma)]
        if gemv:
            item = {"float32": 4}.get(problem.dtype, 2)
            out += [Candidate(c.name, GemmBackend.TRITON, c)
                    for c in GV.configs(sizes[2], sizes[3], item)]
    if GemmBackend.CUTLASS in backends:
        cands = cutlass_candidates(problem, opts, evt)
        built = cutlass.compile_all({c.name: cutlass.render(c) for c in cands}, work,
                                    jobs=opts.jobs, shared=True)
        for c in cands:
            r = built[c.name]
            if isinstance(r, Path):
                out.append(Candidate(c.name, GemmBackend.CUTLASS, cutlass_config(c), str(r),
                                     c.evt.to_json() if c.evt is not None else None))
            else:
                dropped.append((c.name, r[-200:]))
    return out, dropped


def profile(problem: GemmProblem, sizes, cands: list[Candidate], timeout_s: float,
            printed: Path | None = None
            ) -> tuple[list[tuple[str, GemmBackend, GemmConfig, float]], list]:
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
                "cands": [c.to_json() for c in todo]}
        try:
            proc = subprocess.run([sys.executable, "-m", "kiln.gemm.gpu_child",
                                   json.dumps(spec)], capture_output=True, text=True,
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
                cand = next(c for c in todo if c.name == name)
                if sec < 0:
                    dropped.append((name, "failed: " + err.strip()[-160:]))
                elif not e_ <= tol:
                    dropped.append((name, f"wrong answer: max error {e_:g} > tolerance {tol:g}"))
                else:
                    results.append((name, cand.backend, cand.config, sec))
        rest = [c for c in todo if c.name not in seen]
        if rest and rc == 0:
            dropped += [(c.name, "no result line") for c in rest]
            break
        if rest:  # the first one without a result crashed the process
            dropped.append((rest[0].name, f"crash (exit {rc}): {err.strip()[-200:]}"))
            rest = rest[1:]
        todo = rest
    results = [(n, b, c, s + (epilogue_s if _unfused(b, c) else 0.0))
               for n, b, c, s in results]
    return results, dropped


def _unfused(backend: GemmBackend, cfg: GemmConfig) -> bool:
    """A candidate whose package leaves the GEMM's epilogue to a kernel of its own."""
    return backend is GemmBackend.BLAS or (isinstance(cfg, CutlassConfig) and cfg.evt is None)
