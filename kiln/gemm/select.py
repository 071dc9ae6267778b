"""The autotuning stage: one `Choice` per GEMM of the program.

Order of decisions for a GEMM:
1. `Options.max_autotune` on and the device can run candidates here: profile every candidate
   of every allowed backend (one child process each, `profile.py`), keep the fastest that gave
   the right answer, write the autotuning cache;
2. otherwise the autotuning cache, when it holds the problem for this device (best allowed
   candidate it recorded);
3. otherwise the heuristic of the device's module (`cpu.heuristic`); on CUDA first the GEMV
   template (gemm/gemv.py) for an M = 1 GEMM streaming nn.Linear's weight rows: float16 /
   bfloat16 when it fuses a prologue (gemm/prologue.py) or an epilogue (gemm/fuse.py), any
   dtype when cuBLAS is not allowed.
An M = 1 GEMM of a quantised weight (weight-only int8 / int4: `mixed` side "b", streaming
the weight's rows) takes the GEMV template first, whatever the options: no profiling or cache
(its launch config is the launch tuner's, template family "gemv"); an int4 weight only has it.
Profiling happens at the example sizes; every candidate is valid for the whole Dim range."""

from __future__ import annotations

import dataclasses
import platform
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

from kiln.gemm import cache as acache
from kiln.gemm import cpu
from kiln.gemm.configs import BlasConfig, GemmConfig, config_from_json
from kiln.gemm.problem import GemmProblem, problem_of
from kiln.gemm.profile import run_candidate
from kiln.errors import UnsupportedError
from kiln.ir import loop as L
from kiln.ir.sym import UNBOUNDED_NOMINAL, evaluate, product
from kiln.options import BACKEND_DEVICES, GemmBackend, Options
from kiln.toolchain.cuda import default_archs
from kiln.schedule.program import unbacked_bounds
from kiln.gemm.fuse import epilogue_member
from kiln.gemm.cutlass_evt import from_epilogue
from kiln.gemm.cutlass_evt import Evt
from kiln.gemm import gpu
from kiln.gemm import gemv as GV
from kiln.gemm.prologue import prologue_of
from kiln.gemm import printed as PR
from kiln import config
from kiln.gemm.printed import epilogue_key
from kiln.gemm.triton_gemm import tma_refusal
import torch


@dataclass(frozen=True)
class Choice:
    backend: GemmBackend  # (a backend's name is accepted and converted)
    config: GemmConfig = BlasConfig()  # of the backend's type (kiln/gemm/configs.py)
    how: str = "heuristic"  # "profiled" | "cache" | "heuristic"
    problem: str = ""
    #: backend -> [(candidate, seconds)], fastest first, at most 3 (profiled or cached only)
    timings: dict = field(default_factory=dict)
    dropped: tuple = ()  # (candidate, reason) of candidates that crashed, hung or were wrong
    tune_seconds: float = 0.0
    #: CUDA: whether CUTLASS candidates fuse the GEMM's absorbed epilogue ("cutlass fuses
    #: evt ...") or why not ("cutlass: epilogue ... stays a separate kernel: ..."); "" when
    #: there is no epilogue or CUTLASS is not a candidate
    epilogue: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", GemmBackend(self.backend))
        if self.config.backend is not self.backend:
            raise TypeError(f"a {self.backend.value!r} choice with config {self.config!r}")

    def to_json(self) -> dict:
        return {"backend": self.backend.value, "config": self.config.to_json(), "how": self.how,
                "problem": self.problem, "tune_seconds": round(self.tune_seconds, 3),
                "timings": {b: [[n, s] for n, s in v] for b, v in self.timings.items()},
                "dropped": [list(d) for d in self.dropped],
                **({"epilogue": self.epilogue} if self.epilogue else {})}


def allowed_backends(opts: Options, device: str) -> tuple[GemmBackend, ...]:
    dev = device.split(":")[0]
    out = tuple(GemmBackend(b) for b in opts.gemm_backends if dev in BACKEND_DEVICES[b])
    if not out:
        raise UnsupportedError(f"Options.gemm_backends={opts.gemm_backends!r} has no GEMM backend "
                               f"for device {dev!r}; for {dev} use any of "
                               f"{[b.value for b, d in BACKEND_DEVICES.items() if dev in d]}")
    return out


def cpu_device_id(opts: Options) -> str:
    name = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{name}:march={opts.march or 'generic'}:threads={opts.num_threads}"


def _names(backends) -> tuple[str, ...]:
    """Backends as `Options.gemm_backends` spells them (for messages)."""
    return tuple(GemmBackend(b).value for b in backends)


#: a measured candidate: (name, backend, config, seconds)
Result = tuple[str, GemmBackend, GemmConfig, float]


def _summary(results: list[Result]) -> dict:
    per: dict[str, list] = {}
    for name, backend, _, sec in sorted(results, key=lambda r: r[3]):
        per.setdefault(backend.value, [])
        if len(per[backend.value]) < 3:
            per[backend.value].append((name, sec))
    return per


def _from_results(results: list[Result], allowed, how, problem, dropped=(), seconds=0.0
                  ) -> Choice | None:
    ok = [r for r in results if r[1] in allowed]
    if not ok:
        return None
    best = min(ok, key=lambda r: r[3])
    return Choice(best[1], best[2], how, problem.describe(), _summary(ok), tuple(dropped),
                  seconds)


def _results_json(results: list[Result]) -> list[list]:
    """The cache's record of measured candidates: [name, backend, config JSON, seconds]."""
    return [[n, b.value, c.to_json(), sec] for n, b, c, sec in results]


def _cached_results(entry: dict, allowed) -> list[Result]:
    """The measured candidates of a cache entry (`_results_json`'s, also of older entries)
    of the `allowed` backends."""
    return [(n, GemmBackend(b), config_from_json(b, c), sec)
            for n, b, c, sec in entry.get("results", []) if b in allowed]


def _store(root: Path, problem: GemmProblem, dev_id: str, choice: Choice,
           results: list[Result]) -> None:
    acache.store(root, problem, dev_id, {
        "winner": {"backend": choice.backend.value, "config": choice.config.to_json()},
        "results": _results_json(results), "tune_seconds": choice.tune_seconds})


def _profile_cpu(problem: GemmProblem, sizes, allowed, opts: Options, tc,
                 tick=None) -> tuple[Choice, list]:
    t0 = time.perf_counter()
    nb, m, n, k = sizes
    configs = cpu.cpp_configs(opts.march) if GemmBackend.CPP in allowed else []
    if problem.const_b and configs:  # B packed once, as the package packs it at compile time
        configs = cpu.packed_configs(opts.march) + configs
    nr = cpu.packed_nr(problem.dtype, opts.march)
    exe = cpu.build_driver(tc, problem.dtype, configs, nr)
    cands = ([("blas", GemmBackend.BLAS, BlasConfig(), 0)] if GemmBackend.BLAS in allowed
             else []) + [(c.name, GemmBackend.CPP, c, i) for i, c in enumerate(configs, 1)]
    env = {"OMP_NUM_THREADS": str(opts.num_threads)} if opts.num_threads else {}
    results, dropped = [], []
    for j, (name, backend, cfg, idx) in enumerate(cands):
        if tick is not None:
            tick(j, len(cands))
        r = run_candidate([str(exe), str(idx), str(nb), str(m), str(n), str(k), problem.layout_a,
                           problem.layout_b, "0.02", "c" if problem.const_b else "-"],
                          opts.autotune_timeout_s, env)
        if r.seconds is None:
            dropped.append((name, r.reason))
        else:
            results.append((name, backend, cfg, r.seconds))
    if tick is not None:
        tick(len(cands), len(cands))
    if not results:
        raise UnsupportedError(f"GEMM {problem.describe()}: every candidate failed: {dropped}")
    choice = _from_results(results, allowed, "profiled", problem, dropped,
                           time.perf_counter() - t0)
    return choice, results


def choose_gemms(steps, symbols, opts: Options, device: str = "cpu", tc=None,
                 outputs: set[str] | None = None, buffers: dict | None = None,
                 printer=None, cached: bool = True,
                 packable: set[str] = frozenset(),
                 progress: Callable[[str, int, int], None] | None = None) -> dict[str, Choice]:
    """Gemm name -> Choice for every `L.Gemm` in `steps`. `symbols`: the graph's symbols (name,
    min, max, example); `tc`: the C++ toolchain (CPU profiling builds its driver with it);
    `outputs` (CUDA): the buffers that must be stored, to find each GEMM's absorbed epilogue
    (gemm/fuse.py), which the template's candidates and CUTLASS candidates (when it
    maps to a visitor tree) are profiled with; `buffers` (CUDA): the Loop IR buffers, to
    print the template's candidates as the package would (without them a GEMM is profiled
    without its epilogue); `printer` (CUDA): the target's candidate printer,
    `printer(gemm, epilogue, buffers, env, configs) -> printed.Printed`
    (kiln/targets/cuda/gemm_candidates.py); without it the template is not profiled.
    `cached=False` (CPU, max_autotune off): the heuristic alone, ignoring the autotuning
    cache (the default choices a tuned CPU package is timed against).
    `packable` (CPU): the GEMMs whose constant B may be packed at compile time
    (`cpu.packable`); their problems have `const_b` and packed candidates.
    `progress(what, done, total)`, when given, is told the autotuning's counts (max_autotune:
    the CPU's candidates of each GEMM, the GEMMs profiled on CUDA)."""

    allowed = allowed_backends(opts, device)
    ranges = {s.name: (s.min, s.max) for s in symbols}
    env = {s.name: s.example for s in symbols}
    hi = {s.name: s.max for s in symbols}
    for name, bound in unbacked_bounds(steps):  # data-dependent sizes: 0 up to their bounds,
        hi.setdefault(name, UNBOUNDED_NOMINAL)   # profiled at the bound for the example sizes
        env.setdefault(name, UNBOUNDED_NOMINAL)  # (a nominal size where there is none)
        ranges[name] = (0, evaluate(bound, hi))
        env[name] = evaluate(bound, env)
    dev = device.split(":")[0]
    dev_id = cpu_device_id(opts) if dev == "cpu" else device
    root = Path(opts.cache_dir) if opts.cache_dir else None
    if root is None:
        root = config.cache_dir()
    out: dict[str, Choice] = {}
    n_gemms = sum(isinstance(g, L.Gemm) for g in steps)
    tell = progress if opts.max_autotune else None  # otherwise no choice takes long
    for i, g in enumerate(steps):
        if not isinstance(g, L.Gemm):
            continue
        if tell is not None and dev != "cpu":
            tell("GEMMs autotuned", len(out), n_gemms)
        if g.lowp is not None:  # 8-bit float / int8 operands: cuBLASLt is the one backend
            out[g.name] = Choice(GemmBackend.BLAS, BlasConfig(),
                                 "cuBLASLt: the only low-precision GEMM backend",
                                 f"{g.lowp.kind} {g.lowp.a_dtype}x{g.lowp.b_dtype}->{g.dtype} "
                                 f"m={g.m} n={g.n} k={g.k}")
            continue
        sizes = (int(evaluate(product(g.batch), env)), int(evaluate(g.m, env)),
                 int(evaluate(g.n, env)), int(evaluate(g.k, env)))
        if dev != "cpu":
            epi = _epilogue(steps, i, outputs)
            evt = _evt(g, epi)
            fuses = _gemv_fuses(g, steps, i, outputs, epi)
            if buffers is None:  # the template's candidates are profiled without it
                epi = None
            problem = problem_of(g, ranges, _epilogue_key(evt, epi, allowed))
            printed = (epi, buffers, env, printer)
            out[g.name] = _choose_cuda(g, problem, sizes, allowed, opts, root, evt, printed,
                                       fuses)
            continue
        problem = problem_of(g, ranges)
        if g.name in packable:
            problem = dataclasses.replace(problem, const_b=True)
        mine = _cpu_backends(g, allowed)
        choice = None
        if opts.max_autotune and tc is not None:
            tick = None if tell is None else partial(
                tell, f"GEMM {len(out) + 1}/{n_gemms} ({g.name}): candidates timed")
            choice, results = _profile_cpu(problem, sizes, mine, opts, tc, tick)
            if mine == allowed:  # (a cache entry holds every allowed backend's time)
                _store(root, problem, dev_id, choice, results)
        elif cached:
            hit = acache.load(root, problem, dev_id)
            if hit is not None:
                choice = _from_results(_cached_results(hit, mine), mine, "cache", problem)
        if choice is None:
            backend, cfg = cpu.heuristic(problem, mine, opts.march)
            choice = Choice(backend, cfg, "heuristic", problem.describe())
        out[g.name] = choice
    if tell is not None and dev != "cpu":
        tell("GEMMs autotuned", n_gemms, n_gemms)
    return out


def _cpu_backends(g: L.Gemm, allowed) -> tuple[GemmBackend, ...]:
    """The allowed CPU backends that can read `g`'s operands: kiln's own ("cpp") alone for
    an A whose rows overlap (L.Gemm.blas_operands); lowering makes one only where "cpp" is
    allowed (passes/conv1d_gemm.py runs only then)."""
    if g.blas_operands():
        return allowed
    if GemmBackend.CPP not in allowed:
        raise UnsupportedError(f"GEMM {g.name}: an operand whose rows overlap needs kiln's "
                               f"CPU GEMM (\"cpp\" in Options.gemm_backends)")
    return (GemmBackend.CPP,)


def _cuda_arch(opts: Options) -> tuple[int, bool]:
    """(target architecture, whether the local GPU is of that architecture)."""
    local = default_archs()
    arch = (tuple(opts.cuda_archs) or local)[0]
    try:
        here = torch.cuda.is_available() and local[0] == arch
    except Exception:  # no usable CUDA
        here = False
    return arch, here


def _epilogue(steps, i: int, outputs: set[str] | None):
    """The member GEMM `steps[i]` absorbs as its epilogue in a package, or None."""
    if outputs is None:
        return None
    return epilogue_member(steps, i, outputs)


def _gemv_fuses(g: L.Gemm, steps, i: int, outputs: set[str] | None, epi) -> str | None:
    """None when the GEMV template does not apply to `g` (gemm/gemv.py: M = 1, ...); else what
    it would fuse ("prologue", "epilogue", both joined by " and ", or "" for nothing)."""
    if outputs is None or not GV.applies(g):
        return None
    parts = (["prologue"] if prologue_of(steps, i, outputs) is not None else []) + \
        (["epilogue"] if epi is not None else [])
    return " and ".join(parts)


def _evt(g: L.Gemm, epi):
    """The visitor tree of GEMM `g`'s absorbed epilogue `epi` (cutlass_evt.Evt), why it has
    none (cutlass_evt.EvtRefusal), or None when it absorbs no epilogue."""
    if epi is None or g.mixed is not None:  # (int8 operands: the template only)
        return None
    return from_epilogue(g, epi)


def _epilogue_key(evt, epi, allowed) -> str:
    """The problem's epilogue: the visitor tree's key when CUTLASS can fuse it, else the
    epilogue's own key when the template (which fuses any absorbed epilogue) may be chosen,
    else "" (no candidate fuses it: the plain GEMM's entry)."""
    if isinstance(evt, Evt) and GemmBackend.CUTLASS in allowed:
        return evt.key
    if epi is not None and GemmBackend.TRITON in allowed:
        return epilogue_key(epi)
    return ""


def _epilogue_note(evt, backends, cands=None) -> str:
    """The Choice's `epilogue` line: what CUTLASS does with the GEMM's epilogue."""
    if evt is None or GemmBackend.CUTLASS not in backends:
        return ""
    if not isinstance(evt, Evt):
        return f"cutlass: {evt.reason}"
    if cands is not None and not any(c.evt is not None for c in cands):
        return (f"cutlass: no kernel with a TMA epilogue fits the problem (alignment); the "
                f"epilogue stays a separate kernel ({evt.key})")
    return f"cutlass fuses {evt.key}"


def _choose_cuda(g: L.Gemm, problem: GemmProblem, sizes, allowed, opts: Options, root: Path,
                 evt=None, printed: tuple = (None, None, {}, None),
                 gemv: str | None = None) -> Choice:
    """`gemv`: what the GEMV template would fuse (`_gemv_fuses`), None where it does not
    apply."""
    backends = gpu.eligible(problem, allowed, opts)
    if not backends and problem.mixed:
        raise UnsupportedError(
            f"GEMM {g.name} ({', '.join(g.source)}, {problem.describe()}): a mixed-dtype GEMM "
            f"runs on the Triton template only; Options.gemm_backends={_names(allowed)!r}")
    if not backends:
        raise UnsupportedError(
            f"GEMM {g.name} ({', '.join(g.source)}, {problem.describe()}): none of "
            f"Options.gemm_backends={_names(allowed)!r} can compute it on CUDA (the Triton "
            f"template takes {', '.join(gpu.TRITON_DTYPES)}; CUTLASS float16/bfloat16 with at "
            f"most one batch dim, cutlass_library and nvcc); add 'blas'")
    fuse = evt if isinstance(evt, Evt) else None
    note = _epilogue_note(evt, backends, gpu.cutlass_candidates(problem, opts, fuse)
                          if fuse is not None and GemmBackend.CUTLASS in backends else None)
    choice = _choose_cuda_backend(g, problem, sizes, backends, allowed, opts, root, fuse,
                                  printed, gemv)
    return dataclasses.replace(choice, epilogue=note)


def _choose_cuda_backend(g: L.Gemm, problem: GemmProblem, sizes, backends, allowed,
                         opts: Options, root: Path, evt, printed, gemv=None) -> Choice:
    if g.mixed is not None and g.mixed.side == "b" and (g.mixed.group or (
            gemv is not None and GV.streams_rows(g))):
        if gemv is None or GemmBackend.TRITON not in backends:
            raise UnsupportedError(
                f"GEMM {g.name} ({', '.join(g.source)}, {problem.describe()}): an int4 weight "
                f"is read by the GEMV template only (M = 1, static N and K, groups of a power "
                f"of two >= 32 dividing K, Triton allowed); got M = {g.m}, K = {g.k}, group "
                f"{g.mixed.group}, Options.gemm_backends={_names(allowed)!r}")
        cfg = GV.gemv_configs(g)[0]
        return Choice(GemmBackend.TRITON, cfg, "heuristic", problem.describe())
    arch, here = _cuda_arch(opts)
    dev_id = gpu.device_id(arch)
    if opts.max_autotune and here:
        t0 = time.perf_counter()
        cands, dropped = gpu.candidates(problem, backends, sizes, opts,
                                        root / "autotune_cutlass", evt, tma_refusal(g) is None,
                                        gemv is not None)
        path = _print_candidates(g, cands, printed, root / "autotune_printed" /
                                 f"{problem.key(dev_id)}.pkl")
        results, more = gpu.profile(problem, sizes, cands, opts.autotune_timeout_s, path)
        dropped = list(dropped) + list(more)
        if results:
            choice = _from_results(results, backends, "profiled", problem, dropped,
                                   time.perf_counter() - t0)
            _store(root, problem, dev_id, choice, results)
            return choice
    hit = acache.load(root, problem, dev_id)
    if hit is not None:  # (GEMV results only for a GEMM the GEMV template computes)
        cached = [r for r in _cached_results(hit, backends)
                  if gemv is not None or not getattr(r[2], "gemv", False)]
        choice = _from_results(cached, backends, "cache", problem)
        if choice is not None:
            return choice
    # the GEMV template: with cuBLAS allowed, for 16-bit GEMMs where it fuses what cuBLAS
    # leaves apart; without cuBLAS, for every GEMV (rather than the GEMM template's tiles)
    if gemv is not None and GemmBackend.TRITON in backends and GV.streams_rows(g) and (
            GemmBackend.BLAS not in backends or
            (gemv and problem.dtype in ("float16", "bfloat16"))):
        cfg = GV.configs(sizes[2], sizes[3], g.dtype.itemsize)[0]
        return Choice(GemmBackend.TRITON, cfg, "heuristic", problem.describe())
    backend, cfg = gpu.heuristic(problem, backends, sizes, opts, evt)
    if backend is None:
        raise UnsupportedError(f"GEMM {g.name} ({', '.join(g.source)}, {problem.describe()}): "
                               f"no CUTLASS kernel fits it and no other backend is allowed "
                               f"(Options.gemm_backends={_names(allowed)!r})")
    return Choice(backend, cfg, "heuristic", problem.describe())


def _print_candidates(g: L.Gemm, cands, printed, path: Path) -> Path | None:
    """The template's candidates as the package would print them, and the GEMM's epilogue as
    its own kernel (kiln/gemm/printed.py: its time is charged to the candidates that do
    not fuse it, also when the template is not a candidate), pickled at `path` for the
    profiling child; None when there is neither."""
    configs = {c.name: c.config for c in cands if c.backend is GemmBackend.TRITON}
    epi, buffers, env, printer = printed
    if printer is None or (not configs and epi is None):
        return None
    if buffers is None:
        buffers = PR.gemm_buffers(g, env)
    return PR.write(printer(g, epi, buffers, env, configs), path)

