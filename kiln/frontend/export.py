"""ExportedProgram -> Graph IR.

Runs the core-ATen decompositions, turns parameters / buffers / lifted constants into weights
(keyed by their FQN), user inputs into typed inputs with symbolic shapes, every call node into
kiln ops through `aten_table.TABLE`, and records the pytree specs and `Dim` ranges."""

from __future__ import annotations

import contextlib
import operator
import sys
import warnings
from dataclasses import dataclass

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from kiln.errors import UnsupportedError
from kiln.frontend import fallback, sym_values, user_triton
from kiln.frontend.aliasing import output_aliases
from kiln.frontend.custom_ops import custom_rewrites
from kiln.frontend.scalar_ops import ScalarArgument, rewrite_table
from kiln.frontend import aten_extra, aten_random  # noqa: F401 - register their converters
from kiln.frontend import aten_spatial  # noqa: F401  (registers spatial converters)
import kiln.frontend.aten_library  # noqa: F401  (registers library-call converters)
import kiln.frontend.aten_unique  # noqa: F401  (registers unique, unique_consecutive)
import kiln.frontend.aten_lowp  # noqa: F401  (registers _scaled_mm, _int_mm)
import kiln.frontend.aten_collectives  # noqa: F401  (registers the functional collectives)
from kiln.frontend.aten_high import Fallback
from kiln.frontend.aten_library import DATA_DEPENDENT_NATIVE, cpu_only
from kiln.frontend.aten_table import TABLE
from kiln.frontend.aten_complex import COMPLEX
from kiln.frontend import aten_complex_fft, aten_complex_linalg, aten_complex_math  # noqa: F401
from kiln.frontend.fold import fold_constants
from kiln.frontend.control import CONTROL, convert_int_value
from kiln.frontend.builder import RNG_FQN, RNG_STATE, Builder, to_dtype
from kiln.frontend.symbols import SymbolTable
from kiln.ir import dtypes
from kiln.ir.graph import Graph, Input, Node, SymbolRange, TensorType

_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class Imported:
    graph: Graph
    weights: dict[str, torch.Tensor]  # graph input name -> tensor (contiguous, detached)


def _rng_update(b: Builder) -> tuple[Node, Node]:
    """state_next = state + [0, 1]: the seed stays, the run counter advances."""
    t = b.types[RNG_STATE]
    step = Node(f"{RNG_STATE}_step", "iota", (), t, (("start", 0), ("step", 1)), "random")
    nxt = Node(f"{RNG_STATE}_next", "add", (RNG_STATE, step.name), t, (), "random")
    return step, nxt


def _weights_and_inputs(ep: ExportedProgram, syms: SymbolTable, b: Builder):
    kinds = {s.arg.name: s for s in ep.graph_signature.input_specs}
    inputs: list[Input] = []
    weights: dict[str, torch.Tensor] = {}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    # user inputs first so that symbols are numbered by user input order
    ordered = sorted(placeholders, key=lambda n: kinds[n.name].kind != InputKind.USER_INPUT)
    for n in ordered:  # every plain symbol first: a dim may be an expression of a later one
        v = n.meta.get("val")
        if kinds[n.name].kind == InputKind.USER_INPUT and isinstance(v, torch.Tensor):
            for d in v.shape:
                if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                    syms.add(d.node.expr)
        elif kinds[n.name].kind == InputKind.USER_INPUT and _int_input(v):
            syms.add(v.node.expr)
    for n in ordered:  # then symbols found only in a derived dim (`2 * Dim("h")`)
        v = n.meta.get("val")
        if kinds[n.name].kind == InputKind.USER_INPUT and isinstance(v, torch.Tensor):
            for d in v.shape:
                if isinstance(d, torch.SymInt) and _linear_in_new(d.node.expr, syms):
                    syms.add(next(iter(d.node.expr.free_symbols)))
    for position, n in enumerate(n for n in placeholders
                                 if kinds[n.name].kind == InputKind.USER_INPUT):
        v = n.meta.get("val")
        if isinstance(v, (bool, int, float)) and not n.users:
            b.constant_inputs.append({"index": position, "name": n.name, "value": v})
    for n in ordered:
        spec = kinds[n.name]
        v = n.meta.get("val")
        if any(c["name"] == n.name for c in b.constant_inputs):
            continue
        if spec.kind == InputKind.USER_INPUT and _int_input(v):
            # uses of the int read its symbol (Builder.tensor); the value binds it at run time
            t = TensorType(dtypes.int64, ())
            inputs.append(Input(n.name, t, "user", symbol=syms.convert(v).name))
            b.types[n.name] = t
            continue
        if not isinstance(v, torch.Tensor):
            raise UnsupportedError(f"input {n.name} is a {type(v).__name__} used as a symbolic "
                                   "value; only tensors and constant scalars are supported")
        if spec.kind == InputKind.USER_INPUT:
            kind, fqn = "user", ""
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            fqn = spec.target
            data = ep.state_dict.get(fqn)
            if data is None:
                data = ep.constants[fqn]
            if data.dtype == torch.complex32:  # safetensors cannot store it
                raise UnsupportedError(f"weight {fqn} is complex32, which a package cannot "
                                       "store (safetensors has no complex32); keep it "
                                       "complex64 and cast in forward (`w.to(torch.chalf)`)")
            weights[n.name] = data.detach().contiguous()
            kind = "weight"
        elif spec.kind == InputKind.TOKEN:
            effects = sorted({str(u.args[1]) for u in ep.graph.nodes if u.op == "call_function"
                              and "with_effects" in str(u.target)})
            raise UnsupportedError(f"the program has side-effecting ops ({', '.join(effects)}; "
                                   "e.g. torch.linalg.inv's singular-matrix check); kiln does "
                                   "not compile effect tokens: use the *_ex variant (e.g. "
                                   "torch.linalg.inv_ex) and check `info` in the model")
        else:
            raise UnsupportedError(f"input {n.name} of kind {spec.kind.name} is not supported")
        t = TensorType(to_dtype(v.dtype), syms.shape(v.shape))
        inputs.append(Input(n.name, t, kind, fqn))
        b.env[n.name] = n.name
        b.types[n.name] = t
    user = [i for i in inputs if i.kind == "user"]
    order = {n.name: k for k, n in enumerate(placeholders)}
    user.sort(key=lambda i: order[i.name])
    return tuple(user + [i for i in inputs if i.kind == "weight"]), weights


def _int_input(v) -> bool:
    """An int input marked dynamic at export: a SymInt placeholder that is a plain symbol."""
    return isinstance(v, torch.SymInt) and v.node.expr.is_Symbol


def _linear_in_new(e, syms: SymbolTable) -> bool:
    """Whether size `e` is a * s + b (integers a > 0, b) of one symbol s not yet in `syms`."""
    free = e.free_symbols
    if len(free) != 1 or next(iter(free)) in syms.rename:
        return False
    s = next(iter(free))
    try:
        poly = sympy.Poly(e, s)
    except sympy.PolynomialError:
        return False
    a, *rest = poly.all_coeffs()
    return poly.degree() == 1 and a.is_Integer and a > 0 and rest[0].is_Integer


def _bound(v, default: int) -> int:
    """An export range bound as an int; unbounded (torch's int_oo, which claims to be finite)
    gives `default`."""
    try:
        value = int(v)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return default
    return default if abs(value) >= 2**62 else value


def _symbol_ranges(ep: ExportedProgram, syms: SymbolTable) -> tuple[SymbolRange, ...]:
    hints = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
            for d in n.meta["val"].shape:
                if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                    hints[d.node.expr] = d.node.hint
                elif isinstance(d, torch.SymInt) and len(d.node.expr.free_symbols) == 1 \
                        and d.node.hint is not None:  # a derived dim: its symbol's example
                    s = next(iter(d.node.expr.free_symbols))
                    sol = sympy.solve(d.node.expr - d.node.hint, s)
                    if len(sol) == 1 and sol[0].is_Integer:
                        hints.setdefault(s, int(sol[0]))
        elif n.op == "placeholder" and _int_input(n.meta.get("val")):
            hints[n.meta["val"].node.expr] = n.meta["val"].node.hint
    out = []
    for theirs, ours in syms.rename.items():
        if ours.name in syms.unbacked:  # data-dependent: bound by the call that makes it
            continue
        vr = ep.range_constraints.get(theirs)
        lo = _bound(vr.lower, 0) if vr is not None else 0
        hi = _bound(vr.upper, _INT_MAX) if vr is not None else _INT_MAX
        out.append(SymbolRange(ours.name, lo, min(hi, sys.maxsize), int(hints.get(theirs, lo))))
    return tuple(out)


def _plain(obj):
    """Structseq results (torch.return_types.max, ...) as plain tuples, recursively."""
    if isinstance(obj, tuple) and hasattr(obj, "n_fields"):
        return tuple(_plain(x) for x in obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _dump_spec(spec) -> str:
    """JSON of a pytree spec. Structseq nodes have no serialised name in torch's pytree
    registry: they become tuples (the runner returns a tuple where eager returns e.g.
    torch.return_types.max; fields keep their order)."""
    try:
        return pytree.treespec_dumps(spec)
    except NotImplementedError:
        plain = _plain(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))
        return pytree.treespec_dumps(pytree.tree_flatten(plain)[1])


def _all_known(ep: ExportedProgram) -> bool:
    for n in ep.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if isinstance(n.meta.get("val"), (torch.SymInt, int, float)):
            continue
        if str(n.target) not in TABLE:
            return False
    return True


def import_program(ep: ExportedProgram, fold: bool = True, aten_fallback: bool = False,
                   seed: int = 0, library_routines: bool = True, fused_attention: bool = False
                   ) -> Imported:
    """Translate `ep` to Graph IR; with `fold`, weight-only subgraphs are evaluated now and
    become weights (see fold.py). When every op is one kiln converts directly (aten_high.py
    and aten_table.py), the program is imported as exported; otherwise (or when a converter
    declines) it is decomposed to core ATen first. The target decides two things:
    `library_routines` (the target links kiln's CPU library routines, kiln_lib.h): without
    them an op kiln would lower to one (aten_library.CPU_ONLY_OPS) calls ATen instead (with
    `aten_fallback`; else it is refused); `fused_attention` turns
    scaled_dot_product_attention into one `attention` node instead of its decomposition."""
    args = (fold, aten_fallback, seed, library_routines, fused_attention)
    if _all_known(ep):
        try:
            return _import(ep, *args)
        except (Fallback, ScalarArgument):
            pass
    # triton_op custom ops decompose into the Triton kernel HOP (frontend/user_triton.py)
    rewritten: list = []  # ops the ATen fallback met with Scalar arguments (scalar_ops.py)
    first: ScalarArgument | None = None
    views_as_reshape = False
    # a target with the fused attention step keeps scaled_dot_product_attention whole (torch
    # would decompose it into its math on a CPU export); if its converter declines the call,
    # the program is decomposed again with torch's table
    keep_sdpa = fused_attention
    while True:
        table = rewrite_table(rewritten) if rewritten else None
        if keep_sdpa:
            table = dict(torch.export.default_decompositions() if table is None else table)
            table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
        try:
            with warnings.catch_warnings(), _views_as_reshape(ep, views_as_reshape):
                warnings.filterwarnings(  # torch's deepcopy of its own pytree specs warns on
                    # every compile (a deprecation inside torch)
                    "ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
                decomposed = _decompose(ep, table)
            return _import(decomposed, *args)
        except (ValueError, RuntimeError) as e:
            # torch re-traces the program to decompose it, and a decomposed op (the math of
            # scaled_dot_product_attention, ...) may give its result other strides than the
            # export saw: a later `view` of it then fails in torch ("Cannot view a tensor
            # with shape [s72, s70, 128] and strides ..."). kiln's views are index maps over
            # values, so the program is decomposed again with view as reshape (a copy where
            # the strides need one, the same values)
            if views_as_reshape or "Cannot view a tensor with shape" not in str(e):
                raise
            views_as_reshape = True
        except Fallback:
            if not keep_sdpa:
                raise
            keep_sdpa = False
        except ScalarArgument as e:
            first = first or e
            if e.op in rewritten or rewrite_table([*rewritten, e.op]) is None:
                raise
            rewritten.append(e.op)
        except UnsupportedError as e:
            if first is None:
                raise
            # the rewrite made ops kiln cannot compile either: the Scalar is the reason
            raise UnsupportedError(f"{first} (its decomposition fails too: {e})") from None


def _decompose(ep: ExportedProgram, table: dict | None) -> ExportedProgram:
    """`ep` decomposed to core ATen by `table` (None: torch's default). When torch's own
    re-trace fails (e.g. GPT-2: SDPA's math decomposition yields other strides than the fused
    op, and the `view` after it no longer applies), the program is decomposed again keeping
    every op kiln converts directly (aten_table.TABLE) as it is. Ops outside ATen that kiln
    rewrites (custom_ops.py) are rewritten in the same step."""
    custom = custom_rewrites({n.target for n in ep.graph.nodes if n.op == "call_function"})
    if custom:
        table = {**(torch.export.default_decompositions() if table is None else table), **custom}
    try:
        return ep.run_decompositions(table, decompose_custom_triton_ops=True)
    except (RuntimeError, ValueError, TypeError) as failed:
        keep = torch.export.default_decompositions() if table is None else dict(table)
        for op in list(keep):
            if str(op) in TABLE:
                del keep[op]
        try:
            return ep.run_decompositions(keep, decompose_custom_triton_ops=True)
        except (RuntimeError, ValueError, TypeError):
            raise failed from None


@contextlib.contextmanager
def _views_as_reshape(ep: ExportedProgram, on: bool):
    """With `on`, the program's aten.view nodes read as aten.reshape while torch decomposes
    it (a reshape copies where the re-traced strides need it); restored afterwards."""
    nodes = [n for n in ep.graph.nodes if on and n.target is torch.ops.aten.view.default]
    for n in nodes:
        n.target = torch.ops.aten.reshape.default
    try:
        yield
    finally:
        for n in nodes:
            n.target = torch.ops.aten.view.default
        if nodes:
            ep.graph_module.recompile()


SIZE_ASSERTS = {"aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default",
                "aten.sym_constrain_range.default"}


# ops that only move complex elements: kiln lowers them (index maps / copies) like any other
COMPLEX_MOVES = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                 "aten.permute.default", "aten.t.default", "aten.transpose.int",
                 "aten.slice.Tensor", "aten.select.int", "aten.expand.default",
                 "aten.clone.default", "aten.alias.default", "aten.unsqueeze.default",
                 "aten.squeeze.dim", "aten.squeeze.dims", "aten.cat.default",
                 "aten.split_with_sizes.default", "aten.split.Tensor", "aten.as_strided.default",
                 "aten.flip.default", "aten.diagonal.default", "aten.masked_scatter.default",
                 "aten.squeeze.default", "aten.repeat.default", "aten.index_select.default",
                 "aten.gather.default", "aten.index.Tensor", "aten.roll.default",
                 "aten.contiguous.default", "aten.detach.default", "aten.lift_fresh_copy.default",
                 "aten._assert_tensor_metadata.default"}  # (a check of metadata, no values)


def _complex(n) -> bool:
    """Whether `n` computes on complex values (then ATen does: kiln only stores them)."""
    if str(n.target) in COMPLEX_MOVES:
        return False
    vals = [n.meta.get("val")] + [a.meta.get("val") for a in n.all_input_nodes]
    vals = [x for v in vals for x in (v if isinstance(v, (tuple, list)) else [v])]
    return any(isinstance(v, torch.Tensor) and v.is_complex() for v in vals)


def _data_dependent_number(v, syms: SymbolTable) -> bool:
    """Whether int `v` is computed from a tensor's data (`y.item()`), not from sizes."""
    return isinstance(v, torch.SymInt) and any(s not in syms.rename
                                               for s in v.node.expr.free_symbols)


def _new_size(n, syms: SymbolTable) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.SymInt) and v.node.expr.is_Symbol and v.node.expr not in syms.rename


def _data_dependent(n, syms: SymbolTable) -> bool:
    """Whether a result of `n` has a size only known once it ran (a new unbacked symbol)."""
    vals = n.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else [vals]
    return any(isinstance(d, torch.SymInt) and any(
        s not in syms.rename for s in d.node.expr.free_symbols)
        for v in vals if isinstance(v, torch.Tensor) for d in v.shape)


def convert_node(b: Builder, n: torch.fx.Node, gm: torch.fx.GraphModule) -> None:
    """Convert one FX call node into kiln nodes (recorded in `b`). `gm` owns the subgraphs
    that control-flow operators (torch.cond, while_loop) name. With `b.aten_fallback`, ops
    kiln does not lower, ops with data-dependent result sizes and ops computing on complex
    values become ATen fallback calls (frontend/fallback.py)."""
    if n.target is operator.getitem:
        src, k = n.args
        results = b.multi.get(src.name)
        if results is not None:
            b.env[n.name] = results[k]
            if isinstance(n.meta.get("val"), torch.SymInt):  # an int a while_loop carried
                b.value_ints.add(n.name)
        elif k == 0:
            b.env[n.name] = b.tensor(src)
        elif n.users:
            raise UnsupportedError(f"result {k} of {src.target} (node {src.name}) is used")
        return
    if str(n.target) == "aten._local_scalar_dense.default" and _new_size(n, b.syms):
        b.env[n.name] = fallback.read_size(b, n)  # `x.item()` used as a size
        return
    if convert_int_value(b, n):
        return  # arithmetic on ints held as values (a while_loop counter)
    if isinstance(n.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat, int, float)) \
            and not isinstance(n.meta.get("val"), bool):
        return  # size arithmetic: shapes (and size predicates) are read from node metadata,
        # values made where a tensor op reads them (Builder.tensor, frontend/sym_values.py)
    if str(n.target) in SIZE_ASSERTS:
        return  # facts about sizes: bounds of data-dependent sizes are checked at run time
    if n.target in CONTROL:
        b.multi[n.name] = CONTROL[n.target](b, n, gm)
        return
    if n.target is _triton_hop():
        b.multi[n.name] = user_triton.convert_user_kernel(b, n, gm)
        return
    conv = TABLE.get(str(n.target))
    if _complex(n):  # complex arithmetic as real arithmetic on the parts, where kiln has it
        conv = COMPLEX.get(str(n.target))
        if conv is None and not b.aten_fallback:
            raise UnsupportedError(f"operator {n.target} (node {n.name}) computes on complex "
                                   "values in a way kiln leaves to ATen: enable aten_fallback")
    if b.aten_fallback and (conv is None or (_data_dependent(n, b.syms) and
                                             str(n.target) not in DATA_DEPENDENT_NATIVE)):
        conv = fallback.aten_fallback
    if conv is None:
        raise UnsupportedError(f"operator {n.target} (node {n.name}) is not supported yet")
    mark, known = len(b.nodes), set(b.types)
    try:
        result = conv(b, n)
        if not b.library_routines and any(cpu_only(x, b.types) for x in b.nodes[mark:]):
            raise UnsupportedError(f"operator {n.target} (node {n.name}) is lowered to a CPU "
                                   "library routine, which CUDA programs cannot call: enable "
                                   "aten_fallback to run it through ATen")
    except UnsupportedError as declined:
        if not b.aten_fallback or conv is fallback.aten_fallback or isinstance(declined, Fallback):
            raise
        del b.nodes[mark:]  # a converter that declines a form of its op: ATen computes it
        for k in set(b.types) - known:
            del b.types[k]
        try:
            result = fallback.aten_fallback(b, n)
            b.fallback_why.setdefault(str(n.target), str(declined))
        except ScalarArgument:
            raise  # the importer rewrites the op (scalar_ops.py)
        except UnsupportedError as refused:
            raise UnsupportedError(f"{declined}; the ATen fallback refused it too: {refused}"
                                   ) from None
    if isinstance(result, list):
        b.multi[n.name] = result
    else:
        b.env[n.name] = result


def _triton_hop():
    """torch's functional Triton kernel HOP (None when this torch has none)."""
    return getattr(torch.ops.higher_order, "triton_kernel_wrapper_functional", None)


def _input_mutation(b: Builder, spec, inputs) -> tuple[int, str] | None:
    """A user input the program writes in place (`x.add_(1)`, batch norm's running stats
    passed as inputs): (the input's position among the user inputs, the kiln value of its new
    contents, cast to the input's dtype). The value becomes an extra output after the user
    outputs, listed in the manifest's `input_mutations`; the Python runner copies it into the
    caller's tensor after each run (runtime/loader.py), C callers get it as that output. None
    when the value written back is the input itself (a user Triton kernel torch could not
    analyse without a GPU lists every tensor argument as mutated; kiln's own analysis found
    it unwritten)."""
    value = b.env.get(spec.arg.name)
    user = [i for i in inputs if i.kind == "user"]
    if any(i.name == value for i in user):
        return None
    pos = next((k for k, i in enumerate(user) if i.name == spec.target), None)
    if pos is None or value is None or value not in b.types:
        raise UnsupportedError(f"the program writes user input {spec.target} in place "
                               f"(through {spec.arg.name}), which kiln cannot follow")
    want, got = user[pos].type, b.types[value]
    if tuple(want.shape) != tuple(got.shape):
        raise UnsupportedError(f"the program writes user input {spec.target} in place with a "
                               f"value of shape {list(got.shape)}; expected its shape "
                               f"{list(want.shape)}")
    if want.dtype != got.dtype:
        value = b.cast_to(value, want.dtype.torch, _FakeRef(spec.arg.name))
    return pos, value


class _FakeRef:
    """A stand-in FX node (only its name is read) for nodes made for an output spec."""

    def __init__(self, name: str) -> None:
        self.name = name


def _import(ep: ExportedProgram, fold: bool, aten_fallback: bool = False, seed: int = 0,
            library_routines: bool = True, fused_attention: bool = False) -> Imported:
    syms = SymbolTable()
    b = Builder(syms, convert_node)
    b.fused_attention = fused_attention
    b.ranges = dict(ep.range_constraints)
    b.aten_fallback = aten_fallback
    b.library_routines = library_routines
    inputs, weights = _weights_and_inputs(ep, syms, b)
    mutated = {s.target for s in ep.graph_signature.output_specs
               if s.kind == OutputKind.BUFFER_MUTATION}
    mutated_names = {i.name for i in inputs if i.fqn in mutated}
    folded = fold_constants(ep, weights, mutated_names) if fold else {"__folded__": set()}
    skip = folded.pop("__folded__")
    for name, value in folded.items():  # folded values become weights
        t = TensorType(to_dtype(value.dtype), tuple(sympy.Integer(d) for d in value.shape))
        inputs = inputs + (Input(name, t, "weight", f"<folded {name}>"),)
        weights[name] = value
        b.env[name], b.types[name] = name, t
    for n in ep.graph.nodes:
        if n.op != "call_function" or n.name in skip:
            continue
        convert_node(b, n, ep.graph_module)
    outputs = []
    out_nodes: list[str | None] = []  # the FX node of each user output
    int_outputs: list[int] = []
    mutations = []
    input_writes: list[tuple[int, str]] = []  # (user input position, its new value)
    written_fx: dict[str, str] = {}  # FX node of a written input's new contents -> the input
    by_fqn = {i.fqn: i.name for i in inputs if i.kind == "weight"}
    for spec in ep.graph_signature.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION and spec.target in by_fqn:
            mutations.append((by_fqn[spec.target], b.env[spec.arg.name]))
            continue
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            written = _input_mutation(b, spec, inputs)
            if written is not None:
                input_writes.append(written)
                written_fx[spec.arg.name] = spec.target
            continue
        if spec.kind != OutputKind.USER_OUTPUT:
            raise UnsupportedError(f"output {spec.arg} of kind {spec.kind.name} is not "
                                   "supported yet")
        name = getattr(spec.arg, "name", None)
        node = next((n for n in ep.graph.nodes if n.name == name), None)
        val = node.meta.get("val") if node is not None else None
        number = isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float))
        if name not in b.env and isinstance(val, (torch.SymInt, int)) and \
                not isinstance(val, bool) and not _data_dependent_number(val, b.syms):
            # a size returned as a Python int: a 0-d int64 output the loader turns into an int
            value = b.syms.convert(val)
            b.env[name] = b.fresh(f"{name}_int")
            t = TensorType(dtypes.int64, ())
            b.nodes.append(Node(b.env[name], "full", (), t, (("value", value),), name))
            b.types[b.env[name]] = t
        elif name not in b.env and number:
            # a float / bool computed from sizes, or `y.item()`: a 0-d output (int64,
            # float64 or bool) the loader turns into a Python number
            b.env[name] = sym_values.sym_value(b, node)
        if number or name in b.value_ints:  # returned as a Python number
            int_outputs.append(len(outputs))
        if name is None or name not in b.env:
            raise UnsupportedError(f"output {spec.arg} is not a tensor")
        out_nodes.append(None if int_outputs and int_outputs[-1] == len(outputs) else name)
        outputs.append(b.env[name])
    input_mutations = []
    for pos, value in input_writes:  # extra outputs after the user outputs
        input_mutations.append((pos, len(outputs)))
        out_nodes.append(None)
        outputs.append(value)
    if b.rng is not None:  # random ops: the seed and run counter are state, updated per run
        inputs = inputs + (Input(RNG_STATE, b.types[RNG_STATE], "weight", RNG_FQN),)
        weights[RNG_STATE] = torch.tensor([seed, 0], dtype=torch.int64)
        b.nodes.extend(_rng_update(b))
        mutations.append((RNG_STATE, f"{RNG_STATE}_next"))
    state = {name for name, _ in mutations}
    inputs = tuple(Input(i.name, i.type, "state", i.fqn) if i.name in state else i
                   for i in inputs)
    graph = Graph(inputs, tuple(b.nodes), tuple(outputs), _symbol_ranges(ep, syms),
                  in_spec=pytree.treespec_dumps(ep.call_spec.in_spec),
                  out_spec=_dump_spec(ep.call_spec.out_spec),
                  meta={"constant_inputs": tuple(b.constant_inputs),
                        "aten_fallback_why": tuple(sorted(b.fallback_why.items())),
                        "relations": tuple(b.relations),
                        "int_outputs": tuple(int_outputs),
                        # eager's storage sharing between outputs and inputs (aliasing.py)
                        "output_aliases": output_aliases(
                            ep, [i.name for i in inputs if i.kind == "user"], out_nodes, syms,
                            written_fx),
                        "mutations": tuple(mutations),
                        "input_mutations": tuple(input_mutations)})
    return Imported(graph, weights)
