"""kiln runtime: load and run compiled packages (``load(path) -> Runner``).

``build_libkiln()`` / ``include_dir()`` give the C runtime library and headers for C users.
"""
from __future__ import annotations

from kiln.runtime.build import build_libkiln, include_dir, libkiln_path
from kiln.runtime.comm import nccl_unique_id
from kiln.runtime.generation import (BatchGeneration, Generation, Sampler, generate,
                                     generate_batch)
from kiln.runtime.loader import Runner, cpu_supports, load

__all__ = ["BatchGeneration", "Generation", "Runner", "Sampler", "build_libkiln", "cpu_supports",
           "generate", "generate_batch", "include_dir", "libkiln_path", "load", "nccl_unique_id"]
