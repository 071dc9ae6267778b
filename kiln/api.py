"""The public surface: `compile` (exporting for the user when given an nn.Module) and
`CompiledModel` (sources, memory plan, report; `save` writes the package)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.__version__ import __version__
from kiln.errors import KilnError, UnsupportedError
from kiln.ir import loop as L
from kiln.ir.loop import flat_steps
from kiln.ir.sym import evaluate
from kiln.memory.assign import inplace_report, plan_sizes
from kiln.memory.report import plan_summary
from kiln.options import GemmBackend, Options
from kiln.package import write_package
from kiln.pipeline import Built, build, target_of
from kiln.schedule import Kernel
from kiln.schedule.steps import CutlassGemm, GemmKernel
from kiln.schedule.analysis import aten_fallback_ops
from kiln.toolchain.cxx import compiler_identity
from kiln.runtime import load

MANIFEST_SCHEMA = "kiln.manifest/1"

def _shape_json(shape) -> list:
    return [int(d) if getattr(d, "is_Integer", False) or isinstance(d, int) else str(d)
            for d in shape]


def _kernels_json(built: Built) -> list[dict]:
    out = []
    kind = target_of(built.device).kernel_kind  # a schedule kernel's kind on this target
    for s in flat_steps(built.steps):  # control-flow regions' kernels included
        if isinstance(s, Kernel):
            out.append({"name": s.name, "kind": kind, "members": [m.name for m in s.members],
                        "source_ops": list(s.source)})
        elif isinstance(s, L.UserKernel):
            out.append({"name": s.name, "kind": "user_triton", "members": list(s.outs),
                        "kernel": s.kernel, "source_ops": list(s.source)})
        elif isinstance(s, GemmKernel):  # the Triton GEMM template, epilogue fused
            choice = built.gemms.get(s.gemm.name)
            out.append({"name": s.name, "kind": "triton_gemm",
                        "members": [s.gemm.name] + ([s.epilogue.name] if s.epilogue else []),
                        "source_ops": list(s.source),
                        **({"gemm": choice.to_json()} if choice is not None else {})})
        elif isinstance(s, CutlassGemm):  # a CUTLASS kernel, epilogue fused (visitor tree)
            choice = built.gemms.get(s.gemm.name)
            out.append({"name": s.name, "kind": "cutlass_gemm",
                        "members": [s.gemm.name, s.epilogue.name], "epilogue": s.config.evt,
                        "source_ops": list(s.source),
                        **({"gemm": choice.to_json()} if choice is not None else {})})
        elif isinstance(s, L.Extern):
            out.append({"name": s.name, "kind": f"lib.{s.routine}", "members": list(s.outs),
                        "source_ops": list(s.source)})
        else:
            choice = built.gemms.get(s.name)
            backend = choice.backend if choice is not None else GemmBackend.BLAS
            out.append({"name": s.name, "kind": f"{backend.value}_gemm", "members": [s.name],
                        "source_ops": list(s.source),
                        **({"gemm": choice.to_json()} if choice is not None else {})})
    return out


def _manifest(built: Built, opts: Options, report: dict) -> dict[str, Any]:
    g = built.graph
    types = g.types()
    plan = dict(plan_summary(built.intervals, built.plan, opts.alignment))
    plan["dynamic"] = built.program.dynamic
    plan["planned_at"] = "runtime (cached per input sizes)" if built.program.dynamic else \
        "compile time"
    plan["example_sizes"] = {s.name: s.example for s in g.symbols}
    plan["buffers"] = [{"name": iv.name, "size": iv.size, "start": iv.start, "end": iv.end,
                        "offset": built.plan.offsets[iv.name]} for iv in built.intervals]
    plan["inplace"] = inplace_report(built.program, built.plan, opts.plan_budget_s)
    plan["sizes"] = plan_sizes(built.program, verify=False)  # the run-time plan per size tried
    return {
        "schema": MANIFEST_SCHEMA,
        "kiln_version": __version__,
        "torch_version": torch.__version__,
        "abi_version": 1,
        "device": built.device,
        **({built.device: dict(built.info)} if built.info else {}),
        "options": opts.to_json(),
        "inputs": [{"name": i.name, "dtype": i.type.dtype.name, "shape": _shape_json(i.type.shape),
                    "contiguous": True,
                    **({"python_int": True, "symbol": i.symbol} if i.symbol else {})}
                   for i in g.user_inputs],
        "outputs": [{"name": o, "dtype": types[o].dtype.name, "shape": _shape_json(types[o].shape),
                     **({"python_int": True} if k in g.meta.get("int_outputs", ()) else {})}
                    for k, o in enumerate(g.outputs)],
        "constant_inputs": [dict(c) for c in g.meta.get("constant_inputs", ())],
        "symbols": {s.name: {"min": s.min, "max": s.max, "example": s.example}
                    for s in g.symbols},
        "in_spec": g.in_spec,
        "out_spec": g.out_spec,
        "weights": [{"name": w.name, "fqn": w.fqn, "dtype": w.dtype.name, "shape": list(w.shape),
                     "nbytes": w.nbytes, **({"permuted": list(w.permuted)} if w.permuted else {}),
                     **({"packed": dict(w.packed)} if w.packed else {})}
                    for w in built.program.weights],
        "kernels": _kernels_json(built),
        "plan": plan,
        "requires": _requires(built),
        "build": {"cxx": compiler_identity(opts.cxx or "c++"), "march": opts.march,
                  "compile_seconds": report["compile_seconds"]},
    }


def _requires(built: Built) -> dict[str, Any]:
    """What the package needs at run time besides libkiln: libtorch only for ATen fallbacks."""
    aten_ops = aten_fallback_ops(built.program)
    target = target_of(built.device)
    libs = target.libraries(built.steps, built.gemms)
    if aten_ops:
        libs = [*libs, f"{target.torch_libraries} (torch >= 2.10), for the ATen fallback"]
    return {"libtorch": bool(aten_ops), "aten_fallback_ops": aten_ops, "shared_libraries": libs,
            # instruction-set extensions the code uses: checked at load, before mapping it
            **({"cpu_features": list(built.cpu_features)}
               if built.cpu_features is not None else {})}


@dataclass(frozen=True)
class CompiledModel:
    """The result of `kiln.compile`: everything needed to write a package, plus the report."""

    built: Built
    manifest: dict[str, Any]
    report: dict[str, Any]

    @property
    def sources(self) -> dict[str, str]:
        return dict(self.built.sources)

    @property
    def library(self) -> Path:
        return self.built.library

    def save(self, path: str | os.PathLike[str]) -> Path:
        files = {f"src/{name}": text.encode() for name, text in self.built.sources.items()}
        files["lib/model.so"] = Path(self.built.library).read_bytes()
        write_package(path, self.manifest, files, self.built.weights)
        return Path(path)

    def load(self, path: str | os.PathLike[str] | None = None, device: str | None = None):
        """Save (to `path`, or next to the cached library) and load the package."""

        target = Path(path) if path else Path(self.built.library).with_name("model.kiln")
        self.save(target)
        return load(target, device or self.built.device)


class _Function(torch.nn.Module):
    """A plain function or an op overload (`torch.ops.aten.add.Tensor`) as a module to export."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _export(model, example_args, example_kwargs, dynamic_shapes):
    if isinstance(model, torch.export.ExportedProgram):
        return model
    if callable(model) and not isinstance(model, torch.nn.Module):
        model = _Function(model)
    if not isinstance(model, torch.nn.Module):
        raise KilnError(f"kiln.compile expects an ExportedProgram, an nn.Module or a function, "
                        f"got {type(model).__name__}")
    if example_args is None and example_kwargs is None:
        raise KilnError("kiln.compile: an nn.Module needs example_args to export it")
    args = tuple(example_args or ())
    try:
        return torch.export.export(model, args, kwargs=example_kwargs,
                                   dynamic_shapes=dynamic_shapes)
    except Exception as e:  # torch raises many types here; give one clear error
        raise UnsupportedError(f"torch.export failed: {type(e).__name__}: {e}") from e


def compile(model, example_args=None, *, example_kwargs=None, dynamic_shapes=None,
            device: str = "cpu", options: Options | None = None) -> CompiledModel:
    """Compile an ExportedProgram (or an nn.Module, a function or an op overload, with example
    inputs) ahead of time."""
    target_of(device)  # refuses a device no target compiles for
    opts = options or Options()
    t0 = time.perf_counter()
    ep = _export(model, example_args, example_kwargs, dynamic_shapes)
    t_export = time.perf_counter() - t0
    built = build(ep, opts, device)
    total = time.perf_counter() - t0
    env = {s.name: s.example for s in built.graph.symbols}
    report = {
        "compile_seconds": total,
        "export_seconds": t_export,
        "stages": dict(built.timings),
        "kernels": sum(1 for s in flat_steps(built.steps) if isinstance(s, Kernel)),
        "extern_calls": sum(1 for s in flat_steps(built.steps) if not isinstance(s, Kernel)),
        "graph_nodes": len(built.graph.nodes),
        "arena_bytes": built.plan.arena_bytes,
        "lower_bound_bytes": built.plan.lower_bound_bytes,
        "weights_bytes": sum(w.nbytes for w in built.program.weights),
        "reorder_peak_bytes": {"program_order": built.reorder[0], "chosen": built.reorder[1]},
        "example_sizes": env,
        "output_numel": [evaluate(1, env)],
    }
    del report["output_numel"]
    return CompiledModel(built, _manifest(built, opts, report), report)
