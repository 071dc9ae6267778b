"""End to end: every bundled model compiles, and its package matches eager PyTorch when loaded
with `kiln.load` in a fresh process and when run by the C example (examples/c/run_model.c), at
the example sizes and at other sizes inside the `Dim` ranges."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from torch.utils import _pytree as pytree

import kiln
from kiln.models import ALL_MODELS
from kiln.runtime.cbin import read_tensor_bin, write_tensor_bin

MODELS = ["mlp", "resnet18", "gpt", "ln_softmax", "intermediates"]
# sizes other than the example ones, inside each model's Dim ranges
OTHER_SIZES = {"mlp": [{"batch": 1}, {"batch": 17}], "gpt": [{"batch": 1, "seq": 2},
                                                             {"batch": 4, "seq": 67}],
               "intermediates": [{"n": 2}, {"n": 64}]}


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, pathlib.Path]:
    out = {}
    d = tmp_path_factory.mktemp("models")
    for name in MODELS:
        spec = ALL_MODELS[name]()
        c = kiln.compile(spec.module, spec.example_args, dynamic_shapes=spec.dynamic_shapes)
        out[name] = c.save(d / f"{name}.kiln")
    return out


def _cases(name: str) -> list[tuple]:
    spec = ALL_MODELS[name]()
    cases = [spec.example_args] + [spec.make_inputs(seed=k + 1, **s)
                                   for k, s in enumerate(OTHER_SIZES.get(name, []))]
    out = []
    with torch.no_grad():
        for args in cases:
            out.append((args, pytree.tree_leaves(spec.module(*args))))
    return out


CHILD = textwrap.dedent("""
    import sys, torch, kiln
    from safetensors.torch import load_file
    from torch.utils import _pytree as pytree
    pkg, n_in = sys.argv[1], int(sys.argv[2])
    rtol, atol = map(float, sys.argv[3:5])
    for k, data in enumerate(sys.argv[5:]):
        t = load_file(data)
        runner = kiln.load(pkg)  # loaded afresh for each case, as by a process of its own
        out = pytree.tree_leaves(runner(*[t[f"in{i}"] for i in range(n_in)]))
        for i, o in enumerate(out):
            torch.testing.assert_close(o, t[f"out{i}"], rtol=rtol, atol=atol,
                                       msg=lambda m: f"case {k}, output {i}: {m}")
        print("ok", k, len(out))
""")


@pytest.mark.parametrize("name", MODELS)
def test_fresh_process_matches_eager(name, packages, tmp_path):
    """One fresh process per model checks all its cases (each case its own kiln.load)."""
    spec = ALL_MODELS[name]()
    cases = _cases(name)
    files = []
    for k, (args, ref) in enumerate(cases):
        data = tmp_path / f"case{k}.safetensors"
        tensors = {f"in{i}": a.contiguous() for i, a in enumerate(args)}
        tensors.update({f"out{i}": r.contiguous() for i, r in enumerate(ref)})
        save_file(tensors, str(data))
        files.append(str(data))
    n_in = {len(args) for args, _ in cases}
    assert len(n_in) == 1, n_in
    proc = subprocess.run([sys.executable, "-c", CHILD, str(packages[name]), str(n_in.pop()),
                           str(spec.rtol), str(spec.atol), *files],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == \
        [["ok", str(k)] for k in range(len(cases))], proc.stdout


@pytest.mark.parametrize("name", MODELS)
def test_c_example_matches_eager(name, packages, run_model_exe, tmp_path):
    spec = ALL_MODELS[name]()
    for k, (args, ref) in enumerate(_cases(name)):
        files = []
        for i, a in enumerate(args):
            files.append(str(tmp_path / f"c{k}_in{i}.bin"))
            write_tensor_bin(files[-1], a.contiguous())
        prefix = str(tmp_path / f"c{k}_out")
        proc = subprocess.run([str(run_model_exe), "-o", prefix, str(packages[name]), *files],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert proc.returncode == 0, proc.stderr
        for i, r in enumerate(ref):
            got = read_tensor_bin(f"{prefix}{i}.bin")
            torch.testing.assert_close(got, r, rtol=spec.rtol, atol=spec.atol)


def test_dynamic_range_is_enforced(packages):
    runner = kiln.load(packages["mlp"])
    with pytest.raises(kiln.errors.InputError, match=r"input 0 \(x\): dim 0 is 1025, expected a "
                                                     r"value in \[1, 1024\]"):
        runner(torch.randn(1025, 1024))
    gpt = kiln.load(packages["gpt"])
    with pytest.raises(kiln.errors.InputError, match=r"dim 1 is 257"):
        gpt(torch.zeros(1, 257, dtype=torch.long))


def test_input_checks_name_input_expected_and_actual(packages):
    runner = kiln.load(packages["mlp"])
    cases = [
        (torch.randn(4, 1024, dtype=torch.float64), "expected dtype float32, got float64"),
        (torch.randn(4, 1024, 1), "expected 2 dimensions, got 3"),
        (torch.randn(4, 1000), "expected size 1024 for dim 1, got 1000"),
    ]
    for x, msg in cases:
        with pytest.raises(kiln.errors.InputError, match="input 0 \\(x\\)") as info:
            runner(x)
        assert msg in str(info.value)
    with pytest.raises(kiln.errors.InputError):
        runner(torch.randn(4, 1024), torch.randn(4, 1024))
    with pytest.raises(kiln.errors.InputError):
        runner([1.0] * 1024)


def test_relations_between_dims(tmp_path):
    class Add(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    n = torch.export.Dim("n", min=2, max=32)
    c = kiln.compile(Add(), (torch.randn(4, 3), torch.randn(4, 3)),
                     dynamic_shapes=({0: n}, {0: n}))
    runner = c.load(tmp_path / "add.kiln")
    x, y = torch.randn(9, 3), torch.randn(9, 3)
    torch.testing.assert_close(runner(x, y), x + y)
    with pytest.raises(kiln.errors.InputError, match=r"input 1 \(y\): expected size s0 for dim 0, "
                                                     r"got 8"):
        runner(x, torch.randn(8, 3))


def test_package_has_no_libtorch(packages, tmp_path):
    import zipfile

    with zipfile.ZipFile(packages["resnet18"]) as z:
        (tmp_path / "model.so").write_bytes(z.read("lib/model.so"))
        names = z.namelist()
    assert {"manifest.json", "lib/model.so", "weights.safetensors", "src/model.cpp",
            "src/model.py"} <= set(names)
    ldd = subprocess.run(["ldd", str(tmp_path / "model.so")], capture_output=True, text=True)
    assert "torch" not in ldd.stdout and "libc10" not in ldd.stdout
    assert "openblas" in ldd.stdout


def test_manifest_describes_the_program(packages):
    m = kiln.load(packages["gpt"]).manifest
    assert m["schema"] == "kiln.manifest/1"
    assert [i["dtype"] for i in m["inputs"]] == ["int64"]
    assert m["inputs"][0]["shape"] == ["s0", "s1"]
    assert m["symbols"]["s1"] == {"min": 2, "max": 256, "example": 128}
    assert any(w["fqn"].endswith("weight") for w in m["weights"])
    assert m["requires"]["libtorch"] is False
    assert m["plan"]["dynamic"] is True and m["plan"]["arena_bytes"] >= \
        m["plan"]["lower_bound_bytes"]
    assert all(k["source_ops"] for k in m["kernels"])
