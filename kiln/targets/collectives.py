"""The C++ both wrappers print for programs with collectives (lowering/collectives.py): the
call of one collective step, the instance's communicator member and the exported
`kiln_model_comm_v1` table (kiln_model_abi.h) through which libkiln attaches a communicator.

The communicator's implementation is a header of the same calls: CPU
`kiln/runtime/model/kiln_comm_mpi.h` (MPI, namespace kc), CUDA
`targets/cuda/include/kiln_comm_nccl.h` (NCCL, namespace kcn, with the element's NCCL type
and the run's stream as extra arguments).

Asynchronous collectives (CUDA, `async_waits`): torch.export places each `wait_tensor` right
after its collective; kiln keeps the collective where the program issues it (its operand is
ready there) and places its completion - a `collective_wait` line, `WAIT` - as late as the
data allows: just before the first line that reads the result, writes the operand, or frees
the result; at the latest before `Return` or the end of a nested block. The operand's `Free`
moves after the wait, so the memory planner (which runs after this pass) keeps its bytes
while the communication may still read them. NCCL runs the collective on the instance's
communication stream, and the compute lines between the collective and its wait run
concurrently with it (kiln_comm_nccl.h: events order the two streams, also under CUDA graph
capture)."""

from __future__ import annotations

from dataclasses import replace

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.dtypes import DType
from kiln.ir import program as P
from kiln.ir.sym import to_c
from kiln.lowering.collectives import COLLECTIVES
from kiln.targets.cxx_wrapper import _cstr


def collective_steps(prog: P.Program) -> list[L.Extern]:
    return [x.call for x in P.walk(prog.lines)
            if isinstance(x, P.CallLib) and x.call.routine in COLLECTIVES]


def is_collective(x: P.Line) -> bool:
    return isinstance(x, P.CallLib) and x.call.routine in COLLECTIVES


WAIT = "collective_wait"  # the completion of collective `attr("collective")` (CUDA only)


def collective_index(prog: P.Program) -> dict[str, int]:
    """Result buffer -> the collective's index in program order (its events in the NCCL
    communicator: kcn::Comm)."""
    return {c.name: k for k, c in enumerate(collective_steps(prog))}


def _writes(line: P.Line) -> set[str]:
    if isinstance(line, P.CallKernel):
        return {n for kind, n in line.args if kind == "out"}
    if isinstance(line, (P.CallLib, P.CallUser)):
        return set(line.call.outs)
    if isinstance(line, P.CallGemm):
        return {line.epilogue.name if line.epilogue is not None else line.gemm.name}
    if isinstance(line, P.CallAten):
        return {r.name for r in line.call.results()}
    if isinstance(line, (P.CopyState, P.CopyBuf)):
        return {line.dst}
    if isinstance(line, P.Alloc) and line.reuse is not None:
        return {line.reuse}
    return set()


def async_waits(prog: P.Program) -> P.Program:
    """`prog` with a `collective_wait` line after each collective, as late as the data
    allows, and each operand's Free after the last wait that needs it (see the module
    docstring). Pure; a program without collectives is returned as it is."""
    index = collective_index(prog)
    if not index:
        return prog
    return replace(prog, lines=_place_waits(prog.lines, index))


def _place_waits(lines, index: dict[str, int]) -> tuple:
    out: list = []
    pending: dict[str, L.Extern] = {}  # result buffer -> its collective, in issue order
    deferred: dict[str, P.Free] = {}  # operand -> its Free, held until no collective reads it

    def flush(results) -> None:
        for r in [r for r in pending if r in results]:
            c = pending.pop(r)
            out.append(P.CallLib(L.Extern(WAIT, (r,), c.args, (("collective", index[r]),),
                                          c.source)))
        reading = {c.args[0].buf for c in pending.values()}
        for b in [b for b in deferred if b not in reading]:
            out.append(deferred.pop(b))

    for line in lines:
        if isinstance(line, P.If):
            flush(set(pending))
            line = replace(line, then=_place_waits(line.then, index),
                           orelse=_place_waits(line.orelse, index))
        elif isinstance(line, P.While):
            flush(set(pending))
            line = replace(line, body=_place_waits(line.body, index))
        elif isinstance(line, (P.Return, P.BreakUnless)):
            flush(set(pending))
        elif isinstance(line, P.Free) and line.buf in pending:
            flush({line.buf})  # the result unread: complete before its bytes are reused
        elif isinstance(line, P.Free) and any(c.args[0].buf == line.buf
                                              for c in pending.values()):
            deferred[line.buf] = line
            continue
        elif pending:
            used, written = set(P.line_buffers(line)), _writes(line)
            flush({r for r, c in pending.items() if r in used or r in written
                   or c.args[0].buf in written})
        out.append(line)
        if is_collective(line) and line.call.name in index:
            pending[line.call.name] = line.call
    flush(set(pending))
    return tuple(out)


def has_collectives(state) -> bool:
    """Stage predicate (a targets.stages.Build with its Program built)."""
    return state.program is not None and bool(collective_steps(state.program))


def async_collectives(state):
    """The CUDA stage: `async_waits` on the Build's Program (before the memory plan)."""
    return replace(state, program=async_waits(state.program))


def group_size(prog: P.Program) -> int:
    """The process group's size the program was exported for (0: any)."""
    sizes = {int(c.attr("group_size")) for c in collective_steps(prog)} - {0}
    return max(sizes, default=0)


# ncclDataType_t of each dtype NCCL reduces (kiln_comm_nccl.h)
NCCL_TYPES = {dtypes.int8: 0, dtypes.uint8: 1, dtypes.bool_: 1, dtypes.int32: 2, dtypes.int64: 4,
              dtypes.float16: 6, dtypes.float32: 7, dtypes.float64: 8, dtypes.bfloat16: 9}
# MPI: the element types kiln_comm_mpi.h maps to MPI datatypes
MPI_TYPES = (dtypes.float32, dtypes.float64, dtypes.int64, dtypes.int32, dtypes.int16,
             dtypes.int8, dtypes.uint8, dtypes.bool_)


def collective_lines(x: L.Extern, dtype: DType, backend: str, ptr: str = "buf_{}",
                     index: int = 0) -> list[str]:
    """MPI: `kc::<kind><T>(e, self->comm, what, group_size, reduce, out, in, numel)` on host
    pointers; NCCL: `kcn::<kind><uintN_t>(..., out, in + bytes, numel, ncclDataType, stream,
    index)` on device pointers (CUdeviceptr: offsets in bytes), `index` the collective's
    (`collective_index`): it runs on the communication stream after the compute stream's
    work so far; its `wait_lines` make the compute stream wait for it."""
    (a,) = x.args
    numel = sympy.Mul(*a.shape)
    what = _cstr(f"{x.routine} {x.name} <- {', '.join(x.source)}")
    if backend == "nccl":
        if dtype not in NCCL_TYPES:
            raise UnsupportedError(f"collective {x.name} ({', '.join(x.source)}) of dtype "
                                   f"{dtype.name}: NCCL has no such type")
        ns, t = "kcn", f"uint{8 * dtype.itemsize}_t"
        src = f"{ptr.format(a.buf)} + {to_c(a.offset * dtype.itemsize)}"
        tail = f", {NCCL_TYPES[dtype]}, stream, {index}"
    else:
        if dtype not in MPI_TYPES:
            raise UnsupportedError(f"collective {x.name} ({', '.join(x.source)}) of dtype "
                                   f"{dtype.name}: the CPU (MPI) supports "
                                   f"{', '.join(d.name for d in MPI_TYPES)}")
        ns, t = "kc", dtype.c_type
        src, tail = f"{ptr.format(a.buf)} + {to_c(a.offset)}", ""
    return [f"// collective {x.routine} -> {x.name}  <- {', '.join(x.source)}",
            f"if ({ns}::{x.routine}<{t}>(e, self->comm, {what}, {int(x.attr('group_size'))}, "
            f"{int(x.attr('reduce'))}, {ptr.format(x.name)}, {src}, {to_c(numel)}{tail})) "
            "goto fail;"]


def wait_lines(x: L.Extern) -> list[str]:
    """NCCL: the compute stream waits for collective `x.attr("collective")` (a `WAIT` line)."""
    return [f"// wait for collective {x.name} (issued earlier on the communication stream)  "
            f"<- {', '.join(x.source)}",
            f"if (kcn::wait(e, self->comm, {int(x.attr('collective'))}, stream)) goto fail;"]


def comm_table_lines(prog: P.Program, backend: str, attach_body: list[str]) -> list[str]:
    """The exported table (after the anonymous namespace). `attach_body`: statements of
    attach(instance, rank, world_size, comm_id, comm_id_len, err, errlen) that end by
    returning 0 or non-zero (an `Instance* self` and a `kr::Err e` are in scope)."""
    return [
        "namespace {",
        "int comm_attach(void* instance, int32_t rank, int32_t world_size, const void* comm_id,",
        "                size_t comm_id_len, char* err, size_t errlen) {",
        "  kr::Err e{err, errlen};",
        "  Instance* self = static_cast<Instance*>(instance);",
        "  if (!self) return e.fail(\"attach: instance is NULL\");",
        *("  " + s for s in attach_body),
        "}",
        "",
        "void comm_move(void* from, void* to) {",
        "  if (from && to)",
        "    static_cast<Instance*>(to)->comm.take(static_cast<Instance*>(from)->comm);",
        "}",
        "}  // namespace",
        "",
        'extern "C" KILN_KERNEL const kiln_model_comm* kiln_model_comm_v1(void) {',
        f"  static const kiln_model_comm table = {{1, {group_size(prog)}, {_cstr(backend)}, "
        "comm_attach, comm_move};",
        "  return &table;",
        "}",
        "",
    ]


__all__ = ["COLLECTIVES", "NCCL_TYPES", "MPI_TYPES", "WAIT", "collective_steps", "is_collective",
           "collective_index", "async_waits", "has_collectives", "async_collectives",
           "group_size", "collective_lines", "wait_lines", "comm_table_lines"]
