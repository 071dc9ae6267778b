"""kiln runtime: load and run compiled packages (``load(path) -> Runner``).

``build_libkiln()`` / ``include_dir()`` give the C runtime library and headers for C users.
Attributes are imported lazily so that ``kiln.runtime.build`` stays usable without torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Runner", "build_libkiln", "include_dir", "load"]


def __getattr__(name: str) -> Any:
    if name in ("Runner", "load"):
        from kiln.runtime import loader

        return getattr(loader, name)
    if name in ("build_libkiln", "include_dir"):
        from kiln.runtime import build

        return getattr(build, name)
    raise AttributeError(f"module 'kiln.runtime' has no attribute {name!r}")
