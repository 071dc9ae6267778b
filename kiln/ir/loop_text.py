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


def lib_text(n: L.Extern) -> str:
    args = ", ".join(f"%{a.buf}[{a.offset}; {list(a.shape)}:{list(a.strides)}]" for a in n.args)
    attrs = "".join(f", {k}={v}" for k, v in n.attrs)
    outs = ", ".join(f"%{o}" for o in n.outs)
    return f"{outs} = lib.{n.routine}({args}{attrs})  # {', '.join(n.source)}"


def node_text(n: L.LoopNode) -> str:
    if isinstance(n, L.Extern):
        return lib_text(n)
    if isinstance(n, L.Gemm):
        return (f"%{n.name}: {n.dtype.name}{list(n.shape)} = gemm(%{n.a.buf}, %{n.b.buf})  "
                f"# {', '.join(n.source)}")
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
    lines += ["  " + node_text(n) for n in p.nodes]
    lines.append("  outputs " + ", ".join(f"%{o}" for o in p.outputs))
    return "\n".join(lines)


class LoopError(ValueError):
    pass


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


def verify_loop(p: L.LoopProgram) -> None:
    declared = {b.name: b for b in p.buffers}
    written = {b.name for b in p.buffers if b.kind in ("input", "weight", "state")}
    for n in p.nodes:
        where = f"loop node {n.name}: {node_text(n)[:300]}"
        outs = L.node_writes(n)
        for o in outs:
            if o not in declared:
                raise LoopError(f"{where}: writes an undeclared buffer {o}")
            if o in written:
                raise LoopError(f"{where}: buffer {o} written twice")
        if isinstance(n, L.Extern):
            _verify_extern(n, declared, where)
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
