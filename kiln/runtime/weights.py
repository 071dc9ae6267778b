"""Replacement weights for a loaded model: a state_dict (keys are the original FQNs, as in
`model.state_dict()`, or kiln's weight names) checked against the manifest's "weights" list and
written as a safetensors file keyed by kiln's weight names.

Every weight the model uses must be given, with its dtype and shape; keys the model does not
use (e.g. buffers dead code elimination removed) are ignored. The random-number state of
models with random ops may be left out: it restarts at the compiled seed, run 0."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import save_file

from kiln.errors import InputError
from kiln.ir.packing import pack_panels

RNG_FQN = "<rng state>"  # kiln.frontend.export.RNG_FQN (the runtime imports no compiler code)


def checked_tensors(manifest: Mapping[str, Any], state: Mapping[str, Any]
                    ) -> dict[str, torch.Tensor]:
    specs = manifest.get("weights", [])
    out: dict[str, torch.Tensor] = {}
    # each weight by its name, else by its FQN (a package of several entry points may store
    # one FQN under several names: other values or layouts per entry)
    pairs = [(w["name"] if w["name"] in state else w["fqn"], w) for w in specs
             if w["name"] in state or w["fqn"] in state]
    for key, w in pairs:
        t = state[key]
        if not isinstance(t, torch.Tensor):
            raise InputError(f"weight {key!r}: expected a tensor, got {type(t).__name__}")
        if w.get("permuted") and key == w["fqn"] and key != w["name"]:
            if t.dim() != len(w["permuted"]):  # frozen: stored as the FQN's tensor permuted
                raise InputError(f"weight {key!r}: expected {len(w['permuted'])} dims, got "
                                 f"{t.dim()}")
            t = t.permute(w["permuted"])
        packed = w.get("packed")  # prepacked for a CPU GEMM: new weights are packed alike
        if packed and list(t.shape) == list(packed["shape"]) != list(w["shape"]):
            t = pack_panels(t.detach().to("cpu"), packed)
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != w["dtype"]:
            raise InputError(f"weight {key!r}: expected dtype {w['dtype']}, got {dtype}")
        if list(t.shape) != list(w["shape"]):
            want = packed["shape"] if packed else w["shape"]
            raise InputError(f"weight {key!r}: expected shape {want}, got {list(t.shape)}")
        out[w["name"]] = t.detach().to("cpu").contiguous()
    quantised = [w["fqn"] for w in specs if w["fqn"].startswith("<quantised")]
    if quantised:  # passes/quant_weights.py: stored quantised / repacked at compile time
        raise InputError(f"update_weights: this package stores weights quantised or repacked "
                         f"at compile time ({', '.join(sorted(set(quantised)))}; Options."
                         f"weight_quant={manifest.get('options', {}).get('weight_quant')!r}); "
                         "new weights would need quantising the same way. Compile the package "
                         "again with the new weights")
    folded = [w["fqn"] for w in specs if w["fqn"].startswith("<folded")]
    if folded:
        raise InputError(f"update_weights: this package folded weight-only computations at "
                         f"compile time ({', '.join(folded)}); new weights would not reach "
                         "them. Compile with kiln.Options(fold_constants=False) to update "
                         "weights")
    for w in specs:  # the random-number state restarts at (the compile-time seed, run 0)
        if w["fqn"] == RNG_FQN and w["name"] not in out:
            seed = int(manifest.get("options", {}).get("seed", 0))
            out[w["name"]] = torch.tensor([seed, 0], dtype=torch.int64)
    missing = [w["fqn"] or w["name"] for w in specs if w["name"] not in out]
    if missing:
        raise InputError(f"update_weights: missing weights {missing}")
    return out


def write_weights_file(tensors: Mapping[str, torch.Tensor], directory: str | None = None) -> str:
    """A temporary safetensors file holding `tensors` (the caller maps it, then removes it)."""
    fd, path = tempfile.mkstemp(prefix="kiln-weights-", suffix=".safetensors", dir=directory)
    os.close(fd)
    save_file(dict(tensors), path)
    return path
