"""kiln's import structure against its declared layers (kiln/layers.py): every import of a kiln
module, at module level or inside a function, goes to an earlier layer or the importer's own
part; no kiln module is imported inside a function; an import inside a function is of a heavy
optional dependency and says why (`# deferred: <reason>` on it or on the comment line that
opens its group of imports)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest


import kiln
from kiln.layers import LAYERS

ROOT = Path(kiln.__file__).resolve().parent
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}
#: the only third-party modules a function may import: optional for a CPU-only install
#: (triton, CUTLASS, NVIDIA's wheels; matplotlib, the `report` extra) or for a GPU-only one
#: (OpenBLAS's wheel)
OPTIONAL = {"triton", "cutlass_library", "nvidia", "scipy_openblas32", "matplotlib"}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name.removesuffix(".__init__")


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "kiln"
    two = ".".join(parts[1:3])
    return two if two in RANK else parts[1]


def _is_module(name: str) -> bool:
    p = ROOT.parent / name.replace(".", "/")
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _imports(path: Path):
    """(line, imported module, inside a function, has a deferral reason) of every import."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                       for a in node.names]
        else:
            continue
        q, in_function = node, False
        while q in parent:
            q = parent[q]
            if isinstance(q, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function = True
                break
        k = node.lineno - 1
        reason = "# deferred:" in lines[k]
        while not reason and k > 0 and lines[k - 1].strip().startswith(("import ", "from ")):
            k -= 1
        reason = reason or (k > 0 and lines[k - 1].strip().startswith("# deferred:"))
        for t in targets:
            yield node.lineno, t, in_function, reason


def _files():
    return sorted(ROOT.rglob("*.py"))


def test_every_part_has_a_layer():
    parts = {_part(_module(p)) for p in _files()}
    assert parts <= set(RANK), f"parts without a layer in kiln/layers.py: {parts - set(RANK)}"


def test_imports_follow_the_layers():
    bad = []
    for path in _files():
        src = _part(_module(path))
        for line, target, _, _ in _imports(path):
            if target != "kiln" and not target.startswith("kiln."):
                continue
            dst = _part(target)
            if dst != src and RANK[dst] >= RANK[src]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} imports {target} "
                           f"({dst}, layer {RANK[dst]} >= {RANK[src]})")
    assert not bad, "imports against kiln/layers.py:\n" + "\n".join(bad)


def test_function_level_imports_are_optional_dependencies_with_a_reason():
    bad = []
    for path in _files():
        for line, target, in_function, reason in _imports(path):
            if not in_function:
                continue
            top = target.split(".")[0]
            where = f"{path.relative_to(ROOT.parent)}:{line}: {target}"
            if top == "kiln":
                bad.append(f"{where} (a kiln module: import it at module level)")
            elif top not in OPTIONAL:
                bad.append(f"{where} (not an optional dependency: import it at module level)")
            elif not reason:
                bad.append(f"{where} (no '# deferred: <reason>')")
    assert not bad, "\n".join(bad)


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_every_module_imports_first():
    """Each module imported first, in a fresh set of kiln modules: no import-time cycle inside
    a part (a module importing a half-initialised one) hides behind an import order."""
    names = sorted(m.name for m in pkgutil.walk_packages(kiln.__path__, "kiln."))
    script = (
        "import importlib, sys, traceback\n"
        f"names = {names!r}\n"
        "bad = []\n"
        "for n in names:\n"
        "    for k in [k for k in sys.modules if k == 'kiln' or k.startswith('kiln.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{n}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not out.stdout.strip(), out.stdout
