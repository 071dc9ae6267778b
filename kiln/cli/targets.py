"""Resolve a ``kiln compile`` TARGET into something :func:`kiln.compile` accepts.

A target is ``zoo:NAME`` (a bundled model), ``path/file.py:factory`` (a function returning
``(model, example_args)``, ``(model, example_args, dynamic_shapes)``, a ``ModelSpec`` or an
``ExportedProgram``) or a ``.pt2`` file written by ``torch.export.save``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.errors import InputError
from kiln.models import ALL_MODELS
from torch.export import Dim

__all__ = ["Target", "resolve_target", "parse_dynamic", "parse_options"]


@dataclass
class Target:
    """A resolved target: either an exported program or a module with example inputs."""

    label: str
    program: torch.export.ExportedProgram | None = None
    module: torch.nn.Module | None = None
    example_args: tuple[Any, ...] = ()
    example_kwargs: dict[str, Any] | None = None
    dynamic_shapes: Any = None


def _from_value(label: str, value: Any) -> Target:
    if isinstance(value, torch.export.ExportedProgram):
        return Target(label, program=value)
    if hasattr(value, "module") and hasattr(value, "example_args"):  # a ModelSpec
        return Target(label, module=value.module, example_args=tuple(value.example_args),
                      dynamic_shapes=getattr(value, "dynamic_shapes", None))
    if isinstance(value, tuple) and len(value) in (2, 3):
        module, args = value[0], value[1]
        dyn = value[2] if len(value) == 3 else None
        if not isinstance(module, torch.nn.Module):
            raise InputError(f"{label}: the factory's first element must be an nn.Module, "
                             f"found {type(module).__name__}")
        args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
        return Target(label, module=module, example_args=args, dynamic_shapes=dyn)
    raise InputError(f"{label}: expected the factory to return (model, example_args), "
                     f"(model, example_args, dynamic_shapes), a ModelSpec or an "
                     f"ExportedProgram; found {type(value).__name__}")


def _load_file_factory(path_str: str, attr: str) -> Any:
    path = Path(path_str)
    if not path.is_file():
        raise InputError(f"target file {path_str!r} does not exist")
    mod_name = "_kiln_target_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"cannot import {path_str!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    factory = getattr(module, attr, None)
    if factory is None:
        raise InputError(f"{path_str!r} defines no {attr!r}")
    return factory() if callable(factory) else factory


def resolve_target(target: str) -> Target:
    """Turn a TARGET string into a :class:`Target`; raises :class:`InputError` when malformed."""
    if target.startswith("zoo:"):

        name = target[4:]
        if name not in ALL_MODELS:
            raise InputError(f"unknown zoo model {name!r}; known: {', '.join(ALL_MODELS)}")
        return _from_value(target, ALL_MODELS[name]())
    if target.endswith(".pt2"):
        if not Path(target).is_file():
            raise InputError(f"exported program {target!r} does not exist")
        return Target(target, program=torch.export.load(target))
    path, sep, attr = target.rpartition(":")
    if not sep or not path.endswith(".py") or not attr:
        raise InputError(f"cannot read target {target!r}: expected zoo:NAME, "
                         "path/file.py:factory or a .pt2 file")
    return _from_value(target, _load_file_factory(path, attr))


_DYN_RE = re.compile(r"^(\w+)\.(\d+)=(\w+)(?::(\d+)?:(\d+)?)?$")


def parse_dynamic(specs: list[str], example_args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Build ``dynamic_shapes`` from ``ARG.DIM=NAME[:MIN:MAX]`` strings.

    ``ARG`` is a positional index; dimensions sharing a ``NAME`` share one ``Dim``.
    """

    dims: dict[str, Any] = {}
    per_arg: list[dict[int, Any] | None] = [None] * len(example_args)
    for text in specs:
        m = _DYN_RE.match(text)
        if not m:
            raise InputError(f"cannot read --dynamic {text!r}: expected ARG.DIM=NAME[:MIN:MAX], "
                             "e.g. 0.0=batch:1:64")
        arg, dim, name, lo, hi = m.groups()
        if not arg.isdigit() or int(arg) >= len(example_args):
            raise InputError(f"--dynamic {text!r}: argument {arg} out of range "
                             f"(the model takes {len(example_args)} positional arguments)")
        kwargs = {k: int(v) for k, v in (("min", lo), ("max", hi)) if v is not None}
        if name not in dims:
            dims[name] = Dim(name, **kwargs)
        slot = per_arg[int(arg)] or {}
        slot[int(dim)] = dims[name]
        per_arg[int(arg)] = slot
    return tuple(per_arg)


def _literal(text: str) -> Any:
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """Turn ``key=value`` strings into a dict with ints, floats, bools and None recognised."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"cannot read --option {pair!r}: expected key=value")
        out[key.strip().replace("-", "_")] = _literal(value.strip())
    return out
