"""Triton sources -> cubins, ahead of time, for given CUDA architectures (no GPU needed).

Input: the text of one generated Triton module (`print_triton_module`), its `TritonKernel`s,
the target architectures (e.g. (90,)) and a cache directory. Output: one `Cubin` per (kernel,
arch): the cubin bytes, the entry symbol, num_warps, the shared memory the launch needs, the
global scratch bytes per program and the parameter types the entry takes (the kernel's
signature without constexprs, then Triton's two scratch pointers).

Global scratch (what a kernel making TMA descriptors on the device writes them into: Triton
gives program p the `scratch` bytes at base + p * scratch) is accepted only for persistent
kernels (`TritonKernel.tiles`: the GEMM template), whose grid never exceeds the SM count, so
the model instance allocates the block once at creation (SMs x the largest per-program size)
and passes it to every launch, inside a CUDA graph too. Host-side descriptors (a CUtensorMap
per operand, encoded by the wrapper with cuTensorMapEncodeTiled and passed by value) would
need the wrapper to re-encode them whenever an operand's address or a size changes, i.e. on
every run of a dynamic-shape program and for every new graph; device-side descriptors follow
the kernel's own size arguments and need nothing from the wrapper but the block. Profiling
scratch (instrumentation) is rejected; so is global scratch for any other kernel.

Invariants: results are cached under `<cache>/triton/<sha256>/` where the hash covers the
kernel's source, signature, constexprs, num_warps, the architecture and the Triton version,
written to a temporary directory and renamed into place (concurrent builds never see half a
result). Kernels compile in this process and in worker processes (`compile_cubins`; those of
`Workers` where a build started them ahead, else their own), which hand back cubins and
metadata; `Pool` (launch-config tuning) also reports where Triton's own on-disk cache holds
each compile, which this process loads from those files (`load_compiled`). The module is
imported from a file (Triton reads the source of @triton.jit functions back through
`inspect`)."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from kiln.errors import CompileError, UnsupportedError
from kiln.toolchain.triton_warm import compile_args, metadata
import subprocess
import sys

# The modification time given to every module file: the cubins' line tables record the
# source file's mtime, so without it two builds of one model (serial or parallel) differed
SOURCE_MTIME = 315532800  # 1980-01-01, as zip files

# `compile_cubins` gives each compiling process at least this many kernels: a worker costs
# about 0.5 s (Python, then Triton's import) before its first compile, about one kernel's
PER_PROCESS = 2

@dataclass(frozen=True)
class Cubin:
    kernel: str
    arch: int
    symbol: str
    cubin: bytes
    num_warps: int
    shared: int
    arg_types: tuple[str, ...]
    scratch: int = 0  # global scratch bytes per program (0: the kernel needs none)


def triton_version() -> str:
    """Triton's version; an UnsupportedError naming the extra to install when it is absent
    (the CPU install, `pip install kiln`, has no Triton)."""
    try:
        # deferred: Triton is optional (GPU builds only)
        import triton
    except ImportError as e:
        raise UnsupportedError("CUDA builds compile their kernels with Triton, which is not "
                               f"installed here ({e}): pip install 'kiln[cuda]'") from None
    return triton.__version__


_KEY_LOCK = threading.Lock()  # one computation of Triton's key at a time (`warm_key`)


def _triton_key() -> str:
    """Triton's own cache key of its installation (a hash of its sources and of libtriton,
    about 400 MB: computed once per process, then handed to the compile workers)."""
    # deferred: Triton is optional (GPU builds only)
    from triton.runtime.cache import triton_key
    with _KEY_LOCK:
        return triton_key()


def warm_key() -> None:
    """Starts computing `_triton_key` in a thread (about 0.5 s, mostly hashing, which releases
    the GIL), so that the caller's next work overlaps it (a CUDA build's front end): the
    compile workers, which need the key, then start without waiting for it."""
    def run() -> None:
        try:
            _triton_key()
        except Exception:  # noqa: BLE001 - no Triton here: the compile reports it later
            pass

    threading.Thread(target=run, name="kiln-triton-key", daemon=True).start()


def warm_driver() -> threading.Thread:
    """Starts, in a thread, what this process's first launch of a Triton kernel would build:
    Triton's CUDA driver object and its utilities (`cuda_utils`, a C extension compiled with
    the system's C compiler on a cold Triton cache, about half a second, in a process of its
    own, which releases the GIL), so that launch-config tuning finds them ready. Without a
    CUDA driver the thread ends quietly (the first launch reports it)."""
    def run() -> None:
        try:
            # deferred: Triton is optional (GPU builds only)
            import triton
            triton.runtime.driver.active.utils  # noqa: B018 - built on first access
        except Exception:  # noqa: BLE001 - no driver or no Triton: reported at launch
            pass

    t = threading.Thread(target=run, name="kiln-triton-driver", daemon=True)
    t.start()
    return t


def module_path(text: str, cache: Path) -> tuple[Path, str]:
    """Where `import_module` keeps the module of `text`, and the module's name."""
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    return cache / "triton_src" / f"kiln_kernels_{key}.py", f"kiln_kernels_{key}"


def write_module(text: str, cache: Path) -> tuple[Path, str]:
    """`text` written to its `module_path` file (once), without importing it: worker
    processes import it from there; (path, module name)."""
    path, name = module_path(text, cache)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.utime(tmp, (SOURCE_MTIME, SOURCE_MTIME))
        os.replace(tmp, path)
    return path, name


def _written(tasks: list, cache: Path) -> list[tuple[Path, str]]:
    """(path, module name) of each (module text, ...) task, each distinct text hashed and
    written once (a tuning pass deals a few module texts, each holding many kernels, to
    dozens of tasks)."""
    seen: dict[int, tuple[Path, str]] = {}
    return [seen.get(id(t[0])) or seen.setdefault(id(t[0]), write_module(t[0], cache))
            for t in tasks]


def import_module(text: str, cache: Path):
    path, name = write_module(text, cache)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _key(kernel, arch: int, prelude_hash: str) -> str:
    parts = [kernel.source, kernel.signature, kernel.config.xblock, kernel.config.rblock,
             kernel.config.num_warps, arch, triton_version(), prelude_hash]
    if kernel.config.num_stages:  # attention kernels (row kernels' keys stay as they were)
        parts.append(kernel.config.num_stages)
    if kernel.constexprs:  # the GEMM template
        parts += [list(kernel.constexprs), kernel.num_stages]
    blob = json.dumps(parts)
    return hashlib.sha256(blob.encode()).hexdigest()


def _plain(kernel) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of a TritonKernel's compile, as plain data."""
    consts = dict(kernel.constexprs) or {"XBLOCK": kernel.config.xblock,
                                         "RBLOCK": kernel.config.rblock}
    options = {"num_warps": kernel.config.num_warps}
    stages = kernel.num_stages or kernel.config.num_stages
    if stages:
        options["num_stages"] = stages
    return dict(kernel.signature), consts, options


def compile_kernel(mod, kernel, arch: int):
    """Triton's CompiledKernel of `kernel` (a TritonKernel defined in module `mod`) for sm_arch;
    CompileError naming the kernel if Triton fails."""
    # deferred: Triton is optional (GPU builds only)
    import triton
    # deferred: Triton is optional (GPU builds only)
    from triton.backends.compiler import GPUTarget
    _triton_key()  # the key `warm_key` is hashing: waited for, not hashed a second time
    fn = getattr(mod, kernel.name)
    sig, consts, options = _plain(kernel)
    sig, consts, attrs = compile_args(sig, consts)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # Triton raises many types; name the kernel and keep the message
        raise CompileError(f"Triton failed to compile {kernel.name} for sm_{arch}: "
                           f"{type(e).__name__}: {e}") from e
    return ck


def load_compiled(mod, kernel, files: dict):
    """Triton's CompiledKernel of `kernel` (defined in module `mod`) from the cache files a
    worker's compile left (`Pool.compiled_files`), not looked up again by Triton's cache key:
    the key this process computes can differ from the worker's. (torch.compile, run earlier in
    the process, sets TRITON_PTXAS_PATH after Triton here cached the ptxas version it hashes
    into every key; each lookup then missed and every tuning candidate was compiled a second
    time here: 18-43 s of a compile on the H100.) None when a file is gone."""
    # deferred: Triton is optional (GPU builds only)
    import triton
    from triton.compiler.compiler import CompiledKernel
    group = files.get("files") or {}
    if not any(k.endswith(".json") for k in group) or \
            not all(Path(v).exists() for v in group.values()):
        return None
    sig, consts, _ = _plain(kernel)
    sig, consts, attrs = compile_args(sig, consts)
    src = triton.compiler.ASTSource(fn=getattr(mod, kernel.name), signature=sig,
                                    constexprs=consts, attrs=attrs)
    return CompiledKernel(src, group, files["hash"])


def _compile_one(mod, kernel, arch: int) -> Cubin:
    return _to_cubin(compile_kernel(mod, kernel, arch), kernel, arch)


def store_compiled(ck, kernel, arch: int, prelude_hash: str, cache: Path) -> None:
    """Puts an already compiled kernel (the autotuner's winner) into the cubin cache."""
    _store(cache / "triton" / _key(kernel, arch, prelude_hash), _to_cubin(ck, kernel, arch))


def store_cubin(cubin: Cubin, kernel, arch: int, prelude_hash: str, cache: Path) -> None:
    """Puts a cubin compiled elsewhere (a worker of `Pool`) into the cubin cache, where
    `compile_cubins` finds it."""
    d = cache / "triton" / _key(kernel, arch, prelude_hash)
    if not (d / "meta.json").exists():
        _store(d, cubin)


def _to_cubin(ck, kernel, arch: int) -> Cubin:
    return _from_meta(metadata(ck), bytes(ck.asm["cubin"]), kernel, arch)


def _from_meta(md: dict, cubin: bytes, kernel, arch: int) -> Cubin:
    if md["profile_scratch_size"]:
        raise CompileError(f"{kernel.name}: Triton asked for profiling scratch memory, which "
                           "kiln's launcher does not provide")
    scratch = md["global_scratch_size"]
    if scratch and getattr(kernel, "tiles", None) is None:
        raise CompileError(f"{kernel.name}: Triton asked for global scratch memory, which kiln "
                           "provides only to persistent kernels (grid at most the SM count)")
    align = max(md["global_scratch_align"] or 1, 1)
    if align > 256:  # the block comes from cuMemAlloc, 256-byte aligned
        raise CompileError(f"{kernel.name}: global scratch aligned to {align} bytes")
    args = tuple(t for t in kernel.signature.values() if t != "constexpr") + ("*scratch",) * 2
    return Cubin(kernel.name, arch, md["name"], cubin, md["num_warps"], md["shared"], args,
                 scratch)


def _load_cached(d: Path, kernel, arch: int) -> Cubin | None:
    meta = d / "meta.json"
    if not meta.exists():
        return None
    m = json.loads(meta.read_text())
    return Cubin(kernel.name, arch, m["symbol"], (d / "kernel.cubin").read_bytes(),
                 m["num_warps"], m["shared"], tuple(m["arg_types"]), m.get("scratch", 0))


def _store(d: Path, c: Cubin) -> None:
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=d.name + "."))
    try:
        (tmp / "kernel.cubin").write_bytes(c.cubin)
        (tmp / "meta.json").write_text(json.dumps({
            "symbol": c.symbol, "num_warps": c.num_warps, "shared": c.shared,
            "arg_types": list(c.arg_types), "scratch": c.scratch}))
        try:
            os.rename(tmp, d)
        except OSError:  # another process stored it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Workers:
    """Compile worker processes (kiln/toolchain/triton_warm.py `--serve`) started ahead of
    their tasks, e.g. at the start of a CUDA build while its front end runs, so that their
    start (Python, Triton's import: about half a second each) is over when the tasks come;
    `Pool` and `compile_cubins` then hand them jobs instead of starting processes of their
    own, launch-config tuning and the cubins stage the same processes. `n` processes (none
    where Triton is not installed), spawned by a thread (tens of ms each from a process as
    large as one that imported torch), which then sends them Triton's cache key
    (`_triton_key`, which they need) once this process has it. `close()` (or the object's
    collection, or the interpreter's exit) ends them: they exit when their stdin closes."""

    def __init__(self, n: int) -> None:
        self.procs: list = []
        self._spawned = threading.Event()  # self.procs is complete
        self._ready = threading.Event()  # the key went out: jobs may follow it
        self._lock = threading.Lock()
        if n < 1 or importlib.util.find_spec("triton") is None:
            self._spawned.set()
            self._ready.set()
            return
        self._finalizer = weakref.finalize(self, _end, self.procs, True)
        threading.Thread(target=self._start, args=(n,), name="kiln-workers",
                         daemon=True).start()

    def _start(self, n: int) -> None:
        script = str(Path(__file__).with_name("triton_warm.py"))
        try:
            for _ in range(n):
                self.procs.append(subprocess.Popen(
                    [sys.executable, script, "--serve"], stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True))
        except OSError:  # (out of processes: the stages start their own or compile here)
            pass
        finally:
            self._spawned.set()
        try:
            key = _triton_key()
        except Exception:  # noqa: BLE001 - no Triton: the compile reports it
            key = ""
        try:
            with self._lock:
                for p in self.procs:
                    _write(p, {"triton_key": key})
        finally:
            self._ready.set()

    def alive(self) -> list[int]:
        """The indices of the workers still running."""
        self._spawned.wait()
        return [w for w, p in enumerate(self.procs) if p.poll() is None]

    def send(self, w: int, job: dict) -> bool:
        """Queues `job` ({"tasks": rows, "out": directory}, as triton_warm.py reads it) on
        worker `w`; False where the worker is gone."""
        self._ready.wait()
        with self._lock:
            return _write(self.procs[w], job)

    def close(self, kill: bool = False) -> None:
        """Ends the workers once their queued jobs are done (`kill`: at once)."""
        self._spawned.wait()
        if self.procs:
            with self._lock:  # (not while the key is being written)
                _end(self.procs, kill)
            self._finalizer.detach()
            self.procs = []


def _write(proc, job: dict) -> bool:
    try:
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        return True
    except (OSError, ValueError):  # the worker is gone (or its pipe closed)
        return False


def _end(procs: list, kill: bool = False) -> None:
    for p in procs:
        if kill:
            p.kill()
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _rows(tasks: list, cache: Path, flags: list | None = None) -> list:
    """triton_warm.py's rows of (module text, TritonKernel, arch) tasks (each module written
    to its file first: the workers import it from there)."""
    rows = []
    for n, ((_, kernel, arch), (path, name)) in enumerate(
            zip(tasks, _written(tasks, cache), strict=True)):
        sig, consts, options = _plain(kernel)
        row = [str(path), name, kernel.name, sig, consts, options, arch]
        if flags is not None:
            row.append(bool(flags[n]))
        rows.append(row)
    return rows


class Pool:
    """Worker processes (kiln/toolchain/triton_warm.py) compiling (module text, TritonKernel,
    arch) tasks, started at once (or, given `started`, the `Workers` already running, which
    this pool then only hands jobs) and left running while the caller works: up to `workers`
    processes (one per task at most; none for fewer than 2 tasks: the caller then compiles
    them itself), the tasks dealt round-robin in their order, so the first tasks finish
    first. `wait(t)` returns once task t's worker is past it (compiled, failed, or the
    worker gone): compiling it in this process then reads Triton's on-disk cache; `cubin(t,
    kernel, arch)` is its result (None where it failed); `close()` waits for the rest and
    removes the workers' files (processes of `started` keep running). `launchers` (one flag,
    or one per task): the workers build Triton's host launchers too (for kernels this process
    will launch), before marking a task done.

    With `started` workers the tasks are not dealt ahead but handed out in their order, one at
    a time, to whichever worker is free (a thread of this pool watches them: `_dispatch`):
    tasks' compile times differ tenfold (a convolution template against a pointwise kernel),
    and dealt round-robin the busiest of 16 workers had twice the average's work (resnet18 on
    the H100: 3.1 s against 1.6 s, the tuner waiting on it)."""

    def __init__(self, tasks: list[tuple[str, object, int]], cache: Path, workers: int,
                 launchers: bool | list[bool] = False, started: Workers | None = None) -> None:
        self.procs: list = []
        self.where: dict[int, tuple[int, Path, int]] = {}  # task -> (worker, out dir, index)
        self.tmp: str | None = None
        self.started = started
        self._feeder: threading.Thread | None = None
        self._stop = threading.Event()
        ready = started.alive() if started is not None else []
        ready = ready if len(ready) >= 2 else []  # (one left running: a pool of its own)
        n = min(min(workers, len(ready)) if ready else workers, len(tasks))
        if n < 2:
            return
        flags = launchers if isinstance(launchers, list) else [launchers] * len(tasks)
        rows = _rows(tasks, cache, flags)
        self.tmp = tempfile.mkdtemp(prefix="kiln_pool_")
        if ready:
            outs = []
            for w, proc in enumerate(ready[:n]):
                self.procs.append(started.procs[proc])
                outs.append(Path(self.tmp) / str(w))
                outs[-1].mkdir()
            self._feeder = threading.Thread(target=self._dispatch, args=(rows, ready[:n], outs),
                                            name="kiln-pool-feeder", daemon=True)
            self._feeder.start()
            return
        script = str(Path(__file__).with_name("triton_warm.py"))
        key = _triton_key()
        for w in range(n):
            mine = list(range(w, len(tasks), n))
            out = Path(self.tmp) / str(w)
            out.mkdir()
            job = {"tasks": [rows[t] for t in mine], "out": str(out)}
            (out / "tasks.json").write_text(json.dumps({**job, "triton_key": key}))
            self.procs.append(subprocess.Popen(
                [sys.executable, script, str(out / "tasks.json")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.where.update({t: (w, out, i) for i, t in enumerate(mine)})

    def _dispatch(self, rows: list, ready: list[int], outs: list[Path]) -> None:
        """Hands task after task, in order, to the first of the `ready` workers to be free
        (its last task done or failed), until none is left or `close(kill=True)`; a worker
        that ended gets no more (the tasks it held are compiled by the caller). Task t's
        files are `t.json` / `t.failed` in its worker's folder `outs[w]`."""
        current: list[int | None] = [None] * len(ready)
        todo = list(range(len(rows)))[::-1]  # (popped from the end: in order)
        while todo and not self._stop.is_set():
            idle = [w for w in range(len(ready)) if self.procs[w].poll() is None and (
                current[w] is None or self._done(outs[w], current[w]))]
            if not idle and not any(p.poll() is None for p in self.procs):
                break  # every worker ended: the caller compiles what is left
            for w in idle:
                if not todo:
                    break
                t = todo.pop()
                self.where[t] = (w, outs[w], t)
                current[w] = t
                job = {"tasks": [rows[t]], "out": str(outs[w]), "first": t}
                if not self.started.send(ready[w], job):
                    self.where.pop(t)
                    todo.append(t)
            if not idle:  # (5 ms: tasks take 0.1-1.5 s; rarer wake-ups take the GIL
                time.sleep(0.005)  # less often from the caller, which times kernels)

    @staticmethod
    def _done(out: Path, i: int) -> bool:
        return (out / f"{i}.json").exists() or (out / f"{i}.failed").exists()

    def wait(self, t: int) -> None:
        while t not in self.where and self._feeder is not None and self._feeder.is_alive():
            time.sleep(0.002)  # not handed out yet
        loc = self.where.get(t)
        if loc is None:
            return
        w, out, i = loc
        proc = self.procs[w]
        while not ((out / f"{i}.json").exists() or (out / f"{i}.failed").exists()):
            if proc.poll() is not None:
                return
            time.sleep(0.005)

    def cubin(self, t: int, kernel, arch: int) -> Cubin | None:
        self.wait(t)  # (handed out by then, unless no worker is left)
        if t not in self.where:
            return None
        _, out, i = self.where[t]
        return _read_result(out, i, kernel, arch)

    def compiled_files(self, t: int) -> dict | None:
        """Where Triton's cache holds task t's compile ({"hash", "files"}: `load_compiled`),
        None where the task failed or ran here."""
        self.wait(t)
        if t not in self.where:
            return None
        _, out, i = self.where[t]
        meta = out / f"{i}.json"
        return json.loads(meta.read_text()).get("triton") if meta.exists() else None

    def seconds(self) -> dict[str, float]:
        """The workers' seconds so far, summed over the tasks done: "compile" (Triton's
        compiles) and "launcher" (host launchers built), and "busiest": the most compile and
        launcher seconds of one worker (the pool's critical path when it is the busiest)."""
        out = {"compile": 0.0, "launcher": 0.0}
        per: dict[int, float] = {}
        for w, o, i in list(self.where.values()):
            try:
                s = json.loads((o / f"{i}.json").read_text()).get("seconds") or {}
            except (OSError, ValueError):
                continue
            for k in out:
                out[k] += s.get(k, 0.0)
            per[w] = per.get(w, 0.0) + s.get("compile", 0.0) + s.get("launcher", 0.0)
        out["busiest"] = max(per.values(), default=0.0)
        return out

    def close(self, kill: bool = False) -> None:
        """Waits for the workers' tasks (`kill`: stops the workers, shared ones too: the
        caller failed and needs no more)."""
        shared = {id(p) for p in (self.started.procs if self.started is not None else ())}
        if kill:
            self._stop.set()
        if self._feeder is not None:
            self._feeder.join()
        if kill and shared and self.started is not None:
            self.started.close(kill=True)
        for p in self.procs:
            if kill:
                p.kill()
            if id(p) in shared and not kill:
                continue
            try:
                p.wait(timeout=600)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not kill:
            for t in list(self.where):  # the shared workers' tasks (their processes go on)
                self.wait(t)
        self.procs = []
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def canonical(kernel) -> str:
    """A hash of what Triton compiles for `kernel`, independent of the names kiln gives it:
    the kernel's own name, its parameters and its local variables renamed by position,
    comments dropped (ast.unparse), plus the parameter types, constexprs and config. Two
    kernels of one build with the same hash compile to the same code but for the entry name
    (e.g. the same LayerNorm in every transformer block), so one cubin serves both."""
    tree = ast.parse(kernel.source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    used = [n for n in ast.walk(fn) if isinstance(n, ast.Name)]  # (one walk, in its order)
    local = {a.arg for a in fn.args.args} | {n.id for n in used if isinstance(n.ctx, ast.Store)}
    names: dict[str, str] = {}

    def rename(name: str) -> str:
        return names.setdefault(name, f"_v{len(names)}")

    fn.name = "_kernel"
    for a in fn.args.args:
        a.arg = rename(a.arg)
    for n in used:
        if n.id in local:
            n.id = rename(n.id)
    blob = json.dumps([ast.unparse(tree), list(kernel.signature.values()), kernel.config.xblock,
                       kernel.config.rblock, kernel.config.num_warps, kernel.config.num_stages,
                       list(kernel.constexprs), kernel.num_stages])
    return hashlib.sha256(blob.encode()).hexdigest()


def compile_cubins(module_text: str, kernels: list, archs: tuple[int, ...], cache: Path,
                   workers: int = 1, *, prelude: str,
                   progress: Callable[[int, int], None] | None = None,
                   started: Workers | None = None
                   ) -> tuple[dict[tuple[str, int], Cubin], dict[str, float]]:
    """Every kernel of the module for every arch; returns {(kernel, arch): Cubin} and timings.
    `prelude`: the helper functions the module starts with (part of each kernel's cache key).

    Kernels that compile to the same code (`canonical`) are compiled once: the others get
    that cubin, whose entry keeps the first kernel's name. What the cache lacks is compiled
    by up to `workers` processes (at least PER_PROCESS kernels each): this one and workers
    (kiln/toolchain/triton_warm.py), each given its share of the kernels (largest first,
    dealt round-robin), which return cubins and metadata, so nothing compiles twice. Not
    threads: Triton's front end builds Python ASTs, CPython 3.11's AST converter keeps its
    recursion counter per interpreter (two threads compiling at once can fail with "AST
    constructor recursion depth mismatch"), and the work holds the GIL. `progress(done,
    total)`, when given, counts the (kernel, arch) pairs ready (cache hits and kernels
    compiled in this process as they finish, the workers' as their results appear)."""
    t0 = time.perf_counter()
    root = cache / "triton"
    prelude_hash = hashlib.sha256(prelude.encode()).hexdigest()
    out: dict[tuple[str, int], Cubin] = {}
    todo, same = [], {}  # kernels to compile; (kernel, arch) -> the kernel compiled for it
    first: dict[tuple[str, int], Any] = {}  # (canonical, arch) -> the kernel compiled
    cached: dict[tuple[str, int], Cubin] = {}  # (canonical, arch) -> a cubin the cache had
    # the cache's own entries first; `canonical` (an AST pass, ~6 ms a kernel) only where one
    # is missing: after launch tuning, whose workers stored every kernel, there is none
    dirs = {(k.name, a): root / _key(k, a, prelude_hash) for k in kernels for a in archs}
    found = {(k.name, a): _load_cached(dirs[(k.name, a)], k, a) for k in kernels for a in archs}
    canon = {k.name: canonical(k) for k in kernels} if None in found.values() else {}
    if canon:
        for k in kernels:
            for a in archs:
                if found[(k.name, a)] is not None:
                    cached.setdefault((canon[k.name], a), found[(k.name, a)])
    for k in kernels:
        for a in archs:
            d = dirs[(k.name, a)]
            hit = found[(k.name, a)] or (
                replace(cached[(canon[k.name], a)], kernel=k.name)
                if (canon[k.name], a) in cached else None)
            if hit is not None:
                out[(k.name, a)] = hit
                continue
            rep = first.setdefault((canon[k.name], a), k)
            same[(k.name, a)] = (rep, d)
            if rep is k:
                todo.append((k, a, d))
    hits = len(out)
    tick = None if progress is None else \
        (lambda n: progress(min(hits + n, len(todo) + hits), len(todo) + hits))
    if tick is not None:
        tick(0)
    done, used = _compile_parallel(module_text, todo, cache, workers, tick, started)
    for k, a, d in todo:
        _store(d, done[(k.name, a)])
    for (name, a), (rep, d) in same.items():
        c = done[(rep.name, a)]
        if rep.name != name:
            c = replace(c, kernel=name)
            _store(d, c)
        out[(name, a)] = c
    return out, {"triton": time.perf_counter() - t0, "cache_hits": float(hits),
                 "compiled": float(len(todo)), "shared": float(len(same) - len(todo)),
                 "workers": float(used)}


def _compile_parallel(module_text: str, todo: list, cache: Path, workers: int,
                      tick: Callable[[int], None] | None = None,
                      started: Workers | None = None
                      ) -> tuple[dict[tuple[str, int], Cubin], int]:
    """{(kernel, arch): Cubin} for each (kernel, arch, _) of `todo`, compiled by this process
    and up to `workers - 1` worker processes: those of `started` that are running (one kernel
    each at least: they have started already), else ones started here (PER_PROCESS kernels
    each at least); the number of workers used. A kernel a worker did not return (it failed
    there) is compiled here, which reports the failure."""
    if not todo:
        return {}, 0
    mod = import_module(module_text, cache)
    order = sorted(range(len(todo)), key=lambda i: -len(todo[i][0].source))
    ready = (started.alive() if started is not None else [])[:max(0, workers - 1)]
    n = min(1 + len(ready), len(todo)) if ready else \
        max(1, min(workers, len(todo) // PER_PROCESS))
    shares = [[todo[i] for i in order[j::n]] for j in range(n)]
    procs = []
    with tempfile.TemporaryDirectory(prefix="kiln_triton_") as tmp:
        for j, share in enumerate(shares[1:], 1):
            outdir = Path(tmp) / str(j)
            if ready:
                outdir.mkdir(parents=True)
                job = {"tasks": _rows([(module_text, k, a) for k, a, _ in share], cache),
                       "out": str(outdir)}
                if started.send(ready[j - 1], job):
                    procs.append((started.procs[ready[j - 1]], outdir))
                    continue
                outdir = Path(tmp) / f"{j}.own"  # that worker just ended: one of our own
            procs.append(_start_worker(module_text, share, cache, outdir))
        done = {}
        for k, a, _ in shares[0]:
            done[(k.name, a)] = _compile_one(mod, k, a)
            if tick is not None:  # the workers' results written so far count too
                tick(len(done) + sum(len(list(d.glob("*.cubin"))) for _, d in procs))
        for (proc, outdir), share in zip(procs, shares[1:]):
            _wait_files(proc, outdir, len(share))
            for i, (k, a, _) in enumerate(share):
                c = _read_result(outdir, i, k, a)
                done[(k.name, a)] = c if c is not None else _compile_one(mod, k, a)
            if tick is not None:
                tick(len(done))
    return done, len(procs)


def _wait_files(proc, outdir: Path, n: int, timeout: float = 600) -> None:
    """Until tasks 0..n-1 of a worker's job in `outdir` are done (a result or `.failed`), the
    worker has ended, or `timeout` seconds have passed (the worker is then stopped, unless
    it is a shared one: `Workers` ends those)."""
    end = time.monotonic() + timeout
    for i in range(n):
        while not ((outdir / f"{i}.json").exists() or (outdir / f"{i}.failed").exists()):
            if proc.poll() is not None:
                return
            if time.monotonic() > end:
                if proc.stdin is None:  # one of this call's own
                    proc.kill()
                    proc.wait()
                return
            time.sleep(0.005)
    if proc.stdin is None:  # one of this call's own: it exits after its last task
        proc.wait()


def _start_worker(module_text: str, share: list, cache: Path, outdir: Path):
    path, name = module_path(module_text, cache)
    rows = []
    for k, a, _ in share:
        sig, consts, options = _plain(k)
        rows.append([str(path), name, k.name, sig, consts, options, a])
    outdir.mkdir(parents=True)
    (outdir / "tasks.json").write_text(json.dumps({"tasks": rows, "out": str(outdir),
                                                   "triton_key": _triton_key()}))
    script = str(Path(__file__).with_name("triton_warm.py"))
    proc = subprocess.Popen([sys.executable, script, str(outdir / "tasks.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, outdir


def _read_result(outdir: Path, i: int, kernel, arch: int) -> Cubin | None:
    meta, data = outdir / f"{i}.json", outdir / f"{i}.cubin"
    if not (meta.exists() and data.exists()):
        return None
    return _from_meta(json.loads(meta.read_text()), data.read_bytes(), kernel, arch)
