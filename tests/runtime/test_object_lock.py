"""An object file is compiled by one process at a time (kiln/toolchain/cxx.py): processes
sharing a cache that need the same object (parallel builds, test workers) wait for the first
one's compile instead of running the compiler on the same file beside it."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

from kiln.targets.cpu.build import toolchain
from kiln.options import Options
from kiln.toolchain.cxx import compile_object

SOURCE = 'extern "C" int kiln_lock_test_%s(int x) { return x * 3 + 1; }\n'


def _wrapper(tmp: Path, cxx: str) -> Path:
    """A compiler that records each compile (not `--version`) and takes a moment."""
    log = tmp / "calls.log"
    w = tmp / "cxx.sh"
    w.write_text(f'#!/bin/sh\ncase "$*" in *" -c "*) echo c >> {log}; sleep 1;; esac\n'
                 f'exec {cxx} "$@"\n')
    w.chmod(w.stat().st_mode | stat.S_IEXEC)
    return w


def _compile(tc, tag: str, out) -> None:
    out.put(str(compile_object(tc, "lock_test.cpp", SOURCE % tag, "h")))


def test_concurrent_processes_compile_an_object_once(tmp_path):
    base = toolchain(Options(cache_dir=str(tmp_path / "cache")))
    tc = replace(base, cxx=str(_wrapper(tmp_path, shutil.which(base.cxx) or base.cxx)))
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_compile, args=(tc, "a", out)) for _ in range(3)]
    for p in procs:
        p.start()
    paths = {out.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (obj,) = paths  # the same cached object for all three
    assert os.path.getsize(obj) > 0
    assert (tmp_path / "calls.log").read_text().count("c") == 1  # one compile, two waits
    # another source is another key: compiled again
    _compile(tc, "b", out)
    assert out.get(timeout=120) != obj
    assert (tmp_path / "calls.log").read_text().count("c") == 2
