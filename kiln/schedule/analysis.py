"""Analyses the printers read instead of computing them: a scheduled kernel's parameter list
(buffers written, buffers read, size symbols, in the order the printers declare them and the
Program IR's `CallKernel` lines pass them), whether it indexes through data (then it takes a
status flag), which of its members a later member reads back from memory (a GPU kernel puts a
barrier after them), and the ATen ops a program calls through the fallback (the manifest's
`requires`)."""

from __future__ import annotations

from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import free_size_symbols
from kiln.schedule import Kernel


def kernel_params(kernel: Kernel, buffers: dict[str, L.Buffer]) -> list[tuple[str, str]]:
    """(kind, name) of every parameter, in order: buffers written, buffers read, sizes."""
    private = kernel.locals | kernel.row_locals  # never leave the kernel: not parameters
    written = [m.name for m in kernel.members if m.name not in private]
    read: list[str] = []
    syms: set = set()
    for m in kernel.members:
        for ld in L.loads(m.body):
            if ld.buf not in written and ld.buf not in read and ld.buf not in private:
                read.append(ld.buf)
        for e in list(m.shape) + list(m.reduce.sizes if m.reduce else ()):
            syms |= free_size_symbols(e)
        syms |= _expr_syms(m.body)
    for e in kernel.outer:
        syms |= free_size_symbols(e)
    params = [("out", b) for b in written] + [("in", b) for b in read]
    params += [("size", s.name) for s in sorted(syms, key=lambda s: s.name)]
    return params


def indexes_through_data(kernel: Kernel) -> bool:
    """Some member loads at an index read from data (`Load.indirect`, also inside another
    indirect index): the kernel bounds-checks those indices and takes a status flag
    (`kiln_status`) to report one out of range."""
    return any(ld.indirect for m in kernel.members for ld in L.loads(m.body))


def index_sites(kernel: Kernel) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(member, buffers its data-dependent indices are read from) for every member that
    indexes through data: what a run-time "index out of range" names (the node the user
    wrote and the input the bad index came from), not only the kernel it was fused into: the
    node the indexing was lowered from (`Indirect.site`) where known, else the member."""
    sites: dict[str, list[str]] = {}
    for m in kernel.members:
        for ld in L.loads(m.body):
            for ind in ld.indirect:
                bufs = sites.setdefault(ind.site or m.name, [])
                bufs += [x.buf for x in L.loads(ind.value) if x.buf not in bufs]
    return tuple((site, tuple(bufs)) for site, bufs in sites.items() if bufs)


def read_after_store(kernel: Kernel) -> set[str]:
    """The members whose stored result a later member of the kernel loads (a register local,
    `Kernel.locals`, is never stored): on a GPU other threads of the program stored what that
    member reads, so a barrier comes between."""
    out: set[str] = set()
    for j, m in enumerate(kernel.members):
        for later in kernel.members[j + 1:]:
            if m.name in {ld.buf for ld in L.loads(later.body)} and m.name not in kernel.locals:
                out.add(m.name)
    return out


def _expr_syms(e: L.Expr) -> set:
    out: set = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, L.Load):
            out |= free_size_symbols(x.index)
            for ind in x.indirect:
                out |= free_size_symbols(ind.bound)
                stack.append(ind.value)
        elif isinstance(x, L.Index):
            out |= free_size_symbols(x.expr)
        elif isinstance(x, L.Op):
            stack.extend(x.args)
    return out


def aten_fallback_ops(prog: P.Program) -> list[str]:
    """The ATen ops the program calls through the fallback, e.g. `aten::linalg_inv_ex`."""
    ops = {f"{x.call.op}.{x.call.overload or 'default'}" for x in P.walk(prog.lines)
           if isinstance(x, P.CallAten)}
    return sorted(ops)
