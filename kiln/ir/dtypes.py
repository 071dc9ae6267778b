"""Element types known to kiln, with their C, DLPack and safetensors spellings.

One table (`DTYPES`) holds all per-dtype knowledge; the rest of the compiler looks it up by
name. Names follow torch (`float32`, `int64`, ...)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str
    c_type: str
    itemsize: int
    # DLPack type code: 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool, 10 float8_e4m3fn,
    # 12 float8_e5m2 (dlpack.h v1.1: kDLFloat8_e4m3fn, kDLFloat8_e5m2)
    dl_code: int
    safetensors: str
    is_float: bool
    is_signed: bool = True
    # complex values are stored and moved by kiln, computed on by ATen (the fallback)
    is_complex: bool = False

    def __repr__(self) -> str:
        return self.name


_ROWS = [
    DType("float32", "float", 4, 2, "F32", True),
    DType("float64", "double", 8, 2, "F64", True),
    # storage-only types: kernels compute in float32 and round on store (passes/widen_half.py)
    DType("float16", "kr::half", 2, 2, "F16", True),
    DType("bfloat16", "kr::bfloat16", 2, 4, "BF16", True),
    # 8-bit floats: storage only, like the 16-bit ones (eager computes on them only by casting)
    DType("float8_e4m3fn", "kr::float8_e4m3fn", 1, 10, "F8_E4M3", True),
    DType("float8_e5m2", "kr::float8_e5m2", 1, 12, "F8_E5M2", True),
    DType("int64", "int64_t", 8, 0, "I64", False),
    DType("int32", "int32_t", 4, 0, "I32", False),
    DType("int16", "int16_t", 2, 0, "I16", False),
    DType("int8", "int8_t", 1, 0, "I8", False),
    DType("uint8", "uint8_t", 1, 1, "U8", False, is_signed=False),
    DType("bool", "bool", 1, 6, "BOOL", False, is_signed=False),
    DType("complex64", "kr_complex64", 8, 5, "C64", False, is_complex=True),
    DType("complex128", "kr_complex128", 16, 5, "C128", False, is_complex=True),
]
DTYPES: dict[str, DType] = {d.name: d for d in _ROWS}

float32 = DTYPES["float32"]
float64 = DTYPES["float64"]
float16 = DTYPES["float16"]
bfloat16 = DTYPES["bfloat16"]
int64 = DTYPES["int64"]
int32 = DTYPES["int32"]
bool_ = DTYPES["bool"]


HALF = frozenset({"float16", "bfloat16"})
FLOAT8 = frozenset({"float8_e4m3fn", "float8_e5m2"})
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


def acc_dtype(dt: DType) -> DType:
    """The dtype internal statistics of a reduction over `dt` are kept in (means, variances,
    softmax sums): float32 for 16-bit floats, as eager's kernels do; `dt` otherwise."""
    return float32 if dt.name in NARROW else dt
