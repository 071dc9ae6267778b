"""The autotuning cache: one JSON file per (problem, device) under `<cache>/autotune/`.

An entry records the winning backend and configuration and the best timings per backend, so
a later compile (also on a machine without the target device) links the same choice. Writes
are atomic (temporary file + rename), so concurrent compiles never read half an entry."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from kiln.gemm.problem import GemmProblem

SCHEMA = "kiln.gemm/1"


def cache_path(root: Path, problem: GemmProblem, device: str) -> Path:
    return Path(root) / "autotune" / f"{problem.key(device)}.json"


def load(root: Path, problem: GemmProblem, device: str) -> dict | None:
    p = cache_path(root, problem, device)
    try:
        entry = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if entry.get("schema") != SCHEMA or entry.get("device") != device:
        return None
    return entry


def store(root: Path, problem: GemmProblem, device: str, entry: dict) -> Path:
    p = cache_path(root, problem, device)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = {"schema": SCHEMA, "device": device, "problem": problem.describe(), **entry}
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=p.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    Path(tmp).replace(p)
    return p
