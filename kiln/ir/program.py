"""Program IR: the flat list of typed lines one model run executes, printed as C++ (the
artifact) and as Python (debugging) by the targets' wrapper printers (`targets/*/wrapper*.py`).

Lines, in the order a run executes them:
  CheckInput   validate one user input (dtype, device, rank, data pointer, contiguity)
  BindSize     read a size symbol from an input's dim, or (dim None) from the value of an
               int input (a 0-d int64 host tensor: a Python int marked dynamic at export)
  CheckSize    a dim that must equal an expression of bound symbols (static sizes, relations)
  CheckRange   a symbol must lie in its `Dim` range
  CheckRelation  a relation between sizes an op assumes and the export did not guard (a
               reshape keeps the element count; a size divisor is not 0)
  AllocOutput  a fresh output tensor (owned by the caller afterwards)
  Alloc / Free an intermediate buffer in the arena; `offset` is set by the memory planner
               (None while unplanned, or when planned at run time for dynamic sizes). An
               Alloc with `reuse=src` is in place: the buffer takes over the bytes of `src`,
               a live temp of the same dtype and size that the very next step (a kernel that
               writes this buffer) reads for the last time; `src` is freed right after it.
               An Alloc with `state=S` is not in the arena: the buffer is state S's own
               storage, which its one writer (a library put) updates in place, so no
               CopyState into S follows
  CallKernel   a generated kernel; CallGemm a BLAS call; CallAten an ATen fallback call;
               CallLib a kiln runtime routine (sort, scan, scatter, ...: `kiln_lib.h`), which
               may fail on bad indices; CallUser a user-written Triton kernel (CUDA)
  Return       hand the outputs over
Control flow (torch.cond, while_loop; lines nest):
  SetFlag      a host boolean from a 0-d buffer (read on the host) or a size condition
  If           run `then` or `orelse` on a flag
  While        run `body` until a BreakUnless in it leaves the loop
  BreakUnless  leave the innermost While unless the flag holds
  CopyBuf      copy one buffer into another (loop-carried values)
Buffers a nested block allocates it frees in the same block (and, in a While, before any
BreakUnless), so the flat walk of all lines (`walk`: then before orelse, a loop body once)
is a valid linear order for liveness and memory planning: every run executes a subsequence of
it per iteration, and buffers live across a block span all of it.

Invariants (checked by `verify_program`): sizes are bound before use, every buffer is
allocated before it is used and freed after its last use, no buffer is freed twice, every
output is allocated, a planned program has offsets on every Alloc, and every in-place Alloc
names a live temp of its dtype and byte size, is followed by the kernel that writes it and
reads `src` for the last time, and (when planned statically) sits at `src`'s offset."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

import sympy

from kiln.ir.dtypes import DType
from kiln.ir.graph import SymbolRange
from kiln.ir.loop import AtenCall, Compute, Extern, Gemm, ReadSize, UserKernel, loads, node_reads
from kiln.ir.sym import free_size_symbols
from kiln.ir.loop_text import lib_text
from kiln.ir.loop_text import user_text
from kiln.ir.loop_text import node_text


@dataclass(frozen=True)
class CheckInput:
    index: int
    name: str
    dtype: DType
    rank: int
    host: bool = False  # an int input: a 0-d int64 tensor in host memory on every device


@dataclass(frozen=True)
class BindSize:
    symbol: str
    input: int
    dim: int | None  # None: the input's value (an int input)
    # a dim declared as scale * symbol + offset (a derived Dim, `2 * Dim("h")`): the symbol is
    # (dim - offset) / scale, and a CheckSize line checks the dim is exactly that
    scale: int = 1
    offset: int = 0


@dataclass(frozen=True)
class CheckSize:
    input: int
    name: str
    dim: int
    expr: sympy.Expr


@dataclass(frozen=True)
class CheckRange:
    symbol: str
    input: int
    name: str
    dim: int | None  # None: the input's value (an int input)
    lo: int
    hi: int


@dataclass(frozen=True)
class CheckRelation:
    lhs: sympy.Expr
    rhs: sympy.Expr
    equal: bool  # lhs == rhs, else lhs != rhs
    what: str  # the op that needs it, for the message
    symbols: str  # where its symbols come from, e.g. "s0 = input 0 (x) dim 0"


@dataclass(frozen=True)
class AllocOutput:
    index: int
    buf: str
    dtype: DType
    shape: tuple[sympy.Expr, ...]
    # when the shape has data-dependent sizes: the shape allocated (their upper bounds); the
    # output's shape is set to `shape` once they are known
    capacity: tuple[sympy.Expr, ...] | None = None


@dataclass(frozen=True)
class Alloc:
    buf: str
    dtype: DType
    numel: sympy.Expr
    offset: int | None = None
    reuse: str | None = None  # in place: takes over this dying temp's bytes
    # sized by a data-dependent size without an upper bound: allocated at run time outside
    # the arena (freed at its Free, or when the run ends)
    heap: bool = False
    #: the storage of this state buffer (not the arena): the one step that writes the temp
    #: updates the state in place, and no CopyState follows (memory/inplace.py state_updates)
    state: str | None = None

    @property
    def nbytes(self) -> sympy.Expr:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Free:
    buf: str


@dataclass(frozen=True)
class CallKernel:
    kernel: str
    args: tuple[tuple[str, str], ...]  # (kind, name): kind in out / in / size
    status: bool  # takes a status flag (data-dependent indexing)
    members: tuple[str, ...]
    source: tuple[str, ...]
    #: what an index out of range names: "embedding (node `embedding`, input `input_ids`)"
    index_site: str = ""

    @property
    def index_error(self) -> str:
        return f"index out of range in {self.index_site or ', '.join(self.source)}"


@dataclass(frozen=True)
class CallGemm:
    gemm: Gemm
    #: fused into the GEMM's kernel (a CUTLASS epilogue visitor tree): the pointwise Compute
    #: reading the GEMM's result; the call then writes `epilogue.name`, never `gemm.name`
    epilogue: Compute | None = None


@dataclass(frozen=True)
class CallAten:
    """The ATen fallback: one op called through libtorch (see `loop.AtenCall`)."""

    call: AtenCall
    # its results sized by the data-dependent sizes it binds without an upper bound: their
    # Alloc (heap) / AllocOutput lines, made once the call has returned and before its
    # results are copied out (the printers declare their pointers before the call)
    allocs: tuple = ()


@dataclass(frozen=True)
class ReadSizeLine:
    """A data-dependent size read from a 0-d tensor (see `loop.ReadSize`)."""

    node: ReadSize


@dataclass(frozen=True)
class CallLib:
    call: Extern


@dataclass(frozen=True)
class CallUser:
    """A user Triton kernel (see `loop.UserKernel`): copy `inits` into `outs` (`numels`
    elements each), then launch it with the grid of the config codegen chose."""

    call: UserKernel
    numels: tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class CopyState:
    """After every step: the state buffer `dst` takes the value in `src` (same dtype, size).
    It persists in the model instance to the next run."""

    dst: str
    src: str
    numel: sympy.Expr
    dtype: DType


@dataclass(frozen=True)
class SetFlag:
    flag: str
    buf: str | None = None  # a 0-d buffer: true when its element is non-zero
    expr: object = None  # else a sympy condition over size symbols


@dataclass(frozen=True)
class If:
    flag: str
    then: tuple["Line", ...]
    orelse: tuple["Line", ...]
    source: tuple[str, ...] = ()


@dataclass(frozen=True)
class While:
    name: str
    body: tuple["Line", ...]
    source: tuple[str, ...] = ()


@dataclass(frozen=True)
class BreakUnless:
    flag: str


@dataclass(frozen=True)
class CopyBuf:
    dst: str
    src: str
    numel: sympy.Expr
    dtype: DType


@dataclass(frozen=True)
class Return:
    buffers: tuple[str, ...]


Line = Union[CheckInput, BindSize, CheckSize, CheckRange, CheckRelation, AllocOutput, Alloc, Free,
             CallKernel, CallGemm, CallAten, ReadSizeLine, CallLib, CallUser, CopyState, Return,
             SetFlag, If, While, BreakUnless, CopyBuf]


def walk(lines):
    """Every line, nested blocks included, in the linear order described above."""
    for x in lines:
        yield x
        if isinstance(x, If):
            yield from walk(x.then)
            yield from walk(x.orelse)
        elif isinstance(x, While):
            yield from walk(x.body)


def map_lines(lines, fn) -> tuple:
    """`lines` with every line x (nested ones included) replaced by fn(x)."""
    out = []
    for x in lines:
        if isinstance(x, If):
            x = replace(x, then=map_lines(x.then, fn), orelse=map_lines(x.orelse, fn))
        elif isinstance(x, While):
            x = replace(x, body=map_lines(x.body, fn))
        out.append(fn(x))
    return tuple(out)


@dataclass(frozen=True)
class WeightSpec:
    name: str
    fqn: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    mutable: bool = False  # a state buffer: the instance owns a writable copy
    permuted: tuple[int, ...] = ()  # frozen: the FQN's tensor permuted by these dims
    #: prepacked for a CPU GEMM (passes/pack_cpu.py): the packing record (ir/packing.py);
    #: `shape` is then the packed shape, the record's "shape" the one it was packed from
    packed: dict | None = field(default=None, hash=False)


@dataclass(frozen=True)
class Program:
    lines: tuple[Line, ...]
    inputs: tuple[tuple[str, DType, tuple[sympy.Expr, ...]], ...]
    weights: tuple[WeightSpec, ...]
    symbols: tuple[SymbolRange, ...]
    buffer_dtypes: dict[str, DType] = field(default_factory=dict)
    arena_bytes: int | None = None  # static plan; None when planned at run time
    alignment: int = 64
    unbacked: tuple[tuple[str, sympy.Expr], ...] = ()  # data-dependent sizes, upper bounds

    @property
    def dynamic(self) -> bool:
        return bool(self.symbols)

    def steps(self) -> list[Line]:
        return [x for x in self.lines if isinstance(x, STEPS)]


CHECKS = (CheckInput, BindSize, CheckSize, CheckRange, CheckRelation)  # lines before any step
STEPS = (CallKernel, CallGemm, CallAten, ReadSizeLine, CallLib, CallUser)  # lines that run a step


def _fmt(line: Line) -> str:
    if isinstance(line, CheckInput):
        return f"check_input {line.index} ({line.name}): {line.dtype.name} rank {line.rank}"
    if isinstance(line, BindSize):
        where = "value" if line.dim is None else f"shape[{line.dim}]"
        if line.scale != 1 or line.offset:
            where = f"({where} - {line.offset}) / {line.scale}"
        return f"{line.symbol} = input {line.input}.{where}"
    if isinstance(line, CheckSize):
        return f"check input {line.input} ({line.name}).shape[{line.dim}] == {line.expr}"
    if isinstance(line, CheckRange):
        return f"check {line.symbol} in [{line.lo}, {line.hi}]"
    if isinstance(line, CheckRelation):
        return f"check {line.lhs} {'==' if line.equal else '!='} {line.rhs} ({line.what})"
    if isinstance(line, AllocOutput):
        return f"%{line.buf} = output {line.index}: {line.dtype.name}{list(line.shape)}"
    if isinstance(line, Alloc):
        where = "runtime" if line.offset is None else f"arena+{line.offset}"
        if line.reuse is not None:
            where = f"in place of %{line.reuse} ({where})"
        if line.state is not None:
            where = f"state %{line.state}, updated in place"
        return f"%{line.buf} = alloc {line.dtype.name}[{line.numel}] @ {where}"
    if isinstance(line, Free):
        return f"free %{line.buf}"
    if isinstance(line, CallKernel):
        args = ", ".join(("%" if k != "size" else "") + n for k, n in line.args)
        return f"call {line.kernel}({args})  # {', '.join(line.source)}"
    if isinstance(line, CallGemm):
        g = line.gemm
        lp = "" if g.lowp is None else f" {g.lowp.kind}(" + ", ".join(
            f"%{b}" for b in g.lowp.reads()) + ")"
        if g.mixed is not None:
            lp += f" mixed({g.mixed.side}={g.mixed.qdtype.name}" + (
                f", int4 group={g.mixed.group}" + (" tc" if g.mixed.tc else "")
                if g.mixed.group else "") + "".join(
                f", scale=%{b}" for b in g.mixed.reads()) + ")"
        epi = "" if line.epilogue is None else f"%{line.epilogue.name} = epilogue(" + ", ".join(
            f"%{b}" for b in _epilogue_reads(line)) + ") of "
        return (f"gemm {epi}%{g.name} = %{g.a.buf} @ %{g.b.buf}{lp}  batch={list(g.batch)} "
                f"m={g.m} n={g.n} k={g.k}  # {', '.join(g.source)}")
    if isinstance(line, CallLib):
        return "lib " + lib_text(line.call)
    if isinstance(line, CallUser):
        grids = {c.grid for c in line.call.spec.configs}
        grid = ", ".join(map(str, next(iter(grids)))) if len(grids) == 1 else \
            f"grid of the chosen config among {len(grids)}"
        return f"launch[{grid}] {user_text(line.call)}"
    if isinstance(line, (CallAten, ReadSizeLine)):
        return node_text(line.call if isinstance(line, CallAten) else line.node)
    if isinstance(line, CopyState):
        return f"state %{line.dst} = %{line.src}"
    if isinstance(line, Return):
        return "return " + ", ".join(f"%{b}" for b in line.buffers)
    if isinstance(line, SetFlag):
        return f"{line.flag} = " + (f"bool(%{line.buf})" if line.buf else f"({line.expr})")
    if isinstance(line, If):
        return f"if {line.flag}:  # {', '.join(line.source)}"
    if isinstance(line, While):
        return f"while {line.name}:  # {', '.join(line.source)}"
    if isinstance(line, BreakUnless):
        return f"break unless {line.flag}"
    if isinstance(line, CopyBuf):
        return f"copy %{line.dst} = %{line.src}"
    raise TypeError(line)


def _text(lines, depth: int) -> list[str]:
    out = []
    for x in lines:
        out.append("  " * depth + _fmt(x))
        if isinstance(x, If):
            out += _text(x.then, depth + 1) + ["  " * depth + "else:"]
            out += _text(x.orelse, depth + 1)
        elif isinstance(x, While):
            out += _text(x.body, depth + 1)
    return out


def print_program(p: Program) -> str:
    head = [f"program (arena {p.arena_bytes if p.arena_bytes is not None else 'dynamic'} bytes)"]
    return "\n".join(head + _text(p.lines, 1))


class ProgramError(ValueError):
    pass


def _epilogue_reads(line: CallGemm) -> list[str]:
    """Buffers a fused epilogue reads besides the GEMM's result."""
    out: list[str] = []
    for ld in loads(line.epilogue.body):
        if ld.buf != line.gemm.name and ld.buf not in out:
            out.append(ld.buf)
    return out


def _uses(line: Line) -> list[str]:
    if isinstance(line, CallKernel):
        return [n for k, n in line.args if k != "size"]
    if isinstance(line, CallGemm):
        g = line.gemm
        if line.epilogue is not None:
            return [g.a.buf, g.b.buf, *_epilogue_reads(line), line.epilogue.name]
        return [g.a.buf, g.b.buf, *g.extra_reads(), g.name]
    if isinstance(line, CallLib):
        return [a.buf for a in line.call.args] + list(line.call.outs)
    if isinstance(line, CallUser):
        return sorted(node_reads(line.call)) + list(line.call.outs)
    if isinstance(line, CallAten):
        return sorted(node_reads(line.call)) + [r.name for r in line.call.results()]
    if isinstance(line, ReadSizeLine):
        return [line.node.src, line.node.name]
    if isinstance(line, Return):
        return list(line.buffers)
    if isinstance(line, (CopyState, CopyBuf)):
        return [line.dst, line.src]
    if isinstance(line, SetFlag) and line.buf is not None:
        return [line.buf]
    return []


def line_buffers(line: Line) -> list[str]:
    """The buffers one (non-nested) line reads or writes."""
    return _uses(line)


def _check_reuse(p: Program, k: int, line: Alloc, temps: dict[str, Alloc], live: set[str],
                 planned: bool, lines=None) -> None:
    """An in-place Alloc at line k: see the module docstring for what it must satisfy."""
    where = f"line {k} ({_fmt(line)})"
    src = temps.get(line.reuse) if line.reuse in live else None
    if src is None:
        raise ProgramError(f"{where}: {line.reuse} is not a live arena temp")
    if src.dtype != line.dtype or sympy.expand(src.nbytes - line.nbytes) != 0:
        raise ProgramError(f"{where}: {line.reuse} is {src.dtype.name}[{src.numel}], "
                           f"a different dtype or size")
    if planned and not p.dynamic and line.offset != src.offset:
        raise ProgramError(f"{where}: offset {line.offset} differs from {line.reuse}'s "
                           f"{src.offset}")
    rest = (p.lines if lines is None else lines)[k + 1:]
    j = next((j for j, x in enumerate(rest) if not isinstance(x, Alloc)), len(rest))
    call = rest[j] if j < len(rest) else None
    if not (isinstance(call, CallKernel) and ("out", line.buf) in call.args
            and ("in", line.reuse) in call.args):
        raise ProgramError(f"{where}: the next step is not a kernel writing {line.buf} and "
                           f"reading {line.reuse}")
    for x in rest[j + 1:]:
        if isinstance(x, Free) and x.buf == line.reuse:
            return
        if isinstance(x, (*STEPS, Return)):
            break
    raise ProgramError(f"{where}: {line.reuse} is not freed right after {call.kernel}, its "
                       f"last reader")


def _check_state(p: Program, k: int, line: Alloc, lines) -> None:
    """An Alloc in a state's storage: the state exists with this dtype and size, the temp
    reuses nothing else, and no CopyState into the state follows (it is updated in place)."""
    where = f"line {k} ({_fmt(line)})"
    w = next((w for w in p.weights if w.name == line.state and w.mutable), None)
    if w is None:
        raise ProgramError(f"{where}: {line.state} is not a state buffer")
    numel = 1
    for d in w.shape:
        numel *= int(d)
    if w.dtype != line.dtype or sympy.expand(line.numel - numel) != 0 or line.reuse:
        raise ProgramError(f"{where}: {line.state} is {w.dtype.name}[{numel}], a different "
                           f"dtype or size")
    if any(isinstance(x, CopyState) and x.dst == line.state for x in walk(p.lines)):
        raise ProgramError(f"{where}: {line.state} is updated in place and copied into")


def verify_program(p: Program, planned: bool = False) -> None:
    bound: set[str] = set()
    live: set[str] = {name for name, _, _ in p.inputs} | {w.name for w in p.weights}
    _verify_lines(p, p.lines, planned, bound, live, set(), {}, set(), None)
    if not p.lines or not isinstance(p.lines[-1], Return):
        raise ProgramError("program does not end with Return")


def _verify_lines(p: Program, lines, planned: bool, bound: set[str], live: set[str],
                  freed: set[str], temps: dict[str, Alloc], flags: set[str],
                  loop_live: set[str] | None) -> None:
    """Check `lines` in order, updating the sets; `loop_live` is the live set on entry to the
    innermost While (None outside loops). A nested block must leave `live` as it found it."""
    for k, line in enumerate(lines):
        where = f"line {k} ({_fmt(line)})"
        if isinstance(line, Alloc) and line.reuse is not None:
            _check_reuse(p, k, line, temps, live, planned, lines)
        if isinstance(line, Alloc) and line.state is not None:
            _check_state(p, k, line, lines)
        if isinstance(line, Alloc):
            temps[line.buf] = line
        if isinstance(line, BindSize):
            bound.add(line.symbol)
        elif isinstance(line, (CallAten, ReadSizeLine)):
            binds = line.call.all_binds() if isinstance(line, CallAten) else line.node.binds
            bound |= {name for _, name, _ in binds}
            if isinstance(line, CallAten) and line.allocs:  # sized by the call: made in it
                _verify_lines(p, line.allocs, planned, bound, live, freed, temps, flags,
                              loop_live)
        elif isinstance(line, (CheckSize, CheckRelation, AllocOutput, Alloc, SetFlag, CopyBuf)):
            exprs = [line.expr] if isinstance(line, CheckSize) else [line.lhs, line.rhs] if \
                isinstance(line, CheckRelation) else (
                list(line.capacity or line.shape) if isinstance(line, AllocOutput) else
                [line.numel] if isinstance(line, (Alloc, CopyBuf)) else
                [line.expr] if line.expr is not None else [])
            for e in exprs:
                missing = {s.name for s in free_size_symbols(e)} - bound
                if missing:
                    raise ProgramError(f"{where}: symbols {sorted(missing)} not bound yet")
            if isinstance(line, (AllocOutput, Alloc)):
                if line.buf in live:
                    raise ProgramError(f"{where}: {line.buf} allocated twice")
                live.add(line.buf)
            if planned and isinstance(line, Alloc) and line.offset is None and not p.dynamic \
                    and not line.heap and line.state is None:
                raise ProgramError(f"{where}: no arena offset")
            if isinstance(line, SetFlag):
                flags.add(line.flag)
        elif isinstance(line, Free):
            if line.buf not in live:
                raise ProgramError(f"{where}: freeing {line.buf}, which is not live")
            live.discard(line.buf)
            freed.add(line.buf)
        elif isinstance(line, (If, BreakUnless)) and line.flag not in flags:
            raise ProgramError(f"{where}: flag {line.flag} is not set")
        if isinstance(line, If):
            for block in (line.then, line.orelse):
                inner = set(live)
                _verify_lines(p, block, planned, bound, inner, freed, temps, set(flags),
                              loop_live)
                if inner != live:
                    raise ProgramError(f"{where}: a branch leaves {sorted(inner ^ live)} "
                                       "allocated or freed")
        elif isinstance(line, While):
            inner = set(live)
            _verify_lines(p, line.body, planned, bound, inner, freed, temps, set(flags),
                          set(live))
            if inner != live:
                raise ProgramError(f"{where}: the loop body leaves {sorted(inner ^ live)} "
                                   "allocated or freed")
            if not any(isinstance(x, BreakUnless) for x in line.body):
                raise ProgramError(f"{where}: the loop has no BreakUnless")
        elif isinstance(line, BreakUnless):
            if loop_live is None:
                raise ProgramError(f"{where}: outside a loop")
            if live != loop_live:
                raise ProgramError(f"{where}: leaving the loop with {sorted(live ^ loop_live)} "
                                   "allocated or freed")
        for b in _uses(line):
            if b not in live:
                state = "after it was freed" if b in freed else "before it is allocated"
                raise ProgramError(f"{where}: uses {b} {state}")
