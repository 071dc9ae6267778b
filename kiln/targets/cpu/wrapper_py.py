"""Program IR -> model.py: a readable Python wrapper that runs the same compiled kernels from
model.so through ctypes, with torch tensors as buffers. It is for debugging (step through a
run, inspect any intermediate) and JIT use; GEMMs run through torch.matmul on strided views of
the same buffers. Dynamic programs allocate each intermediate separately instead of planning an
arena."""

from __future__ import annotations

from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import to_py
from kiln.targets.cpu.gemm import epilogue_args, epilogue_function
from kiln.targets.cxx_wrapper import condition


def _gemm(g: L.Gemm) -> list[str]:
    def view(op: L.Operand, rows, cols) -> str:
        sizes = [*(to_py(b) for b in g.batch), to_py(rows), to_py(cols)]
        strides = [*(to_py(s) for s in op.batch_strides), to_py(op.rows), to_py(op.cols)]
        return (f"buf_{op.buf}.view(-1).as_strided(({', '.join(sizes)},), "
                f"({', '.join(strides)},), buf_{op.buf}.storage_offset() + {to_py(op.offset)})")

    out = [*(to_py(b) for b in g.batch), to_py(g.m), to_py(g.n)]
    b = view(g.b, g.k, g.n)
    if g.packed_b:  # B's panels [P, K, NR] (passes/pack_cpu.py) read back as K x N
        b = (f"buf_{g.b.buf}.permute(1, 0, 2).reshape({to_py(g.k)}, -1)[:, :{to_py(g.n)}]")
    lines = [f"# gemm {g.name} = {g.a.buf} @ {g.b.buf}  <- {', '.join(g.source)}",
             f"torch.matmul({view(g.a, g.m, g.k)}, {b}, "
             f"out=buf_{g.name}.view({', '.join(out)},))"]
    if g.epilogue is not None:  # fused into the GEMM in model.so; here its own pass, in place
        args = [f"_ptr(buf_{n})" if k == "in" else f"_i64({n})" for k, n, _ in epilogue_args(g)]
        lines.append(f"lib.{epilogue_function(g.name)}({', '.join([f'_ptr(buf_{g.name})', *args])})"
                     f"  # epilogue {g.epilogue.name} <- {', '.join(g.epilogue.source)}")
    return lines


def _aten_arg(a: L.AtenArg) -> str:
    match a:
        case L.AtenTensor(buf=buf, shape=shape, strides=strides, offset=offset):
            sizes = "".join(f"{to_py(d)}, " for d in shape)
            st = "".join(f"{to_py(d)}, " for d in strides)
            return (f"buf_{buf}.view(-1).as_strided(({sizes}), ({st}), "
                    f"buf_{buf}.storage_offset() + {to_py(offset)})")
        case L.AtenTensors(items=items):
            return "[" + ", ".join(_aten_arg(x) for x in items) + "]"
        case L.AtenOptional(value=value):
            return _aten_arg(value)
        case L.AtenNone():
            return "None"
        case L.AtenInt(value=v):
            return to_py(v)
        case L.AtenInts(values=vs):
            return "[" + ", ".join(to_py(v) for v in vs) + "]"
        case L.AtenDtype(dtype=dt):
            return str(dt.torch)
        case L.AtenBool(value=v) | L.AtenStr(value=v):
            return repr(v)
        case L.AtenFloat(value=v):
            return f"float({str(float(v))!r})"
    raise TypeError(a)


def _aten(c: L.AtenCall, bounds, allocs=()) -> list[str]:
    name = c.op.split("::", 1)[1]
    ov = c.overload or "default"
    n_pos = len(c.args) - len(c.keywords)
    args = [_aten_arg(a) for a in c.args[:n_pos]]
    args += [f"{k}={_aten_arg(a)}" for k, a in zip(c.keywords, c.args[n_pos:])]
    res = c.results()
    out = [f"# aten fallback {c.op}.{ov} -> {', '.join(r.name for r in res)}  <- "
           f"{', '.join(c.source)}",
           f"_r = torch.ops.aten.{name}.{ov}({', '.join(args)})"]
    for r in res:
        got = f"_r[{r.result}]" if c.n_results > 1 else "_r"
        for d, sym, _ in r.binds:  # data-dependent sizes
            out += [f"{sym} = {got}.shape[{d}]",
                    f"_expect({sym} <= {to_py(bounds[sym])}, 'data-dependent size {sym} exceeds "
                    f"its bound')"]
    for a in allocs:  # results sized by the call: allocated now
        out += (_alloc_output if isinstance(a, P.AllocOutput) else _alloc)(None, a)
    for r in res:
        got = f"_r[{r.result}]" if c.n_results > 1 else "_r"
        shape = "".join(f"{to_py(d)}, " for d in r.shape)
        numel = " * ".join(to_py(d) for d in r.shape) or "1"
        out.append(f"buf_{r.name}.view(-1)[:{numel}].view(({shape})).copy_({got})")
    return out


def _lib(x: L.Extern) -> list[str]:
    ops = [f"buf_{a.buf}.view(-1).as_strided(({''.join(to_py(d) + ', ' for d in a.shape)}), "
           f"({''.join(to_py(d) + ', ' for d in a.strides)}), buf_{a.buf}.storage_offset() + "
           f"{to_py(a.offset)})" for a in x.args]
    outs = ", ".join(f"buf_{o}" for o in x.outs)
    return [f"# lib.{x.routine} -> {', '.join(x.outs)}  <- {', '.join(x.source)}",
            f"_lib({x.routine!r}, {dict(x.attrs)!r}, [{outs}], {', '.join(ops)})"]


class _Else:
    """Marks the start of an If's else block in `_nested`."""


class _Pass:
    """Ends a (possibly empty) block in `_nested`."""


def _nested(lines, depth: int = 0):
    """(depth, line) for every line, nested control-flow blocks included, in printing order."""
    for x in lines:
        yield depth, x
        if isinstance(x, P.If):
            yield from _nested(x.then + (_Pass(),), depth + 1)
            yield depth, _Else()
            yield from _nested(x.orelse + (_Pass(),), depth + 1)
        elif isinstance(x, P.While):
            yield from _nested(x.body, depth + 1)


def _control(body: list[str], x) -> None:
    """Control-flow lines (the nested lines follow, one level deeper)."""

    if isinstance(x, P.SetFlag):
        value = (f"bool(buf_{x.buf}.reshape(-1)[0])" if x.buf is not None
                 else condition(x.expr, to_py, ("and", "or", "not")))
        body.append(f"{x.flag} = {value}")
    elif isinstance(x, P.If):
        body.append(f"if {x.flag}:  # torch.cond {', '.join(x.source)}")
    elif isinstance(x, _Else):
        body.append("else:")
    elif isinstance(x, P.While):
        body.append(f"while True:  # while_loop {', '.join(x.source)}")
    elif isinstance(x, P.BreakUnless):
        body.append(f"if not {x.flag}:")
        body.append("    break")
    elif isinstance(x, P.CopyBuf):
        body.append(f"buf_{x.dst}.view(-1)[:{to_py(x.numel)}].copy_("
                    f"buf_{x.src}.reshape(-1)[:{to_py(x.numel)}])  # {x.dst} <- {x.src}")
    elif isinstance(x, _Pass):
        body.append("pass")


def _check_input(prog: P.Program, x: P.CheckInput) -> list[str]:
    if x.host:
        return [f"{x.name} = _int_input(inputs[{x.index}], {x.index}, {x.name!r})",
                f"buf_{x.name} = {x.name}"]
    return [f"{x.name} = inputs[{x.index}]",
            f"_check({x.name}, {x.index}, {x.name!r}, {x.dtype.torch}, {x.rank})",
            f"buf_{x.name} = {x.name}"]


def _bind_size(prog: P.Program, x: P.BindSize) -> list[str]:
    if x.dim is None:
        return [f"{x.symbol} = int(inputs[{x.input}])"]
    return [f"{x.symbol} = (inputs[{x.input}].shape[{x.dim}] - {x.offset}) // {x.scale}"]


def _check_size(prog: P.Program, x: P.CheckSize) -> list[str]:
    return [f"_expect(inputs[{x.input}].shape[{x.dim}] == {to_py(x.expr)}, "
            f"'input {x.input} ({x.name}): dim {x.dim} must be {x.expr}')"]


def _check_relation(prog: P.Program, x: P.CheckRelation) -> list[str]:
    op = "==" if x.equal else "!="
    return [f"_expect({to_py(x.lhs)} {op} {to_py(x.rhs)}, 'input sizes: {x.what} "
            f"needs {x.lhs} {op} {x.rhs} ({x.symbols})')"]


def _check_range(prog: P.Program, x: P.CheckRange) -> list[str]:
    what = "the value" if x.dim is None else f"dim {x.dim}"
    return [f"_expect({x.lo} <= {x.symbol} <= {x.hi}, 'input {x.input} ({x.name}):"
            f" {what} must be in [{x.lo}, {x.hi}]')"]


def _alloc_output(prog: P.Program, x: P.AllocOutput) -> list[str]:
    shape = ", ".join(to_py(d) for d in (x.capacity or x.shape))
    return [f"buf_{x.buf} = torch.empty(({shape}{',' if shape else ''}), "
            f"dtype={x.dtype.torch})"]


def _alloc(prog: P.Program, x: P.Alloc) -> list[str]:
    dt = x.dtype.torch
    if x.state is not None:  # the state's own storage: updated in place
        return [f"buf_{x.buf} = buf_{x.state}.view(-1)"]
    if x.offset is None:
        return [f"buf_{x.buf} = torch.empty({to_py(x.numel)}, dtype={dt})"]
    return [f"buf_{x.buf} = arena[{x.offset}:{x.offset} + {to_py(x.nbytes)}].view({dt})"]


def _call_kernel(prog: P.Program, x: P.CallKernel) -> list[str]:
    args = [f"_i64({n})" if k == "size" else f"_ptr(buf_{n})" for k, n in x.args]
    if x.status:
        args.append("ctypes.byref(status)")
    out = [f"# {x.kernel}: {', '.join(x.members)}  <- {', '.join(x.source)}",
           f"lib.{x.kernel}({', '.join(args)})"]
    if x.status:
        out.append(f"_expect(status.value == 0, {x.index_error!r})")
    return out


def _read_size(prog: P.Program, x: P.ReadSizeLine) -> list[str]:
    n = x.node
    return [f"# {n.symbol} = {n.src}.item(): a data-dependent size",
            f"{n.symbol} = int(buf_{n.src}.reshape(-1)[0])",
            f"_expect({n.lo} <= {n.symbol} <= {to_py(n.hi)}, '{n.src}.item() is "
            f"outside [{n.lo}, {n.hi}], the range the export assumed')",
            f"buf_{n.name}.view(-1)[0] = {n.symbol}"]


def _copy_state(prog: P.Program, x: P.CopyState) -> list[str]:
    return [f"buf_{x.dst}.view(-1).copy_(buf_{x.src}.reshape(-1)[:{to_py(x.numel)}])"
            f"  # state persists to the next run"]


def _return(prog: P.Program, x: P.Return) -> list[str]:
    out = []
    for y in (y for y in prog.lines if isinstance(y, P.AllocOutput) and y.capacity):
        numel = " * ".join(to_py(d) for d in y.shape) or "1"
        shape = "".join(f"{to_py(d)}, " for d in y.shape)
        out.append(f"buf_{y.buf} = buf_{y.buf}.view(-1)[:{numel}].view(({shape}))"
                   "  # data-dependent shape")
    return out + [f"return [{', '.join(f'buf_{b}' for b in x.buffers)}]"]


#: Program IR line type -> its Python lines (control-flow lines: `_control`)
_LINES = {
    P.CheckInput: _check_input, P.BindSize: _bind_size, P.CheckSize: _check_size,
    P.CheckRelation: _check_relation, P.CheckRange: _check_range,
    P.AllocOutput: _alloc_output, P.Alloc: _alloc,
    P.Free: lambda prog, x: [f"del buf_{x.buf}"],
    P.CallKernel: _call_kernel,
    P.CallGemm: lambda prog, x: _gemm(x.gemm),
    P.CallAten: lambda prog, x: _aten(x.call, dict(prog.unbacked), x.allocs),
    P.ReadSizeLine: _read_size,
    P.CallLib: lambda prog, x: _lib(x.call),
    P.CopyState: _copy_state, P.Return: _return,
}


def print_python_wrapper(prog: P.Program, steps, buffers) -> str:
    body: list[str] = []
    for depth, x in _nested(prog.lines):
        start = len(body)
        _control(body, x)
        text = _LINES.get(type(x))
        if text is not None:
            body += text(prog, x)
        body[start:] = ["    " * depth + s for s in body[start:]]
    weights = "\n".join(f"    buf_{w.name} = weights[{w.name!r}]  # {w.fqn}" for w in prog.weights)
    arena = prog.arena_bytes or 0
    return f'''"""Generated by kiln: Python wrapper over the kernels in model.so (for debugging).

Usage: model = Model("path/to/model.so", weights); outputs = model(*flat_inputs)
"""
import ctypes

import torch


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _i64(v):
    return ctypes.c_int64(int(v))


def _expect(ok, message):
    if not ok:
        raise ValueError(message)


def _check(t, index, name, dtype, rank):
    _expect(isinstance(t, torch.Tensor), f"input {{index}} ({{name}}): expected a tensor")
    _expect(t.dtype == dtype, f"input {{index}} ({{name}}): expected {{dtype}}, got {{t.dtype}}")
    _expect(t.dim() == rank, f"input {{index}} ({{name}}): expected rank {{rank}}, got {{t.dim()}}")
    _expect(t.is_contiguous(), f"input {{index}} ({{name}}): expected a contiguous tensor")


def _int_input(v, index, name):
    """An int input (a Python int, or a 0-d int64 tensor) as a 0-d int64 tensor."""
    if isinstance(v, torch.Tensor):
        _expect(v.dtype == torch.int64 and v.dim() == 0, f"input {{index}} ({{name}}): "
                f"expected an int, got a {{v.dtype}} tensor of rank {{v.dim()}}")
        return v
    _expect(isinstance(v, int) and not isinstance(v, bool),
            f"input {{index}} ({{name}}): expected an int, got {{type(v).__name__}}")
    return torch.tensor(v, dtype=torch.int64)


def _lib(routine, attrs, outs, *operands):
    """A kiln_lib.h routine, run by its numpy twin in kiln.ir.interp (this file is for
    debugging: the C++ routine runs in model.so's own wrapper)."""
    from kiln.ir.interp import ROUTINES
    import numpy as np
    specs = [(str(o.dtype).removeprefix("torch."), tuple(o.shape)) for o in outs]
    # numpy has no bfloat16: half operands reach the twin as float32 (exact)
    got = ROUTINES[routine](specs, attrs, *[
        (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x).numpy()
        for x in operands])
    for o, g in zip(outs, got):  # (a data-dependent result, nonzero's: the buffer's front)
        src = torch.from_numpy(np.ascontiguousarray(g).reshape(-1)).to(o.dtype)
        o.view(-1)[:src.numel()].copy_(src)


STATE = {{{", ".join(repr(w.name) for w in prog.weights if w.mutable)}}}


class Model:
    def __init__(self, lib_path, weights):
        self.lib = ctypes.CDLL(str(lib_path))
        # state buffers are updated by every run: this model owns copies of them
        self.weights = {{k: v.clone() if k in STATE else v for k, v in weights.items()}}

    def __call__(self, *inputs):
        with torch.no_grad():
            return run(self.lib, self.weights, inputs)


def run(lib, weights, inputs):
    _expect(len(inputs) == {len(prog.inputs)},
            f"expected {len(prog.inputs)} inputs, got {{len(inputs)}}")
    status = ctypes.c_int32(0)
    arena = torch.empty({arena}, dtype=torch.uint8)
{weights}
''' + "\n".join("    " + s for s in body) + "\n"
