"""libkiln.so (the C runtime, kiln/runtime/src): where a process finds it, and how it is built.

A user's process never compiles libkiln while loading a package (a C++ compile here takes
seconds: 8.5 s on a 2-core box). `find_libkiln` looks, running no compiler, in order:
  1. the installed copy, ``kiln/runtime/lib/<key>/libkiln.so``, built at install time
     (``python -m kiln.runtime``; ``make setup`` runs it);
  2. the cache, ``<cache>/runtime/<key>/libkiln.so``;
  3. the package being loaded: every package carries the libkiln of the kiln that compiled it
     (``lib/libkiln-<key>.so``; the compile step builds it, beside the model's own compile),
     extracted into the cache (2.) once.
Only when all three miss does `libkiln_path` compile it (`build_libkiln`), after a
`RuntimeBuildWarning` that says so and how to avoid it.

``<key>`` hashes the sources and headers (kiln/runtime/src, kiln/runtime/include) and the
flags, not the compiler: libkiln's interface is C, so any compiler's build serves, and finding
one needs no compiler. Sanitizer builds (`build_libkiln(sanitize=...)`, tests only) are keyed by
the compiler's identity too (its sanitizer runtime must match) and are never shipped.
``<cache>`` is ``$KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln``.

Invariants: a libkiln at any of these paths is always complete: it is written to a temporary
name in the same directory and renamed into place, so processes that build, extract or load it
at the same time never see a partial file (a per-key file lock keeps them from compiling the
same thing twice). Only the kiln.h functions are exported (``-fvisibility=hidden`` plus a linker
version script). Imports nothing from kiln above `kiln.config`."""
from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import warnings
import zipfile

from kiln import config

_HERE = pathlib.Path(__file__).resolve().parent
_SRC = _HERE / "src"
_INCLUDE = _HERE / "include"
#: where the install step puts libkiln (`install`)
PREBUILT = _HERE / "lib"

CXXFLAGS = ["-O2", "-fPIC", "-shared", "-std=c++17", "-fvisibility=hidden", "-pthread"]
LDLIBS = ["-ldl"]
_VERSION_SCRIPT = "{\n  global:\n    kiln_*;\n  local:\n    *;\n};\n"


class BuildError(RuntimeError):
    """The C++ compiler failed to build libkiln."""


class RuntimeBuildWarning(UserWarning):
    """libkiln was compiled while loading a package: no installed, cached or shipped copy."""


def include_dir() -> pathlib.Path:
    """Directory holding kiln.h, dlpack.h and kiln_model_abi.h."""
    return _INCLUDE


def cache_dir() -> pathlib.Path:
    """Root of kiln's on-disk cache."""
    return config.cache_dir()


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


def runtime_key(sanitize: str = "", cxx: str | None = None) -> str:
    """The hash naming a libkiln build: sources, headers and flags (sanitizer builds: the
    compiler's identity too, which runs it)."""
    h = hashlib.sha256()
    if sanitize:
        h.update(_compiler_identity(cxx or config.cxx()).encode())
    h.update(repr((CXXFLAGS, LDLIBS, _VERSION_SCRIPT, _sanitize_flags(sanitize))).encode())
    files = sorted(_SRC.glob("*")) + sorted(_INCLUDE.glob("*.h"))
    for f in files:
        if f.is_file():
            h.update(f.name.encode() + b"\0")
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


def package_entry(key: str | None = None) -> str:
    """The package entry holding the libkiln that the compiling kiln built."""
    return f"lib/libkiln-{key or runtime_key()}.so"


def _cached(key: str) -> pathlib.Path:
    return cache_dir() / "runtime" / key / "libkiln.so"


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libkiln.", suffix=".so", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _from_package(package: str | os.PathLike[str], key: str) -> pathlib.Path | None:
    """The package's own libkiln, extracted into the cache (None: it carries none of `key`)."""
    try:
        with zipfile.ZipFile(package) as z:
            data = z.read(package_entry(key))
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    lib = _cached(key)
    _write_atomic(lib, data)
    return lib


def find_libkiln(package: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """An existing libkiln of these sources (installed, cached, or carried by `package`,
    which is then extracted into the cache); None where there is none. Runs no compiler."""
    key = runtime_key()
    for lib in (PREBUILT / key / "libkiln.so", _cached(key)):
        if lib.is_file():
            return lib
    return _from_package(package, key) if package is not None else None


def libkiln_path(package: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The libkiln a process loads (`find_libkiln`); compiled, with a `RuntimeBuildWarning`,
    only where none exists."""
    lib = find_libkiln(package)
    if lib is not None:
        return lib
    warnings.warn(RuntimeBuildWarning(
        f"kiln: compiling the runtime library libkiln now (no installed copy in {PREBUILT}, "
        f"none in the cache {cache_dir() / 'runtime'}"
        + (f", none in {package}" if package is not None else "") +
        "); this takes seconds once. Run `python -m kiln.runtime` at install time "
        "(make setup does) to avoid it."), stacklevel=3)
    return build_libkiln()


def build_libkiln(cxx: str | None = None, sanitize: str = "") -> pathlib.Path:
    """Returns the path of a built libkiln.so: an existing one (`find_libkiln`), else compiled
    with `cxx` (default: $KILN_CXX, $CXX, c++) into the cache; ``sanitize`` (e.g.
    "address,undefined") builds a separate sanitizer-instrumented copy."""
    cxx = cxx or config.cxx()
    if not sanitize:
        hit = find_libkiln()
        if hit is not None:
            return hit
    key = runtime_key(sanitize, cxx)
    lib = _cached(key)
    if lib.is_file():
        return lib
    out_dir = lib.parent
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
    script = out_dir / f"libkiln.{os.getpid()}.map"
    try:
        script.write_text(_VERSION_SCRIPT)
        cmd = [cxx, *CXXFLAGS, *extra, f"-I{_INCLUDE}", *map(str, _sources()), "-o", str(tmp),
               f"-Wl,--version-script={script}", *LDLIBS]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise BuildError(f"building libkiln failed: cannot run C++ compiler {cxx!r}: "
                             f"{e}") from e
        if proc.returncode != 0:
            raise BuildError(f"building libkiln failed ({' '.join(cmd)}):\n{proc.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if tmp.exists():
            tmp.unlink()
        script.unlink(missing_ok=True)


def build_in_background(cxx: str | None = None) -> threading.Thread | None:
    """Starts building libkiln in a thread (the compiler runs as its own process) when no
    copy exists, so that a compile's package can carry it without waiting: `build_libkiln`
    later waits on the same file lock. None when a copy exists."""
    if find_libkiln() is not None:
        return None

    def run() -> None:
        try:
            build_libkiln(cxx)
        except BuildError:  # build_libkiln, asked again when the package is written, reports it
            pass

    t = threading.Thread(target=run, name="kiln-libkiln-build", daemon=True)
    t.start()
    return t


def shipped(cxx: str | None = None) -> dict[str, bytes]:
    """The package entry carrying this kiln's libkiln ({} with a warning where it cannot be
    built: such a package loads where kiln is installed or cached)."""
    try:
        return {package_entry(): build_libkiln(cxx).read_bytes()}
    except BuildError as e:
        warnings.warn(f"kiln: the package will not carry libkiln: {e}", stacklevel=3)
        return {}


def install(cxx: str | None = None) -> pathlib.Path:
    """Builds libkiln into the installed package (`PREBUILT/<key>/libkiln.so`: the name C
    programs link with -lkiln), where every process finds it without a compiler or a cache;
    older builds there are removed."""
    key = runtime_key()
    dest = PREBUILT / key / "libkiln.so"
    if not dest.is_file():
        _write_atomic(dest, build_libkiln(cxx).read_bytes())
    for old in PREBUILT.glob("*/libkiln.so"):
        if old != dest:
            shutil.rmtree(old.parent, ignore_errors=True)
    return dest
