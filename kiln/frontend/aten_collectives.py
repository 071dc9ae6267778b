"""Converters for torch's functional collectives (`torch.distributed._functional_collectives`,
traced by torch.export as `torch.ops._c10d_functional.*`) into Graph IR.

Each collective becomes two nodes that keep the program's order and its asynchronous form:
  `collective`       kind (all_reduce | all_gather | reduce_scatter | all_to_all), the reduce
                     op ("sum", "avg", "max", "min", "product"; "" when none), the process
                     group's name as exported (`group`) and its size (`group_size`). Its value
                     is the result buffer, a new tensor (functional: the input is not changed).
  `collective_wait`  the torch `wait_tensor` on it: readers of the result read this node.
The group's size is the one given at export (shapes depend on it: all_gather's result is
group_size times larger); which rank a process is, and the communicator, are run-time values
of the loaded instance (`kiln.load(..., rank=, world_size=, comm_id=)`).

They register into `aten_table.TABLE`; `lowering/collectives.py` lowers them."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from kiln.errors import UnsupportedError
from kiln.frontend.aten_table import register

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def _reduce_op(n, op) -> str:
    op = str(op).lower()
    if op not in REDUCE_OPS:
        raise UnsupportedError(f"collective {n.target} (node {n.name}): reduce op {op!r} is not "
                               f"supported (expected one of {', '.join(REDUCE_OPS)})")
    return op


def _collective(b, n, kind: str, op: str, group, group_size: int) -> str:
    if int(group_size) < 0:
        raise UnsupportedError(f"collective {n.target} (node {n.name}): group size {group_size}")
    return b.emit("collective", [b.tensor(n.args[0])], n, kind=kind, reduce=op,
                  group=str(group), group_size=int(group_size))


@register("_c10d_functional.all_reduce.default")
def _all_reduce(b, n):
    x, op, group = n.args[:3]
    # the group's size is not an argument of all_reduce: it is the group's at export
    return _collective(b, n, "all_reduce", _reduce_op(n, op), group, _group_size(n, group))


@register("_c10d_functional.all_gather_into_tensor.default")
def _all_gather(b, n):
    x, group_size, group = n.args[:3]
    return _collective(b, n, "all_gather", "", group, group_size)


@register("_c10d_functional.reduce_scatter_tensor.default")
def _reduce_scatter(b, n):
    x, op, group_size, group = n.args[:4]
    rows = b.shape(x)[0] if b.rank(x) else None
    if rows is None or (rows.is_Integer and int(rows) % int(group_size)):
        raise UnsupportedError(f"reduce_scatter (node {n.name}): dim 0 ({b.shape(x)[0]}) is "
                               f"not a multiple of the group size {group_size}")
    return _collective(b, n, "reduce_scatter", _reduce_op(n, op), group, group_size)


@register("_c10d_functional.all_to_all_single.default")
def _all_to_all(b, n):
    x, out_splits, in_splits, group = n.args[:4]
    size = _group_size(n, group)
    rows = b.shape(x)[0] if b.rank(x) else None
    for what, splits in (("output", out_splits), ("input", in_splits)):
        if splits is None:
            continue
        splits = [int(s) for s in splits]
        if len(set(splits)) != 1:
            raise UnsupportedError(f"all_to_all_single (node {n.name}): unequal {what} split "
                                   f"sizes {splits} (only equal splits are supported)")
        size = len(splits)
    if rows is None or (rows.is_Integer and int(rows) % size):
        raise UnsupportedError(f"all_to_all_single (node {n.name}): dim 0 of shape "
                               f"{list(b.shape(x))} does not split into {size} equal parts")
    return _collective(b, n, "all_to_all", "", group, size)


@register("_c10d_functional.wait_tensor.default")
def _wait(b, n):
    return b.emit("collective_wait", [b.tensor(n.args[0])], n)


def _group_size(n, group) -> int:
    """The size of process group `group` (its registered name) at export; 0 (any size) when
    the group is gone (all_reduce's shapes do not depend on it)."""
    try:
        return dist.get_world_size(_resolve_process_group(str(group)))
    except Exception:  # noqa: BLE001 - any failure means the group is gone
        if "all_to_all" in str(n.target) and n.args[1] is None and n.args[2] is None:
            raise UnsupportedError(f"all_to_all_single (node {n.name}): process group {group!r} "
                                   "is not initialised in this process and no split sizes are "
                                   "given, so the group's size is unknown") from None
        return 0
