"""libkiln (the C runtime) is never compiled while a package loads (kiln/runtime/build.py): a
package carries the libkiln of the kiln that compiled it, and a fresh process with an empty
kiln cache and no installed copy loads it with no compiler on PATH; two such processes at once
share one extraction. Where no copy exists at all, the fall-back compile is announced."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

import kiln
from kiln.runtime import build

CHILD = textwrap.dedent("""
    import sys, time, warnings, torch
    warnings.simplefilter("error", UserWarning)     # a fall-back compile would be an error
    from kiln.runtime import build
    build.PREBUILT = build.PREBUILT.with_name("no_such_dir")   # no installed copy
    import kiln
    t0 = time.perf_counter()
    runner = kiln.load(sys.argv[1])
    load_s = time.perf_counter() - t0
    x = torch.load(sys.argv[2])
    torch.testing.assert_close(runner(x), torch.load(sys.argv[3]))
    print("ok", load_s)
""")


def _fake_compilers(tmp_path):
    """A PATH directory whose compilers fail and leave a mark; the environment pointing at
    them."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    mark = tmp_path / "compiler_ran"
    for name in ("c++", "g++", "gcc", "cc", "clang++", "clang", "fake-cxx"):
        p = bindir / name
        p.write_text(f"#!/bin/sh\necho \"$0 $@\" >> {mark}\nexit 1\n")
        p.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
               CXX=str(bindir / "fake-cxx"), KILN_CXX=str(bindir / "fake-cxx"),
               KILN_CACHE_DIR=str(tmp_path / "empty_cache"))
    return env, mark


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    d = tmp_path_factory.mktemp("rtlib")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    x = torch.randn(3, 8)
    path = d / "m.kiln"
    kiln.compile(model, (x,)).save(path)
    with torch.no_grad():
        torch.save(model(x), d / "out.pt")
    torch.save(x, d / "x.pt")
    return path, d / "x.pt", d / "out.pt"


def test_package_carries_libkiln(package):
    with zipfile.ZipFile(package[0]) as z:
        names = z.namelist()
        data = z.read(build.package_entry())
    assert build.package_entry() in names
    assert data[:4] == b"\x7fELF"


def test_fresh_process_loads_without_a_compiler(package, tmp_path):
    env, mark = _fake_compilers(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, *map(str, package)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # two at once: one extraction must not break the other
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.startswith("ok"), out
    assert not mark.exists(), mark.read_text()
    extracted = list((tmp_path / "empty_cache" / "runtime").glob("*/libkiln.so"))
    assert len(extracted) == 1
    assert not list(extracted[0].parent.glob(".libkiln.*"))  # no temporary left behind


def test_missing_runtime_is_compiled_loudly(tmp_path):
    """No installed, cached or shipped copy: the loader's look-up says it compiles libkiln
    (here with a failing compiler, so it then fails naming libkiln's build)."""
    env, mark = _fake_compilers(tmp_path)
    child = textwrap.dedent("""
        from kiln.runtime import build
        build.PREBUILT = build.PREBUILT.with_name("no_such_dir")
        build.libkiln_path()
    """)
    p = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0
    assert "RuntimeBuildWarning" in p.stderr and "compiling the runtime library" in p.stderr
    assert "building libkiln failed" in p.stderr
    assert mark.exists()
