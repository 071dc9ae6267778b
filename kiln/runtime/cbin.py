"""The tensor file format of the C example (examples/c/run_model.c), read and written from Python.

Layout (all little-endian), version 1:

    offset 0   4 bytes  magic b"KLT1"
    offset 4   uint8    DLPack type code (0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool,
                        10 float8_e4m3fn, 11 float8_e4m3fnuz, 12 float8_e5m2,
                        13 float8_e5m2fnuz)
    offset 5   uint8    bits per element (8, 16, 32, 64, 128)
    offset 6   uint16   lanes (always 1)
    offset 8   uint32   ndim
    offset 12  int64 x ndim   shape
    then       prod(shape) * bits / 8 bytes of data, C-contiguous (row-major)

Invariant: ``read_tensor_bin(write_tensor_bin(p, t))`` equals ``t`` (dtype, shape, bits).
"""
from __future__ import annotations

import os
import struct

import torch

from kiln.runtime.dlpack_ctypes import DL_TO_DTYPE, DTYPE_TO_DL

MAGIC = b"KLT1"


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    code = DTYPE_TO_DL.get(t.dtype)
    if code is None:
        raise ValueError(f"unsupported dtype {t.dtype}")
    head = MAGIC + struct.pack("<BBHI", code[0], code[1], 1, t.dim())
    head += struct.pack(f"<{t.dim()}q", *t.shape)
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return head + flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, what: str = "tensor file") -> torch.Tensor:
    if len(data) < 12 or data[:4] != MAGIC:
        raise ValueError(f"{what}: not a KLT1 tensor file")
    code, bits, lanes, ndim = struct.unpack_from("<BBHI", data, 4)
    dtype = DL_TO_DTYPE.get((code, bits))
    if dtype is None or lanes != 1:
        raise ValueError(f"{what}: unsupported dtype code {code} bits {bits} lanes {lanes}")
    if len(data) < 12 + 8 * ndim:
        raise ValueError(f"{what}: truncated shape")
    shape = struct.unpack_from(f"<{ndim}q", data, 12)
    numel = 1
    for s in shape:
        numel *= s
    body = data[12 + 8 * ndim:]
    if any(s < 0 for s in shape) or len(body) != numel * bits // 8:
        raise ValueError(f"{what}: data size {len(body)} does not match shape {list(shape)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def write_tensor_bin(path: str | os.PathLike[str], tensor: torch.Tensor) -> None:
    """Writes ``tensor`` (any strides, any device) to ``path`` in the KLT1 format."""
    with open(path, "wb") as f:
        f.write(tensor_to_bytes(tensor))


def read_tensor_bin(path: str | os.PathLike[str]) -> torch.Tensor:
    """Reads a KLT1 tensor file into a new CPU tensor."""
    with open(path, "rb") as f:
        return tensor_from_bytes(f.read(), str(path))
