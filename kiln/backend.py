"""`torch.compile(model, backend="kiln")`: a TorchDynamo backend.

Dynamo hands over each captured FX graph with example inputs. kiln exports it, compiles it,
and runs it through the Python printer's wrapper (model.py), which calls the same compiled
kernels through ctypes.

- Dynamic sizes: after a second input shape Dynamo recompiles with symbolic sizes (its
  graph then takes the sizes as SymInt inputs and its placeholders carry symbolic shapes).
  Every symbolic dimension becomes a `torch.export` dynamic dimension, a used SymInt input a
  dynamic Python int; unused size inputs are dropped. The package is planned at run time per
  input size tuple, as any dynamic kiln package.
- Training: when grad is enabled and an input requires grad, the graph goes through
  AOTAutograd, which splits it into a forward and a backward graph; kiln compiles both as
  inference graphs, so outputs keep their autograd semantics.
- A graph kiln cannot compile (an unsupported op, a non-tensor input) runs as Dynamo gave it,
  with a `KilnFallbackWarning` naming the graph and the reason, once per graph, and a count in
  `stats()`: a backend must never break a model, nor fall back silently.

Registered under the name "kiln" through the `torch_dynamo_backends` entry point."""

from __future__ import annotations

import collections
import importlib.util
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.export import Dim

from kiln.api import compile as kiln_compile
from kiln.errors import InputError, KilnError
from kiln.options import Options

__all__ = ["KilnFallbackWarning", "kiln_backend", "reset_stats", "stats"]


class KilnFallbackWarning(UserWarning):
    """A graph handed to the kiln backend runs eagerly (as Dynamo captured it)."""


_STATS: collections.Counter = collections.Counter()  # the backend's public counters
_REASONS: collections.Counter = collections.Counter()


def stats() -> dict[str, Any]:
    """Counters since the last `reset_stats()`: graphs compiled by kiln (`compiled`, of which
    `dynamic` with symbolic sizes, `forward`/`backward` from training graphs) and graphs run
    eagerly (`eager`), with `eager_reasons` (reason -> count)."""
    out = {k: _STATS.get(k, 0) for k in ("compiled", "dynamic", "forward", "backward",
                                          "eager")}
    out["eager_reasons"] = dict(_REASONS)
    return out


def reset_stats() -> None:
    _STATS.clear()
    _REASONS.clear()


def _fall_back(name: str, reason: str) -> None:
    _STATS["eager"] += 1
    _REASONS[reason.split(":")[0].split(" (")[0]] += 1  # the kind of reason, not its details
    warnings.warn(f"kiln backend: {name} runs eagerly (not compiled by kiln): {reason}",
                  KilnFallbackWarning, stacklevel=3)


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


def _value(node: torch.fx.Node, given: Any) -> Any:
    """The placeholder's symbolic value (fake tensor or SymInt) if Dynamo/AOT recorded one."""
    meta = node.meta.get("val", node.meta.get("example_value"))
    return meta if meta is not None else given


def _hint(d: Any) -> int:
    """A size's example value, without guarding on it."""
    if isinstance(d, torch.SymInt):
        hint = d.node.hint
        if hint is None:
            hint = d.node.shape_env.size_hint(d.node.expr)
        return int(hint)
    return int(d)


def _real(x: Any) -> Any:
    """A real example input standing for `x` (AOTAutograd hands fake tensors and SymInts)."""
    if isinstance(x, torch.SymInt):
        return _hint(x)
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, torch._subclasses.FakeTensor):
        return x.detach().contiguous()
    shape = [_hint(d) for d in x.shape]
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return torch.randn(shape, dtype=x.dtype)
    return torch.zeros(shape, dtype=x.dtype)


def _is_dynamic(d: Any) -> bool:
    return isinstance(d, torch.SymInt) and not d.node.is_constant()


@dataclass(frozen=True)
class _Split:
    """The part of a graph kiln compiles: its computed tensor outputs from its used inputs.
    Outputs that are an input, None or a constant are put back around the compiled call;
    symbolic scalars (sizes AOTAutograd saves for the backward) come from `sizes`, a graph of
    size arithmetic alone, run as it is."""

    core: torch.fx.GraphModule
    kept: tuple[int, ...]  # positions of the graph inputs the core takes
    outs: tuple[tuple[str, Any], ...]  # ("core", k) | ("input", i) | ("const", v) | ("size", k)
    sizes: torch.fx.GraphModule | None = None


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _val(n: torch.fx.Node) -> Any:
    return n.meta.get("val", n.meta.get("example_value"))


def _sizes_from_tensors(graph: torch.fx.Graph) -> None:
    """A SymInt input that is a tensor input's size is read from that tensor (aten.sym_size)
    instead: export then relates it to the tensor's dimension itself, and the input is
    dropped."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    dims = {}
    for p in placeholders:
        v = _val(p)
        if isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (p, d))
    for p in placeholders:
        v = _val(p)
        if isinstance(v, torch.SymInt) and p.users and v.node.expr in dims:
            tensor, d = dims[v.node.expr]
            with graph.inserting_after(placeholders[-1]):
                size = graph.call_function(torch.ops.aten.sym_size.int, (tensor, d))
            size.meta["val"] = v
            p.replace_all_uses_with(size)


def _split(gm: torch.fx.GraphModule) -> tuple[_Split, bool] | str:
    """The core to compile (and whether the graph returns one value), or why there is none."""
    graph = torch.fx.Graph()
    env = {}
    graph.graph_copy(gm.graph, env)  # copies all but the output node
    for n in graph.nodes:  # AOTAutograd's views hold for its strides, not always for export's
        if n.op == "call_function" and n.target in _VIEWS:
            n.target = torch.ops.aten.reshape.default
    _sizes_from_tensors(graph)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = out_node.args[0]
    single = not isinstance(flat, (list, tuple))
    flat = [flat] if single else list(flat)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = {n: i for i, n in enumerate(placeholders)}
    outs, core_outs, size_outs = [], [], []
    for o in flat:
        if o is None or not isinstance(o, torch.fx.Node):
            outs.append(("const", o))
        elif o in where:
            outs.append(("input", where[o]))
        elif isinstance(_val(o), (torch.SymInt, int, float, bool)):
            size_outs.append(o)
            outs.append(("size", len(size_outs) - 1))
        else:
            if env[o] not in core_outs:
                core_outs.append(env[o])
            outs.append(("core", core_outs.index(env[o])))
    if not core_outs:
        return "the graph computes no tensor"
    sizes = _size_graph(gm, size_outs) if size_outs else None
    if isinstance(sizes, str):
        return sizes
    graph.output(tuple(core_outs))
    graph.eliminate_dead_code()
    kept = []
    for n, orig in zip([n for n in graph.nodes if n.op == "placeholder"], placeholders):
        if n.users:
            kept.append(where[orig])
        else:
            graph.erase_node(n)
    core = torch.fx.GraphModule(gm, graph)
    return _Split(core, tuple(kept), tuple(outs), sizes), single


def _size_graph(gm: torch.fx.GraphModule, outs: list) -> torch.fx.GraphModule | str:
    """The scalar outputs' own graph: size arithmetic on the inputs, no tensor computed."""
    graph = torch.fx.Graph()
    env = {}
    graph.graph_copy(gm.graph, env)
    graph.output(tuple(env[o] for o in outs))
    graph.eliminate_dead_code()
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(_val(n), torch.Tensor):
            return f"a symbolic scalar output ({outs[0].name}) depends on tensor data"
    return torch.fx.GraphModule(gm, graph)


def _dynamic_shapes(values: list[Any]) -> tuple | None:
    """torch.export dynamic shapes for the core's inputs: Dim.AUTO on every dimension (and
    SymInt input) Dynamo made symbolic, so export relates them and keeps them dynamic."""
    specs, dynamic = [], False
    for v in values:
        if isinstance(v, torch.Tensor):
            spec = {i: Dim.AUTO for i, d in enumerate(v.shape) if _is_dynamic(d)}
            specs.append(spec or None)
            dynamic |= bool(spec)
        elif _is_dynamic(v):
            specs.append(Dim.AUTO)
            dynamic = True
        else:
            specs.append(None)
    return (tuple(specs),) if dynamic else None


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, options: Options | None,
                   name: str, kind: str) -> tuple[Callable | None, str | None]:
    """Compile one FX graph as an inference graph: (run(*flat_inputs) -> outputs, None), or
    (None, the reason kiln cannot)."""
    split = _split(gm)
    if isinstance(split, str):
        return None, split
    split, single = split
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [_value(placeholders[i], example_inputs[i]) for i in split.kept]
    for i, v in zip(split.kept, values):
        if not isinstance(v, (torch.Tensor, torch.SymInt, int)):
            return None, (f"input {placeholders[i].name} is a {type(v).__name__} "
                          f"(kiln takes tensors and integers)")
    dynamic = _dynamic_shapes(values)
    # outside Dynamo's tracing context: export's own shape guards must not join Dynamo's
    with unset_fake_temporarily(), torch._guards.tracing(None), \
            torch._guards.compile_context(None):
        args = tuple(_real(example_inputs[i]) for i in split.kept)
        try:
            compiled = kiln_compile(_Wrapped(split.core).eval(), args, dynamic_shapes=dynamic,
                                    options=options)
        except KilnError as e:
            return None, f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - a JIT backend must never break the model
            return None, f"kiln crashed ({type(e).__name__}: {e}); please report it"
    directory = Path(tempfile.mkdtemp(prefix="kiln-jit-"))
    model = _load_python_wrapper(compiled.sources["model.py"], directory).Model(
        compiled.library, dict(compiled.built.weights))
    with unset_fake_temporarily(), torch.no_grad():
        differs = _differs(model(*args), split.core(*args))
    if differs:  # a miscompile must not reach the user (nor their gradients) silently
        return None, f"kiln's result differs from the graph's at the example inputs ({differs}); " \
                     "a kiln bug, please report it"
    kept, outs, size_graph = split.kept, split.outs, split.sizes
    eager = {"warned": False}

    def run(*inputs):
        core_in = [inputs[i].contiguous() if isinstance(inputs[i], torch.Tensor) else inputs[i]
                   for i in kept]
        try:
            got = model(*core_in)
        except (InputError, ValueError) as e:  # e.g. a size export specialised that Dynamo
            # kept dynamic (the Python wrapper's checks raise ValueError): eager semantics
            if not eager["warned"]:
                eager["warned"] = True
                _fall_back(name, f"inputs outside what kiln compiled: {e}")
            got = gm(*inputs)
            return got
        sizes = size_graph(*inputs) if size_graph is not None else ()
        res = [got[v] if k == "core" else inputs[v] if k == "input" else sizes[v] if k == "size"
               else v for k, v in outs]
        return res[0] if single else tuple(res)

    _STATS["compiled"] += 1
    _STATS[kind] += kind != "compiled"
    _STATS["dynamic"] += dynamic is not None
    run.kiln_compiled = compiled  # lets callers (and tests) see the graph went through kiln
    return run, None


def _differs(got, want) -> str:
    """How kiln's outputs differ from the graph's own (empty when they agree: same shapes and
    dtypes, values within a tolerance loose enough for reassociated float sums)."""
    want = want if isinstance(want, (list, tuple)) else (want,)
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return (f"output {k}: {tuple(getattr(g, 'shape', ()))} {getattr(g, 'dtype', '?')}, "
                    f"expected {tuple(w.shape)} {w.dtype}")
        if w.is_floating_point() and w.numel():
            scale = float(w.double().abs().max()) or 1.0
            err = float((g.double() - w.double()).abs().max())
            if not err <= 1e-2 * scale + 1e-4:
                return f"output {k}: max abs difference {err:.3g} at magnitude {scale:.3g}"
        elif not w.is_floating_point() and not torch.equal(g, w):
            return f"output {k}: values differ"
    return ""


def _graph_name(gm: torch.fx.GraphModule, kind: str) -> str:
    """"forward graph (3 ops: linear, gelu, layer_norm)": which graph a warning is about."""
    ops = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            t = n.target
            name = t if isinstance(t, str) else getattr(t, "_opname", None) or getattr(
                t, "__name__", str(t))
            ops.append(str(name).split(".")[-1])
    shown = ", ".join(ops[:4]) + (", ..." if len(ops) > 4 else "")
    return f"{kind + ' ' if kind else ''}graph ({len(ops)} ops: {shown})"


def _inference(gm, example_inputs, options, kind="compiled"):
    name = _graph_name(gm, "" if kind == "compiled" else kind)
    try:
        run, reason = _compile_graph(gm, list(example_inputs), options, name, kind)
    except Exception as e:  # noqa: BLE001 - preparing the graph failed: still never break it
        run, reason = None, f"kiln crashed preparing the graph ({type(e).__name__}: {e})"
    if run is None:
        _fall_back(name, reason)
        return gm.forward
    return run


def _training(gm, example_inputs, options):
    """Forward and backward graphs from AOTAutograd, each compiled as an inference graph."""

    def compiler(kind):
        def compile_one(g, inputs):
            return make_boxed_func(_inference(g, inputs, options, kind))
        return compile_one

    return aot_autograd(fw_compiler=compiler("forward"),
                        bw_compiler=compiler("backward"))(gm, example_inputs)


def kiln_backend(gm: torch.fx.GraphModule, example_inputs, options: Options | None = None):
    """The Dynamo backend: returns a callable taking the graph's flat inputs."""
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                       for x in example_inputs):
        return _training(gm, example_inputs, options)
    return _inference(gm, example_inputs, options)
