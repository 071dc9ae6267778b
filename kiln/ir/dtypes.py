"""Element types known to kiln and their target-neutral facts: torch's name, C type, size,
DLPack code, safetensors spelling, torch's ScalarType number, the torch and numpy dtypes.

One table (`DTYPES`) holds all per-dtype knowledge that is not a target's own spelling (those
stay in the target's tables, keyed by `DType`: the Triton types in targets/cuda/ops.py, the
CUDA library types in targets/cuda/wrapper.py); the rest of the compiler looks it up by name
or holds the `DType`. Names follow torch (`float32`, `int64`, ...). kiln/runtime/ keeps its
own small table (it imports nothing of the compiler)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DType:
    name: str  # torch's name: getattr(torch, name) is the torch dtype
    c_type: str
    itemsize: int
    # DLPack type code: 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool, 10 float8_e4m3fn,
    # 11 float8_e4m3fnuz, 12 float8_e5m2, 13 float8_e5m2fnuz (dlpack.h v1.1: kDLFloat8_e4m3fn,
    # kDLFloat8_e4m3fnuz, kDLFloat8_e5m2, kDLFloat8_e5m2fnuz)
    dl_code: int
    safetensors: str
    # torch's ScalarType number (part of its stable C interface; the ATen fallback passes it)
    scalar_type: int
    is_float: bool
    is_signed: bool = True
    # complex values: pairs of real parts (complex_part) in torch's layout; kiln computes on
    # complex64 / complex128 as arithmetic on the parts (frontend/aten_complex.py)
    is_complex: bool = False

    def __repr__(self) -> str:
        return self.name

    @property
    def bits(self) -> int:
        return self.itemsize * 8

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.name)

    @property
    def numpy(self) -> type:
        """The numpy scalar type (np.float32, np.bool_, ...); KeyError for the types numpy does
        not have (bfloat16, the 8-bit floats)."""
        if self.name not in _NUMPY:
            raise KeyError(self.name)
        return np.dtype(self.name).type

    @property
    def int_range(self) -> tuple[int, int] | None:
        """The smallest and largest value of an integer or bool dtype; None for the others."""
        if self.is_float or self.is_complex:
            return None
        if self.name == "bool":
            return (0, 1)
        if not self.is_signed:
            return (0, 2**self.bits - 1)
        return (-(2**(self.bits - 1)), 2**(self.bits - 1) - 1)


_ROWS = [
    DType("float32", "float", 4, 2, "F32", 6, True),
    DType("float64", "double", 8, 2, "F64", 7, True),
    # storage-only types: kernels compute in float32 and round on store (passes/widen_half.py)
    DType("float16", "kr::half", 2, 2, "F16", 5, True),
    DType("bfloat16", "kr::bfloat16", 2, 4, "BF16", 15, True),
    # 8-bit floats: storage only, like the 16-bit ones (eager computes on them only by casting)
    DType("float8_e4m3fn", "kr::float8_e4m3fn", 1, 10, "F8_E4M3", 24, True),
    DType("float8_e5m2", "kr::float8_e5m2", 1, 12, "F8_E5M2", 23, True),
    # the "fnuz" variants (finite, no negative zero: biases 8 and 16, no infinities, one NaN
    # 0x80, no -0); safetensors (0.8 here) spells them F8_E4M3FNUZ / F8_E5M2FNUZ
    DType("float8_e4m3fnuz", "kr::float8_e4m3fnuz", 1, 11, "F8_E4M3FNUZ", 26, True),
    DType("float8_e5m2fnuz", "kr::float8_e5m2fnuz", 1, 13, "F8_E5M2FNUZ", 25, True),
    DType("int64", "int64_t", 8, 0, "I64", 4, False),
    DType("int32", "int32_t", 4, 0, "I32", 3, False),
    DType("int16", "int16_t", 2, 0, "I16", 2, False),
    DType("int8", "int8_t", 1, 0, "I8", 1, False),
    DType("uint8", "uint8_t", 1, 1, "U8", 0, False, is_signed=False),
    DType("bool", "bool", 1, 6, "BOOL", 11, False, is_signed=False),
    # complex32 (torch.chalf: two float16): stored and moved like the others; ATen computes on
    # it as eager does (in complex<float>, rounded per op); safetensors has no spelling for it
    DType("complex32", "kr_complex32", 4, 5, "C32", 8, False, is_complex=True),
    DType("complex64", "kr_complex64", 8, 5, "C64", 9, False, is_complex=True),
    DType("complex128", "kr_complex128", 16, 5, "C128", 10, False, is_complex=True),
]
DTYPES: dict[str, DType] = {d.name: d for d in _ROWS}
# the dtypes numpy has (the reference interpreter computes in numpy)
_NUMPY = frozenset({"float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8",
                    "bool", "complex64", "complex128"})

float32 = DTYPES["float32"]
float64 = DTYPES["float64"]
float16 = DTYPES["float16"]
bfloat16 = DTYPES["bfloat16"]
float8_e4m3fn = DTYPES["float8_e4m3fn"]
float8_e5m2 = DTYPES["float8_e5m2"]
float8_e4m3fnuz = DTYPES["float8_e4m3fnuz"]
float8_e5m2fnuz = DTYPES["float8_e5m2fnuz"]
int64 = DTYPES["int64"]
int32 = DTYPES["int32"]
int16 = DTYPES["int16"]
int8 = DTYPES["int8"]
uint8 = DTYPES["uint8"]
bool_ = DTYPES["bool"]
complex32 = DTYPES["complex32"]
complex64 = DTYPES["complex64"]
complex128 = DTYPES["complex128"]


HALF = frozenset({"float16", "bfloat16"})
FLOAT8 = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})
FNUZ = frozenset({"float8_e4m3fnuz", "float8_e5m2fnuz"})  # finite, no negative zero
NARROW = HALF | FLOAT8  # floats stored narrow and computed in float32


def is_narrow(dt: DType) -> bool:
    """A float narrower than 32 bits (16- or 8-bit): a storage type, computed in float32."""
    return dt.name in NARROW


def dtype(name: str) -> DType:
    """Look a dtype up by its torch-style name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise KeyError(f"dtype {name!r} is not supported by kiln; supported: {sorted(DTYPES)}")


def from_torch(t: torch.dtype) -> DType:
    """The kiln dtype of torch dtype `t` (KeyError, as `dtype`, if kiln does not support it)."""
    return dtype(str(t).removeprefix("torch."))


#: complex dtype -> the dtype of each of its two parts
_PART = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}


def complex_part(dt: DType) -> DType:
    """The real dtype of each part (real, imaginary) of complex dtype `dt`."""
    return DTYPES[_PART[dt.name]]


def complex_of(dt: DType) -> DType:
    """The complex dtype whose parts are real dtype `dt` (float16 / float32 / float64)."""
    return DTYPES[{v: k for k, v in _PART.items()}[dt.name]]


def acc_dtype(dt: DType) -> DType:
    """The dtype internal statistics of a reduction over `dt` are kept in (means, variances,
    softmax sums): float32 for 16-bit floats, as eager's kernels do; `dt` otherwise."""
    return float32 if dt.name in NARROW else dt
