"""Schedule -> Program IR.

Emits the input checks from the export's promises (dtype, rank, static sizes, `Dim` ranges and
relations between dims), binds each size symbol at its first plain occurrence, allocates the
outputs, and surrounds every step with Alloc / Free lines from buffer liveness: a temp is
allocated just before the step that first writes it and freed right after the step that last
reads it. With `inplace` (the default), a kernel output that may take over a dying input's bytes
(`kiln.memory.inplace.choose_reuse`, which states and proves the rule) is allocated with
`reuse=<input>`; the planner then gives both one interval and one offset.

Control steps (Loop IR `Branch` / `Loop`) become nested Program IR lines (`control_lines`).

Each region's lines are built like a whole program's (`build_program`: Alloc before a temp's
first writer, Free after its last reader, in-place reuse among its own temps) minus input
checks, output allocation and Return: the parent buffers a region reads and writes are already
live around the control line, so a region allocates and frees only its own temps.

  cond:       SetFlag(f, pred | size condition); If(f, then-lines, else-lines)
  while_loop: CopyBuf(carry_k, init_k) ...
              While(body = Alloc pred; cond-lines; SetFlag(f, pred); Free pred; BreakUnless(f);
                           Alloc next_k ...; body-lines; CopyBuf(carry_k, next_k) ...;
                           Free next_k ...)
The body reads the carries and writes `next_k` (a separate buffer, live at the same time, so
the planner gives it separate bytes); the copies after the body make them iteration i+1's
carries.
"""

from __future__ import annotations

from dataclasses import replace

import sympy

from kiln.schedule.analysis import index_sites, indexes_through_data, kernel_params
from kiln.errors import UnsupportedError
from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.graph import Graph
from kiln.ir.sym import data_dependent_symbols, unbacked_symbol
from kiln.memory.inplace import choose_reuse, state_updates
from kiln.schedule import Kernel, Step
from kiln.schedule.steps import CutlassGemm, GemmKernel, PutKernel


def _derived(e: sympy.Expr, bound: set[str]) -> tuple[str, int, int] | None:
    """(s, scale, offset) when size `e` is scale * s + offset for one symbol s not bound yet
    (integer scale > 0): a derived Dim."""
    free = [s for s in e.free_symbols if s.name not in bound]
    if len(free) != 1 or e.free_symbols != set(free):
        return None
    s = free[0]
    poly = sympy.Poly(e, s) if e.is_polynomial(s) else None
    if poly is None or poly.degree() != 1:
        return None
    scale, offset = poly.all_coeffs()
    if not (scale.is_Integer and offset.is_Integer and scale > 0):
        return None
    return s.name, int(scale), int(offset)


def input_lines(graph: Graph) -> list[P.Line]:
    lines: list[P.Line] = []
    ranges = {s.name: s for s in graph.symbols}
    bound: set[str] = set()
    checks: list[P.Line] = []
    for k, inp in enumerate(graph.user_inputs):
        lines.append(P.CheckInput(k, inp.name, inp.type.dtype, inp.type.rank,
                                  host=bool(inp.symbol)))
    plain = {str(e) for inp in graph.user_inputs for e in inp.type.shape
             if sympy.sympify(e).is_Symbol}  # bound from a dim of their own where they have one
    for k, inp in enumerate(graph.user_inputs):
        if inp.symbol:  # an int input: its value is the symbol
            bound.add(inp.symbol)
            lines.append(P.BindSize(inp.symbol, k, None))
            r = ranges[inp.symbol]
            checks.append(P.CheckRange(inp.symbol, k, inp.name, None, r.min, r.max))
            continue
        for d, e in enumerate(inp.type.shape):
            e = sympy.sympify(e)
            if e.is_Symbol and e.name not in bound:
                bound.add(e.name)
                lines.append(P.BindSize(e.name, k, d))
                r = ranges[e.name]
                checks.append(P.CheckRange(e.name, k, inp.name, d, r.min, r.max))
                continue
            derived = _derived(e, bound | plain)  # scale * s + offset, s in no input dim alone
            if derived is not None:
                s, scale, offset = derived
                bound.add(s)
                lines.append(P.BindSize(s, k, d, scale, offset))
                r = ranges[s]
                checks.append(P.CheckRange(s, k, inp.name, d, r.min, r.max))
            checks.append(P.CheckSize(k, inp.name, d, e))
    where = {}
    for k, inp in enumerate(graph.user_inputs):
        if inp.symbol:
            where.setdefault(inp.symbol, f"input {k} ({inp.name})")
        for d, e in enumerate(inp.type.shape):
            if sympy.sympify(e).is_Symbol:
                where.setdefault(str(e), f"input {k} ({inp.name}) dim {d}")
            elif _derived(sympy.sympify(e), set()) is not None:
                where.setdefault(_derived(sympy.sympify(e), set())[0],
                                 f"input {k} ({inp.name}) dim {d} = {e}")
    for lhs, rhs, equal, what in graph.meta.get("relations", ()):
        names = sorted({s.name for s in (lhs - rhs).free_symbols})
        if set(names) <= bound:
            checks.append(P.CheckRelation(lhs, rhs, equal, what, ", ".join(
                f"{s} = {where[s]}" for s in names if s in where)))
    unbound = set(ranges) - bound
    if unbound:
        raise UnsupportedError(f"size symbols {sorted(unbound)} appear in no input dim alone "
                               "and are no int input")
    return lines + checks


def _reads_writes(step: Step, buffers) -> tuple[list[str], list[str]]:
    if isinstance(step, (GemmKernel, CutlassGemm)):
        return step.reads(), [step.out]
    if isinstance(step, PutKernel):
        return step.reads(), step.writes()
    if isinstance(step, L.CONTROL):
        return list(step.reads), list(step.writes)
    if isinstance(step, L.CALLS):
        return sorted(L.node_reads(step)), list(L.node_writes(step))
    params = kernel_params(step, buffers)
    return [n for k, n in params if k == "in"], [n for k, n in params if k == "out"]


def index_site(graph: Graph, kernel: Kernel) -> str:
    """The ops, nodes and inputs an "index out of range" in `kernel` names."""
    ops = {n.name: n.op for n in graph.nodes}
    users = {i.name for i in graph.user_inputs}
    parts = []
    for member, bufs in index_sites(kernel):
        src = ", ".join(f"input `{b}`" if b in users else f"indices `{b}`" for b in bufs)
        parts.append(f"{ops.get(member, member)} (node `{member}`, {src})")
    return "; ".join(parts)


def build_program(graph: Graph, prog: L.LoopProgram, steps: tuple[Step, ...],
                  weights, inplace: bool = True, state_inplace: bool | None = None
                  ) -> P.Program:
    buffers = {b.name: b for b in prog.buffers}
    lines = input_lines(graph)
    bounds = unbacked_bounds(steps)
    cap = {unbacked_symbol(n): b for n, b in bounds}
    rw = [_reads_writes(s, buffers) for s in steps]
    first_write: dict[str, int] = {}
    for i, (_, writes) in enumerate(rw):
        for b in writes:
            first_write.setdefault(b, i)
    late: dict[int, list[P.Line]] = {}  # step -> outputs allocated just before it
    for k, name in enumerate(prog.outputs):
        b = buffers[name]
        shape = tuple(prog.output_shapes[k])
        capacity = tuple(sympy.sympify(d).subs(cap) for d in shape)
        if data_dependent_symbols(sympy.Mul(*capacity)) and name in first_write:
            # no upper bound: allocated at its exact shape once the sizes are known
            late.setdefault(first_write[name], []).append(P.AllocOutput(k, name, b.dtype, shape))
            continue
        lines.append(P.AllocOutput(k, name, b.dtype, shape,
                                   capacity if capacity != shape else None))
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, (reads, writes) in enumerate(rw):
        for b in writes:
            first.setdefault(b, i)
            last[b] = max(last.get(b, i), i)
        for b in reads:
            last[b] = max(last.get(b, i), i)
    for _, src in prog.mutations:  # new state values stay alive until they are copied back
        last[src] = len(steps)
    temps = {b for b in first if buffers[b].kind == "temp"}
    numel = {b: sympy.sympify(buffers[b].numel).subs(cap) for b in temps}
    heap = {b for b in temps if data_dependent_symbols(numel[b])}  # no upper bound
    reuse = choose_reuse(steps, buffers, first, last) if inplace else {}
    reuse = {b: r for b, r in reuse.items() if b not in heap and r not in heap}
    # state updates in place (memory/inplace.py) apart from temps' reuse: CUDA builds keep
    # the first and not the second
    state_inplace = inplace if state_inplace is None else state_inplace
    in_state = state_updates(steps, buffers, prog.mutations, first, last) \
        if state_inplace else {}
    in_state = {b: s for b, s in in_state.items() if b not in heap}
    for i, step in enumerate(steps):
        made = list(late.get(i, ()))
        for b in sorted(temps):
            if first[b] == i:
                made.append(P.Alloc(b, buffers[b].dtype, numel[b], reuse=reuse.get(b),
                                    heap=b in heap, state=in_state.get(b)))
        # results of an ATen call sized by the sizes it binds: allocated inside the call
        binds = {n for _, n, _ in step.all_binds()} if isinstance(step, L.AtenCall) else set()
        in_call = tuple(x for x in made if binds and _sized_by(x, binds))
        lines += [x for x in made if x not in in_call]
        if isinstance(step, L.Gemm):
            lines.append(P.CallGemm(step))
        elif isinstance(step, CutlassGemm):
            lines.append(P.CallGemm(step.gemm, step.epilogue))
        elif isinstance(step, GemmKernel):
            members = (step.gemm.name,) + ((step.epilogue.name,) if step.epilogue else ())
            lines.append(P.CallKernel(step.name, tuple(step.params()), step.status, members,
                                      step.source))
        elif isinstance(step, L.AtenCall):
            lines.append(P.CallAten(step, in_call))
        elif isinstance(step, L.ReadSize):
            lines.append(P.ReadSizeLine(step))
        elif isinstance(step, L.CONTROL):
            lines += control_lines(step, inplace)
        elif isinstance(step, PutKernel):
            # each put's copy (out = self) where it is not in place, then the one launch
            # (absorbed by an attention, a put's values are not stored: its copy reads self)
            lines += [P.CallLib(replace(p, args=p.args[:1] if step.attention else p.args,
                                        attrs=p.attrs + (("copy_only", True),)))
                      for p in step.puts]
            lines += [P.CallKernel(name, tuple(step.params(buffers)), True, step.members,
                                   step.source) for name in step.launches]
        elif isinstance(step, L.Extern):
            lines.append(P.CallLib(step))
        elif isinstance(step, L.UserKernel):
            lines.append(P.CallUser(step, tuple(sympy.sympify(buffers[o].numel).subs(cap)
                                                for o in step.outs)))
        else:
            assert isinstance(step, Kernel)
            params = tuple(kernel_params(step, buffers))
            lines.append(P.CallKernel(step.name, params, indexes_through_data(step),
                                      tuple(m.name for m in step.members), step.source,
                                      index_site(graph, step)))
        for b in sorted(temps):
            if last[b] == i:
                lines.append(P.Free(b))
    for dst, src in prog.mutations:
        if in_state.get(src) != dst:  # else updated in place (memory/inplace.py)
            lines.append(P.CopyState(dst, src, buffers[dst].numel, buffers[dst].dtype))
    lines += [P.Free(b) for b in sorted(temps) if last[b] == len(steps)]
    lines.append(P.Return(tuple(prog.outputs)))
    inputs = tuple((i.name, i.type.dtype, i.type.shape) for i in graph.user_inputs)
    dtypes = {b.name: b.dtype for b in prog.buffers}
    return P.Program(tuple(lines), inputs, tuple(weights), graph.symbols, dtypes,
                     unbacked=bounds)


def _sized_by(x: P.Line, names: set[str]) -> bool:
    size = x.numel if isinstance(x, P.Alloc) else sympy.Mul(*x.shape)
    return any(s.name in names for s in data_dependent_symbols(size))


def unbacked_bounds(steps) -> tuple[tuple[str, sympy.Expr], ...]:
    """(u<k>, upper bound over input sizes) for every data-dependent size, in definition
    order; a bound that mentions an earlier data-dependent size uses that size's bound."""
    out: list[tuple[str, sympy.Expr]] = []
    for s in steps:
        if isinstance(s, (L.AtenCall, L.ReadSize)):
            for _, name, bound in (s.all_binds() if isinstance(s, L.AtenCall) else s.binds):
                subs = {unbacked_symbol(n): b for n, b in out}
                out.append((name, sympy.sympify(bound).subs(subs)))
    return tuple(out)


def region_lines(region: L.Region, inplace: bool) -> tuple[P.Line, ...]:
    prog = build_program(Graph((), (), ()), region.prog, region.steps, (), inplace)
    return tuple(x for x in prog.lines if not isinstance(x, (P.AllocOutput, P.Return)))


def control_lines(step, inplace: bool = True) -> list[P.Line]:
    flag = f"flag_{step.name}"
    if isinstance(step, L.Branch):
        return [P.SetFlag(flag, step.pred, step.expr),
                P.If(flag, region_lines(step.then, inplace), region_lines(step.orelse, inplace),
                     step.source)]
    bufs = {b.name: b for b in step.locals}
    pred = bufs[step.pred]
    body: list[P.Line] = [P.Alloc(pred.name, pred.dtype, pred.numel)]
    body += region_lines(step.cond, inplace)
    body += [P.SetFlag(flag, pred.name), P.Free(pred.name), P.BreakUnless(flag)]
    body += [P.Alloc(x, bufs[x].dtype, bufs[x].numel) for x in step.nexts]
    body += region_lines(step.body, inplace)
    body += [P.CopyBuf(c, x, bufs[x].numel, bufs[x].dtype) for c, x in zip(step.carries,
                                                                             step.nexts)]
    body += [P.Free(x) for x in step.nexts]
    return [*(P.CopyBuf(c, i, bufs[x].numel, bufs[x].dtype)
              for c, i, x in zip(step.carries, step.inits, step.nexts)),
            P.While(step.name, tuple(body), step.source)]
