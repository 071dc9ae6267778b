"""Printer and verifier for Loop IR (kept apart from the data definitions in loop.py)."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import ivars, rvars


def expr_text(e: L.Expr) -> str:
    if isinstance(e, L.Const):
        return repr(e.value)
    if isinstance(e, L.Index):
        return f"idx({e.expr})"
    if isinstance(e, L.Load):
        ind = "".join(f" where {i.var}={expr_text(i.value)}<{i.bound}" for i in e.indirect)
        return f"{e.buf}[{e.index}{ind}]"
    return f"{e.op}({', '.join(expr_text(a) for a in e.args)})"


def aten_arg_text(a: L.AtenArg) -> str:
    match a:
        case L.AtenTensor(buf=buf):
            return f"%{buf}"
        case L.AtenOperand(index=k):
            return f"$arg{k}"
        case L.AtenTensors(items=items):
            return "[" + ", ".join(aten_arg_text(x) for x in items) + "]"
        case L.AtenOptional(value=value):
            return aten_arg_text(value)
        case L.AtenNone():
            return "None"
        case L.AtenInts(values=values):
            return "[" + ", ".join(str(x) for x in values) + "]"
        case L.AtenDtype(dtype=dt):
            return dt.name
        case L.AtenInt(value=v) | L.AtenFloat(value=v) | L.AtenBool(value=v) | L.AtenStr(value=v):
            return str(v)
    raise TypeError(a)


def lib_text(n: L.Extern) -> str:
    args = ", ".join(f"%{a.buf}[{a.offset}; {list(a.shape)}:{list(a.strides)}]" for a in n.args)
    attrs = "".join(f", {k}={v}" for k, v in n.attrs)
    outs = ", ".join(f"%{o}" for o in n.outs)
    return f"{outs} = lib.{n.routine}({args}{attrs})  # {', '.join(n.source)}"


def user_text(n: L.UserKernel) -> str:
    def arg(v: L.UserArg) -> str:
        match v:
            case L.UserBuf(buf=buf):
                return f"%{buf}"
            case L.UserNone():
                return "None"
            case L.UserConfigured():
                return "<config>"
            case L.UserOperand(index=k):
                return f"$arg{k}"
        return str(v.value)
    outs = ", ".join(f"%{o}" + (f" <- copy %{i}" if i else "") for o, i in zip(n.outs, n.inits))
    args = ", ".join(f"{p}={arg(v)}" for p, v in n.args)
    return f"{outs} = triton.{n.kernel}({args})  # {', '.join(n.source)}"


def node_text(n: L.LoopNode) -> str:
    if isinstance(n, L.Extern):
        return lib_text(n)
    if isinstance(n, L.UserKernel):
        return user_text(n)
    if isinstance(n, L.ReadSize):
        return (f"%{n.name}: int64[] = read_size {n.symbol} = %{n.src}.item() in [{n.lo}, "
                f"{n.hi}]  # {', '.join(n.source)}")
    if isinstance(n, L.AtenCall):
        ov = n.overload or "default"
        outs = ", ".join(f"%{r.name}: {r.dtype.name}{list(r.shape)}"
                         + (f" = [{r.result}]" if n.n_results > 1 else "") for r in n.results())
        return (f"{outs} <- aten_fallback {n.op}.{ov}("
                f"{', '.join(aten_arg_text(a) for a in n.args)})  # {', '.join(n.source)}")
    if isinstance(n, L.Branch):
        pred = f"%{n.pred}" if n.pred is not None else f"({n.expr})"
        return (f"{', '.join('%' + r for r in n.results)} = cond({pred}; "
                f"{', '.join('%' + o for o in n.operands)})  # {', '.join(n.source)}")
    if isinstance(n, L.Loop):
        return (f"{', '.join('%' + r for r in n.carries)} = while_loop(init "
                f"{', '.join('%' + o for o in n.inits)}; extra "
                f"{', '.join('%' + o for o in n.extra)})  # {', '.join(n.source)}")
    if isinstance(n, L.Gemm):
        extra = "".join(f", {k}=%{b}" for k, b in (
            ("scale_a", n.lowp.scale_a and n.lowp.scale_a[0]),
            ("scale_b", n.lowp.scale_b and n.lowp.scale_b[0]), ("bias", n.lowp.bias))
            if b) if n.lowp else ""
        kind = f"{n.lowp.kind}_gemm" if n.lowp else "gemm"
        if n.mixed:
            kind = "mixed_gemm"
            extra = f", {n.mixed.side}={n.mixed.qdtype.name}" + (
                f", int4 group={n.mixed.group}" + (" tc" if n.mixed.tc else "")
                if n.mixed.group else "") + "".join(
                f", scale=%{b}" for b in n.mixed.reads())
        if n.epilogue is not None:  # CPU: fused, in place (gemm/fuse_cpu.py)
            extra += f", epilogue={expr_text(n.epilogue.body)}"
        return (f"%{n.name}: {n.dtype.name}{list(n.shape)} = {kind}(%{n.a.buf}, %{n.b.buf}"
                f"{extra})  # {', '.join(n.source)}")
    red = ""
    if n.reduce is not None:
        red = f" reduce {n.reduce.kind} over r{list(n.reduce.sizes)}"
    return (f"%{n.name}: {n.dtype.name}{list(n.shape)}{red} = {expr_text(n.body)}  "
            f"# {', '.join(n.source)}")


def print_loop(p: L.LoopProgram) -> str:
    lines = ["loop program"]
    for b in p.buffers:
        if b.kind in ("input", "weight", "state"):
            lines.append(f"  {b.kind} %{b.name}: {b.dtype.name}{list(b.shape)}")
    for n in p.nodes:
        lines.append("  " + node_text(n))
        if isinstance(n, L.CONTROL):  # regions, indented
            for name, r in zip(("then", "else") if isinstance(n, L.Branch) else ("cond", "body"),
                               n.regions):
                lines += [f"    {name}: " + x if j == 0 else "    " + x
                          for j, x in enumerate(print_loop(r.prog).splitlines())]
    lines.append("  outputs " + ", ".join(f"%{o}" for o in p.outputs))
    return "\n".join(lines)


class LoopError(ValueError):
    pass


def _verify_control(n, where: str, declared, written: set[str]) -> None:
    """A control node reads written buffers, writes each result once, and its regions are
    programs of their own whose inputs / outputs are exactly those parent buffers."""
    for b in n.reads:
        if b not in declared or b not in written:
            raise LoopError(f"{where}: reads {b} before it is written")
    for b in n.writes:
        if b not in declared or b in written:
            raise LoopError(f"{where}: result {b} undeclared or written twice")
    local = {b.name for b in getattr(n, "locals", ())}
    for r in n.regions:
        try:
            verify_loop(r.prog)
        except LoopError as e:
            raise LoopError(f"{where}: region: {e}") from None
        for b in r.prog.buffers:
            ok = (b.kind == "temp" or (b.kind == "input" and (b.name in n.reads or
                                                               b.name in n.writes))
                  or (b.kind == "output" and (b.name in n.writes or b.name in local)))
            if not ok or b.name in declared and b.kind == "temp":
                raise LoopError(f"{where}: region buffer {b.name} ({b.kind}) is not one of "
                                "the node's operands, results or its own")
    written.update(n.writes)


def _verify_extern(n: L.Extern, declared, where: str) -> None:
    """Operands are well formed, and no output is also an operand (routines never alias)."""
    for a in n.args:
        if len(a.shape) != len(a.strides):
            raise LoopError(f"{where}: operand %{a.buf} has {len(a.shape)} sizes and "
                            f"{len(a.strides)} strides")
        if a.buf in n.outs:
            raise LoopError(f"{where}: operand %{a.buf} is also an output")
    for k, v in n.attrs:
        ok = isinstance(v, (bool, int, float)) or (
            isinstance(v, tuple) and all(isinstance(x, int) for x in v))
        if not ok:
            raise LoopError(f"{where}: attribute {k}={v!r} is not an int, float, bool or "
                            f"tuple of ints")


def _verify_aten(n: L.AtenCall, where: str) -> None:
    """Arguments are Loop IR kinds (tensors are strided views of buffers, not Graph IR
    operands) and every tensor has as many strides as sizes."""

    def check(a: L.AtenArg) -> L.AtenArg:
        if not isinstance(a, L.AtenTensor):
            raise LoopError(f"{where}: tensor argument {a!r} is not a buffer view")
        if len(a.shape) != len(a.strides):
            raise LoopError(f"{where}: operand %{a.buf} has {len(a.shape)} sizes and "
                            f"{len(a.strides)} strides")
        return a
    for a in n.args:
        L.map_aten_tensors(a, check)


def _verify_user(n: L.UserKernel, where: str) -> None:
    for p, v in n.args:
        if isinstance(v, L.UserOperand):
            raise LoopError(f"{where}: argument {p} is a Graph IR operand, not a buffer")


def verify_loop(p: L.LoopProgram) -> None:
    declared = {b.name: b for b in p.buffers}
    written = {b.name for b in p.buffers if b.kind in ("input", "weight", "state")}
    for n in p.nodes:
        where = f"loop node {n.name}: {node_text(n)[:300]}"
        if isinstance(n, L.CONTROL):
            _verify_control(n, where, declared, written)
            continue
        outs = L.node_writes(n)
        for o in outs:
            if o not in declared:
                raise LoopError(f"{where}: writes an undeclared buffer {o}")
            if o in written:
                raise LoopError(f"{where}: buffer {o} written twice")
        if isinstance(n, L.Extern):
            _verify_extern(n, declared, where)
        elif isinstance(n, L.AtenCall):
            _verify_aten(n, where)
        elif isinstance(n, L.UserKernel):
            _verify_user(n, where)
        for b in L.node_reads(n):
            if b not in declared:
                raise LoopError(f"{where}: reads undeclared buffer {b}")
            if b not in written:
                raise LoopError(f"{where}: reads {b} before it is written")
        if isinstance(n, L.Compute):
            bound = set(ivars(len(n.shape)))
            if n.reduce is not None:
                bound |= set(rvars(len(n.reduce.sizes)))
            for ld in L.loads(n.body):
                extra = {s for s in ld.index.free_symbols
                         if s.name[0] in "ir" and s not in bound}
                if extra:
                    names = sorted(map(str, extra))
                    raise LoopError(f"{where}: index uses unbound loop vars {names}")
        written.update(outs)
    for o in p.outputs:
        if o not in written:
            raise LoopError(f"output {o} is never written")
    _ = sympy
