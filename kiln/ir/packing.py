"""The prepacked panel layout of a constant GEMM operand B (the one home of this layout in
Python: the compile-time pass, passes/pack_cpu.py, and `update_weights`,
runtime/weights.py, both call `pack_panels`; the kernel reading it is
`kr::gemm_cpp_packed` in runtime/model/kiln_gemm.h).

A packing record (the manifest's `weights[].packed`) says how B is read from the weight as
stored before packing - element (k, n) of B at flat index offset + k * rows + n * cols of a
tensor of `shape` - and the panel width `nr`. The packed tensor is [ceil(n / nr), k, nr]:

    packed[p, k, c] = B[k, p * nr + c]      (zero for p * nr + c >= n)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def pack_panels(w: torch.Tensor, rec: Mapping[str, Any]) -> torch.Tensor:
    k, n, nr = int(rec["k"]), int(rec["n"]), int(rec["nr"])
    flat = w.contiguous().reshape(-1)
    # as_strided's offset counts from the start of the storage, not of the view: a weight
    # that is a view into a larger tensor (a row shard, w.chunk(n, 0)[r]) starts at its own
    # storage_offset
    b = flat.as_strided((k, n), (int(rec["rows"]), int(rec["cols"])),
                        flat.storage_offset() + int(rec["offset"]))
    panels = -(-n // nr)
    out = torch.zeros((k, panels * nr), dtype=w.dtype)
    out[:, :n] = b
    return out.reshape(k, panels, nr).permute(1, 0, 2).contiguous()
