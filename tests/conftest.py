"""Shared pytest fixtures.

Runtime fixtures (used by test_package.py and test_runtime_abi.py): ``libkiln_path`` (libkiln
built and loaded once per session, before any test changes KILN_CACHE_DIR), ``toy_so`` (bytes
of the hand-written test model tests/fixtures/toy_model.cpp; ``toy_so_no_weights`` is the same
model with built-in weights), ``make_toy_package`` (writes a package around it) and
``toy_reference`` (the model in eager PyTorch).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

TESTS = pathlib.Path(__file__).resolve().parent
# Tests live in folders by stage (tests/README.md); the shared helpers (difftest.py,
# gemm_models.py, user_triton_kernels.py) sit here, and some tests import another folder's test
# module or run one in a subprocess: every test folder is importable, here and in children.
_FOLDERS = [str(TESTS)] + sorted(str(p) for p in TESTS.rglob("*") if p.is_dir() and
                                 any(p.glob("test_*.py")))
for _f in reversed(_FOLDERS):
    if _f not in sys.path:
        sys.path.insert(0, _f)
os.environ["PYTHONPATH"] = os.pathsep.join(
    _FOLDERS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
# every conv package's conv.cpp specialises all epilogue pairs, so the suite's many small
# convolution packages share one object per target level instead of compiling one each
# (tests/targets/cpu/test_conv_direct.py checks the per-package selection without it)
os.environ.setdefault("KILN_CONV_EPIS", "all")
# generated C++ compiles with a precompiled header of each file's leading #include lines
# (kiln/toolchain/cxx.py; GCC): the same translation unit and object code
# (tests/runtime/test_pch.py compares them), without re-parsing the runtime headers in each
# of the suite's ~1,500 object files; `KILN_PCH=0 make test` runs it without (cold cache: 45
# .gch files, 2.5 GB beside the cache's 360 MB)
os.environ.setdefault("KILN_PCH", "1")
TOY_W = torch.tensor([1.0, -2.0, 0.5, 3.0])
TOY_B = torch.tensor([0.25, 1.0, -1.5, 2.0])


@pytest.fixture(scope="session")
def libkiln_path() -> pathlib.Path:
    from kiln.runtime import build, loader

    loader.libkiln()  # loaded once per process; later KILN_CACHE_DIR changes do not rebuild it
    return build.build_libkiln()


def _compile_toy(out: pathlib.Path, *defines: str) -> bytes:
    from kiln.runtime.build import include_dir

    cmd = ["c++", "-O2", "-fPIC", "-shared", "-std=c++17", "-fvisibility=hidden",
           *defines, "-I", str(include_dir()), str(TESTS / "fixtures" / "toy_model.cpp"),
           "-o", str(out)]
    subprocess.run(cmd, check=True)
    return out.read_bytes()


@pytest.fixture(scope="session")
def toy_so(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _compile_toy(tmp_path_factory.mktemp("toy") / "toy_model.so")


@pytest.fixture(scope="session")
def toy_so_no_weights(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _compile_toy(tmp_path_factory.mktemp("toy") / "toy_nw.so", "-DTOY_NO_WEIGHTS")


def toy_manifest() -> dict[str, Any]:
    from torch.utils._pytree import tree_flatten, treespec_dumps

    x, s = torch.zeros(2, 4), torch.tensor(1.0)
    _, in_spec = tree_flatten(((x,), {"scale": s}))
    _, out_spec = tree_flatten((x, x))
    return {"in_spec": treespec_dumps(in_spec), "out_spec": treespec_dumps(out_spec),
            "inputs": [{"name": "x"}, {"name": "scale"}], "outputs": [{"name": "y"},
                                                                    {"name": "s"}]}


@pytest.fixture
def make_toy_package(tmp_path: pathlib.Path, toy_so: bytes) -> Callable[..., pathlib.Path]:
    from kiln.package import write_package

    def make(name: str = "toy.kiln", weights: dict[str, torch.Tensor] | None = None,
             so: bytes | None = None, **manifest_extra: Any) -> pathlib.Path:
        path = tmp_path / name
        w = {"w": TOY_W, "b": TOY_B} if weights is None else weights
        files = {"lib/model.so": toy_so if so is None else so,
                 "src/model.cpp": (TESTS / "fixtures" / "toy_model.cpp").read_bytes()}
        write_package(path, {**toy_manifest(), **manifest_extra}, files, w)
        return path

    return make


@pytest.fixture(scope="session")
def toy_reference() -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Eager reference of the toy model: (x, scale) -> (x * w * scale + b, row sums)."""

    def ref(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * TOY_W * scale + TOY_B
        return y, y.sum(1)

    return ref


@pytest.fixture(scope="session")
def run_model_exe(libkiln_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> pathlib.Path:
    """examples/c/run_model.c built against libkiln (with -Wall -Werror)."""
    from kiln.runtime.build import include_dir

    exe = tmp_path_factory.mktemp("cexample") / "run_model"
    libdir = str(libkiln_path.parent)
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-I", str(include_dir()),
                    str(TESTS.parent / "examples" / "c" / "run_model.c"), f"-L{libdir}",
                    "-lkiln", f"-Wl,-rpath,{libdir}", "-o", str(exe)], check=True)
    return exe


# Test files by their cold-cache time in the default suite (a clean-clone run's --durations
# summed per file), heaviest first. xdist's `load` scheduling hands tests out in collection
# order, so a heavy file collected last (tests/targets/cuda/ sorts after everything) left one
# worker compiling alone at the end; run first, its long tests overlap the other worker's many
# short ones instead. A file's own tests keep their order (module fixtures are built once per
# worker as before); files not listed follow in collection order.
HEAVY_FIRST = [
    "ops/test_ops_nn.py", "gemm/test_gemm_prepacked.py", "targets/cpu/test_conv_direct.py",
    "e2e/test_models.py", "ops/test_ops_library.py", "ops/test_ops_pointwise.py",
    "e2e/test_hf_decoders.py",
    "frontend/test_control_flow.py", "ops/test_float8_fnuz.py", "memory/test_memory_e2e.py",
    "ops/test_half.py", "gemm/test_gemm_epilogue_cpu.py", "e2e/test_fuzz.py",
    "frontend/test_fallback_scalars.py", "frontend/test_aten_fallback.py",
    "targets/cpu/test_attention_cpu.py", "e2e/test_backend.py", "ops/test_ops_spatial.py",
    "gemm/test_autotune.py", "targets/cpu/test_qgemm.py", "e2e/test_hf_corpus.py",
    "targets/cuda/test_quant_gemv.py", "targets/cuda/test_gemv.py",
    "runtime/test_cpu_levels.py", "targets/cpu/test_thread_split.py", "e2e/test_cli.py",
    "gemm/test_gemm_mixed.py", "runtime/test_concurrency.py", "e2e/test_errors.py",
    "targets/cuda/test_merge_gemms.py", "ops/test_cuda_sdpa_ops.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {f: i for i, f in enumerate(HEAVY_FIRST)}

    def key(item: pytest.Item) -> int:
        try:
            rel = item.path.relative_to(TESTS).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: the rest keep pytest's order


# KILN_TEST_TIMELINE=<file>: each test's worker, start and end time (setup to teardown) and
# node id appended to <file>, to see how xdist spread the suite over its workers (what one
# worker ran alone at the end).
_TIMELINE = os.environ.get("KILN_TEST_TIMELINE")
_STARTED: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _TIMELINE or hasattr(report, "node"):  # xdist's controller: the worker wrote it
        return
    import time

    now = time.time()
    if report.when == "setup":
        _STARTED[report.nodeid] = now - report.duration
    elif report.when == "teardown":
        start = _STARTED.pop(report.nodeid, now)
        with open(_TIMELINE, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {start:.1f} {now:.1f} "
                    f"{report.nodeid}\n")
