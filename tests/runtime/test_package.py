"""Tests of the package file format (kiln.package): writing, reading, verification, alignment."""
from __future__ import annotations

import hashlib
import json
import pathlib
import zipfile
from collections.abc import Callable

import pytest
import torch

from kiln.errors import PackageError
from kiln.package import ALIGNMENT, FORMAT, read_package, write_package
from kiln.package.format import data_offset

SO = b"\x7fELF" + bytes(range(256)) * 3


def _write(path: pathlib.Path, **kw: object) -> pathlib.Path:
    files = kw.pop("files", {"lib/model.so": SO, "src/model.cpp": b"int x;\n"})
    weights = kw.pop("weights", {"w": torch.arange(6.0).reshape(2, 3)})
    manifest = kw.pop("manifest", {"model": "toy"})
    write_package(path, manifest, files, weights)  # type: ignore[arg-type]
    return path


def _offsets(path: pathlib.Path) -> dict[str, tuple[int, int]]:
    """arcname -> (data offset, size)."""
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        return {i.filename: (data_offset(f, i.header_offset), i.file_size) for i in zf.infolist()}


def test_roundtrip(tmp_path: pathlib.Path) -> None:
    weights = {"w": torch.randn(3, 5), "idx": torch.arange(7), "h": torch.randn(2).half()}
    manifest = {"model": "toy", "nested": {"a": [1, 2]}}
    path = _write(tmp_path / "m.kiln", weights=weights, manifest=manifest)
    assert manifest == {"model": "toy", "nested": {"a": [1, 2]}}  # caller's dict untouched
    pkg = read_package(path)
    assert pkg.manifest["format"] == FORMAT
    assert pkg.manifest["model"] == "toy" and pkg.manifest["nested"] == {"a": [1, 2]}
    assert pkg.read("lib/model.so") == SO
    assert pkg.read("src/model.cpp") == b"int x;\n"
    for name, data in [("lib/model.so", SO), ("src/model.cpp", b"int x;\n")]:
        rec = pkg.manifest["files"][name]
        assert rec == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert set(pkg.manifest["files"]) == {"lib/model.so", "src/model.cpp", "weights.safetensors"}
    loaded = pkg.weights()
    assert loaded.keys() == weights.keys()
    for k, v in weights.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v)
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        assert infos[0].filename == "manifest.json"
        assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
        raw = zf.read("manifest.json").decode()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, indent=1)
    with pytest.raises(PackageError, match="no entry"):
        pkg.read("nope")


def test_deterministic(tmp_path: pathlib.Path) -> None:
    a = _write(tmp_path / "a.kiln").read_bytes()
    b = _write(tmp_path / "b.kiln").read_bytes()
    assert a == b


@pytest.mark.parametrize("seed", range(12))
def test_alignment(tmp_path: pathlib.Path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(0, 300, (1,), generator=g))
    files = {f"src/{'x' * n}.cpp": b"y" * int(torch.randint(0, 200, (1,), generator=g)),
             "lib/model.so": bytes(int(torch.randint(0, 500, (1,), generator=g)))}
    weights = {f"w{i}": torch.randn(int(torch.randint(1, 9, (1,), generator=g)))
               for i in range(int(torch.randint(0, 4, (1,), generator=g)))}
    path = _write(tmp_path / "m.kiln", files=files, weights=weights,
                  manifest={"pad": "z" * seed * 7})
    offs = _offsets(path)
    for name in ("weights.safetensors", "lib/model.so"):
        assert offs[name][0] % ALIGNMENT == 0, (name, offs[name])
    read_package(path)


def test_zip64_records(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)  # force zip64 extras and end records
    path = _write(tmp_path / "m.kiln")
    monkeypatch.undo()
    offs = _offsets(path)
    assert offs["lib/model.so"][0] % ALIGNMENT == 0
    assert read_package(path).read("lib/model.so") == SO
    assert b"PK\x06\x06" in path.read_bytes()


def test_empty_weights(tmp_path: pathlib.Path) -> None:
    pkg = read_package(_write(tmp_path / "m.kiln", weights={}))
    assert pkg.weights() == {}


def test_bad_arguments(tmp_path: pathlib.Path) -> None:
    for name in ["manifest.json", "weights.safetensors", "/abs", "a/../b", "", "a//b", "a\\b"]:
        with pytest.raises(PackageError):
            _write(tmp_path / "m.kiln", files={name: b""})
    with pytest.raises(PackageError, match="bytes"):
        _write(tmp_path / "m.kiln", files={"lib/model.so": "text"})
    with pytest.raises(PackageError, match="JSON"):
        _write(tmp_path / "m.kiln", manifest={"x": object()})
    with pytest.raises(PackageError, match="torch.Tensor"):
        _write(tmp_path / "m.kiln", weights={"w": [1.0]})
    assert not list(tmp_path.iterdir())  # no temporary files left behind


def test_shared_weights(tmp_path: pathlib.Path) -> None:
    base = torch.arange(8.0)
    pkg = read_package(_write(tmp_path / "m.kiln", weights={"a": base, "b": base[:4]}))
    assert torch.equal(pkg.weights()["b"], base[:4])


def _expect_error(path: pathlib.Path, *fragments: str) -> None:
    with pytest.raises(PackageError) as info:
        read_package(path)
    for f in fragments:
        assert f in str(info.value), str(info.value)


def test_missing_and_not_a_zip(tmp_path: pathlib.Path) -> None:
    _expect_error(tmp_path / "nope.kiln", "does not exist")
    (tmp_path / "junk.kiln").write_bytes(b"hello world" * 10)
    _expect_error(tmp_path / "junk.kiln", "junk.kiln")
    _expect_error(tmp_path, "directory")


def test_truncated(tmp_path: pathlib.Path) -> None:
    data = _write(tmp_path / "m.kiln").read_bytes()
    for cut in [0, 1, 30, 100, len(data) // 3, len(data) // 2, len(data) - 23, len(data) - 1]:
        p = tmp_path / f"cut{cut}.kiln"
        p.write_bytes(data[:cut])
        _expect_error(p, str(p))


@pytest.mark.parametrize("entry", ["manifest.json", "lib/model.so", "weights.safetensors",
                                   "src/model.cpp"])
def test_flipped_byte(tmp_path: pathlib.Path, entry: str) -> None:
    path = _write(tmp_path / "m.kiln")
    off, size = _offsets(path)[entry]
    data = bytearray(path.read_bytes())
    data[off + size // 2] ^= 0x10
    path.write_bytes(bytes(data))
    _expect_error(path, entry)


def _rewrite(src: pathlib.Path, dst: pathlib.Path,
             edit: Callable[[dict[str, bytes]], None], deflate: bool = False) -> pathlib.Path:
    with zipfile.ZipFile(src) as zf:
        entries = {i.filename: zf.read(i) for i in zf.infolist()}
    edit(entries)
    if "manifest.json" in entries and "manifest.sha256" in entries:  # past the hash check
        entries["manifest.sha256"] = hashlib.sha256(entries["manifest.json"]).hexdigest().encode()
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(dst, "w", compression=method) as zf:
        for k, v in entries.items():
            zf.writestr(k, v)
    return dst


def test_structural_errors(tmp_path: pathlib.Path) -> None:
    src = _write(tmp_path / "m.kiln")

    def manifest_edit(fn: Callable[[dict], None]) -> Callable[[dict[str, bytes]], None]:
        def edit(entries: dict[str, bytes]) -> None:
            m = json.loads(entries["manifest.json"])
            fn(m)
            entries["manifest.json"] = json.dumps(m).encode()
        return edit

    cases: list[tuple[Callable[[dict[str, bytes]], None], bool, str]] = [
        (lambda e: None, True, "compressed"),
        (lambda e: e.update({"extra.txt": b"x"}), False, "not listed"),
        (lambda e: e.pop("src/model.cpp"), False, "missing entry 'src/model.cpp'"),
        (lambda e: e.pop("manifest.json"), False, "manifest.json"),
        (lambda e: e.update({"manifest.json": b"{not json"}), False, "not valid JSON"),
        (lambda e: e.update({"manifest.json": b"[1]"}), False, "not a JSON object"),
        (manifest_edit(lambda m: m.update(format="kiln.package/2")), False, "kiln.package/2"),
        (manifest_edit(lambda m: m.pop("format")), False, "unsupported format"),
        (manifest_edit(lambda m: m.pop("files")), False, "'files'"),
        (manifest_edit(lambda m: m["files"]["lib/model.so"].update(size=1)), False,
         "lib/model.so"),
        (manifest_edit(lambda m: m["files"]["lib/model.so"].update(sha256="0" * 64)), False,
         "lib/model.so"),
    ]
    for i, (edit, deflate, fragment) in enumerate(cases):
        _expect_error(_rewrite(src, tmp_path / f"c{i}.kiln", edit, deflate), fragment)
