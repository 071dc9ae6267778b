"""Shared helpers of the differential op tests (tests/ops/test_ops_*.py).

Every check compiles a small module with kiln, loads the package through the C ABI, runs it on
fresh random inputs and compares each output with torch eager:

* float32 outputs against a float64 eager reference (``module.double()(x.double())``) with
  rtol = atol = 1e-4 (``ref="f64"``, the default), or against float32 eager where the op is
  discontinuous in its input (floor of a quotient, comparisons of computed values: ``ref="same"``),
  or against float64 math rounded to the output's dtype (``ref="f64r"``: special values, where
  float32 eager itself differs by ISA, e.g. gelu(+inf) is nan on AVX-512 and inf in float64);
* float64 outputs against float64 eager with rtol = atol = 1e-10;
* integer and bool outputs exactly.
Dtypes and shapes must match eager exactly. NaNs must sit in the same places.

Inputs are contiguous (other layouts are copied in by libkiln: tests/e2e/test_strided_inputs.py);
``Layout`` wraps a module so that it transposes or slices its inputs first, which gives the
generated kernels non-trivial index maps.
"""

from __future__ import annotations

import copy
import itertools
import re
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

import kiln
from kiln.ir import loop as L
from kiln.ir.interp import run_loop

F32_TOL = {"rtol": 1e-4, "atol": 1e-4}
F64_TOL = {"rtol": 1e-10, "atol": 1e-10}
FLOATS = (torch.float32, torch.float64)

# (shape, layout) cases shared by the elementwise tests: size-1 dims, odd sizes, one element,
# more than 10k elements, and inputs that the model transposes / slices with a step.
SHAPES = [(7, 13), (1,), (3, 1, 5), (1, 1), (130, 97)]
STRIDED = [((7, 13), "t"), ((5, 9), "step"), ((2, 3, 4), "perm"), ((6, 11), "neg")]


class Fn(torch.nn.Module):
    """A module whose forward is `fn` (so one-off test models are one line)."""

    def __init__(self, fn: Callable, name: str = "") -> None:
        super().__init__()
        self.fn = fn
        self.label = name or getattr(fn, "__name__", "fn")

    def forward(self, *args):
        return self.fn(*args)

    def extra_repr(self) -> str:
        return self.label


class Cases(torch.nn.Module):
    """Several independent cases in one program, so one package (one C++ compile and link)
    checks them all: case k reads its own `arity` inputs, in order, and its outputs (a dict) are
    named "<k>__<output>" (a single tensor output: "<k>"; a tuple's: "<k>__<position>"). Every
    case keeps its own static shapes, so its kernels are the ones a package of its own would
    have. Give each case its own weights (a weight shared by two cases is read twice, which can
    change how kiln stores it)."""

    def __init__(self, cases: dict[str, tuple[torch.nn.Module, int]]) -> None:
        super().__init__()
        self.mods = torch.nn.ModuleDict({k: m for k, (m, _) in cases.items()})
        self.arity = [n for _, n in cases.values()]

    def forward(self, *args):
        out, i = {}, 0
        for (k, m), n in zip(self.mods.items(), self.arity):
            r = m(*args[i:i + n])
            if isinstance(r, torch.Tensor):
                out[k] = r
            else:  # a dict, or a tuple / list (outputs named by their position)
                for name, v in (r.items() if isinstance(r, dict) else enumerate(r)):
                    out[f"{k}__{name}"] = v
            i += n
        assert i == len(args), (i, len(args))
        return out


def case_name(*parts) -> str:
    """A ModuleDict-safe name for a case, e.g. case_name((2, 4, 9), "t") == "2_4_9_t"."""
    return re.sub(r"\W+", "_", "_".join(map(str, parts))).strip("_")


def layout_input(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Map a contiguous input to the strided tensor the inner module sees."""
    if kind == "contig" or x.dim() == 0:
        return x
    if kind == "t":
        return x.transpose(-1, -2) if x.dim() >= 2 else x
    if kind == "step":
        return x[..., ::2]
    if kind == "perm":
        return x.permute(*reversed(range(x.dim())))
    if kind == "neg":  # negative start/end: drop the first and the last element of each dim
        for d in range(x.dim()):
            x = x[(slice(None),) * d + (slice(1, -1),)]
        return x
    raise ValueError(kind)


def layout_shape(shape: Sequence[int], kind: str) -> tuple[int, ...]:
    """The contiguous input shape that `layout_input(., kind)` turns into `shape`."""
    shape = tuple(shape)
    if kind == "contig" or not shape:
        return shape
    if kind == "t":
        return shape[:-2] + (shape[-1], shape[-2]) if len(shape) >= 2 else shape
    if kind == "step":
        return shape[:-1] + (2 * shape[-1],)
    if kind == "perm":
        return tuple(reversed(shape))
    if kind == "neg":
        return tuple(d + 2 for d in shape)
    raise ValueError(kind)


class Layout(torch.nn.Module):
    """Runs `inner` on strided views of its (contiguous) tensor inputs."""

    def __init__(self, inner: torch.nn.Module, kind: str) -> None:
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, *args):
        return self.inner(*[layout_input(a, self.kind) if isinstance(a, torch.Tensor) and
                            a.is_floating_point() else a for a in args])


def gen(*key) -> torch.Generator:
    """A generator seeded from `key` (reproducible, different for every case)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def batch_norm(c: int, g: torch.Generator) -> torch.nn.BatchNorm2d:
    """A 2-D batch norm in eval mode with non-trivial statistics and affine parameters."""
    bn = torch.nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=g))
        bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(c, generator=g))
        bn.bias.copy_(torch.randn(c, generator=g))
    return bn.eval()


def run_twin(built, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """A compiled CPU build's Loop IR run by kiln's numpy interpreter (the package's twin) on
    its one user input `x`: (its one output, the count of each library routine it calls)."""
    feeds = {i.name: x.numpy() for i in built.graph.user_inputs}
    feeds.update({k: v.numpy() for k, v in built.weights.items()})
    (got,) = run_loop(built.loop, feeds, {})
    calls: dict[str, int] = {}
    for s in built.loop.nodes:
        if isinstance(s, L.Extern):
            calls[s.routine] = calls.get(s.routine, 0) + 1
    return torch.tensor(got), calls


def rand(shape, dtype=torch.float32, g: torch.Generator | None = None, low=-20, high=20):
    """Random values: normal floats, integers in [low, high), bools."""
    g = g or gen(shape, dtype)
    shape = tuple(shape)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        low = max(low, 0)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def _double(a):
    return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _leaf_name(path) -> str:
    return "".join(str(p) for p in path) or "[]"


def _plain(obj):
    """torch.return_types results (x.max(dim), ...) as the plain tuples kiln documents."""
    if isinstance(obj, tuple):
        return tuple(_plain(x) for x in obj)
    if isinstance(obj, list):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def compare(got, want, want64=None, *, tol: dict | None = None, what: str = "") -> None:
    """Compare kiln outputs with the eager outputs (`want64`: float64 reference values).
    Outputs are named by their pytree path, so a model returning a dict of op results names
    the op that is wrong."""
    want, want64 = _plain(want), _plain(want64)
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_paths, w_spec = pytree.tree_flatten_with_path(want)
    assert g_spec == w_spec, f"{what}: output structure {g_spec} != eager {w_spec}"
    r_leaves = pytree.tree_leaves(want64) if want64 is not None else [w for _, w in w_paths]
    for g, (path, w), r in zip(g_leaves, w_paths, r_leaves):
        where = f"{what}, output {_leaf_name(path)}"
        assert isinstance(g, torch.Tensor), f"{where}: got {type(g).__name__}"
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype} != eager {w.dtype}"
        assert g.shape == w.shape, f"{where}: shape {tuple(g.shape)} != eager {tuple(w.shape)}"
        if w.is_floating_point():
            t = tol or (F64_TOL if w.dtype == torch.float64 else F32_TOL)
            torch.testing.assert_close(g.double(), r.double(), equal_nan=True, msg=lambda m: (
                f"{where} ({w.dtype}, vs {r.dtype} eager):\n{m}"), **t)
        elif not torch.equal(g, w):
            bad = (g != w).nonzero()[:5].tolist()
            raise AssertionError(f"{where} ({w.dtype}): mismatch at {bad}: got "
                                 f"{[g[tuple(i)].item() for i in bad]}, want "
                                 f"{[w[tuple(i)].item() for i in bad]}")


class Checker:
    """Compiles modules into packages under one (module-scoped) directory and checks them."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.count = itertools.count()

    def compile(self, module: torch.nn.Module, args: Sequence, *, dynamic_shapes=None,
                options: kiln.Options | None = None):
        module = module.eval()
        if dynamic_shapes is not None and isinstance(module, (Fn, Layout)):
            dynamic_shapes = (tuple(dynamic_shapes),)  # forward(*args): one tuple parameter
        compiled = kiln.compile(module, tuple(args), dynamic_shapes=dynamic_shapes,
                                options=options)
        return compiled, compiled.load(self.root / f"m{next(self.count)}.kiln")

    def __call__(self, module: torch.nn.Module, args: Sequence, *, ref: str = "f64",
                 tol: dict | None = None, more: Sequence[Sequence] = (), dynamic_shapes=None,
                 options: kiln.Options | None = None):
        """Compile `module` at `args`, then check it at `args` and at each of `more`."""
        compiled, runner = self.compile(module, args, dynamic_shapes=dynamic_shapes,
                                        options=options)
        module64 = copy.deepcopy(module).double() if ref in ("f64", "f64r") else None
        for k, a in enumerate([tuple(args), *map(tuple, more)]):
            shapes = [tuple(t.shape) for t in a if isinstance(t, torch.Tensor)]
            with torch.no_grad():
                want = module(*a)
                want64 = module64(*map(_double, a)) if module64 is not None else None
            if ref == "f64r":  # float64 math rounded to each output's dtype
                w_leaves, spec = pytree.tree_flatten(_plain(want))
                want64 = pytree.tree_unflatten(
                    [r.to(w.dtype) if w.is_floating_point() else r
                     for w, r in zip(w_leaves, pytree.tree_leaves(_plain(want64)))], spec)
            got = runner(*a)
            compare(got, want, want64, tol=tol, what=f"{module} at {shapes} (run {k})")
        return compiled



def dim(name: str, lo: int = 2, hi: int = 256) -> torch.export.Dim:
    return torch.export.Dim(name, min=lo, max=hi)


def assert_host_compiles(tmp_path: Path, source: str) -> None:
    """A generated CUDA wrapper source passes the host compiler's syntax and type
    checks with kiln's flags and include directories."""
    import subprocess

    from kiln.options import Options
    from kiln.toolchain.cuda import cuda_toolchain as toolchain

    tc = toolchain(Options())
    f = tmp_path / "w.cpp"
    f.write_text(source)
    out = subprocess.run([tc.cxx, *tc.cflags, *[f"-I{d}" for d in tc.include_dirs],
                          "-fsyntax-only", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]


def assert_golden(path: Path, got: str) -> None:
    """`got` equals the golden file `path` (written when missing or KILN_UPDATE_GOLDEN=1)."""
    import os

    if os.environ.get("KILN_UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
    assert got == path.read_text(), "generated Triton changed; KILN_UPDATE_GOLDEN=1 to accept"


def run_interpreted(script: str, *args: str, timeout: float = 600) -> str:
    """Runs `script` (python -c) with `args` in a child process whose Triton runs kernels in
    its interpreter (TRITON_INTERPRET must hold when Triton is imported, and the AOT compiler
    of this process needs the normal mode), with this checkout on the path; asserts it exits
    0 and prints "ALL OK"; returns its output."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout[-2000:] + \
        out.stderr[-3000:]
    return out.stdout
