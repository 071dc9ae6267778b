"""How the torch that compiles a program rounds float32 to float8_e4m3fn on overflow, which
changed between versions: torch 2.13 saturates finite overflow and infinities to +-448, torch
2.11 makes them NaN (values past 464; 464 itself rounds to 448 in both). kiln's conversions
follow the compiling torch (eager is the reference a package must match); both code
generators ask `e4m3fn_saturates()`. float8_e5m2 overflows to +-inf in both.

The fnuz variants (float8_e4m3fnuz / float8_e5m2fnuz) make overflow (from 248 / 61440), +-inf
and NaN their one NaN 0x80 and have no negative zero; kiln's C++ (`kr::float_to_f8fnuz`) does
the same, and `fnuz_rule_matches()` probes that the compiling torch still does (a torch that
saturated them instead is refused rather than silently mismatched)."""

from __future__ import annotations

import functools

import torch

from kiln.errors import UnsupportedError


@functools.cache
def e4m3fn_saturates() -> bool:
    probe = torch.tensor([1e6, float("inf")]).to(torch.float8_e4m3fn).view(torch.uint8)
    return probe.tolist() == [0x7E, 0x7E]


@functools.cache
def fnuz_rule_matches(dtype_name: str) -> bool:
    """Whether eager's float32 -> `dtype_name` (a fnuz type) is the rule kiln's C++ follows:
    overflow from the halfway point past the largest finite value, +-inf and NaN -> 0x80;
    values below it stay finite; -0.0 and negative underflow -> +0."""
    big = {"float8_e4m3fnuz": (240.0, 247.9, 248.0),
           "float8_e5m2fnuz": (57344.0, 61439.0, 61440.0)}[dtype_name]
    v = torch.tensor([*big, -big[2], 1e6, float("inf"), float("-inf"), float("nan"), -0.0,
                      -1e-30])
    got = v.to(getattr(torch, dtype_name)).view(torch.uint8).tolist()
    return got == [0x7F, 0x7F, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0, 0]


def check_fnuz_rule(dtype_name: str) -> None:
    """Refuses a fnuz conversion when the compiling torch's rule is not kiln's."""
    if dtype_name.endswith("fnuz") and not fnuz_rule_matches(dtype_name):
        raise UnsupportedError(f"this torch ({torch.__version__}) converts float32 to "
                               f"{dtype_name} with another overflow rule than kiln's (NaN from "
                               "the halfway point past the largest finite value); convert to "
                               f"{dtype_name} outside the program")


def cpp_cast(c_type: str, dtype_name: str, text: str) -> str:
    """C++ conversion of `text` to the storage type `c_type`."""
    check_fnuz_rule(dtype_name)
    if dtype_name == "float8_e4m3fn" and not e4m3fn_saturates():
        return f"kr::float8_e4m3fn::overflow_nan({text})"
    return f"static_cast<{c_type}>({text})"


def triton_round(dtype_name: str) -> str:
    """The PRELUDE helper rounding float32 to an 8-bit float as the compiling torch does."""
    if dtype_name == "float8_e4m3fn":
        return "_kl_f8e4m3" if e4m3fn_saturates() else "_kl_f8e4m3_nan"
    return "_kl_f8e5m2"
