"""The public surface: `compile` (exporting for the user when given an nn.Module) and
`CompiledModel` (sources, memory plan, report; `save` writes the package)."""

from __future__ import annotations

import os
import re
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from kiln.__version__ import __version__
from kiln.errors import CompileError, KilnError, UnsupportedError
from kiln.ir import loop as L
from kiln.ir.loop import flat_steps
from kiln.ir.sym import evaluate
from kiln.memory.assign import inplace_report, plan_sizes
from kiln.memory.report import plan_summary
from kiln.options import GemmBackend, Options
from kiln.package import write_package
from kiln.package import entries as package_entries
from kiln.pipeline import Built, build, target_of
from kiln.schedule import Kernel
from kiln.schedule.steps import CutlassGemm, GemmKernel, PutKernel
from kiln.schedule.analysis import aten_fallback_ops
from kiln.toolchain.cxx import compiler_identity
from kiln.runtime import load
from kiln.runtime.build import build_in_background, shipped
from kiln.runtime.ab_time import time_ab
from kiln.targets.cpu.never_lose import differing

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
            out.append({"name": s.name, "kind": s.kind,  # triton_gemm / triton_gemv
                        "members": [s.gemm.name] + ([s.epilogue.name] if s.epilogue else []),
                        "source_ops": list(s.source),
                        **({"gemm": choice.to_json()} if choice is not None else {})})
        elif isinstance(s, PutKernel):  # a one-row kernel and KV-cache writes, one launch
            out.append({"name": s.name, "kind": f"{kind}_put", "members": list(s.members),
                        "source_ops": list(s.source)})
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


# what the compiled code reads per input, and what becomes of other strides (the runners'
# copy-in: kiln/runtime/src/copy_in.h for CPU packages, the Python loader for CUDA ones)
_INPUT_LAYOUT = {
    "cpu": "contiguous (other strides copied in)",
    "cuda": "contiguous (other strides copied in by the Python runner; C callers pass "
            "contiguous tensors)",
}


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
        # the model table has the state functions (kiln_model_abi.h); 2: and weight_buffer /
        # share_weight (device models: one upload of the weights per loaded package)
        "state_abi": 2 if built.device == "cuda" else 1,
        "device": built.device,
        **({built.device: dict(built.info)} if built.info else {}),
        "options": opts.to_json(),
        "inputs": [{"name": i.name, "dtype": i.type.dtype.name, "shape": _shape_json(i.type.shape),
                    "contiguous": True, "layout": _INPUT_LAYOUT.get(built.device, "contiguous"),
                    **({"python_int": True, "symbol": i.symbol} if i.symbol else {})}
                   for i in g.user_inputs],
        "outputs": [{"name": o, "dtype": types[o].dtype.name, "shape": _shape_json(types[o].shape),
                     **({("python_int" if types[o].dtype.name == "int64" else "python_number"):
                         True} if k in g.meta.get("int_outputs", ()) else {}),
                     **({"alias": dict(a)} if (a := _alias(g, k)) else {})}
                    for k, o in enumerate(g.outputs)],
        # user inputs the program writes in place: output `output` (after the user outputs)
        # is input `input`'s new contents, which the Python runner copies into the caller's
        # tensor after each run (C callers copy it themselves)
        **({"input_mutations": [{"input": i, "output": k} for i, k in muts]}
           if (muts := g.meta.get("input_mutations", ())) else {}),
        "constant_inputs": [dict(c) for c in g.meta.get("constant_inputs", ())],
        "symbols": {s.name: {"min": s.min, "max": s.max, "example": s.example}
                    for s in g.symbols},
        "in_spec": g.in_spec,
        "out_spec": g.out_spec,
        "weights": [{"name": w.name, "fqn": w.fqn, "dtype": w.dtype.name, "shape": list(w.shape),
                     "nbytes": w.nbytes, **({"state": True} if w.mutable else {}),
                     **({"permuted": list(w.permuted)} if w.permuted else {}),
                     **({"packed": dict(w.packed)} if w.packed else {})}
                    for w in built.program.weights],
        "kernels": _kernels_json(built),
        "plan": plan,
        "requires": _requires(built),
        "build": {"cxx": compiler_identity(opts.cxx or "c++"), "march": opts.march,
                  "compile_seconds": report["compile_seconds"]},
    }


def _alias(g, k: int) -> dict | None:
    """Output k's storage sharing in eager (frontend/aliasing.py), None when it has its own."""
    aliases = g.meta.get("output_aliases", ())
    return aliases[k] if k < len(aliases) else None


def _requires(built: Built) -> dict[str, Any]:
    """What the package needs at run time besides libkiln: libtorch only for ATen fallbacks."""
    aten_ops = aten_fallback_ops(built.program)
    target = target_of(built.device)
    libs = target.libraries(built.steps, built.gemms)
    if aten_ops:
        libs = [*libs, f"{target.torch_libraries} (torch >= 2.10), for the ATen fallback"]
    why = {op: r for op, r in built.graph.meta.get("aten_fallback_why", ())}
    return {"libtorch": bool(aten_ops), "aten_fallback_ops": aten_ops,
            # why a converter kiln has left an op to ATen (the target's kernel declined it)
            **({"aten_fallback_why": why} if why and aten_ops else {}),
            "shared_libraries": libs,
            # instruction-set extensions the code uses: checked at load, before mapping it
            **({"cpu_features": list(built.cpu_features)}
               if built.cpu_features is not None else {}),
            # a portable build: the loader runs the first level whose features the CPU has
            **({"cpu_levels": [{"march": lv.march, "library": arc,
                                "cpu_features": list(lv.cpu_features)}
                               for lv, arc in _level_libraries(built)]}
               if built.cpu_levels else {})}


def _level_libraries(built: Built) -> list[tuple[Any, str]]:
    """Each level of a portable build with its package entry: lib/model.<level>.so, the last
    level (built.library) lib/model.so."""
    last = len(built.cpu_levels) - 1
    return [(lv, "lib/model.so" if i == last else f"lib/model.{lv.march}.so")
            for i, lv in enumerate(built.cpu_levels)]


def _package_files(built: Built) -> dict[str, bytes]:
    """The package entries besides the manifest and the weights: sources and libraries."""
    files = {f"src/{name}": text.encode() for name, text in built.sources.items()}
    files["lib/model.so"] = Path(built.library).read_bytes()
    for lv, arc in _level_libraries(built):
        files[arc] = Path(lv.library).read_bytes()
    files.update(shipped())  # libkiln: loading needs no compiler (kiln/runtime/build.py)
    return files


def _timing_inputs(ep: torch.export.ExportedProgram) -> tuple[tuple, dict]:
    """Inputs of the example's shapes: fresh random floating-point tensors (seeded), the
    example's own values for everything else (integer ids must stay in range)."""
    g = torch.Generator().manual_seed(0)

    def fresh(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return torch.randn(x.shape, generator=g).to(x.dtype)
        return x

    args, kwargs = ep.example_inputs or ((), {})
    return (pytree.tree_map(fresh, tuple(args)),
            pytree.tree_map(fresh, dict(kwargs or {})))


#: max_autotune's end-to-end check keeps the tuned package only when its median is lower than
#: the default package's by more than this fraction: within it the two are a tie, and the
#: default (no profiling noise baked in) is kept
NEVER_LOSE_MARGIN = 0.02


def _never_lose(built: Built, ep, opts: Options) -> tuple[Built, dict[str, Any], dict]:
    """Max_autotune's final check: the tuned package and the default one (built.variants
    ["default"], the heuristic's GEMM choices: targets/cpu/never_lose.py) loaded and timed
    end to end on the example's shapes, interleaved (runtime/ab_time.py); the tuned one is
    kept only when faster by more than NEVER_LOSE_MARGIN. Returns the kept build, its
    manifest and the record of the check."""
    v = built.variants["default"]
    tuned = replace(built, variants={})
    default = replace(tuned, gemms=dict(v.gemms), sources=dict(v.sources), library=v.library,
                      cpu_features=v.cpu_features, cpu_levels=tuple(v.cpu_levels))
    args, kwargs = _timing_inputs(ep)
    manifests = {}
    with tempfile.TemporaryDirectory(prefix="kiln_never_lose_") as d:
        runners = []
        for name, b in (("tuned", tuned), ("default", default)):
            manifests[name] = _manifest(b, opts, {"compile_seconds": 0.0})
            path = Path(d) / f"{name}.kiln"
            write_package(path, manifests[name], _package_files(b), b.weights)
            try:
                runners.append(load(path, b.device))
            except KilnError as e:  # code for another CPU than this one: nothing to time
                for r in runners:
                    r.close()
                return tuned, manifests["tuned"], {"kept": "tuned", "skipped": str(e)}
        ra, rb = runners
        try:
            res = time_ab(lambda: ra(*args, **kwargs), lambda: rb(*args, **kwargs))
        finally:
            ra.close()
            rb.close()
    kept = "tuned" if res.a_wins(NEVER_LOSE_MARGIN) else "default"
    check = {"tuned_ms": res.a_s * 1e3, "default_ms": res.b_s * 1e3, "rounds": res.rounds,
             "margin": NEVER_LOSE_MARGIN, "kept": kept,
             "differing_gemms": differing(tuned.gemms, default.gemms)}
    return (tuned if kept == "tuned" else default), manifests[kept], check


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
        write_package(path, self.manifest, _package_files(self.built), self.built.weights)
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


_EXPORT_HINTS = (
    (r"specialized it to be a constant \((0|1)\)",
     "torch.export specialises example sizes of 0 and 1: give an example input whose dynamic "
     "dimension is at least 2 (the Dim's min may still be 1)"),
    (r"specialized it to be a constant \(\d+\)",
     "the model's code fixes that size (a reshape to a constant, a check against a constant "
     "size): drop that Dim, or use Dim.AUTO to let export decide"),
    (r"data-dependent|GuardOnDataDependent",
     "the model branches on a tensor's value: use torch.cond for the branch, or "
     "torch._check(...) to tell export the value's range"),
    (r"mismatch between the structure of `inputs` and `dynamic_shapes`",
     "dynamic_shapes mirrors the example inputs: one entry per forward() argument (a dict "
     "keyed by argument name, or a tuple in argument order), each a {dim: Dim} dict or None"),
    (r"Cannot mark .* as dynamic|not a valid dim",
     "a Dim's range must contain the example size"),
)


def explain_export_error(e: Exception, what: str = "the model") -> str:
    """A torch.export failure in full (torch's reason and suggested fixes, not only its first
    line), with the likely fix kiln knows for it."""
    text = str(e).strip() or type(e).__name__
    text = text.replace("For more information, run with TORCH_LOGS=\"+dynamic\".", "").strip()
    hints = [h for pattern, h in _EXPORT_HINTS if re.search(pattern, text)]
    out = f"torch.export could not export {what}: {type(e).__name__}: {text}"
    if hints:
        out += "\n" + "\n".join(f"likely fix: {h}" for h in hints[:1])
    return out


def export(model, example_args=None, example_kwargs=None, dynamic_shapes=None,
           what: str = "the model") -> torch.export.ExportedProgram:
    """torch.export for kiln.compile and the CLI: an nn.Module, a function or an op overload;
    an export failure raises UnsupportedError with torch's whole reason and the likely fix."""
    if isinstance(model, torch.export.ExportedProgram):
        return model
    wrapped = callable(model) and not isinstance(model, torch.nn.Module)
    if wrapped:
        model = _Function(model)
    if not isinstance(model, torch.nn.Module):
        raise KilnError(f"kiln.compile expects an ExportedProgram, an nn.Module or a function, "
                        f"got {type(model).__name__}")
    if example_args is None and example_kwargs is None:
        raise KilnError("kiln.compile: an nn.Module needs example_args to export it")
    args = tuple(example_args or ())
    try:
        try:
            return torch.export.export(model, args, kwargs=example_kwargs,
                                       dynamic_shapes=dynamic_shapes)
        except Exception as e:  # noqa: BLE001 - a function's shapes given per argument
            if not (wrapped and isinstance(dynamic_shapes, (tuple, list))
                    and "structure of `inputs`" in str(e)):
                raise
            return torch.export.export(model, args, kwargs=example_kwargs,
                                       dynamic_shapes=(tuple(dynamic_shapes),))
    except Exception as e:  # torch raises many types here; give one clear error
        raise UnsupportedError(explain_export_error(e, what)) from e


def _crash_site(tb) -> tuple[str, str, str]:
    """(stage, node, code location) a crash happened at, from the traceback's frames: the
    innermost `node` / `n` local that is a graph node (Graph IR or torch.fx) names the node
    and its op; the driver's `stage` local names the stage."""
    stage = node = where = ""
    for frame, line in reversed(list(traceback.walk_tb(tb))):
        f_locals = frame.f_locals
        code = frame.f_code
        if not where and "/kiln/" in code.co_filename:
            where = f"{code.co_filename.rsplit('/kiln/', 1)[1]}:{line} in {code.co_name}"
        for key in ("node", "n", "step", "member"):
            v = f_locals.get(key)
            if node or v is None:
                continue
            if isinstance(v, torch.fx.Node):
                node = f"node `{v.name}` (op {v.target})"
            elif isinstance(getattr(v, "name", None), str) and \
                    isinstance(getattr(v, "op", None), str):
                node = f"node `{v.name}` (op {v.op})"
        if not stage and code.co_name == "_run" and hasattr(f_locals.get("stage"), "name"):
            stage = f_locals["stage"].name
    return stage, node, where


def _crash(e: Exception, ep: torch.export.ExportedProgram, device: str) -> CompileError:
    """A compiler crash (any non-kiln exception inside the pipeline) as a CompileError naming
    the stage, node and op, with the exported program saved for a bug report."""
    stage, node, where = _crash_site(e.__traceback__)
    saved = ""
    try:
        path = Path(tempfile.mkdtemp(prefix="kiln-bug-")) / "program.pt2"
        torch.export.save(ep, str(path))
        saved = (f"\nThis is a kiln bug: the exported program is saved to {path} for a bug "
                 f"report (`kiln compile {path} -o x.kiln --device {device}` reproduces it)")
    except Exception as save_error:  # noqa: BLE001 - the report must not hide the crash
        saved = f"\nThis is a kiln bug (saving the program failed too: {save_error})"
    at = " while ".join(x for x in (f"in stage {stage}" if stage else "",
                                    f"processing {node}" if node else "") if x)
    return CompileError(f"kiln crashed{' ' + at if at else ''}: {type(e).__name__}: {e}"
                        f"{' [' + where + ']' if where else ''}{saved}\n"
                        f"(set KILN_DEBUG=1 or pass --debug to the CLI for the traceback)")


def compile(model, example_args=None, *, example_kwargs=None, dynamic_shapes=None,
            device: str = "cpu", options: Options | None = None,
            progress: Callable[[str, int, int], None] | None = None,
            detail: Callable[[str, str, int, int], None] | None = None) -> CompiledModel:
    """Compile an ExportedProgram (or an nn.Module, a function or an op overload, with example
    inputs) ahead of time. `progress(stage, k, n)` is told each stage as it starts, and
    `detail(stage, what, done, total)` the counts inside long stages (kernel builds,
    autotuning); the CLI draws both (see kiln.pipeline.build).

    Several entry points in one package: `model` a dict {name: ExportedProgram or (module,
    example_args[, dynamic_shapes[, example_kwargs]])}, e.g. {"prefill": ..., "decode": ...};
    returns a `CompiledPackage` whose entries share weights (same FQN and values: stored once)
    and state buffers (same FQN: one buffer per loaded instance, e.g. a KV cache)."""
    if isinstance(model, dict):
        if example_args is not None or example_kwargs is not None or dynamic_shapes is not None:
            raise KilnError("kiln.compile: with a dict of entry points, give each entry's "
                            "example_args and dynamic_shapes in its tuple, not as arguments")
        return _compile_entries(model, device, options, progress, detail)
    t0 = time.perf_counter()
    target = target_of(device)  # refuses a device no target compiles for (modules imported)
    imports = time.perf_counter() - t0 + _first_import()
    opts = options or Options()
    build_in_background(opts.cxx)  # the package carries libkiln; built meanwhile if missing
    t1 = time.perf_counter()
    # what the target can start before the export runs (CUDA: its compile workers)
    early = target.prestart(opts) if target.prestart is not None else None
    t_prestart = time.perf_counter() - t1
    t1 = time.perf_counter()
    try:
        ep = export(model, example_args, example_kwargs, dynamic_shapes)
    except BaseException:
        if early is not None:
            early.close()
        raise
    t_export = time.perf_counter() - t1
    try:
        built = build(ep, opts, device, progress, detail, early)
    except KilnError:
        raise
    except Exception as e:  # a compiler bug: say where, and keep what reproduces it
        if os.environ.get("KILN_DEBUG"):
            raise
        raise _crash(e, ep, device) from e
    check = manifest = None
    if "default" in built.variants:  # max_autotune on the CPU: keep the faster package
        t1 = time.perf_counter()
        built, manifest, check = _never_lose(built, ep, opts)
        built = replace(built, timings={**built.timings, "never_lose": time.perf_counter() - t1})
    t_manifest = time.perf_counter()
    env = {s.name: s.example for s in built.graph.symbols}
    report = {
        "compile_seconds": t_manifest - t0,  # (the manifest's time added below)
        "export_seconds": t_export,
        # the compiler's modules imported by this call (the first of a process), then the
        # target's stages (kiln/pipeline.py), then the manifest: named, so that a cold
        # compile's time outside them is small (bench/compile_time.py's "rest")
        "stages": {"compiler_imports": imports, "prestart": t_prestart, **built.timings},
        # every step the manifest lists (what `kiln inspect` counts), of which generated
        # fused kernels and calls of GEMMs, library routines and user kernels
        "kernels": sum(1 for _ in flat_steps(built.steps)),
        "fused_kernels": sum(1 for s in flat_steps(built.steps) if isinstance(s, Kernel)),
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
    if check is None:
        manifest = _manifest(built, opts, report)
    report["stages"]["manifest"] = time.perf_counter() - t_manifest
    report["compile_seconds"] = total = time.perf_counter() - t0
    if check is None:
        return CompiledModel(built, manifest, report)
    # max_autotune's end-to-end check: both timings and the package kept
    report["gemm_check"] = check
    manifest["build"] = {**manifest["build"], "compile_seconds": total, "gemm_check": check}
    return CompiledModel(built, manifest, report)


#: seconds the import of this module took where `import kiln` deferred it to the first use
#: of `kiln.compile` (kiln/__init__.py sets it after the import), told once: to the compile
#: that paid it
IMPORT_SECONDS = 0.0


def _first_import() -> float:
    global IMPORT_SECONDS
    seconds, IMPORT_SECONDS = IMPORT_SECONDS, 0.0
    return seconds


@dataclass(frozen=True)
class CompiledPackage:
    """The result of `kiln.compile({name: ...})`: one package of several entry points
    (kiln/package/entries.py); `entries[name]` is each entry's CompiledModel."""

    entries: dict[str, CompiledModel]
    manifest: dict[str, Any]
    files: dict[str, bytes]
    weights: dict[str, torch.Tensor]
    report: dict[str, Any]

    def save(self, path: str | os.PathLike[str]) -> Path:
        write_package(path, self.manifest, self.files, self.weights)
        return Path(path)

    def load(self, path: str | os.PathLike[str] | None = None, device: str | None = None):
        """Save (to `path`, or next to the first entry's cached library) and load."""
        first = next(iter(self.entries.values())).built
        target = Path(path) if path else Path(first.library).with_name("entries.kiln")
        self.save(target)
        return load(target, device or first.device)


def _entry_args(name: str, spec) -> tuple:
    """(model, example_args, dynamic_shapes, example_kwargs) of one entry's spec."""
    if isinstance(spec, torch.export.ExportedProgram):
        return spec, None, None, None
    if isinstance(spec, (tuple, list)) and 2 <= len(spec) <= 4:
        model, args, *rest = spec
        return model, args, rest[0] if rest else None, rest[1] if len(rest) > 1 else None
    raise KilnError(f"kiln.compile: entry point {name!r}: expected an ExportedProgram or a "
                    f"tuple (model, example_args[, dynamic_shapes[, example_kwargs]]), got "
                    f"{type(spec).__name__}")


def _compile_entries(specs: dict, device: str, options: Options | None,
                     progress: Callable[[str, int, int], None] | None,
                     detail: Callable[[str, str, int, int], None] | None = None
                     ) -> CompiledPackage:
    package_entries.check_entry_names(list(specs))
    compiled: dict[str, CompiledModel] = {}
    for name, spec in specs.items():
        model, args, dyn, kwargs = _entry_args(name, spec)
        tell = None if progress is None else \
            (lambda stage, k, n, _name=name: progress(f"{_name}: {stage}", k, n))
        counts = None if detail is None else \
            (lambda stage, *rest, _name=name: detail(f"{_name}: {stage}", *rest))
        compiled[name] = compile(model, args, example_kwargs=kwargs, dynamic_shapes=dyn,
                                 device=device, options=options, progress=tell, detail=counts)
    manifest, files, weights = package_entries.merge(
        [(name, c.manifest, _package_files(c.built), c.built.weights)
         for name, c in compiled.items()])
    report = {"compile_seconds": sum(c.report["compile_seconds"] for c in compiled.values()),
              "weights_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
              "entries": {name: c.report for name, c in compiled.items()}}
    return CompiledPackage(compiled, manifest, files, weights, report)
