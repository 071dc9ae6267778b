"""Reading and verifying kiln packages (``kiln.package/1``, see ``kiln.package.format``).

Input: a package path. Output: a ``Package`` whose ``manifest`` is the parsed manifest.json and
whose ``read(arcname)`` returns an entry's bytes. Invariants: ``read_package`` succeeds only if
the file is a zip of STORED entries without duplicates, manifest.json is a JSON object of format
``kiln.package/1``, every entry but the manifest is listed in ``manifest["files"]`` and every
listed entry exists with the recorded size and sha256. A ``Package`` keeps no file open; each
``read`` re-opens the file and re-verifies the entry. All failures raise ``PackageError``.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import zipfile
from typing import Any

from kiln.errors import PackageError
from kiln.package.format import FORMAT, MANIFEST, MANIFEST_HASH, WEIGHTS
import safetensors.torch

_CHUNK = 1 << 20


class Package:
    """A verified package on disk."""

    def __init__(self, path: pathlib.Path, manifest: dict[str, Any], names: list[str]) -> None:
        self.path = path
        self.manifest = manifest
        self.names = names

    def __repr__(self) -> str:
        return f"Package({str(self.path)!r}, entries={self.names})"

    def read(self, arcname: str) -> bytes:
        """The bytes of one entry, verified against the manifest."""
        if arcname not in self.names:
            raise PackageError(f"package '{self.path}': no entry '{arcname}'")
        with _open(self.path) as zf:
            return _read_verified(self.path, zf, arcname, self.manifest)

    def weights(self) -> dict[str, Any]:
        """The weights as CPU torch tensors (empty dict if the package has none)."""

        if WEIGHTS not in self.names:
            return {}
        return dict(safetensors.torch.load(self.read(WEIGHTS)))


def _open(path: pathlib.Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path, "r")
    except FileNotFoundError:
        raise PackageError(f"package '{path}' does not exist") from None
    except IsADirectoryError:
        raise PackageError(f"package '{path}' is a directory") from None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise PackageError(f"package '{path}' is not a valid kiln package "
                           f"(truncated or corrupt?): {e}") from None


def _read_verified(path: pathlib.Path, zf: zipfile.ZipFile, arcname: str,
                   manifest: dict[str, Any] | None) -> bytes:
    try:
        data = zf.read(arcname)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as e:
        raise PackageError(f"package '{path}': entry '{arcname}' is corrupt: {e}") from None
    if manifest is not None:
        rec = manifest["files"][arcname]
        if len(data) != rec.get("size"):
            raise PackageError(f"package '{path}': entry '{arcname}' has {len(data)} bytes, "
                               f"the manifest records {rec.get('size')}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != rec.get("sha256"):
            raise PackageError(f"package '{path}': entry '{arcname}' is corrupt: sha256 "
                               f"{digest} differs from the manifest's {rec.get('sha256')}")
    return data


def _verify_streaming(path: pathlib.Path, zf: zipfile.ZipFile, arcname: str,
                      rec: dict[str, Any]) -> None:
    h = hashlib.sha256()
    size = 0
    try:
        with zf.open(arcname) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise PackageError(f"package '{path}': entry '{arcname}' is corrupt: {e}") from None
    if size != rec.get("size") or h.hexdigest() != rec.get("sha256"):
        raise PackageError(f"package '{path}': entry '{arcname}' is corrupt: its size/sha256 "
                           f"({size}, {h.hexdigest()}) differ from the manifest's "
                           f"({rec.get('size')}, {rec.get('sha256')})")


def check_manifest_hash(path: pathlib.Path, zf: zipfile.ZipFile, names: list[str],
                         raw: bytes) -> None:
    """manifest.json's bytes against manifest.sha256 (packages written before it existed
    have none: nothing to check)."""
    if MANIFEST_HASH not in names:
        return
    want = _read_verified(path, zf, MANIFEST_HASH, None).decode("ascii", "replace").strip()
    got = hashlib.sha256(raw).hexdigest()
    if got != want:
        raise PackageError(f"package '{path}': '{MANIFEST}' was changed after the package was "
                           f"written (its sha256 {got} is not the recorded {want}); a "
                           "hand-edited manifest is refused: recompile the model instead")


def read_package(path: str | os.PathLike[str]) -> Package:
    """Opens and fully verifies the package at ``path``."""
    path = pathlib.Path(path)
    with _open(path) as zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            raise PackageError(f"package '{path}' has duplicate entries")
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise PackageError(f"package '{path}': entry '{info.filename}' is compressed; "
                                   "kiln packages store every entry uncompressed")
        if MANIFEST not in names:
            raise PackageError(f"package '{path}' has no '{MANIFEST}'")
        raw = _read_verified(path, zf, MANIFEST, None)
        check_manifest_hash(path, zf, names, raw)
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise PackageError(f"package '{path}': '{MANIFEST}' is not valid JSON: {e}") from None
        if not isinstance(manifest, dict):
            raise PackageError(f"package '{path}': '{MANIFEST}' is not a JSON object")
        fmt = manifest.get("format")
        if fmt != FORMAT:
            raise PackageError(f"package '{path}': unsupported format {fmt!r} "
                               f"(this kiln reads {FORMAT!r})")
        files = manifest.get("files")
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise PackageError(f"package '{path}': '{MANIFEST}' has no valid 'files' table")
        for name in names:
            if name not in (MANIFEST, MANIFEST_HASH) and name not in files:
                raise PackageError(f"package '{path}': entry '{name}' is not listed in the "
                                   "manifest")
        for name in files:
            if name not in names:
                raise PackageError(f"package '{path}': missing entry '{name}'")
            _verify_streaming(path, zf, name, files[name])
    return Package(path, manifest, [n for n in names if n != MANIFEST_HASH])  # format-internal
