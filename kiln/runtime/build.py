"""Builds libkiln.so (the C runtime) from kiln/runtime/src and caches it.

Input: the C++ sources under ``kiln/runtime/src`` and headers under ``kiln/runtime/include``, and
a C++ compiler command. Output: the path of ``<cache>/runtime/<key>/libkiln.so`` where ``<cache>``
is ``$KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln``, and ``<key>`` hashes
the sources, the flags and the compiler's identity (its path and ``--version`` output).

Invariants: a ``libkiln.so`` at the cached path is always complete (it is linked to a temporary
name in the same directory and renamed into place), so parallel processes never see a partial
file; a per-key file lock keeps them from compiling the same thing twice. Only the kiln.h
functions are exported (``-fvisibility=hidden`` plus a linker version script). Standard library
only; imports nothing else from kiln.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

_HERE = pathlib.Path(__file__).resolve().parent
_SRC = _HERE / "src"
_INCLUDE = _HERE / "include"

CXXFLAGS = ["-O2", "-fPIC", "-shared", "-std=c++17", "-fvisibility=hidden", "-pthread"]
LDLIBS = ["-ldl"]
_VERSION_SCRIPT = "{\n  global:\n    kiln_*;\n  local:\n    *;\n};\n"


class BuildError(RuntimeError):
    """The C++ compiler failed to build libkiln."""


def include_dir() -> pathlib.Path:
    """Directory holding kiln.h, dlpack.h and kiln_model_abi.h."""
    return _INCLUDE


def cache_dir() -> pathlib.Path:
    """Root of kiln's on-disk cache (same rule as libkiln's extraction cache)."""
    env = os.environ.get("KILN_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg) / "kiln"
    return pathlib.Path.home() / ".cache" / "kiln"


def _sources() -> list[pathlib.Path]:
    return sorted(_SRC.glob("*.cpp"))


def _compiler_identity(cxx: str) -> str:
    exe = shutil.which(cxx) or cxx
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise BuildError(f"cannot run C++ compiler {cxx!r}: {e}") from e
    return f"{os.path.realpath(exe)}\n{out.stdout}"


def _sanitize_flags(sanitize: str) -> list[str]:
    return [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"] if sanitize else []


def _key(cxx: str, sanitize: str = "") -> str:
    h = hashlib.sha256()
    h.update(_compiler_identity(cxx).encode())
    h.update(repr((CXXFLAGS, LDLIBS, _VERSION_SCRIPT, _sanitize_flags(sanitize))).encode())
    files = sorted(_SRC.glob("*")) + sorted(_INCLUDE.glob("*.h"))
    for f in files:
        if f.is_file():
            h.update(f.name.encode() + b"\0")
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


def build_libkiln(cxx: str = "c++", sanitize: str = "") -> pathlib.Path:
    """Returns the path of a built libkiln.so, compiling it with ``cxx`` unless cached;
    ``sanitize`` (e.g. "address,undefined") builds a separate sanitizer-instrumented copy."""
    out_dir = cache_dir() / "runtime" / _key(cxx, sanitize)
    lib = out_dir / "libkiln.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if lib.is_file():  # built by another process while we waited
                return lib
            _compile(cxx, out_dir, lib, _sanitize_flags(sanitize))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return lib


def _compile(cxx: str, out_dir: pathlib.Path, lib: pathlib.Path, extra: list[str]) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=".libkiln.", suffix=".so", dir=out_dir)
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    script = out_dir / "libkiln.map"
    try:
        script.write_text(_VERSION_SCRIPT)
        cmd = [cxx, *CXXFLAGS, *extra, f"-I{_INCLUDE}", *map(str, _sources()), "-o", str(tmp),
               f"-Wl,--version-script={script}", *LDLIBS]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"building libkiln failed ({' '.join(cmd)}):\n{proc.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if tmp.exists():
            tmp.unlink()
