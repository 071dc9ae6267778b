"""Loop IR -> kernels.

A `Kernel` runs several `Compute` nodes inside one parallel loop nest over a shared outer index
space (a prefix of every member's shape). Within one outer iteration, members run in order, so a
member may read what an earlier member wrote in the same outer iteration. Fusion is greedy in
program order: a node joins the open kernel when its outer prefix matches (the kernel's outer may
shrink to a common prefix) and every read of a buffer produced inside the kernel stays inside the
producer's slice for the same outer index. A `Gemm` or an `Extern` is a step of its own.

A reduction whose result is read only inside its kernel, at exactly its own outer position,
becomes a local scalar and gets no buffer (`Kernel.locals`)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import contiguous_strides, ivars, linear_index, product
from kiln.ir.sym import FloorDiv, ModIdx
from kiln.ir.simplify import fold_divmod, simplify_index
from dataclasses import replace


@dataclass(frozen=True)
class Kernel:
    name: str
    outer: tuple[sympy.Expr, ...]
    members: tuple[L.Compute, ...]
    locals: frozenset[str]  # reduction results kept in registers, never stored
    row_locals: frozenset[str] = frozenset()  # buffers kept as one per-thread row (CPU)

    @property
    def source(self) -> tuple[str, ...]:
        out: list[str] = []
        for m in self.members:
            out.extend(s for s in m.source if s not in out)
        return tuple(out)


Step = Kernel | L.Gemm | L.AtenCall | L.ReadSize | L.Extern | L.UserKernel


def outer_of(node: L.Compute) -> tuple[sympy.Expr, ...]:
    if node.reduce is not None:
        shape = list(node.shape)
        while shape and shape[-1] == 1:
            shape.pop()
        return tuple(shape)
    return tuple(node.shape[:-1])


def _common_prefix(a, b) -> tuple:
    out = []
    for x, y in zip(a, b):
        if sympy.expand(x - y) != 0:
            break
        out.append(x)
    return tuple(out)


def _row_local(load: L.Load, producer: L.Buffer, outer) -> bool:
    """True when `load` (by a member whose first len(outer) vars are the outer vars) only reads
    the producer's slice for the same outer index."""
    if load.indirect:
        return False
    k = len(outer)
    iv = ivars(k)
    inner = product(producer.shape[k:])
    base = linear_index(iv, contiguous_strides(outer)) * inner
    rest = sympy.expand(load.index - base)
    return not (rest.free_symbols & set(iv)) and not rest.has(*_opaque())


def _opaque():
    return (FloorDiv, ModIdx)


def _legal(members: list[L.Compute], outer, buffers: dict[str, L.Buffer]) -> bool:
    produced: set[str] = set()
    for m in members:
        if tuple(m.shape[:len(outer)]) != tuple(outer) and any(
                sympy.expand(a - b) != 0 for a, b in zip(m.shape, outer)):
            return False
        for ld in L.loads(m.body):
            if ld.buf in produced and not _row_local(ld, buffers[ld.buf], outer):
                return False
            if any(i.value and ld.buf in produced for i in ld.indirect):
                return False
        produced.add(m.name)
    return True


def _worth(outer, old_outer) -> bool:
    if tuple(outer) == tuple(old_outer):
        return True
    n = product(outer)
    if sympy.expand(n - product(old_outer)) == 0:
        # the same parallel extent without size-1 dims (a one-token decode step: a residual
        # add over [1, 1, C] and the RMSNorm reduction after it, outer () vs (1, 1)): merging
        # loses no parallelism and saves a launch and a round trip through memory
        return True
    return len(outer) > 0 and not (n.is_Integer and int(n) < 32)


def _locals(members: tuple[L.Compute, ...], all_nodes, outputs: set[str], outer) -> frozenset:
    names = {m.name for m in members}
    mine = {m.name: m for m in members}  # as scheduled (a member may be re-indexed)
    out = set()
    for m in members:
        if m.reduce is None or m.name in outputs or product(m.shape[len(outer):]) != 1:
            continue
        readers_ok = True
        for n in all_nodes:
            n = mine.get(n.name, n) if isinstance(n, L.Compute) else n
            reads = L.node_reads(n)
            if m.name not in reads:
                continue
            if n.name not in names or isinstance(n, L.CALLS):
                readers_ok = False
                break
            expect = linear_index(ivars(len(outer)), contiguous_strides(outer))
            for ld in L.loads(n.body):
                if ld.buf == m.name and (ld.indirect or sympy.expand(ld.index - expect) != 0):
                    readers_ok = False
        if readers_ok:
            out.add(m.name)
    return frozenset(out)


def _split_rows(node: L.Compute, outer) -> L.Compute | None:
    """`node`, a pointwise [R, C] node whose R rows are the kernel's multi-dim `outer` flattened
    (a `view` of [B, T, C] as [B*T, C] before a GEMM, after a layer norm over [B, T, C]), as
    the same node iterated over `outer` + [C]: its writes keep their order (row-major over the
    same elements), its reads are re-indexed (i0 = the flat row, linear in the new indices),
    so it joins the kernel that produced its rows. None when that does not apply."""
    if node.reduce is not None or len(node.shape) != 2 or len(outer) < 2 or \
            sympy.expand(node.shape[0] - product(outer)) != 0:
        return None
    new, old = ivars(len(outer) + 1), ivars(2)
    sub = {old[0]: linear_index(new[:len(outer)], contiguous_strides(outer)), old[1]: new[-1]}
    ranges = dict(zip(new, (*outer, node.shape[1])))
    return replace(node, shape=(*outer, node.shape[1]), body=_reindex(node.body, sub, ranges))


def _reindex(e: L.Expr, sub: dict, ranges: dict) -> L.Expr:
    """`e` with the index variables replaced at once by `sub`'s expressions, simplified under
    the new variables' `ranges` (a flat row's FloorDiv / ModIdx become the new indices)."""
    def ix(x):
        return simplify_index(fold_divmod(sympy.sympify(x).xreplace(sub)), ranges)

    if isinstance(e, L.Load):
        ind = tuple(replace(i, value=_reindex(i.value, sub, ranges), bound=ix(i.bound))
                    for i in e.indirect)
        return replace(e, index=ix(e.index), indirect=ind)
    if isinstance(e, L.Index):
        return replace(e, expr=ix(e.expr))
    if isinstance(e, L.Op):
        return replace(e, args=tuple(_reindex(a, sub, ranges) for a in e.args))
    return e


#: tiny kernels (`schedule(..., tiny=True)`): a member of at most this many elements (static)
TINY = 4096


def _tiny(node: L.Compute) -> bool:
    n = sympy.sympify(product(node.shape) * (product(node.reduce.sizes) if node.reduce else 1))
    return n.is_Integer and int(n) <= TINY


def _open_across_calls(groups: list, node: L.Compute) -> list | None:
    """The last kernel group when only `Gemm` / `Extern` calls come after it and `node` reads
    nothing they write: `node` may run before them, in that kernel (its result is a new
    buffer, which those calls, earlier in program order, do not read)."""
    written: set[str] = set()
    for g in reversed(groups):
        head = g[0]
        if isinstance(head, (L.Gemm, L.Extern)):
            written |= set(L.node_writes(head))
            continue
        if isinstance(head, (*L.CALLS, *L.CONTROL)) or head is None:
            return None
        return g if not ({ld.buf for ld in L.loads(node.body)} & written) else None
    return None


def schedule(prog: L.LoopProgram, fuse: bool = True, tiny: bool = False) -> tuple[Step, ...]:
    """`tiny` (CUDA, where each launch costs microseconds): a member of at most `TINY`
    elements also joins a kernel of such members whose outer it shrinks (their parallelism
    was a few programs anyway), and joins the last kernel across the GEMMs and library calls
    after it when it reads nothing they write (a decode step's rotary embedding of the
    queries with that of the keys, across the KV-cache writes)."""
    buffers = {b.name: b for b in prog.buffers}
    groups: list[list] = []  # [outer, members] or [gemm]
    for node in prog.nodes:
        if isinstance(node, L.CALLS):
            groups.append([node])
            continue
        if isinstance(node, L.CONTROL):  # a step of its own; each region scheduled apart
            groups.append([_schedule_regions(node, fuse)])
            continue
        cur = groups[-1] if groups and not isinstance(groups[-1][0], (*L.CALLS, *L.CONTROL)) \
            else None
        if fuse and tiny and _tiny(node):
            back = cur if cur is not None else _open_across_calls(groups, node)
            if back is not None and all(_tiny(m) for m in back[1]):
                outer = _common_prefix(back[0], outer_of(node))
                # a shrunken outer only for pointwise members (a reduction keeps its rows:
                # the printers walk extra non-reduced dims of a reduction one by one)
                keeps = len(outer) == len(back[0]) and (node.reduce is None or
                                                        len(outer) == len(outer_of(node)))
                pointwise = node.reduce is None and all(m.reduce is None for m in back[1])
                if (keeps or pointwise) and _legal(back[1] + [node], outer, buffers):
                    back[0] = outer
                    back[1].append(node)
                    continue
        if fuse and cur is not None:
            outer = _common_prefix(cur[0], outer_of(node))
            if _worth(outer, cur[0]) and _legal(cur[1] + [node], outer, buffers):
                cur[0] = outer
                cur[1].append(node)
                continue
            split = _split_rows(node, cur[0])
            if split is not None and _legal(cur[1] + [split], cur[0], buffers):
                cur[1].append(split)
                continue
        groups.append([outer_of(node), [node]])
    steps: list[Step] = []
    outputs = set(prog.outputs)
    for g in groups:
        if isinstance(g[0], (*L.CALLS, *L.CONTROL)):
            steps.append(g[0])
            continue
        outer, members = tuple(g[0]), tuple(g[1])
        name = f"k{len(steps)}_{members[-1].name}"
        steps.append(Kernel(name, outer, members, _locals(members, prog.nodes, outputs, outer)))
    return tuple(steps)


def _schedule_regions(node, fuse: bool):

    names = ("then", "orelse") if isinstance(node, L.Branch) else ("cond", "body")

    def steps(k: str) -> tuple:  # kernels named <node>_<region>_k<i>_...: unique program-wide
        label = "else" if k == "orelse" else k
        return tuple(replace(s, name=f"{node.name}_{label}_{s.name}") if isinstance(s, Kernel)
                     else s for s in schedule(getattr(node, k).prog, fuse))
    return replace(node, **{k: L.Region(getattr(node, k).prog, steps(k)) for k in names})


def _map_regions(node, fn):
    """`node` with each region's steps replaced by fn(steps, region program)."""

    names = ("then", "orelse") if isinstance(node, L.Branch) else ("cond", "body")
    return replace(node, **{k: L.Region(getattr(node, k).prog,
                                        fn(getattr(node, k).steps, getattr(node, k).prog))
                            for k in names})


ROW_LOCAL_MAX_BYTES = 64 * 1024  # per buffer; several may sit on one thread's stack


def _inner_bytes(buf: L.Buffer, k: int) -> int | None:
    inner = product(buf.shape[k:])
    return int(inner) * buf.dtype.itemsize if inner.is_Integer else None


def localize_rows(steps: tuple[Step, ...], prog: L.LoopProgram) -> tuple[Step, ...]:
    """Buffers written and read only inside one kernel, always within the current outer
    iteration's slice, need only that slice: one row per thread (on the stack) instead of a
    whole buffer in the arena. Saves the round trip through memory of fused intermediates
    (e.g. a layer norm's output consumed by the softmax fused after it)."""

    buffers = {b.name: b for b in prog.buffers}
    keep = {src for _, src in prog.mutations} | set(prog.outputs)
    readers: dict[str, set[int]] = {}
    for i, s in enumerate(steps):
        for b in L.node_reads(s) if not isinstance(s, Kernel) else {
                ld.buf for m in s.members for ld in L.loads(m.body)}:
            readers.setdefault(b, set()).add(i)
    out: list[Step] = []
    for i, s in enumerate(steps):
        if isinstance(s, L.CONTROL):
            out.append(_map_regions(s, localize_rows))
            continue
        if not isinstance(s, Kernel) or not s.outer:
            out.append(s)
            continue
        k, rows = len(s.outer), set()
        for m in s.members:
            b = buffers[m.name]
            size = _inner_bytes(b, k)
            if (m.name in s.locals or m.name in keep or b.kind != "temp" or size is None
                    or size > ROW_LOCAL_MAX_BYTES or readers.get(m.name, set()) - {i}):
                continue
            if all(_row_local(ld, b, s.outer) for n in s.members for ld in L.loads(n.body)
                   if ld.buf == m.name):
                rows.add(m.name)
        out.append(replace(s, row_locals=frozenset(rows)) if rows else s)
    return tuple(out)
