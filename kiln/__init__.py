"""kiln: an ahead-of-time compiler for PyTorch programs.

    compiled = kiln.compile(exported_program_or_module, example_args, options=kiln.Options())
    compiled.save("model.kiln")
    runner = kiln.load("model.kiln")
    outputs = runner(*args)

The public names are looked up on first use (PEP 562), so that `import kiln.errors` or the
`kiln --help` command does not import torch and the compiler."""

from __future__ import annotations

import importlib
import sys
import time
from typing import TYPE_CHECKING, Any

from kiln import errors
from kiln.__version__ import __version__

if TYPE_CHECKING:
    from kiln.api import CompiledModel, compile
    from kiln.options import Options
    from kiln.runtime import load

__all__ = ["CompiledModel", "Options", "compile", "errors", "load", "__version__"]

_PUBLIC = {"CompiledModel": "kiln.api", "compile": "kiln.api", "Options": "kiln.options",
           "load": "kiln.runtime"}


#: seconds the deferred imports of `__getattr__` took, by module (the first kiln.compile of a
#: process reports kiln.api's as its stage "compiler_imports")
IMPORT_SECONDS: dict[str, float] = {}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        module = _PUBLIC[name]
        t0 = time.perf_counter()
        fresh = module not in sys.modules
        mod = importlib.import_module(module)
        value = getattr(mod, name)
        if fresh:
            IMPORT_SECONDS[module] = time.perf_counter() - t0
            if hasattr(mod, "IMPORT_SECONDS"):  # kiln.api reports it as "compiler_imports"
                mod.IMPORT_SECONDS = IMPORT_SECONDS[module]
    else:  # a submodule not imported yet (kiln.api, kiln.backend, ...)
        try:
            value = importlib.import_module(f"kiln.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'kiln' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
