"""The GEMM + epilogue modules the GPU autotuning tests compile (tests/gemm/test_autotune_gpu.py),
shared with scripts/prebuild_cutlass.py so that the CUTLASS kernels it builds ahead on a CPU
machine are exactly the ones those tests ask for."""

from __future__ import annotations

import torch

ACTS = {"none": lambda x: x, "relu": torch.relu, "relu6": lambda x: torch.clamp(x, 0, 6),
        "gelu": torch.nn.functional.gelu}


class Linear(torch.nn.Module):
    """addmm (bias) + an activation + a residual + a cast: every epilogue kind."""

    def __init__(self, k, n, act):
        super().__init__()
        self.l = torch.nn.Linear(k, n)
        self.act = act

    def forward(self, x, r):
        return (ACTS[self.act](self.l(x)) + r).float(), x @ self.l.weight.t()


class Bmm(torch.nn.Module):
    def forward(self, a, b):
        return torch.relu(torch.bmm(a, b))


FUSED = {  # epilogue kind -> (Linear output y, residual r) -> result
    "bias": lambda y, r: y,
    "relu": lambda y, r: torch.relu(y),
    "relu6": lambda y, r: torch.clamp(y, 0, 6),
    "gelu": lambda y, r: torch.nn.functional.gelu(y),
    "residual": lambda y, r: y + 0.5 * r,
    "cast": lambda y, r: torch.relu(y).float(),
}


class Fused(torch.nn.Module):
    """One Linear per epilogue kind, all reading x: one package compiles every kind."""

    def __init__(self, k, n):
        super().__init__()
        self.ls = torch.nn.ModuleList(torch.nn.Linear(k, n) for _ in FUSED)

    def forward(self, x, r):
        return tuple(f(lin(x), r) for lin, f in zip(self.ls, FUSED.values()))
