"""ctypes mirrors of the DLPack v0.8 structs in ``include/dlpack.h`` and torch dtype codes.

Input/output: torch dtypes <-> (DLDataTypeCode, bits) pairs; ctypes Structure classes laid out
exactly like the C structs (``DLTensor`` is 48 bytes, ``DLManagedTensor`` 64 bytes on LP64).
Invariant: ``DTYPE_TO_DL`` and ``DL_TO_DTYPE`` are inverse bijections.
"""
from __future__ import annotations

import ctypes

import torch

KDL_CPU, KDL_CUDA, KDL_METAL, KDL_ROCM = 1, 2, 8, 10
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_COMPLEX, KDL_BOOL = 0, 1, 2, 4, 5, 6
KDL_FLOAT8_E4M3FN, KDL_FLOAT8_E5M2 = 10, 12  # DLPack v1.1
KDL_FLOAT8_E4M3FNUZ, KDL_FLOAT8_E5M2FNUZ = 11, 13


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


DTYPE_TO_DL: dict[torch.dtype, tuple[int, int]] = {
    torch.float64: (KDL_FLOAT, 64),
    torch.float32: (KDL_FLOAT, 32),
    torch.float16: (KDL_FLOAT, 16),
    torch.bfloat16: (KDL_BFLOAT, 16),
    torch.int64: (KDL_INT, 64),
    torch.int32: (KDL_INT, 32),
    torch.int16: (KDL_INT, 16),
    torch.int8: (KDL_INT, 8),
    torch.uint8: (KDL_UINT, 8),
    torch.bool: (KDL_BOOL, 8),
    torch.complex32: (KDL_COMPLEX, 32),
    torch.complex64: (KDL_COMPLEX, 64),
    torch.complex128: (KDL_COMPLEX, 128),
    torch.float8_e4m3fn: (KDL_FLOAT8_E4M3FN, 8),
    torch.float8_e5m2: (KDL_FLOAT8_E5M2, 8),
    torch.float8_e4m3fnuz: (KDL_FLOAT8_E4M3FNUZ, 8),
    torch.float8_e5m2fnuz: (KDL_FLOAT8_E5M2FNUZ, 8),
}
for _name, _bits in (("uint16", 16), ("uint32", 32), ("uint64", 64)):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        DTYPE_TO_DL[getattr(torch, _name)] = (KDL_UINT, _bits)
DL_TO_DTYPE: dict[tuple[int, int], torch.dtype] = {v: k for k, v in DTYPE_TO_DL.items()}


def dl_device(device: torch.device) -> tuple[int, int] | None:
    """(DLDeviceType, device_id) of a torch device, or None when DLPack has no code for it."""
    index = device.index or 0
    if device.type == "cpu":
        return KDL_CPU, 0
    if device.type == "cuda":
        return (KDL_ROCM if getattr(torch.version, "hip", None) else KDL_CUDA), index
    if device.type == "mps":
        return KDL_METAL, index
    return None
