"""Control steps (Loop IR `Branch` / `Loop`) -> nested Program IR lines.

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
carries."""

from __future__ import annotations

from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.graph import Graph


def region_lines(region: L.Region, inplace: bool) -> tuple[P.Line, ...]:
    from kiln.schedule.program import build_program

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
