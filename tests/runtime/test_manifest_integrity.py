"""A hand-edited manifest (a false input shape, with the zip CRC recomputed as zip tools do) is
refused at load, from Python (read_package / kiln.load / kiln inspect) and from C
(kiln_model_load): manifest.sha256 holds the hash of manifest.json's bytes. An untouched
package loads and runs; the C SHA-256 agrees with hashlib on many lengths."""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import subprocess
import sys
import zipfile
import zlib

import pytest
import torch

import kiln
from kiln.errors import PackageError
from kiln.package import read_package
from kiln.runtime.loader import last_error, libkiln


def _patch_manifest(path, old: bytes, new: bytes) -> None:
    """Replace `old` by `new` (same length) in manifest.json and fix its CRC in the local
    header and the central directory, as `zip` would after an edit."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    assert data[:4] == b"PK\x03\x04"
    name_len, extra_len = struct.unpack("<HH", data[26:30])
    size = struct.unpack("<I", data[18:22])[0]
    start = 30 + name_len + extra_len
    body = bytes(data[start:start + size])
    assert body.count(old) >= 1
    body = body.replace(old, new, 1)
    data[start:start + size] = body
    crc = struct.pack("<I", zlib.crc32(body))
    data[14:18] = crc
    cd = data.find(b"PK\x01\x02" + b"", 0)
    while cd != -1:
        n = struct.unpack("<H", data[cd + 28:cd + 30])[0]
        if data[cd + 46:cd + 46 + n] == b"manifest.json":
            data[cd + 16:cd + 20] = crc
            break
        cd = data.find(b"PK\x01\x02", cd + 4)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrity") / "m.kiln"
    kiln.compile(torch.nn.Linear(16, 4), (torch.randn(8, 16),)).save(path)
    return path


def test_untouched_package_loads(package):
    read_package(package)
    with zipfile.ZipFile(package) as zf:
        recorded = zf.read("manifest.sha256").decode()
        assert recorded == hashlib.sha256(zf.read("manifest.json")).hexdigest()
    x = torch.randn(8, 16)
    assert kiln.load(package)(x).shape == (8, 4)


def test_hand_edited_manifest_is_refused(package, tmp_path):
    bad = tmp_path / "edited.kiln"
    bad.write_bytes(package.read_bytes())
    _patch_manifest(bad, b'"shape": [\n    8,', b'"shape": [\n    9,')
    with zipfile.ZipFile(bad) as zf:  # the zip itself is consistent: only the hash tells
        assert zf.testzip() is None
        assert b"9," in zf.read("manifest.json")
    with pytest.raises(PackageError, match="'manifest.json' was changed after the package "
                                           "was written"):
        read_package(bad)
    with pytest.raises(PackageError, match="was changed"):
        kiln.load(bad)
    out = subprocess.run([sys.executable, "-m", "kiln.cli.main", "inspect", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "was changed" in out.stderr
    # from C: libkiln's own loader refuses it too
    lib = libkiln()
    handle = ctypes.c_void_p()
    assert lib.kiln_model_load(os.fsencode(bad), b"cpu", ctypes.byref(handle)) != 0
    assert "'manifest.json' was changed after the package was written" in last_error()
    assert lib.kiln_model_load(os.fsencode(package), b"cpu", ctypes.byref(handle)) == 0
    lib.kiln_model_free(handle)


def test_c_sha256_matches_hashlib(tmp_path):
    src = tmp_path / "t.cpp"
    root = os.path.join(os.path.dirname(kiln.__file__), "runtime", "src")
    src.write_text('#include "sha256.h"\n#include <cstdio>\n#include <string>\n'
                   "int main() { for (int n = 0; n < 300; ++n) { std::string s(n, 'a');\n"
                   "  for (int i = 0; i < n; ++i) s[i] = char(i * 7 + 3);\n"
                   '  std::printf("%s\\n", kiln::sha256_hex(s.data(), s.size()).c_str()); } }\n')
    exe = tmp_path / "t"
    subprocess.run(["c++", "-O1", f"-I{root}", str(src), os.path.join(root, "sha256.cpp"),
                    "-o", str(exe)], check=True)
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    want = [hashlib.sha256(bytes((i * 7 + 3) % 256 for i in range(n))).hexdigest()
            for n in range(300)]
    assert got == want
