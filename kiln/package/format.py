"""The kiln package file format, version ``kiln.package/1`` (the Python side).

A package (``model.kiln``) is a zip file whose entries are all STORED (uncompressed):

* ``manifest.json`` -- first entry; a JSON object (sorted keys, indent 1) with at least
  ``"format": "kiln.package/1"`` and ``"files": {arcname: {"sha256": hex, "size": int}}`` for
  every other entry; the compiler adds its own keys (``in_spec``, ``out_spec``, ``inputs``...).
* ``manifest.sha256`` -- the sha256 of ``manifest.json``'s bytes (64 hex digits): a manifest
  edited after writing is refused at load (from Python and from C).
* ``weights.safetensors`` -- the weights, written by the ``safetensors`` library.
* ``lib/model.so`` and any other ``files`` (``src/model.cpp``, ``src/model.py``, ...).

Invariants: the data of every entry after the manifest (in particular ``weights.safetensors``
and ``lib/model.so``) starts at a 64-byte aligned file offset, obtained by padding the local
header's extra field with a 0xD935 block; entries carry fixed timestamps so the same inputs give
the same bytes; a package is written to a temporary file and renamed into place. No pickle.
Reading verifies the format version, the zip CRCs and the sha256/size of every listed entry, and
rejects unlisted entries; every problem raises ``kiln.errors.PackageError`` naming the package
path and the entry.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import struct
import tempfile
import zipfile
from collections.abc import Mapping
from typing import Any

from kiln.errors import PackageError
import safetensors.torch
import torch

FORMAT = "kiln.package/1"
MANIFEST = "manifest.json"
#: the sha256 (64 hex digits) of manifest.json's bytes: a hand-edited manifest (zip tools
#: recompute its CRC) no longer matches and is refused at load, from Python and from C
MANIFEST_HASH = "manifest.sha256"
WEIGHTS = "weights.safetensors"
ALIGNMENT = 64
_PAD_ID = 0xD935  # extra-field id used for alignment padding (as Android's zipalign does)
_DATE = (1980, 1, 1, 0, 0, 0)
_RESERVED = (MANIFEST, MANIFEST_HASH, WEIGHTS)


def _check_arcname(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise PackageError(f"package entry names must be non-empty strings, got {name!r}")
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise PackageError(f"invalid package entry name {name!r}")
    if name in _RESERVED:
        raise PackageError(f"package entry name {name!r} is reserved")
    return name


def _padding(offset: int, name: str, size: int) -> bytes:
    """Extra field that makes the data of an entry with local header at offset aligned."""
    encoded = name.encode("ascii") if name.isascii() else name.encode("utf-8")
    zip64 = 20 if size * 1.05 > zipfile.ZIP64_LIMIT else 0  # zipfile's own zip64 extra
    base = offset + 30 + len(encoded) + zip64
    pad = -base % ALIGNMENT
    if pad == 0:
        return b""
    if pad < 4:
        pad += ALIGNMENT
    return struct.pack("<HH", _PAD_ID, pad - 4) + bytes(pad - 4)


def _serialise_weights(weights: Mapping[str, Any]) -> bytes:

    tensors: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise PackageError(f"weights must map str to torch.Tensor, got {name!r}: {type(t)}")
        tensors[name] = t.detach().to("cpu").contiguous()
    try:
        return safetensors.torch.save(tensors)
    except RuntimeError:  # tensors sharing storage: give each its own copy
        return safetensors.torch.save({k: v.clone() for k, v in tensors.items()})


def write_package(path: str | os.PathLike[str], manifest: Mapping[str, Any],
                  files: Mapping[str, bytes], weights: Mapping[str, Any]) -> None:
    """Writes a package to ``path`` (atomically). ``manifest`` is not modified: a copy gets the
    ``format`` and ``files`` keys. ``files`` maps arcnames (e.g. ``lib/model.so``) to bytes."""
    path = pathlib.Path(path)
    body: dict[str, bytes] = {WEIGHTS: _serialise_weights(weights)}
    for name, data in files.items():
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PackageError(f"package file {name!r} must be bytes, got {type(data).__name__}")
        body[_check_arcname(name)] = bytes(data)
    man = dict(manifest)
    man["format"] = FORMAT
    man["files"] = {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)}
                    for n, d in sorted(body.items())}
    try:
        man_bytes = json.dumps(man, sort_keys=True, indent=1).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise PackageError(f"manifest is not JSON-serialisable: {e}") from e
    man_hash = hashlib.sha256(man_bytes).hexdigest().encode()
    entries = [(MANIFEST, man_bytes), (MANIFEST_HASH, man_hash)] + sorted(body.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        offsets: dict[str, int] = {}
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, data in entries:
                info = zipfile.ZipInfo(name, date_time=_DATE)
                info.compress_type = zipfile.ZIP_STORED
                info.external_attr = 0o644 << 16
                if name != MANIFEST:
                    info.extra = _padding(zf.start_dir, name, len(data))
                zf.writestr(info, data)
                offsets[name] = info.header_offset
        _check_alignment(tmp, offsets)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def data_offset(f: Any, header_offset: int) -> int:
    """File offset of an entry's data, from its local header at ``header_offset``."""
    f.seek(header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise PackageError(f"bad local header at offset {header_offset}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return header_offset + 30 + name_len + extra_len


def _check_alignment(path: str, offsets: dict[str, int]) -> None:
    with open(path, "rb") as f:
        for name, off in offsets.items():
            if name != MANIFEST and data_offset(f, off) % ALIGNMENT:
                raise PackageError(f"internal error: entry {name!r} is not {ALIGNMENT}-aligned")
