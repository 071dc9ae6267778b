"""How the torch that compiles a program rounds float32 to float8_e4m3fn on overflow, which
changed between versions: torch 2.13 saturates finite overflow and infinities to +-448, torch
2.11 makes them NaN (values past 464; 464 itself rounds to 448 in both). kiln's conversions
follow the compiling torch (eager is the reference a package must match); both code
generators ask `e4m3fn_saturates()`. float8_e5m2 overflows to +-inf in both."""

from __future__ import annotations

import functools
import torch


@functools.cache
def e4m3fn_saturates() -> bool:
    probe = torch.tensor([1e6, float("inf")]).to(torch.float8_e4m3fn).view(torch.uint8)
    return probe.tolist() == [0x7E, 0x7E]


def cpp_cast(c_type: str, dtype_name: str, text: str) -> str:
    """C++ conversion of `text` to the storage type `c_type`."""
    if dtype_name == "float8_e4m3fn" and not e4m3fn_saturates():
        return f"kr::float8_e4m3fn::overflow_nan({text})"
    return f"static_cast<{c_type}>({text})"


def triton_round(dtype_name: str) -> str:
    """The PRELUDE helper rounding float32 to an 8-bit float as the compiling torch does."""
    if dtype_name == "float8_e4m3fn":
        return "_kl_f8e4m3" if e4m3fn_saturates() else "_kl_f8e4m3_nan"
    return "_kl_f8e5m2"
