"""The C++ both wrappers print for programs with collectives (lowering/collectives.py): the
call of one collective step, the instance's communicator member and the exported
`kiln_model_comm_v1` table (kiln_model_abi.h) through which libkiln attaches a communicator.

The communicator's implementation is a header namespace `kc` of the same calls: CPU
`kiln/runtime/model/kiln_comm_mpi.h` (MPI), CUDA `targets/cuda/include/kiln_comm_nccl.h`
(NCCL, with the run's stream as an extra argument)."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import to_c
from kiln.lowering.collectives import COLLECTIVES
from kiln.targets.cxx_wrapper import _cstr


def collective_steps(prog: P.Program) -> list[L.Extern]:
    return [x.call for x in P.walk(prog.lines)
            if isinstance(x, P.CallLib) and x.call.routine in COLLECTIVES]


def is_collective(x: P.Line) -> bool:
    return isinstance(x, P.CallLib) and x.call.routine in COLLECTIVES


def group_size(prog: P.Program) -> int:
    """The process group's size the program was exported for (0: any)."""
    sizes = {int(c.attr("group_size")) for c in collective_steps(prog)} - {0}
    return max(sizes, default=0)


def collective_lines(x: L.Extern, dtype, ptr: str = "buf_{}", extra: str = "") -> list[str]:
    """`kc::<kind>(e, self->comm, what, group_size, reduce, out, in, numel[, extra])`."""
    (a,) = x.args
    numel = sympy.Mul(*a.shape)
    what = _cstr(f"{x.routine} {x.name} <- {', '.join(x.source)}")
    tail = f", {extra}" if extra else ""
    return [f"// collective {x.routine} -> {x.name}  <- {', '.join(x.source)}",
            f"if (kc::{x.routine}<{dtype.c_type}>(e, self->comm, {what}, "
            f"{int(x.attr('group_size'))}, {int(x.attr('reduce'))}, {ptr.format(x.name)}, "
            f"{ptr.format(a.buf)} + {to_c(a.offset)}, {to_c(numel)}{tail})) goto fail;"]


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
        "  if (from && to) static_cast<Instance*>(to)->comm.take(static_cast<Instance*>(from)->comm);",
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


__all__ = ["COLLECTIVES", "collective_steps", "is_collective", "group_size", "collective_lines",
           "comm_table_lines"]
