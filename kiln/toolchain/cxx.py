"""Compile C++ sources into one shared library.

Each source becomes an object file cached under `<cache>/obj/<sha256>.o`, the hash covering
the source text, the flags, the compiler's identity and the content of every header in the
include dirs; the link result is cached the same way. Sources compile in parallel (one compiler
process per source, up to `jobs`). Writes go to a temporary name and are renamed into place, so
concurrent builds of the same model never see half-written files; an object is compiled by one
process at a time (a lock file per key under `<cache>/obj_lock/`): another process that needs
the same object waits for it instead of compiling it again.

With KILN_PCH=1 (kiln/config.py; GCC only) a file's leading `#include` lines (after comments
and blank lines, before anything else) are compiled once into a precompiled header under
`<cache>/pch/<sha256>/` (keyed like an object file, flags included) and the file is compiled
with `-include` of it and those lines commented out: the same translation unit, the same
object code (tests/runtime/test_pch.py compares it), without re-parsing kiln_model_rt.h's
standard headers in every file. A file whose precompiled header another process is still
building compiles without one. Objects are cached under the same key either way."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from kiln import config
from kiln.errors import CompileError
import time

#: kiln's runtime headers every target's generated C++ may include (kiln/runtime: the C ABI,
#: the shared model-side headers, the plan); a target adds its own (kiln/targets/<name>/include)
RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
INCLUDE_DIRS = (RUNTIME / "include", RUNTIME / "model", RUNTIME / "src")


@dataclass(frozen=True)
class Toolchain:
    cxx: str
    cache: Path
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    include_dirs: tuple[Path, ...]
    jobs: int
    #: use a precompiled header of a source's leading includes where one is already built
    #: (`prebuild_header`, started ahead by the caller), never building or waiting for one
    #: here (KILN_PCH=1 builds them on demand for every toolchain)
    pch_ready: bool = False


@lru_cache(maxsize=8)
def compiler_identity(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise CompileError(f"C++ compiler {cxx!r} is not usable: {e}") from e
    return out.stdout.splitlines()[0] if out.stdout else cxx


#: x86-64 instruction-set extensions a package may need, by the macro the compiler defines
#: when its flags enable one, and the name the runtime checks (kiln/runtime/src/cpu.cpp)
CPU_FEATURES = {
    "__SSE3__": "sse3", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4.1", "__SSE4_2__": "sse4.2",
    "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
    "__F16C__": "f16c", "__BMI__": "bmi", "__BMI2__": "bmi2", "__LZCNT__": "lzcnt",
    "__MOVBE__": "movbe", "__AVX512F__": "avx512f", "__AVX512CD__": "avx512cd",
    "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl",
    "__AVX512IFMA__": "avx512ifma", "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512vbmi2", "__AVX512VNNI__": "avx512vnni",
    "__AVX512BITALG__": "avx512bitalg", "__AVX512VPOPCNTDQ__": "avx512vpopcntdq",
    "__AVX512BF16__": "avx512bf16", "__AVX512FP16__": "avx512fp16", "__AVXVNNI__": "avxvnni",
    "__GFNI__": "gfni", "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq",
    "__AMX_TILE__": "amx-tile", "__AMX_INT8__": "amx-int8", "__AMX_BF16__": "amx-bf16",
}


@lru_cache(maxsize=16)
def cpu_features(cxx: str, flags: tuple[str, ...]) -> tuple[str, ...]:
    """The instruction-set extensions code compiled with `flags` (e.g. -march=native) may
    use, as the runtime names them (sorted): what a package records in its manifest and the
    loader checks before it maps the code. Empty where the compiler defines none (not x86)."""
    try:
        out = subprocess.run([cxx, *flags, "-dM", "-E", "-x", "c++", "-"], input="",
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise CompileError(f"C++ compiler {cxx!r} rejects {' '.join(flags)}: "
                           f"{getattr(e, 'stderr', '') or e}") from e
    defined = {ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("#define ")}
    return tuple(sorted(name for macro, name in CPU_FEATURES.items() if macro in defined))


def _headers_digest(dirs: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(Path(d).glob("*.h")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def build_executable(tc: Toolchain, source: str, name: str, what: str,
                     libs: tuple[str, ...] = ()) -> Path:
    """A standalone program (an autotuning driver) compiled from `source` with the toolchain's
    flags and `libs` after them, cached under `<cache>/autotune_bin/<name>_<hash>` (the hash
    covering the source, the flags, the compiler's identity and the headers), its source
    beside it; written under a temporary name and renamed into place."""
    key = hashlib.sha256("\0".join([source, " ".join(tc.cflags), " ".join(tc.ldflags),
                                    " ".join(libs), compiler_identity(tc.cxx),
                                    _headers_digest(tc.include_dirs)]).encode()).hexdigest()[:24]
    exe = Path(tc.cache) / "autotune_bin" / f"{name}_{key}"
    if exe.exists():
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    cpp = exe.with_suffix(".cpp")
    cpp.write_text(source)
    tmp = _atomic_output(exe)
    _run([tc.cxx, *tc.cflags, *[f"-I{d}" for d in tc.include_dirs], str(cpp), "-o", str(tmp),
          *tc.ldflags, *libs], what)
    tmp.replace(exe)
    return exe


def _atomic_output(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=final.name + ".", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"{what} failed ({' '.join(cmd[:3])} ...):\n{proc.stderr[-4000:]}")


def _write_once(path: Path, text: str) -> None:
    if not path.exists():
        tmp = _atomic_output(path)
        tmp.write_text(text)
        tmp.replace(path)


def split_prelude(source: str) -> tuple[list[str], str]:
    """The leading `#include <...>` / `#include "..."` and `#define` lines of `source` (only
    comments and blank lines may come before or between them; an include's trailing comment
    dropped), and the source with each of them commented out (line numbers kept). None:
    ([], source)."""
    lines = source.split("\n")
    prelude = []
    for k, line in enumerate(lines):
        s = line.strip()
        m = _PRELUDE.match(s)
        if m:
            prelude.append(m.group(1))
            lines[k] = f"// (precompiled) {line}"
        elif s and not s.startswith("//"):
            break
    return prelude, "\n".join(lines) if prelude else source


_PRELUDE = re.compile(r'(#include\s*(?:<[^>]*>|"[^"]*")|#define\s+\w+(?:[ \t][^/]*)?)\s*(?://.*)?$')


def precompiled_header(tc: Toolchain, includes: list[str], flags: tuple[str, ...],
                       headers: str) -> Path | None:
    """The header (its `.gch` beside it) holding `includes`, compiled with `flags`; None
    while another process builds it."""
    text = "\n".join(includes) + "\n"
    d = _pch_dir(tc, includes, flags, headers)
    header, gch = d / "prelude.h", d / "prelude.h.gch"
    if gch.exists():
        return header
    d.mkdir(parents=True, exist_ok=True)
    _write_once(header, text)
    with open(d / "lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process is building it
            return None
        if not gch.exists():
            tmp = _atomic_output(d / "prelude.gch.tmp")
            try:
                _run([tc.cxx, *flags, *[f"-I{i}" for i in tc.include_dirs], "-x", "c++-header",
                      str(header), "-o", str(tmp)], "precompiling the header of " + text[:60])
                tmp.replace(gch)
            finally:
                tmp.unlink(missing_ok=True)
    return header


def _use_pch(tc: Toolchain) -> bool:
    return config.pch() and "clang" not in compiler_identity(tc.cxx).lower()


def _pch_dir(tc: Toolchain, includes: list[str], flags: tuple[str, ...], headers: str) -> Path:
    text = "\n".join(includes) + "\n"
    key = hashlib.sha256("\0".join([text, " ".join(flags), compiler_identity(tc.cxx),
                                     headers]).encode()).hexdigest()
    return tc.cache / "pch" / key


def prebuild_header(tc: Toolchain, includes: list[str], extra: tuple[str, ...] = ()
                    ) -> threading.Thread:
    """Starts precompiling `includes` (the leading includes of sources that `tc` will compile
    with `extra` flags) in a thread (the compiler is its own process), so that a later
    `compile_object` of such a source with `tc.pch_ready` finds the header built and compiles
    only the rest (a CUDA wrapper: about half its compile). Failures are silent: that compile
    then compiles the whole source, as without it."""
    def run() -> None:
        try:
            if "clang" not in compiler_identity(tc.cxx).lower():
                precompiled_header(tc, includes, (*tc.cflags, *extra),
                                   _headers_digest(tc.include_dirs))
        except (CompileError, OSError):
            pass

    t = threading.Thread(target=run, name="kiln-pch", daemon=True)
    t.start()
    return t


def _ready_header(tc: Toolchain, includes: list[str], flags: tuple[str, ...],
                  headers: str) -> Path | None:
    """The precompiled header of `includes` where `prebuild_header` has built it, else None."""
    d = _pch_dir(tc, includes, flags, headers)
    return d / "prelude.h" if (d / "prelude.h.gch").exists() else None


def compile_object(tc: Toolchain, name: str, source: str, headers: str,
                   extra: tuple[str, ...] = ()) -> Path:
    flags = (*tc.cflags, *extra)  # later flags win (e.g. -O1 for glue code)
    key = hashlib.sha256("\0".join([source, " ".join(flags), compiler_identity(tc.cxx),
                                     headers]).encode()).hexdigest()
    obj = tc.cache / "obj" / f"{key}.o"
    if obj.exists():
        return obj
    locks = tc.cache / "obj_lock"
    locks.mkdir(parents=True, exist_ok=True)
    # one compile of an object at a time across processes sharing the cache (parallel builds,
    # test workers): a second process waits for the first one's object instead of compiling
    # the same file beside it (conv.cpp: ~30 s of one core)
    with open(locks / key, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if obj.exists():
            return obj
        return _compile_object(tc, name, source, headers, flags, key, obj)


def _compile_object(tc: Toolchain, name: str, source: str, headers: str,
                    flags: tuple[str, ...], key: str, obj: Path) -> Path:
    src_dir = tc.cache / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    pch = []
    if _use_pch(tc) or tc.pch_ready:
        includes, rest = split_prelude(source)
        header = None if not includes else \
            precompiled_header(tc, includes, flags, headers) if _use_pch(tc) else \
            _ready_header(tc, includes, flags, headers)
        if header is not None:  # (same file name: the object's bytes do not change)
            pch, source, src_dir = ["-include", str(header)], rest, src_dir / "pch"
            src_dir.mkdir(exist_ok=True)
    src = src_dir / f"{key}_{name}"
    _write_once(src, source)
    tmp = _atomic_output(obj)
    cmd = [tc.cxx, *flags, *[f"-I{d}" for d in tc.include_dirs], *pch, "-c", str(src), "-o",
           str(tmp)]
    try:
        _run(cmd, f"compiling {name}")
        tmp.replace(obj)
    finally:
        tmp.unlink(missing_ok=True)
    return obj


def compile_objects(jobs: list[tuple[Toolchain, str, str, tuple[str, ...]]],
                    workers: int, progress: Callable[[int, int], None] | None = None
                    ) -> list[Path]:
    """Compile (toolchain, file name, text, extra flags) jobs in parallel (`workers`
    compiler processes); the object files, in the order of `jobs`. Jobs of several toolchains
    (e.g. one per -march level of a portable build) share one pool. `progress(done, total)`,
    when given, is called from this thread as files finish (cache hits included)."""
    digests = {dirs: _headers_digest(dirs) for dirs in {tc.include_dirs for tc, *_ in jobs}}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(compile_object, tc, name, text, digests[tc.include_dirs], extra)
                   for tc, name, text, extra in jobs]
        if progress is not None:
            progress(0, len(futures))
            for done, _ in enumerate(as_completed(futures), 1):
                progress(done, len(futures))
        return [f.result() for f in futures]


def link_shared(tc: Toolchain, objs: list[Path], name: str = "model.so") -> Path:
    """Link objects into a shared library (cached by the objects' hashes and the flags).
    Earlier objects win where several define one inline function (COMDAT), so a caller puts
    the objects compiled for the most specific target first."""
    key = hashlib.sha256("\0".join([*(o.name for o in objs), " ".join(tc.ldflags),
                                     compiler_identity(tc.cxx)]).encode()).hexdigest()
    lib = tc.cache / "lib" / key / name
    if not lib.exists():
        tmp = _atomic_output(lib)
        try:
            _run([tc.cxx, "-shared", *[str(o) for o in objs], "-o", str(tmp), *tc.ldflags],
                 f"linking {name}")
            tmp.replace(lib)
        finally:
            tmp.unlink(missing_ok=True)
    return lib


def build_shared(tc: Toolchain, sources: dict[str, str],
                 extra_flags: dict[str, tuple[str, ...]] | None = None,
                 progress: Callable[[int, int], None] | None = None
                 ) -> tuple[Path, dict[str, float]]:
    """Compile `sources` (file name -> text) and link them; returns the library path.
    `progress`: see compile_objects."""
    extra_flags = extra_flags or {}
    t0 = time.perf_counter()
    objs = compile_objects([(tc, name, text, extra_flags.get(name, ()))
                            for name, text in sorted(sources.items())], tc.jobs, progress)
    t1 = time.perf_counter()
    lib = link_shared(tc, objs)
    return lib, {"compile": t1 - t0, "link": time.perf_counter() - t1}
