"""Outputs that eager returns as views of an input or of another output (the manifest's
`outputs[j].alias`, recorded by kiln/frontend/aliasing.py): the plan read from the manifest
once per runner, and the views made after each call, so kiln's results share storage where
eager's do."""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["alias_plan", "share_storage"]


class _Alias:
    """Output `out` is a view of input or output `index` (manifest outputs[out].alias):
    `strides` and `offset` evaluate the recorded expressions on the input sizes. `same`: the
    output is the base itself; `contiguous` (with `same`): the base itself only when it is
    contiguous at run time (the graph is also eager's `x.contiguous()`), else the view only
    when it is contiguous; `compact_only`: a view of a compact base only (a reshape on the
    way views some layouts only); `when`: per input, the strides (functions of the inputs)
    it must have for the sharing to hold (eager's layout of an output is the export's only
    for the export's input strides), None to hold in any layout."""

    __slots__ = ("out", "of_input", "index", "strides", "offset", "same", "contiguous",
                 "compact_only", "when")

    def __init__(self, out: int, of_input: bool, index: int, strides, offset,
                 same: bool = False, contiguous: bool = False, compact_only: bool = False,
                 when: list | None = None) -> None:
        self.out, self.of_input, self.index = out, of_input, index
        self.strides, self.offset, self.same = strides, offset, same
        self.contiguous, self.compact_only, self.when = contiguous, compact_only, when


_EXPR_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Pow: operator.pow}


def _size_expr(text: int | str, where: dict[str, tuple[int, int | None]]):
    """A recorded size expression (an int, or a polynomial over input size symbols as text:
    "3*s0 - 3") -> a function of the flat inputs; None when it is not of that form."""
    if isinstance(text, int) and not isinstance(text, bool):
        return lambda flat: text
    try:
        tree = ast.parse(str(text), mode="eval").body
    except SyntaxError:
        return None

    def build(n):
        if isinstance(n, ast.Constant) and type(n.value) is int:
            v = n.value
            return lambda flat: v
        if isinstance(n, ast.Name) and n.id in where:
            i, d = where[n.id]
            if d is None:  # an int input: its 0-d tensor
                return lambda flat: int(flat[i])
            return lambda flat: int(flat[i].shape[d])
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            f = build(n.operand)
            return None if f is None else (lambda flat: -f(flat))
        if isinstance(n, ast.BinOp) and type(n.op) in _EXPR_OPS:
            a, b, op = build(n.left), build(n.right), _EXPR_OPS[type(n.op)]
            return None if a is None or b is None else (lambda flat: op(a(flat), b(flat)))
        return None

    return build(tree)


def alias_plan(m: Mapping[str, Any]) -> list[_Alias]:
    """The manifest's output aliases whose expressions this runner can evaluate."""
    where: dict[str, tuple[int, int | None]] = {}  # size symbol -> (input, dim or None: an int)
    for i, rec in enumerate(m.get("inputs", [])):
        if isinstance(rec, dict) and rec.get("python_int") and "symbol" in rec:
            where.setdefault(str(rec["symbol"]), (i, None))
        for d, size in enumerate(rec.get("shape", []) if isinstance(rec, dict) else []):
            if isinstance(size, str) and size.isidentifier():
                where.setdefault(size, (i, d))
    plan = []
    for j, rec in enumerate(m.get("outputs", [])):
        a = rec.get("alias") if isinstance(rec, dict) else None
        if not isinstance(a, dict) or a.get("of") not in ("input", "output"):
            continue
        if not isinstance(a.get("index"), int):
            continue
        when = None
        if "when_strides" in a:
            when = _when(a["when_strides"], where)
            if when is None:  # a condition this runner cannot evaluate: no sharing
                continue
        flags = {"contiguous": a.get("contiguous") is True,
                 "compact_only": a.get("compact_only") is True, "when": when}
        if a.get("same") is True:  # the base itself: no strides to evaluate
            plan.append(_Alias(j, a["of"] == "input", a["index"], [], lambda flat: 0, True,
                               **flags))
            continue
        strides = [_size_expr(x, where) for x in a.get("strides", [])]
        offset = _size_expr(a.get("offset", 0), where)
        if offset is not None and None not in strides:
            plan.append(_Alias(j, a["of"] == "input", a["index"], strides, offset, **flags))
    return plan


def _when(rec, where) -> list | None:
    """The manifest's `when_strides` (per input: its strides at export, or None) -> per
    input a list of functions of the flat inputs, or None; None when not of that form."""
    if not isinstance(rec, list):
        return None
    out: list = []
    for st in rec:
        if st is None:
            out.append(None)
            continue
        if not isinstance(st, list):
            return None
        fs = [_size_expr(x, where) for x in st]
        if None in fs:
            return None
        out.append(fs)
    return out


def _elem_strides(t) -> tuple[int, ...] | None:
    if isinstance(t, torch.Tensor):
        return tuple(t.stride()) if t.layout == torch.strided else None
    if isinstance(t, np.ndarray):
        return tuple(st // t.itemsize for st in t.strides) if t.itemsize else None
    return None


def _strides_hold(when: list, flat) -> bool:
    """Whether every input has the strides `when` names (dims of size 1 aside: their stride
    changes no layout decision)."""
    if len(when) != len(flat):
        return False
    for fs, t in zip(when, flat):
        if fs is None:
            continue
        got = _elem_strides(t)
        if got is None or len(got) != len(fs):
            return False
        if any(n != 1 and g != f(flat) for n, g, f in zip(t.shape, got, fs)):
            return False
    return True


def share_storage(plan: list[_Alias], results: list[Any], flat: Any) -> None:
    """Replaces each aliasing output by the view of its base that eager returns: the base
    object itself when the output is the base (`return x, x`: "same"), a new view object of all
    of the base when the view is the whole of it (`x[:]`, `chunk(x, 1)[0]`, `x.view(x.shape)`:
    eager's is a new tensor on the same storage too), else an as_strided view of a compact
    base. An input that is an output and was exported compact ("contiguous": the graph is also
    `return x.contiguous()`) is returned itself only when it is contiguous now, as eager's
    `contiguous()` returns `self`; otherwise kiln's own compact copy stays, as eager's copy. A
    base with other strides (an input given transposed: its copy-in was compact, the
    recorded strides are not its strides) keeps the output's own copy, and so does a whole
    view through a reshape ("compact_only": eager's reshape copies such a base) and an output
    whose sharing rests on eager's layout, for inputs without the export's strides ("when")."""
    for a in plan:
        if a.when is not None and not _strides_hold(a.when, flat):
            continue  # eager's layout of the base may differ from the export's: a copy
        base = flat[a.index] if a.of_input else results[a.index]
        if isinstance(base, np.ndarray):
            if any(st < 0 for st in base.strides) or not base.dtype.isnative:
                continue
            try:
                base = torch.from_numpy(base)
            except (TypeError, ValueError):
                continue
        out = results[a.out]
        if not isinstance(base, torch.Tensor) or not isinstance(out, torch.Tensor) or \
                base.dtype != out.dtype or base.device != out.device:
            continue
        if a.same:
            if base.shape == out.shape and not (a.contiguous and not base.is_contiguous()):
                results[a.out] = base
            continue
        strides, offset = [f(flat) for f in a.strides], a.offset(flat)
        view = None
        if offset == 0 and base.shape == out.shape and \
                (out.numel() <= 1 or strides == list(_compact_strides(out.shape))) and \
                (not a.of_input or base.layout == torch.strided) and \
                (not a.compact_only or base.is_contiguous()):
            view = base.as_strided(base.shape, base.stride(), base.storage_offset())
        elif base.layout == torch.strided and base.is_contiguous() and len(strides) == out.dim():
            view = base.as_strided(out.shape, strides, base.storage_offset() + offset)
        # `v.contiguous()` of a view v of an input: v itself only when v is contiguous
        if view is not None and (not a.contiguous or view.is_contiguous()):
            results[a.out] = view


def _compact_strides(shape) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))
