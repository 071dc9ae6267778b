"""The C++ both wrappers print for programs with collectives (lowering/collectives.py): the
call of one collective step, the instance's communicator member and the exported
`kiln_model_comm_v1` table (kiln_model_abi.h) through which libkiln attaches a communicator.

The communicator's implementation is a header of the same calls: CPU
`kiln/runtime/model/kiln_comm_mpi.h` (MPI, namespace kc), CUDA
`targets/cuda/include/kiln_comm_nccl.h` (NCCL, namespace kcn, with the element's NCCL type
and the run's stream as extra arguments)."""

from __future__ import annotations

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


def collective_lines(x: L.Extern, dtype: DType, backend: str, ptr: str = "buf_{}") -> list[str]:
    """MPI: `kc::<kind><T>(e, self->comm, what, group_size, reduce, out, in, numel)` on host
    pointers; NCCL: `kcn::<kind><uintN_t>(..., out, in + bytes, numel, ncclDataType, stream)`
    on device pointers (CUdeviceptr: offsets in bytes)."""
    (a,) = x.args
    numel = sympy.Mul(*a.shape)
    what = _cstr(f"{x.routine} {x.name} <- {', '.join(x.source)}")
    if backend == "nccl":
        if dtype not in NCCL_TYPES:
            raise UnsupportedError(f"collective {x.name} ({', '.join(x.source)}) of dtype "
                                   f"{dtype.name}: NCCL has no such type")
        ns, t = "kcn", f"uint{8 * dtype.itemsize}_t"
        src = f"{ptr.format(a.buf)} + {to_c(a.offset * dtype.itemsize)}"
        tail = f", {NCCL_TYPES[dtype]}, stream"
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


__all__ = ["COLLECTIVES", "NCCL_TYPES", "MPI_TYPES", "collective_steps", "is_collective",
           "group_size", "collective_lines", "comm_table_lines"]
