"""kiln: an ahead-of-time compiler for PyTorch programs.

    compiled = kiln.compile(exported_program_or_module, example_args, options=kiln.Options())
    compiled.save("model.kiln")
    runner = kiln.load("model.kiln")
    outputs = runner(*args)
"""

from kiln import errors
from kiln.__version__ import __version__
from kiln.api import CompiledModel, compile
from kiln.options import Options
from kiln.runtime import load

__all__ = ["CompiledModel", "Options", "compile", "errors", "load", "__version__"]
