"""The import order of kiln's parts, lowest first: a module may import the parts of earlier
layers and its own part, never a later layer or a sibling in its own layer. The order follows
the pipeline (export -> IR -> kernels -> package), with the GEMM package below the targets
that call it. `tests/ir/test_layers.py` checks every import against it, at module level and
inside functions, and that imports inside functions are only those a heavy optional
dependency forces (marked `# deferred: <reason>`).

A part is a subpackage (`kiln/ir`), a sub-subpackage listed by its dotted name
(`targets.cpu`) or a top-level module (`kiln/options.py`); `kiln` is the package's
`__init__`."""

from __future__ import annotations

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "config", "__version__", "layers"),
    ("options",),
    ("ir",),  # Graph, Loop and Program IR; dtypes; symbolic sizes; the reference interpreter
    ("ops",),  # the pointwise op table: one row per op (semantics, body, eager twin), forms
    ("frontend",),  # torch.export program -> Graph IR
    ("passes",),  # Graph IR -> Graph IR
    ("lowering",),  # Graph IR -> Loop IR
    ("memory",),  # liveness and the arena plan over Program IR
    ("schedule",),  # Loop IR -> kernels -> Program IR; analyses over them
    ("toolchain",),  # external compilers (C++, Triton, nvcc), knowing no kiln IR above ir
    ("gemm",),  # GEMM problems, candidates, profiling and choice, every backend
    ("targets",),  # what the targets share (kiln/targets/*.py)
    ("targets.cpu", "targets.cuda"),  # one folder per target: printers, wrappers, stages
    ("package",),  # the .kiln file format
    ("runtime",),  # loading and running packages (imports nothing of the compiler)
    ("pipeline",),  # the driver: runs a target's stage list, times, dumps, verifies
    ("api",),  # kiln.compile, CompiledModel
    ("backend", "kiln"),  # torch.compile backend; the package's public names
    ("models", "fuzz"),
    ("cli",),
)
