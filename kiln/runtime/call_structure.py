"""Calls whose (args, kwargs) structure differs from the export's: which argument is missing,
extra or of another structure, by name (the runner's error message; kiln/runtime/loader.py),
and the function that puts a call's results back into the exported output structure."""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["output_builder", "spec_children", "structure_error"]


class _Leaf:
    def __repr__(self) -> str:
        return "*"


def _describe(spec: pytree.TreeSpec) -> str:
    """A readable picture of a (args, kwargs) structure, tensors shown as *."""
    return repr(pytree.tree_unflatten([_Leaf()] * spec.num_leaves, spec))


def spec_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def _short(x: Any) -> str:
    """What a call passed, in a few words (a long list is not dumped)."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, (list, tuple, dict)):
        return f"a {type(x).__name__} of {len(x)} item{'s' * (len(x) != 1)}"
    return f"{type(x).__name__} {x!r}"[:60]


def structure_error(in_spec: pytree.TreeSpec, leaf_names: list[str], args: tuple,
                    kwargs: dict) -> str:
    """Which argument of a call is missing, extra or of another structure than the export's,
    by name (`leaf_names`: the exported inputs' names, one per leaf of `in_spec`)."""
    try:
        args_spec, kw_spec = spec_children(in_spec)
        arg_specs = spec_children(args_spec)
        kw_names = list(kw_spec.context or ())
    except (AttributeError, ValueError, TypeError):
        return (f"inputs do not match the exported structure: expected (args, kwargs) like "
                f"{_describe(in_spec)}, got {_short(args)} and {_short(kwargs)}")
    pos_names, k = [], 0
    for child in arg_specs:  # a positional argument is named by its (first) leaf
        pos_names.append(leaf_names[k] if k < len(leaf_names) else f"arg{len(pos_names)}")
        k += child.num_leaves
    quoted = ", ".join(f"`{n}`" for n in pos_names) or "none"
    problems = []
    if len(args) < len(arg_specs):
        missing = ", ".join(f"`{n}`" for n in pos_names[len(args):])
        problems.append(f"missing positional argument{'s' * (len(arg_specs) - len(args) > 1)} "
                        f"{missing} (the model takes {len(arg_specs)}: {quoted}; got "
                        f"{len(args)})")
    elif len(args) > len(arg_specs):
        problems.append(f"{len(args) - len(arg_specs)} extra positional argument"
                        f"{'s' * (len(args) - len(arg_specs) > 1)} (the model takes "
                        f"{len(arg_specs)}: {quoted}; got {len(args)})")
    missing_kw = [n for n in kw_names if n not in kwargs]
    extra_kw = [n for n in kwargs if n not in kw_names]
    if missing_kw:
        problems.append("missing keyword argument" + "s" * (len(missing_kw) > 1) + " "
                        + ", ".join(f"`{n}`" for n in missing_kw))
    if extra_kw:
        problems.append("unexpected keyword argument" + "s" * (len(extra_kw) > 1) + " "
                        + ", ".join(f"`{n}`" for n in extra_kw) + " (the model takes "
                        + (", ".join(f"`{n}`" for n in kw_names) or "none") + ")")
    if not problems:
        for i, (child, given) in enumerate(zip(arg_specs, args)):
            if pytree.tree_flatten(given)[1] != child:
                problems.append(f"argument {i} (`{pos_names[i]}`): expected "
                                f"{_describe_value(child)}, got {_short(given)}")
        for name, child in zip(kw_names, spec_children(kw_spec)):
            if name in kwargs and pytree.tree_flatten(kwargs[name])[1] != child:
                problems.append(f"keyword argument `{name}`: expected "
                                f"{_describe_value(child)}, got {_short(kwargs[name])}")
    return "inputs do not match the exported structure: " + ("; ".join(problems) or (
        f"expected (args, kwargs) like {_describe(in_spec)}"))


def _describe_value(spec: pytree.TreeSpec) -> str:
    if spec.num_leaves == 1 and not spec_children(spec):
        return "a tensor or scalar"
    text = repr(pytree.tree_unflatten([_Leaf()] * spec.num_leaves, spec))
    return text if len(text) <= 80 else text[:77] + "..."


def output_builder(spec: pytree.TreeSpec | None):
    """results (a list) -> the exported output structure; the common flat forms (one tensor, a
    tuple or list of tensors) without the general pytree walk."""
    if spec is None:
        return tuple
    n = spec.num_leaves
    if spec.is_leaf():
        return operator.itemgetter(0)
    if spec == pytree.tree_flatten(tuple(range(n)))[1]:
        return tuple
    if spec == pytree.tree_flatten(list(range(n)))[1]:
        return list
    return functools.partial(_unflatten, spec=spec)


def _unflatten(results: list, spec: pytree.TreeSpec):
    return pytree.tree_unflatten(results, spec)
