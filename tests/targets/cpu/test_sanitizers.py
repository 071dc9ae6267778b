"""Packages built with `Options(sanitize="address,undefined")` run the zoo models end to end
under AddressSanitizer and UndefinedBehaviorSanitizer, in a subprocess that preloads the ASan
runtime and loads a sanitizer-built libkiln: results match eager, hostile inputs get clear
errors, and the sanitizers report nothing (UBSan halts on its first error).

    .venv/bin/python -m pytest tests/targets/cpu/test_sanitizers.py -m slow -s
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from torch.utils import _pytree as pytree

import kiln
from kiln.models import ALL_MODELS
from kiln.runtime import build

SAN = "address,undefined"
MODELS = ["demo", "ln_softmax", "intermediates", "gpt"]

CHILD = textwrap.dedent("""
    import sys, torch, kiln
    from safetensors.torch import load_file
    from torch.utils import _pytree as pytree
    from kiln.runtime import build, loader
    from kiln.errors import InputError
    loader.libkiln_path = lambda package=None: build.build_libkiln(sanitize=sys.argv[3])
    pkg, data = sys.argv[1], load_file(sys.argv[2])
    n_in = sum(1 for k in data if k.startswith("in"))
    args = [data[f"in{i}"] for i in range(n_in)]
    runner = kiln.load(pkg)
    def check():
        out = pytree.tree_leaves(runner(*args))
        for i, o in enumerate(out):
            torch.testing.assert_close(o, data[f"out{i}"], rtol=1e-4, atol=1e-4)
    check()
    x = args[0]
    hostile = [x.to(torch.float64) if x.is_floating_point() else x.float(),  # dtype
               x.unsqueeze(0),                                               # rank
               x.transpose(0, -1) if x.dim() > 1 and x.shape[0] != x.shape[-1] else x[None],
               torch.empty((0,) + tuple(x.shape[1:]), dtype=x.dtype)]        # size 0
    refused = 0
    for bad in hostile:
        try:
            runner(bad, *args[1:])
        except InputError as e:
            refused += 1
        check()  # a refused input never corrupts the next run
    runner.close()
    print("ok", refused)
""")


def _runtime(name: str) -> str:
    return subprocess.run(["c++", f"-print-file-name={name}"], capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    if not os.path.isabs(_runtime("libasan.so")):
        pytest.skip("no libasan.so for this compiler")
    build.build_libkiln(sanitize=SAN)
    d = tmp_path_factory.mktemp("san")
    out = {}
    opts = kiln.Options(sanitize=SAN, opt_flags=("-O1",))
    for name in MODELS:
        spec = ALL_MODELS[name]()
        c = kiln.compile(spec.module, spec.example_args, dynamic_shapes=spec.dynamic_shapes,
                         options=opts)
        with torch.no_grad():
            outs = pytree.tree_leaves(spec.module(*spec.example_args))
        tensors = {f"in{i}": a.contiguous() for i, a in enumerate(spec.example_args)}
        tensors.update({f"out{i}": o.contiguous() for i, o in enumerate(outs)})
        save_file(tensors, str(d / f"{name}.safetensors"))
        out[name] = (c.save(d / f"{name}.kiln"), d / f"{name}.safetensors")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_model_clean_under_asan_ubsan(sanitized, name):
    pkg, data = sanitized[name]
    # libstdc++ too: ASan must find the real __cxa_throw (python itself does not link it)
    preload = f"{_runtime('libasan.so')}:{_runtime('libstdc++.so')}"
    env = dict(os.environ, LD_PRELOAD=preload,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:halt_on_error=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(pkg), str(data), SAN], env=env,
                          capture_output=True, text=True, timeout=600)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-4000:]
    assert "AddressSanitizer" not in report and "runtime error:" not in report, report[-4000:]
    assert proc.stdout.split()[-2:] == ["ok", "4"], report[-2000:]
