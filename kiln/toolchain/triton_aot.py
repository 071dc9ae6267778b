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
result). Kernels compile in this thread (see `compile_cubins`), after `prewarm` has compiled
them in worker processes when there are enough of them: each worker leaves its results in
Triton's own on-disk cache, which the in-process compile then reads back. The module is
imported from a file (Triton reads the source of @triton.jit functions back through
`inspect`)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import CompileError
from kiln.toolchain.triton_warm import compile_args
import subprocess
import sys

# `prewarm` starts a worker process only for at least this many kernels per worker: a worker
# costs a fraction of a second (Python, then Triton's import) before its first compile
PER_WORKER = 3


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
    # deferred: Triton is optional (GPU builds only)
    import triton
    return triton.__version__


def module_path(text: str, cache: Path) -> tuple[Path, str]:
    """Where `import_module` keeps the module of `text`, and the module's name."""
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    return cache / "triton_src" / f"kiln_kernels_{key}.py", f"kiln_kernels_{key}"


def import_module(text: str, cache: Path):
    path, name = module_path(text, cache)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
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


def _compile_one(mod, kernel, arch: int) -> Cubin:
    return _to_cubin(compile_kernel(mod, kernel, arch), kernel, arch)


def store_compiled(ck, kernel, arch: int, prelude_hash: str, cache: Path) -> None:
    """Puts an already compiled kernel (the autotuner's winner) into the cubin cache."""
    _store(cache / "triton" / _key(kernel, arch, prelude_hash), _to_cubin(ck, kernel, arch))


def _to_cubin(ck, kernel, arch: int) -> Cubin:
    md = ck.metadata
    if getattr(md, "profile_scratch_size", 0):
        raise CompileError(f"{kernel.name}: Triton asked for profiling scratch memory, which "
                           "kiln's launcher does not provide")
    scratch = getattr(md, "global_scratch_size", 0)
    if scratch and getattr(kernel, "tiles", None) is None:
        raise CompileError(f"{kernel.name}: Triton asked for global scratch memory, which kiln "
                           "provides only to persistent kernels (grid at most the SM count)")
    align = max(getattr(md, "global_scratch_align", 1), 1)
    if align > 256:  # the block comes from cuMemAlloc, 256-byte aligned
        raise CompileError(f"{kernel.name}: global scratch aligned to {align} bytes")
    args = tuple(t for t in kernel.signature.values() if t != "constexpr") + ("*scratch",) * 2
    return Cubin(kernel.name, arch, md.name, bytes(ck.asm["cubin"]), md.num_warps, md.shared,
                 args, scratch)


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


def prewarm(tasks: list[tuple[str, object, int]], cache: Path, workers: int) -> int:
    """Compiles each (module text, TritonKernel, arch) of `tasks` in up to `workers` worker
    processes (kiln/toolchain/triton_warm.py, which imports Triton only), so that compiling
    them again in this process reads Triton's on-disk cache. Processes rather than threads:
    the work holds the GIL, and CPython 3.11's AST converter fails when two threads run it at
    once. A worker's failure is ignored (the in-process compile reports it). Returns the
    number of workers started (none for fewer than 2 x PER_WORKER tasks)."""
    n = min(workers, len(tasks) // PER_WORKER)
    if n < 2:
        return 0
    rows = []
    for text, kernel, arch in tasks:
        path, name = module_path(text, cache)
        if not path.exists():  # the workers import the module from its file
            import_module(text, cache)
        sig, consts, options = _plain(kernel)
        rows.append([str(path), name, kernel.name, sig, consts, options, arch])
    script = str(Path(__file__).with_name("triton_warm.py"))
    procs, files = [], []
    for i in range(n):
        fd, path = tempfile.mkstemp(prefix="kiln_warm_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"tasks": rows[i::n]}, f)
        files.append(path)
        procs.append(subprocess.Popen([sys.executable, script, path],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        for p in procs:
            try:
                p.wait(timeout=600)
            except subprocess.TimeoutExpired:
                p.kill()
    finally:
        for path in files:
            os.unlink(path)
    return n


def compile_cubins(module_text: str, kernels: list, archs: tuple[int, ...], cache: Path,
                   workers: int = 1, *, prelude: str
                   ) -> tuple[dict[tuple[str, int], Cubin], dict[str, float]]:
    """Every kernel of the module for every arch; returns {(kernel, arch): Cubin} and timings.
    `prelude`: the helper functions the module starts with (part of each kernel's cache key).

    Kernels compile one after another in this thread. Triton's front end builds Python ASTs,
    and CPython 3.11's AST converter keeps its recursion counter per interpreter, not per
    thread: two threads compiling at once can fail with "AST constructor recursion depth
    mismatch" (seen in CI). Threads also bought nothing, the work holds the GIL: resnet18's
    CUDA kernels took 2.4-3.4 s with one thread or two. With `workers` > 1 and enough kernels
    to compile, `prewarm` compiles them in worker processes first."""
    t0 = time.perf_counter()
    root = cache / "triton"
    prelude_hash = hashlib.sha256(prelude.encode()).hexdigest()
    out: dict[tuple[str, int], Cubin] = {}
    todo = []
    for k in kernels:
        for a in archs:
            d = root / _key(k, a, prelude_hash)
            hit = _load_cached(d, k, a)
            if hit is not None:
                out[(k.name, a)] = hit
            else:
                todo.append((k, a, d))
    hits = len(out)
    warmed = prewarm([(module_text, k, a) for k, a, _ in todo], cache, workers) if todo else 0
    if todo:
        mod = import_module(module_text, cache)
        for k, a, d in todo:
            c = _compile_one(mod, k, a)
            _store(d, c)
            out[(k.name, a)] = c
    return out, {"triton": time.perf_counter() - t0, "cache_hits": float(hits),
                 "compiled": float(len(todo)), "workers": float(warmed)}

