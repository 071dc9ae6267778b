"""User-written Triton kernels (torch.library.triton_op / wrap_triton) -> Graph IR.

torch.export keeps a `triton_op` as a call of its custom op; `import_program` decomposes it
(`run_decompositions(decompose_custom_triton_ops=True)`) into the higher-order op
`triton_kernel_wrapper_functional(kernel_idx, constant_args_idx, grid, tma_descriptor_metadata,
kwargs, tensors_to_clone)`, which is also what a plain `wrap_triton(kernel)[grid](...)` call in
`forward` becomes. The kernel object and the constant arguments live in torch's
`kernel_side_table`. The HOP returns every tensor argument after the kernel ran
(`getitem(hop, "name")`).

One HOP becomes one `user_kernel` node (its inputs: the tensor arguments in parameter order;
attribute `spec`: a `UserKernelSpec`) plus one `user_result` node per tensor argument the
kernel writes (attribute `index`); a tensor argument it does not write reads back as the
value passed in. Which arguments a kernel writes is decided here from the kernel's source
(`written_params`, conservative) intersected with the HOP's `tensors_to_clone` (torch's own
analysis; without a GPU driver torch lists every tensor). An argument made by `empty*` is not
copied before the kernel writes it (`uninit`).

Autotuned kernels keep every `triton.Config` (constexprs, num_warps, num_stages and the grid
torch evaluated for it); the CUDA target picks one (targets/cuda/user_triton.py). torch folds
`triton.heuristics` values into the configs while tracing; a value that depends on a dynamic
size is refused (`_static`)."""

from __future__ import annotations

import ast
import builtins
import textwrap
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_table import register
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node, TensorType
from kiln.ir.sym import contiguous_strides
from kiln.frontend.builder import to_dtype
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

# pointer-writing Triton calls (functions of triton.language or methods of a descriptor)
_STORES = {"store", "atomic_add", "atomic_and", "atomic_cas", "atomic_max", "atomic_min",
           "atomic_or", "atomic_xchg", "atomic_xor", "store_tensor_descriptor"}
_EMPTY = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_permuted.default",
          "aten.empty_strided.default", "aten.new_empty.default"}


@dataclass(frozen=True)
class UserConfig:
    """One launch configuration: constexpr values set by the config (and heuristics), warps,
    pipeline stages and the grid (3 sympy expressions over size symbols)."""

    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    grid: tuple[sympy.Expr, sympy.Expr, sympy.Expr]


@dataclass(frozen=True, eq=False)
class UserKernelSpec:
    """A user Triton kernel call. `args`: per kernel parameter, in order, (name, `loop.UserArg`)
    with tensors as `UserOperand`s (the node's k-th operand).
    `written`: the tensor parameters the kernel writes (the node's results, in order)."""

    name: str
    fn: Any  # the triton.JITFunction
    args: tuple[tuple[str, L.UserArg], ...]
    configs: tuple[UserConfig, ...]
    keys: tuple[str, ...]  # triton.autotune key arguments
    written: tuple[str, ...]
    uninit: frozenset[str]

    def __repr__(self) -> str:
        return f"<triton kernel {self.name}, {len(self.configs)} config(s)>"


def _names(e: ast.AST | None) -> set[str]:
    return {x.id for x in ast.walk(e) if isinstance(x, ast.Name)} if e is not None else set()


def _loaded(e: ast.AST, glb: dict) -> set[str]:
    """Names used only inside Triton library calls in `e` (tl.load(p + offs) is a value read
    through p, not p itself)."""
    inner = set()
    for x in ast.walk(e):
        if isinstance(x, ast.Call) and _is_library(_root(x.func), glb) and \
                getattr(x.func, "attr", None) not in _STORES:
            inner |= _names(x)
    return inner - {n.id for n in _outside_calls(e)}


def _outside_calls(e: ast.AST):
    """Name nodes of `e` that are not inside any call."""
    if isinstance(e, ast.Name):
        yield e
    elif not isinstance(e, ast.Call):
        for child in ast.iter_child_nodes(e):
            yield from _outside_calls(child)


def _root(e: ast.AST) -> str | None:
    while isinstance(e, ast.Attribute):
        e = e.value
    return e.id if isinstance(e, ast.Name) else None


def _is_library(name: str | None, glb: dict) -> bool:
    """Whether global `name` is a module of Triton (tl, triton, libdevice, ...)."""
    obj = glb.get(name) if name else None
    return getattr(obj, "__name__", "").startswith("triton") and type(obj).__name__ == "module"


def written_params(fn, tensors) -> set[str]:
    """The parameters among `tensors` (pointer parameters of Triton kernel `fn`) that may be
    stored through: names reaching the pointer operand of a store / atomic (through any
    assignment), and every name passed to a call that is not Triton's own (a @triton.jit
    helper may store through it). Conservative: a false positive only costs a copy."""
    tree = ast.parse(textwrap.dedent(fn.src))
    func = next(x for x in tree.body if isinstance(x, ast.FunctionDef))
    params = [a.arg for a in func.args.args]
    glb = getattr(fn, "__globals__", None) or getattr(fn.fn, "__globals__", {})
    deps: dict[str, set[str]] = {}
    sinks: set[str] = set()

    def flow(targets, value) -> None:
        for t in targets:
            for name in _names(t):
                deps.setdefault(name, set()).update(_names(value))

    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            flow(node.targets, node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
            flow([node.target], node.value)
        elif isinstance(node, ast.For):
            flow([node.target], node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            flow([node.optional_vars], node.context_expr)
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(
                f, ast.Name) else None
            root = _root(f)
            if fname in _STORES:
                ptr = node.args[0] if node.args else next(
                    (k.value for k in node.keywords if k.arg in ("pointer", "ptr", "desc")), None)
                sinks |= _names(ptr)
                if isinstance(f, ast.Attribute) and not _is_library(root, glb):
                    sinks |= _names(f.value)  # desc.store(...), desc.atomic_add(...)
            elif isinstance(f, ast.Attribute) and (_is_library(root, glb) or root not in glb):
                continue  # tl.* functions, and methods of local values (x.to(...))
            elif isinstance(f, ast.Name) and (hasattr(builtins, f.id) and f.id not in glb):
                continue  # range, min, len, ...
            else:  # a helper (@triton.jit) or anything unknown: it may store through its args
                for a in [*node.args, *(k.value for k in node.keywords)]:
                    sinks |= _names(a) - _loaded(a, glb)
    seen, todo = set(), list(sinks)
    while todo:
        x = todo.pop()
        if x not in seen:
            seen.add(x)
            todo += deps.get(x, ())
    return {p for p in params if p in seen and p in tensors}


def _unwrap(kernel, name: str):
    """(JITFunction, autotune configs or None, key names) of a side-table kernel (a
    JITFunction, possibly inside one triton.autotune; torch has folded heuristics into the
    configs)."""
    # deferred: Triton is optional (GPU builds only)
    from triton.runtime.autotuner import Autotuner
    # deferred: Triton is optional (GPU builds only)
    from triton.runtime.jit import JITFunction

    configs, keys = None, ()
    k = kernel
    if isinstance(k, Autotuner):
        configs, keys = list(k.configs), tuple(k.keys)
        if any(getattr(c, "pre_hook", None) for c in configs) or getattr(
                k, "user_defined_pre_hook", False) or getattr(k, "user_defined_post_hook", False):
            raise UnsupportedError(f"Triton kernel {name}: autotune pre/post hooks run Python "
                                   "at launch time, which a package cannot")
        k = k.fn
    if not isinstance(k, JITFunction):
        raise UnsupportedError(f"Triton kernel {name}: expected a triton.jit function "
                               f"(optionally autotuned), got {type(k).__name__}")
    return k, configs, keys


def _static(v, key: str, where: str):
    """A config value as a Python constant (torch evaluates heuristics on sizes: a value that
    depends on a dynamic size cannot be a constexpr)."""
    if isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        e = v.node.expr
        if e in (sympy.true, sympy.false):
            return bool(e)
        if not e.is_number:
            raise UnsupportedError(f"{where}: constexpr {key} depends on a dynamic size "
                                   f"({e}; e.g. a triton.heuristics value); kiln fixes "
                                   "constexprs at compile time for every size")
        return int(e) if isinstance(v, torch.SymInt) else float(e)
    return v


def _grid_dim(b, g) -> sympy.Expr:
    v = b.int_or_sym(g)
    if isinstance(v, (int, sympy.Expr)):
        return sympy.sympify(v)
    raise UnsupportedError(f"grid entry {g!r} is not an int or a size")


def convert_user_kernel(b, n: torch.fx.Node, gm) -> dict[str, str]:
    """`triton_kernel_wrapper_functional` -> a user_kernel node and its result nodes; returns
    the HOP's results by argument name (for its getitem users)."""


    kw = n.kwargs
    kernel = kernel_side_table.get_kernel(kw["kernel_idx"])
    fn, configs, keys = _unwrap(kernel, getattr(kernel, "__name__", n.name))
    name = fn.__name__
    where = f"Triton kernel {name} (node {n.name})"
    if kw.get("tma_descriptor_metadata"):
        raise UnsupportedError(f"{where}: TMA descriptor arguments are not supported yet")
    given = {**kernel_side_table.get_constant_args(kw["constant_args_idx"]), **kw["kwargs"]}
    raw = [c.__dict__ for c in configs] if configs is not None else [
        {"kwargs": {}, "num_warps": 4, "num_stages": 3, "num_ctas": 1}]
    grids = list(kw["grid"])
    if len(grids) != len(raw):
        raise UnsupportedError(f"{where}: {len(grids)} grids for {len(raw)} configs")
    operands: list[str] = []
    args: list[tuple[str, L.UserArg]] = []
    tensors: dict[str, torch.fx.Node] = {}
    config_keys = {k for c in raw for k in c["kwargs"]}
    for p in fn.params:
        if p.name in given:
            v = given[p.name]
        elif p.name in config_keys:
            args.append((p.name, L.UserConfigured()))
            continue
        elif p.has_default:
            v = p.default
        else:
            raise UnsupportedError(f"{where}: argument {p.name} is not given")
        if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor):
            t = v.meta["val"]
            shape, strides = b.syms.shape(t.shape), b.syms.shape(t.stride())
            contiguous = contiguous_strides(shape)
            if any(sympy.expand(s - c) != 0 and d != 1
                   for s, c, d in zip(strides, contiguous, shape)):
                raise UnsupportedError(f"{where}: tensor argument {p.name} has strides "
                                       f"{list(strides)}; kiln passes contiguous tensors "
                                       f"(strides {list(contiguous)})")
            if p.is_constexpr:
                raise UnsupportedError(f"{where}: tensor argument {p.name} is a constexpr")
            tensors[p.name] = v
            operands.append(b.tensor(v))
            args.append((p.name, L.UserOperand(len(operands) - 1)))
        elif p.is_constexpr:
            args.append((p.name, L.UserConstexpr(v)))
        elif v is None:
            args.append((p.name, L.UserNone()))
        elif isinstance(v, bool):
            args.append((p.name, L.UserBool(v)))
        elif isinstance(v, (int, torch.SymInt)) or (
                isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"),
                                                            (int, torch.SymInt))):
            args.append((p.name, L.UserInt(sympy.sympify(b.int_or_sym(v)))))
        elif isinstance(v, float):
            args.append((p.name, L.UserFloat(v)))
        else:
            raise UnsupportedError(f"{where}: argument {p.name} is a {type(v).__name__}; "
                                   "supported: tensors, ints, sizes, floats, bools, None, "
                                   "constexprs")
    out_configs = []
    for c, g in zip(raw, grids):
        if c.get("num_ctas", 1) != 1:
            raise UnsupportedError(f"{where}: num_ctas={c['num_ctas']} (clusters) is not "
                                   "supported")
        consts = {k: _static(v, k, where) for k, v in c["kwargs"].items()}
        grid = tuple(_grid_dim(b, x) for x in g) + (sympy.Integer(1),) * (3 - len(g))
        out_configs.append(UserConfig(tuple(sorted(consts.items())), int(c.get("num_warps", 4)),
                                      int(c.get("num_stages", 3)), grid))
    clone = set(kw.get("tensors_to_clone", tensors))
    stored = written_params(fn, tensors)
    written = [p for p in tensors if p in clone and p in stored]
    uninit = frozenset(p for p in written if str(tensors[p].target) in _EMPTY)
    spec = UserKernelSpec(name, fn, tuple(args), tuple(out_configs), keys, tuple(written), uninit)
    token = TensorType(dtypes.bool_, ())
    node = name if name not in b.types else b.fresh(name)  # named after the kernel
    b.nodes.append(Node(node, "user_kernel", tuple(operands), token, (("spec", spec),), n.name))
    b.types[node] = token
    results: dict[str, str] = {}
    for p, v in tensors.items():
        if p not in written:
            results[p] = b.tensor(v)
            continue
        t = v.meta["val"]
        rt = TensorType(to_dtype(t.dtype), b.syms.shape(t.shape))
        rname = f"{node}_{p}"
        rname = rname if rname not in b.types else b.fresh(rname)
        b.nodes.append(Node(rname, "user_result", (node,), rt,
                            (("index", written.index(p)),), n.name))
        b.types[rname] = rt
        results[p] = rname
    return results


@register("aten.empty_permuted.default")
def _empty_permuted(b, n):
    """Uninitialised memory in eager; zeros here (a user kernel that writes it whole is not
    given a copy: see `uninit`)."""
    return b.emit("full", [], n, value=0)
