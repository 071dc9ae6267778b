"""Read a package's manifest without loading its library, and summarise it tolerantly.

Every accessor accepts missing keys and the few shapes a field may take (a list of dicts or a
dict keyed by name), so ``kiln inspect`` keeps working while the manifest format evolves.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import sympy
import torch

from kiln.errors import InputError, PackageError
from kiln.ir import dtypes
from kiln.runtime import cpu_supports
from kiln.package.reader import check_manifest_hash
from torch.utils import _pytree as pytree

__all__ = ["read_manifest", "entries", "symbols", "resolve_shape", "torch_dtype", "fmt_bytes",
           "fmt_shape", "random_inputs", "split_args", "kwarg_names", "plan_summary",
           "memory_summary"]


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Return ``manifest.json`` from a package zip (or a directory) without loading model.so."""
    p = Path(path)
    if not p.exists():
        raise PackageError(f"package {str(p)!r} does not exist")
    try:
        if p.is_dir():
            return json.loads((p / "manifest.json").read_text())
        with zipfile.ZipFile(p) as zf:
            raw = zf.read("manifest.json")
            check_manifest_hash(p, zf, zf.namelist(), raw)  # a hand-edited one is refused
            return json.loads(raw)
    except (KeyError, FileNotFoundError):
        raise PackageError(f"{str(p)!r} has no manifest.json: not a kiln package") from None
    except zipfile.BadZipFile:
        raise PackageError(f"{str(p)!r} is not a kiln package (not a zip archive)") from None
    except json.JSONDecodeError as e:
        raise PackageError(f"{str(p)!r}: manifest.json is not valid JSON ({e})") from None


def entries(value: Any) -> list[dict[str, Any]]:
    """Normalise a list of dicts, a dict of dicts keyed by name, or a list of names."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [{"name": k, **(v if isinstance(v, dict) else {"value": v})}
                for k, v in value.items()]
    out = []
    for i, v in enumerate(value):
        out.append(v if isinstance(v, dict) else {"name": str(v), "index": i})
    return out


def symbols(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's symbol table: name -> {min, max, example, ...}."""
    syms = manifest.get("symbols") or {}
    if isinstance(syms, list):
        return {s.get("name", f"s{i}"): s for i, s in enumerate(syms) if isinstance(s, dict)}
    return {k: (v if isinstance(v, dict) else {"example": v}) for k, v in syms.items()}


def resolve_shape(shape: Any, values: dict[str, int]) -> list[int]:
    """Evaluate a symbolic shape (ints, symbol names or expressions) at ``values``."""
    out = []
    for d in shape or []:
        if isinstance(d, int):
            out.append(d)
            continue
        if isinstance(d, dict):
            d = d.get("expr", d.get("name", d.get("value")))
        expr = sympy.sympify(str(d))
        val = expr.subs({sympy.Symbol(k): v for k, v in values.items()})
        if not val.is_number:
            raise InputError(f"cannot size dimension {d!r}: no example value for "
                             f"{', '.join(map(str, val.free_symbols))}")
        out.append(int(val))
    return out


# torch's names and safetensors' spellings (lowercased: "f32", "bf16", ...) of every real
# dtype (random_inputs cannot draw complex values), and C's names for the common ones
_DTYPES = {**{k: d.torch for d in dtypes.DTYPES.values() if not d.is_complex
              for k in (d.name, d.safetensors.lower())},
           **{k: dtypes.dtype(v).torch for k, v in (("float", "float32"), ("double", "float64"),
                                                    ("half", "float16"), ("long", "int64"),
                                                    ("int", "int32"))}}


def torch_dtype(name: Any) -> torch.dtype:
    """Map "float32", "torch.float32" or safetensors' "F32" to a torch dtype."""
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise InputError(f"unknown dtype {name!r} in the manifest")
    return _DTYPES[key]


def fmt_bytes(n: Any) -> str:
    """Human-readable byte count ("1.5 MiB"); "?" when unknown."""
    if not isinstance(n, (int, float)):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def fmt_shape(shape: Any) -> str:
    """``[s0, 1024]``-style text for a (possibly symbolic) shape."""
    if shape is None:
        return "?"
    dims = [d.get("expr", d.get("name", "?")) if isinstance(d, dict) else d for d in shape]
    return "[" + ", ".join(str(d) for d in dims) + "]"


def example_values(manifest: dict[str, Any]) -> dict[str, int]:
    """Each symbol at its example value (falling back to its minimum, then 1)."""
    out = {}
    for name, s in symbols(manifest).items():
        v = s.get("example", s.get("hint", s.get("min", 1)))
        out[name] = int(v) if v is not None else 1
    return out


def split_args(manifest: dict[str, Any], flat: list[Any],
               kwarg_names: dict[int, str] | None = None) -> tuple[list[Any], dict[str, Any]]:
    """Rebuild ``(args, kwargs)`` from flat inputs with the manifest's ``in_spec`` if any."""
    spec = manifest.get("in_spec")
    if spec:

        args, kwargs = pytree.tree_unflatten(flat, pytree.treespec_loads(spec))
        return list(args), dict(kwargs)
    kwarg_names = kwarg_names or {}
    args = [t for i, t in enumerate(flat) if i not in kwarg_names]
    return args, {name: flat[i] for i, name in kwarg_names.items()}


def kwarg_names(manifest: dict[str, Any]) -> dict[int, str]:
    """Flat input positions marked as keyword arguments (used only without an ``in_spec``)."""
    out = {}
    for i, spec in enumerate(entries(manifest.get("inputs"))):
        if spec.get("kind") == "kwarg" or spec.get("kwarg"):
            kw = spec.get("kwarg")
            out[i] = kw if isinstance(kw, str) else str(spec.get("name", i))
    return out


def random_inputs(manifest: dict[str, Any], seed: int) -> tuple[list[Any], dict[str, Any]]:
    """Fresh random inputs matching the manifest, dynamic dims at their example values.

    Floating inputs are standard normal; integer inputs are drawn from [low, high) where the
    manifest gives ``low``/``high`` (or ``min``/``max``), else from [0, 8) so ids stay in range.
    """
    values = example_values(manifest)
    g = torch.Generator().manual_seed(seed)
    flat: list[Any] = []
    for spec in entries(manifest.get("inputs")):
        dtype = torch_dtype(spec.get("dtype", "float32"))
        shape = resolve_shape(spec.get("shape", []), values)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            lo = int(spec.get("low", spec.get("min", 0)))
            hi = int(spec.get("high", spec.get("max", lo + 7) + 1))
            t = torch.randint(lo, hi, shape, generator=g, dtype=dtype)
        flat.append(t)
    return split_args(manifest, flat, kwarg_names(manifest))


def plan_summary(manifest: dict[str, Any], top: int = 5) -> dict[str, Any]:
    """Arena size, lower bound, their ratio, buffer count and the largest buffers."""
    plan = manifest.get("plan") or {}
    arena = plan.get("arena_bytes")
    lower = plan.get("lower_bound_bytes", plan.get("lower_bound"))
    buffers = entries(plan.get("buffers"))
    largest = sorted(buffers, key=lambda b: -int(b.get("size", 0) or 0))[:top]
    ratio = (arena / lower) if isinstance(arena, (int, float)) and lower else None
    return {"arena_bytes": arena, "lower_bound_bytes": lower, "ratio": ratio,
            "buffers": len(buffers), "largest": largest}


def memory_summary(manifest: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """What ``kiln inspect --memory --json`` prints: arena, lower bound, ratio, planning time,
    algorithm, baselines, in-place reuse, the ``top`` largest storages with their lifetimes and,
    for a dynamic program, the run-time plan at every size tried at compile time."""
    plan = manifest.get("plan") or {}
    base = plan_summary(manifest, top)
    inplace = plan.get("inplace") or {}
    return {
        "arena_bytes": base["arena_bytes"],
        "lower_bound_bytes": base["lower_bound_bytes"],
        "ratio": base["ratio"],
        "planning_seconds": plan.get("planning_seconds"),
        "algorithm": plan.get("algorithm"),
        "dynamic": bool(plan.get("dynamic")),
        "planned_at": plan.get("planned_at"),
        "example_sizes": plan.get("example_sizes") or {},
        "naive_bytes": plan.get("naive_bytes"),
        "exact_size_reuse_bytes": plan.get("exact_size_reuse_bytes"),
        "inplace_pairs": entries(inplace.get("pairs")),
        "inplace_saved_bytes": inplace.get("saved_bytes"),
        "n_buffers": base["buffers"],
        "largest_buffers": [{k: b.get(k) for k in ("name", "size", "start", "end", "offset")}
                            for b in base["largest"]],
        "sizes": entries(plan.get("sizes")),
    }


def cpu_summary(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The builds of a CPU package: per -march level (one, or a portable package's several,
    best first) its library and CPU features, whether this machine runs it, and the level
    the loader picks here (the first it runs; None: none). None for packages without
    requires.cpu_features (CUDA, or older)."""
    req = manifest.get("requires") if isinstance(manifest.get("requires"), dict) else {}
    build = manifest.get("build") if isinstance(manifest.get("build"), dict) else {}
    levels = entries(req.get("cpu_levels"))
    if not levels:
        if not isinstance(req.get("cpu_features"), list):
            return None
        levels = [{"march": build.get("march", ""), "library": "lib/model.so",
                   "cpu_features": req["cpu_features"]}]
    out = []
    for lv in levels:
        feats = [str(f) for f in lv.get("cpu_features", [])]
        out.append({"march": str(lv.get("march", "")), "library": str(lv.get("library", "")),
                    "cpu_features": feats,
                    "missing_here": [f for f in feats if not cpu_supports(f)]})
    picked = next((lv["march"] for lv in out if not lv["missing_here"]), None)
    return {"march": build.get("march", ""), "levels": out, "picked_here": picked}
