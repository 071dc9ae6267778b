"""Device memory a package load takes, for the GPU tests that check weights are uploaded once
(tests/targets/cuda/test_generate_cuda.py, tests/runtime/test_shared_weights.py)."""

from __future__ import annotations

import torch

import kiln


def load_bytes(path) -> int:
    """Device memory a load of `path` takes: free memory is device-wide, and other processes
    on the GPU (parallel test workers) move it, so the least of three loads counts."""
    kiln.load(path, device="cuda").close()  # the context, cuBLAS, the output pool: warm
    uses = []
    for _ in range(3):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        r = kiln.load(path, device="cuda")
        uses.append(free0 - torch.cuda.mem_get_info()[0])
        r.close()
    return min(uses)
