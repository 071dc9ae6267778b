"""Compile-time autotuning of Triton launch configs (XBLOCK, RBLOCK, num_warps) and template
tiles (attention, convolution) on the local GPU.

Input: families of steps to tune (`Family`: schedule kernels with their heuristic configs, or
template calls), each step's candidates (the heuristic's first), the Loop IR buffers, the size
hints (the export's example sizes), the cache directory. Output: step name -> the fastest config
measured (steps not tuned keep their heuristic config).

GEMV template kernels (M = 1, decode's weight streaming) are a template family ("gemv") timed
with cold operands: each call reads another copy of its weights (`_cold_sets`, twice the L2
in all), as a decode step reads each weight once; repeated on one copy, a GEMV of up to 50 MB
of weights would be timed from the L2 and the tuner would pick for the wrong memory. Their
launches are queued behind a device-side wait (`event_ms` `queued`): a decode GEMV of 6-20 us
is shorter than a Triton launch from Python, which would otherwise set the time measured.

Method: which steps and candidates are worth it is decided by the caller (targets/cuda/build.py
`tuning_families` with the cost model of tune_plan.py; without it, `worth_tuning`: reductions
with at least MIN_ELEMENTS elements of work, pointwise kernels with POINTWISE_MIN_ELEMENTS).
A schedule kernel gets up to seven candidates around its heuristic config (num_warps halved and
doubled, XBLOCK halved and doubled, RBLOCK halved, one tile covering a wide row). `plan` lists
what is still to time (steps of the same code up to names at the same sizes, e.g. every block of
a transformer, are timed once; steps the autotune cache holds are not timed); `tune_all` has one
pool of worker processes (`triton_aot.Pool`, one per core up to the task count) compile every
candidate of every family, then the build's untuned kernels (into the cubin cache, for the
cubins stage), while this process times each step as soon as its candidates are compiled: CUDA
events on buffers of the example sizes (floats drawn from a normal distribution, integers zero:
data-dependent indices stay in range); a neighbour Triton cannot compile (or, for a template, the
device cannot launch) is skipped; the fastest wins (ties: the heuristic). A winner's cubin is
stored in the cubin cache (`triton_aot`), so the build does not compile it again.

Invariants: results are cached on disk in `<cache>/autotune/<sha256>.json`, the hash covering
the kernel's heuristic source up to names (`triton_aot.canonical`), the candidates, the sizes,
the device name and the Triton version: a second build on the same device measures nothing.
Nothing here times without a CUDA device visible to torch (the caller checks
`device_available`); `plan` runs anywhere."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.targets.cuda.kernel import Config, print_triton_kernel, print_triton_module
from kiln.targets.cuda.ops import PRELUDE
from kiln.errors import CompileError
from kiln.ir.sym import evaluate, product
from kiln.toolchain import triton_aot
from kiln.targets.cuda.attention import attention_candidates, print_attention_kernel
import torch

MIN_ELEMENTS = 2**18
#: template families timed with cold operands (`_cold_sets`): weight-streaming kernels
COLD_FAMILIES = ("gemv",)
POINTWISE_MIN_ELEMENTS = 2**22


def device_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # no usable torch/CUDA: heuristics only
        return False


def warm_context() -> None:
    """Creates this process's CUDA context (torch's first allocation on the device) ahead of
    the tuning, which would otherwise pay it on its first buffer: 0.3 s on the H100 machine,
    most of it in the driver with the GIL released, so a thread can do it while the caller
    runs Python (kiln.compile's export: targets/cuda/build.py `Early`). Quiet where it fails:
    the tuning's own first allocation reports it."""
    try:
        torch.empty(1, device="cuda")
    except Exception:  # noqa: BLE001 - no usable device: the tuning reports it
        pass


def candidates(base: Config, width: int = 1) -> list[Config]:
    """The heuristic config first, then its neighbours (distinct, within Triton's limits);
    for members wider than RBLOCK, one more with a single tile covering the widest member (up
    to 8192: no re-reads of a row between a norm's passes, at the cost of registers)."""
    out = [base]
    full = 1 << max(0, (width - 1).bit_length())
    wide = ((max(1, base.xblock * base.rblock // full), full, min(16, base.num_warps * 2)),) \
        if base.rblock < full <= 8192 else ()
    for x, r, w in ((base.xblock, base.rblock, base.num_warps * 2),
                    (base.xblock, base.rblock, base.num_warps // 2),
                    (base.xblock * 2, base.rblock, base.num_warps),
                    (base.xblock // 2, base.rblock, base.num_warps),
                    (base.xblock, base.rblock // 2, base.num_warps)) + wide:
        c = Config(x, r, w)
        if x >= 1 and r >= 1 and 1 <= w <= 16 and x * r <= 2**16 and c not in out:
            out.append(c)
    return out


def _shape(kernel, hints) -> tuple[int, int]:
    """(rows, widest member) at the example sizes."""
    k = len(kernel.outer)
    rows = max(1, evaluate(product(kernel.outer), hints))
    width = 1
    for m in kernel.members:
        n = m.reduce.sizes if m.reduce is not None else m.shape[k:]
        width = max(width, evaluate(product(n), hints))
    return rows, width


def _cache_key(tk, cands, sizes, device: str, version: str) -> str:
    blob = json.dumps([triton_aot.canonical(tk), [list(c.__dict__.values()) for c in cands],
                       sizes, device, version])
    return hashlib.sha256(blob.encode()).hexdigest()


def _sizes(tk, hints) -> list[int]:
    """The kernel's size arguments at the example sizes, in parameter order."""
    return [int(hints[n]) for kind, n in tk.params if kind == "size"]


def _cached(root: Path, tks, cands, hints, device: str, version: str, look: bool = True
            ) -> tuple[Path, Config | None]:
    """The cache file of one kernel's candidate set at these sizes, and the config it holds
    (None when this set was never timed here). The key is the kernel's code up to names
    (triton_aot.canonical): the same LayerNorm in another block, or another model, at the
    same sizes, reads the same entry."""
    path = root / f"{_cache_key(tks[0], cands, _sizes(tks[0], hints), device, version)}.json"
    if not look or not path.exists():
        return path, None
    hit = json.loads(path.read_text())
    return path, Config(hit["xblock"], hit["rblock"], hit["num_warps"], hit.get("num_stages", 0),
                        hit.get("variant", ""))


def _store(path: Path, cfg: Config, kernel: str, device: str, ms: dict) -> None:
    """Records the winning config (atomically: concurrent builds read whole files only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"xblock": cfg.xblock, "rblock": cfg.rblock, "num_warps": cfg.num_warps,
                   "num_stages": cfg.num_stages, "variant": cfg.variant, "kernel": kernel,
                   "device": device,
                   "ms": ms}, f)
    os.replace(tmp, path)


def worth_tuning(kernel, hints) -> bool:
    """Whether measuring a kernel's launch configs pays for its compiles: reductions of at
    least MIN_ELEMENTS elements of work (norms, softmax, sums: the row tiling matters), and
    pointwise kernels of at least POINTWISE_MIN_ELEMENTS (below that the heuristic's tile of
    about 2048 elements is within a few percent of a kernel that runs in microseconds)."""
    rows, width = _shape(kernel, hints)
    reduces = any(m.reduce is not None for m in kernel.members)
    return rows * width >= (MIN_ELEMENTS if reduces else POINTWISE_MIN_ELEMENTS)


def _add(todo: list, copies: dict, step, tks, path: Path) -> None:
    """Queues `step` for tuning, unless a queued one has the same cache file (the same code up
    to names, candidates and sizes): `step` then takes that one's result (`copies`)."""
    for other, _, other_path in todo:
        if other_path == path:
            copies[other.name].append(step.name)
            return
    todo.append((step, tks, path))
    copies[step.name] = []


def _args(tk, buffers, hints, torch):
    args = []
    for kind, n in tk.params:
        if kind == "size":
            args.append(int(hints[n]))
        elif kind == "status":
            args.append(torch.zeros(4, dtype=torch.int32, device="cuda"))
        else:
            b = buffers[n]
            dt = b.dtype.torch
            numel = max(1, evaluate(b.numel, hints))
            if dt.is_floating_point and dt.itemsize == 1:  # float8: torch draws no samples
                t = torch.randint(0, 256, (numel,), dtype=torch.uint8, device="cuda").view(dt)
            else:
                t = torch.empty(numel, dtype=dt, device="cuda")
                t.normal_() if dt.is_floating_point else t.zero_()
            args.append(t)
    return args


def event_ms(run, reps: int = 20, queued: bool = False) -> float:
    """Milliseconds a call of `run()` takes on the device: three calls to warm up, then the
    mean of `reps` calls enqueued back to back, timed with CUDA events. `queued`: the calls
    are enqueued behind a device-side wait (`torch.cuda._sleep`) longer than the host takes
    to enqueue them, so they run back to back on the device whatever a launch costs the host
    (a Triton launch from Python takes 10-20 us: a kernel shorter than that would otherwise
    be timed at the host's launch rate)."""
    t0 = time.perf_counter()
    for _ in range(3):
        run()
    host = (time.perf_counter() - t0) / 3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda.synchronize()
        # cycles at up to 2 GHz: at least 1.5x the host's enqueue time of the reps, + 50 us
        torch.cuda._sleep(int(min((1.5 * reps * host + 5e-5) * 2e9, 2**31 - 1)))
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _time_ms(ck, grid, args, torch, reps: int = 20) -> float:
    run = ck[grid]
    return event_ms(lambda: run(*args), reps)


#: bytes of operands a "cold" family's timing cycles through: twice an H100's / H200's L2
#: (50 / 60 MiB), so every call streams its operands from HBM as in the model
COLD_BYTES = 128 << 20


def _cold_sets(args, torch) -> list:
    """Copies of `args` (tensors cloned, scalars shared) whose tensors together exceed
    COLD_BYTES (at most 64 copies): timing a weight-streaming kernel (a GEMV) over them in
    turn reads its weights from memory, not from the L2 cache they would sit in when the same
    call repeats."""
    nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    n = min(64, max(1, -(-COLD_BYTES // max(1, nbytes))))
    return [args] + [[a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                     for _ in range(n - 1)]


def queued_cold() -> bool:
    """Cold families are timed with their launches queued on the device (`event_ms`
    `queued`); KILN_TUNE_QUEUED=0 times them at the host's launch rate, as before (A/B)."""
    return os.environ.get("KILN_TUNE_QUEUED", "1") != "0"


def timed_as(label: str, version: str) -> str:
    """The autotune cache key's version part for a family labelled `label`: a cold family's
    results timed with queued launches are kept apart from those timed without."""
    return version + ("-queued" if label in COLD_FAMILIES and queued_cold() else "")


def _time_cold_ms(ck, grid, sets, consts, torch, reps: int = 20) -> float:
    """`_time_ms` with the call's operands taken from `sets` in turn (`_cold_sets`), the
    launches queued (`queued_cold`): a decode GEMV takes 6-20 us on an H100, the Python
    launch about as long."""
    run = ck[grid]
    it = iter(range(1 << 62))
    return event_ms(lambda: run(*sets[next(it) % len(sets)], *consts), max(reps, len(sets)),
                    queued=queued_cold())


def launcher_tasks(kernels) -> list[bool]:
    """Per candidate kernel (in the order they are timed), whether its compile task builds
    Triton's host launcher too: the first of each signature. The launcher's C source is a
    function of the parameter types only (triton/backends/nvidia/driver.py `make_launcher`:
    not of the kernel, its constexpr values or its config), and Triton's cache keys it by that
    source, so one build serves every kernel of the same types."""
    seen: set[tuple] = set()
    out = []
    for tk in kernels:
        sig = tuple(tk.signature.values())
        out.append(sig not in seen)
        seen.add(sig)
    return out


class _Compiling:
    """The candidates of every (step, kernels, cache path) of `todo`, being compiled for
    `arch` by worker processes (kiln/toolchain/triton_warm.py, one per core up to the number of
    candidates; with their host launchers) while this process times the ones already done:
    `compiled[(i, j)]` (candidate j of item i) waits until that candidate's worker is past it,
    then compiles it here (a hit in Triton's on-disk cache) and returns Triton's compiled kernel;
    `(i, j) in compiled` is false for a neighbour Triton cannot compile (e.g. too many
    registers). The heuristic config (j = 0) must compile. Candidates are dealt to the workers
    in item order, so the first items' candidates finish first. One module per candidate index
    keeps the kernel names those the build uses."""

    def __init__(self, todo, cache: Path, arch: int, workers: int = 1, extra=(),
                 started=None) -> None:
        n_mod = max(len(t) for _, t, _ in todo)
        self.texts = [print_triton_module([t[i] for _, t, _ in todo if i < len(t)])
                      for i in range(n_mod)]
        self.todo, self.cache, self.arch = todo, cache, arch
        cands = [(i, j, tk) for i, (_, tks, _) in enumerate(todo) for j, tk in enumerate(tks)]
        self.extra = list(extra)
        tasks = [(self.texts[j], tk, arch) for _, j, tk in cands]
        if self.extra:
            text = print_triton_module(self.extra)
            tasks += [(text, tk, arch) for tk in self.extra]
        # Triton's host launcher depends on the kernel's parameter types alone, which a step's
        # candidates share and often many steps too (ResNet-18's tuned convolutions: one
        # signature): the worker of the first candidate of each signature (timed before the
        # others of it) builds it; the others would build the same C extension again (a C
        # compile, a quarter to a whole second each)
        self.pool = triton_aot.Pool(tasks, cache, workers,
                                    launchers=launcher_tasks([tk for _, _, tk in cands]) +
                                    [False] * len(self.extra), started=started)
        self.first_extra = len(cands)
        self.task = {(i, j): n for n, (i, j, _) in enumerate(cands)}
        self.mods: dict[int, object] = {}
        self.done: dict[tuple[int, int], object] = {}
        self.waited = 0.0  # seconds spent waiting for the workers
        self.loaded = 0.0  # seconds spent loading compiled candidates here (module, cubin)

    def _get(self, key):
        if key not in self.done:
            t0 = time.perf_counter()
            self.pool.wait(self.task[key])
            self.waited += time.perf_counter() - t0
            j = key[1]
            t0 = time.perf_counter()
            try:
                if j not in self.mods:
                    self.mods[j] = triton_aot.import_module(self.texts[j], self.cache)
                kernel = self.todo[key[0]][1][j]
                files = self.pool.compiled_files(self.task[key])
                ck = triton_aot.load_compiled(self.mods[j], kernel, files) if files else None
                self.done[key] = (ck if ck is not None else
                                  triton_aot.compile_kernel(self.mods[j], kernel, self.arch))
            except CompileError:
                if j == 0:  # the build needs the heuristic config anyway
                    raise
                self.done[key] = None
            finally:
                self.loaded += time.perf_counter() - t0
        return self.done[key]

    def __contains__(self, key) -> bool:
        return key in self.task and self._get(key) is not None

    def __getitem__(self, key):
        ck = self._get(key)
        if ck is None:
            raise KeyError(key)
        return ck

    def store_extra(self) -> int:
        """The `extra` kernels the workers compiled, put into the cubin cache (where the
        build's cubins stage finds them); the number stored. One a worker failed on is left to
        that stage, which reports the failure."""
        prelude = hashlib.sha256(PRELUDE.encode()).hexdigest()
        n = 0
        for t, tk in enumerate(self.extra, self.first_extra):
            c = self.pool.cubin(t, tk, self.arch)
            if c is not None:
                triton_aot.store_cubin(c, tk, self.arch, prelude, self.cache)
                n += 1
        return n

    def close(self, kill: bool = False) -> None:
        self.pool.close(kill)


def _compile_candidates(todo, cache: Path, arch: int, workers: int = 1,
                        extra=(), started=None) -> _Compiling:
    """Every candidate of every (step, kernels, cache path) in `todo`, compiled for `arch`
    (`_Compiling`: in worker processes, those of `started` (triton_aot.Workers) where they
    are running, each candidate ready as soon as its worker is past it); then the
    TritonKernels of `extra` (the build's kernels that are not tuned, for its cubins stage:
    `store_extra`)."""
    return _Compiling(todo, cache, arch, workers, extra, started)


def _keep(best: dict, copies: dict, item, tks, win: int, ck, path: Path, arch: int,
          cache: Path, device: str, name: str, times: dict) -> None:
    """Records candidate `win` of `item` as the best (for it and the items of the same code),
    its cubin in the cubin cache and the result in the autotune cache (as `name`)."""
    c = tks[win].config
    best[item.name] = c
    best.update({other: c for other in copies[item.name]})
    prelude = hashlib.sha256(PRELUDE.encode()).hexdigest()
    triton_aot.store_compiled(ck, tks[win], arch, prelude, cache)
    _store(path, c, name, device, times)


@dataclass(frozen=True)
class Family:
    """One kind of tuned step: which steps, how their candidates are listed and printed, how
    they launch and how the report names them."""

    items: tuple  # the steps to tune (schedule kernels, or template calls)
    kernels_of: Callable  # step -> (configs, printed TritonKernels), the heuristic's first
    #: "" for schedule kernels (report key: the kernel's name, configs "x..r..w.."); else a
    #: template call (one kernel a call, its grid from each candidate's tile; a candidate the
    #: device cannot launch is skipped; bool operands all true; report key "<label>_<name>",
    #: configs "m..n..w..s..")
    label: str = ""
    reference: Callable | None = None  # call -> report entries of a peer (cuDNN's time)


def kernel_family(kernels, buffers, hints: dict[str, int], base: dict[str, Config],
                  select: Callable | None = None) -> Family:
    """The schedule kernels `select(kernel)` keeps (default `worth_tuning`), each with the
    `candidates` of its heuristic config `base[name]`."""
    select = select or (lambda k: worth_tuning(k, hints))

    def kernels_of(k):
        cands = candidates(base[k.name], _shape(k, hints)[1])
        return cands, [print_triton_kernel(k, buffers, hints, c) for c in cands]

    return Family(tuple(k for k in kernels if select(k)), kernels_of)


def template_family(calls, candidates_of, print_kernel, buffers, hints: dict[str, int],
                    label: str, reference=None) -> Family:
    """Template calls (attention, convolution): each with `candidates_of(call, buffers,
    hints)`, printed by `print_kernel(call, buffers, hints, config)`."""

    def kernels_of(c):
        cands = candidates_of(c, buffers, hints)
        return cands, [print_kernel(c, buffers, hints, x) for x in cands]

    return Family(tuple(calls), kernels_of, label, reference)


def plan(families, hints: dict[str, int], cache: Path | None = None, device: str = "",
         version: str = "") -> tuple[list, dict[str, list[str]], dict, dict]:
    """What `tune_all` compiles and times: (todo, copies, family of each queued step, the
    configs the autotune cache already holds). `todo` lists (step, printed candidates, cache
    file) of the steps still to time: a step of the same code up to names, candidates and
    sizes as a queued one (another block of a transformer, a repeated ResNet layer) takes
    that one's result (`copies`); one whose candidate set was timed on `device` before (with
    `cache`) takes the cached config. Without a cache it runs without a GPU: the counts of
    bench/compile_time.py --plan."""
    todo: list = []  # (step, [TritonKernel per candidate], cache file)
    copies: dict[str, list[str]] = {}  # a step tuned -> the steps of the same code
    family: dict[str, Family] = {}
    hits: dict[str, Config] = {}
    root = (cache or Path(".")) / "autotune"
    for fam in families:
        for it in fam.items:
            cands, tks = fam.kernels_of(it)
            path, hit = _cached(root, tks, cands, hints, device, timed_as(fam.label, version),
                                look=cache is not None)
            if hit is not None:
                hits[it.name] = hit
                continue
            _add(todo, copies, it, tks, path)
            family[it.name] = fam
    return todo, copies, family, hits


def _config_text(c: Config, template: bool) -> str:
    if template:
        return f"m{c.xblock}n{c.rblock}w{c.num_warps}s{c.num_stages}" + (
            f"_{c.variant}" if c.variant else "")
    return f"x{c.xblock}r{c.rblock}w{c.num_warps}"


def tune_all(families, buffers, hints: dict[str, int], arch: int, cache: Path,
             workers: int = 1, progress=None, stats: dict | None = None, extra=(),
             started=None) -> tuple[dict[str, Config], dict]:
    """Every family's steps tuned on the local GPU in one pass: the candidates of all of them
    (`plan`) compiled by one set of worker processes (`_compile_candidates`) while this
    process times, in order, the steps whose candidates are ready (CUDA events at the example
    sizes, floats drawn from a normal distribution, integers zero); the fastest is kept (ties:
    the heuristic), its cubin stored in the cubin cache and the result in the autotune cache.
    Returns ({step name: best config}, {report key: {config text: ms}} of what ran);
    `progress(done, total)`, when given, counts the steps timed; `stats`, when given, gets
    the counts (steps to tune, steps timed, candidates compiled, compile workers, extra
    kernels compiled), the seconds spent waiting for compiles ("wait") and loading them here
    ("load": module import, Triton's cache lookup and cubin load). `extra`: the
    TritonKernels of the build that are not tuned (their heuristic configs), compiled by the
    same workers after the candidates, while this process times, into the cubin cache.
    `started`: worker processes already running (triton_aot.Workers), used instead of new
    ones."""
    # deferred: Triton is optional (GPU builds only)
    import triton

    device = torch.cuda.get_device_name()
    todo, copies, family, best = plan(families, hints, cache, device, triton.__version__)
    report: dict = {}
    if stats is not None:
        stats.update(steps=float(sum(len(f.items) for f in families)), timed=float(len(todo)),
                     candidates=float(sum(len(t) for _, t, _ in todo)), workers=0.0, wait=0.0,
                     prebuilt=0.0)
    if not todo:
        return best, report
    compiled = _compile_candidates(todo, cache, arch, workers, extra, started)
    if stats is not None and hasattr(compiled, "pool"):
        stats["workers"] = float(len(compiled.pool.procs))
    try:
        for i, (it, tks, path) in enumerate(todo):
            if progress is not None:
                progress(i, len(todo))
            fam = family[it.name]
            args = [a.fill_(True) if fam.label and getattr(a, "dtype", None) == torch.bool
                    else a for a in _args(tks[0], buffers, hints, torch)]
            sets = _cold_sets(args, torch) if fam.label in COLD_FAMILIES else None
            times = {}
            for j, tk in enumerate(tks):
                if (i, j) not in compiled:
                    continue
                rows = max(1, evaluate(tk.rows, hints))  # a template's depends on the tile
                grid = (-(-rows // tk.config.xblock), 1, 1)
                consts = [tk.config.xblock, tk.config.rblock]  # the launcher takes them too
                try:
                    times[j] = (_time_ms(compiled[(i, j)], grid, args + consts, torch)
                                if sets is None else
                                _time_cold_ms(compiled[(i, j)], grid, sets, consts, torch))
                except Exception:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                    if j == 0 or not fam.label:
                        raise
            win = min(times, key=lambda j: (times[j], j))
            name = f"{fam.label}_{it.name}" if fam.label else it.name
            report[name] = {_config_text(tks[j].config, bool(fam.label)): round(ms, 5)
                            for j, ms in times.items()}
            if fam.reference is not None:
                report[name].update(fam.reference(it))
            _keep(best, copies, it, tks, win, compiled[(i, win)], path, arch, cache, device,
                  name, report[name])
            del args, sets
        if hasattr(compiled, "store_extra"):
            n = compiled.store_extra()
            if stats is not None:
                stats["prebuilt"] = float(n)
                stats.update({f"worker_{k}": v for k, v in compiled.pool.seconds().items()})
    except BaseException:
        if hasattr(compiled, "close"):
            compiled.close(kill=True)  # the build fails: the workers' queues are not needed
        raise
    else:
        if hasattr(compiled, "close"):
            compiled.close()
    finally:
        if stats is not None and hasattr(compiled, "waited"):
            stats["wait"] = compiled.waited
            stats["load"] = compiled.loaded
    if progress is not None:
        progress(len(todo), len(todo))
    return best, report


def tune(kernels, buffers, hints: dict[str, int], base: dict[str, Config], arch: int,
         cache: Path, workers: int = 1, progress=None, select=None
         ) -> tuple[dict[str, Config], dict]:
    """The schedule kernels `select` keeps (default `worth_tuning`) tuned (`tune_all`):
    ({kernel name: best config}, {kernel name: {config text: ms}} of what ran)."""
    return tune_all([kernel_family(kernels, buffers, hints, base, select)], buffers, hints,
                    arch, cache, workers, progress)


def time_candidates(calls, candidates_of, print_kernel, buffers, hints: dict[str, int],
                    arch: int, cache: Path, workers: int = 1, *, label: str,
                    reference=None) -> tuple[dict[str, Config], dict]:
    """The template kernels of `calls` (one kernel a call, its grid depending on the
    candidate's tile: attention, convolution) tuned on the local GPU (`tune_all`): every
    candidate of `candidates_of(call, buffers, hints)` (the heuristic's first) printed with
    `print_kernel(call, buffers, hints, config)`, compiled, timed at the example sizes, the
    fastest kept (ties: the heuristic); a candidate Triton cannot compile or the device cannot
    launch (shared memory) is skipped. Bool operands are all true while timing (an all-false
    attention mask would time the fully masked path).

    Returns ({call name: best config}, {"<label>_<call name>": {config text: ms}} of what
    ran); `reference(call)`, when given, adds entries to a call's report (a peer's time)."""
    fam = template_family(calls, candidates_of, print_kernel, buffers, hints, label, reference)
    return tune_all([fam], buffers, hints, arch, cache, workers)


def tune_attention(calls, buffers, hints: dict[str, int], arch: int, cache: Path,
                   workers: int = 1) -> tuple[dict[str, Config], dict]:
    """The flash-attention kernels (targets/cuda/attention.py) of `calls`: the candidates of
    `attention_candidates` timed (`time_candidates`; report keys `attn_<call>`)."""
    return time_candidates(calls, attention_candidates, print_attention_kernel, buffers, hints,
                           arch, cache, workers, label="attn")
