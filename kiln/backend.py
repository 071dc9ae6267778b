"""`torch.compile(model, backend="kiln")`: a TorchDynamo backend.

Dynamo hands over each captured FX graph with example inputs. kiln exports it, compiles it,
and runs it through the Python printer's wrapper (model.py), which calls the same compiled
kernels through ctypes. Graphs kiln cannot compile (unsupported ops, symbolic sizes, non-tensor
inputs) run as Dynamo gave them, and the reason is logged: a backend must never break a model.
Registered under the name "kiln" through the `torch_dynamo_backends` entry point."""

from __future__ import annotations

import importlib.util
import logging
import tempfile
from pathlib import Path

import torch

from kiln.api import compile as kiln_compile
from kiln.errors import KilnError
from kiln.options import Options

log = logging.getLogger("kiln.backend")


class _Wrapped(torch.nn.Module):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        out = self.gm(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def _load_python_wrapper(source: str, directory: Path):
    path = directory / "model.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"kiln_jit_{abs(hash(source))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kiln_backend(gm: torch.fx.GraphModule, example_inputs, options: Options | None = None):
    """The Dynamo backend: returns a callable taking the graph's flat inputs."""
    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        log.info("kiln backend: non-tensor inputs, running the graph as captured")
        return gm.forward
    args = tuple(x.detach().contiguous() for x in example_inputs)
    try:
        compiled = kiln_compile(_Wrapped(gm).eval(), args, options=options)
    except Exception as e:  # noqa: BLE001 - a JIT backend must never break the model
        level = logging.INFO if isinstance(e, KilnError) else logging.WARNING
        log.log(level, "kiln backend: falling back to the captured graph: %s: %s",
                type(e).__name__, e)
        return gm.forward
    directory = Path(tempfile.mkdtemp(prefix="kiln-jit-"))
    model = _load_python_wrapper(compiled.sources["model.py"], directory).Model(
        compiled.library, dict(compiled.built.weights))
    out_spec = _single_or_tuple(gm)

    def run(*inputs):
        outs = model(*[x.contiguous() if isinstance(x, torch.Tensor) else x for x in inputs])
        return outs[0] if out_spec == "single" else tuple(outs)

    run.kiln_compiled = compiled  # lets callers (and tests) see the graph went through kiln
    return run


def _single_or_tuple(gm: torch.fx.GraphModule) -> str:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return "tuple" if isinstance(out.args[0], (list, tuple)) else "single"
