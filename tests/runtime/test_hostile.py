"""Hostile input not covered by test_runtime_abi.py / test_package.py / test_models.py: raw
DLTensors from C with negative or overflowing sizes, a wrong device, vector lanes, misaligned
byte offsets, bad dtype codes, NULL shape/data; packages with an incompatible format version or
tampered weights (wrong names, shapes, dtypes). Every case runs in a child process, so a crash
shows up as a failed test (not a dead pytest); each must give a clear error, and a valid run
right after a refused one must still give the right answer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln
import kiln.package.format as package_format
from kiln.package import write_package

# C-level cases: name -> (python statement mutating DLTensor `t` of input 0, expected words)
C_CASES = {
    "negative_size": ("shape0[0] = -1", "negative"),
    "overflowing_static_dims": ("shape0[0] = 1 << 62; shape0[1] = 1 << 62", "overflows"),
    "overflowing_bytes": ("shape0[0] = 1 << 61; shape0[1] = 8", "overflows"),
    "wrong_device_cuda": ("t.device = dl.DLDevice(2, 0)", "device"),
    "wrong_device_id_type": ("t.device = dl.DLDevice(12345, 0)", "device"),
    "lanes_4": ("t.dtype = dl.DLDataType(2, 32, 4)", "dtype"),
    "bits_0": ("t.dtype = dl.DLDataType(2, 0, 1)", "dtype"),
    "unknown_dtype_code": ("t.dtype = dl.DLDataType(99, 32, 1)", "dtype"),
    "misaligned_byte_offset": ("t.byte_offset = 1", "aligned"),
    "ndim_negative": ("t.ndim = -1", "dimensions"),
    "ndim_huge": ("t.ndim = 1 << 30", "dimensions"),
    "shape_null": ("t.shape = None", "shape is NULL"),
    "data_null": ("t.data = None", "data is NULL"),
    "dynamic_dim_above_max": ("shape1[0] = 1 << 40", "expected a value in"),
    "dynamic_dim_zero": ("shape1[0] = 0", "expected a value in"),
}

CHILD = textwrap.dedent("""
    import ctypes, json, sys, torch
    from kiln.runtime import dlpack_ctypes as dl
    from kiln.runtime.loader import libkiln, last_error
    lib = libkiln()
    pkg, cases = sys.argv[1], json.loads(sys.argv[2])
    h = ctypes.c_void_p()
    assert lib.kiln_model_load(pkg.encode(), b"cpu", ctypes.byref(h)) == 0, last_error()
    x, y = torch.randn(3, 4), torch.randn(5, 4)
    want = x.sum() + y.amax(0)

    def run(mutate):
        shape0, strides0 = (ctypes.c_int64 * 2)(3, 4), (ctypes.c_int64 * 2)(4, 1)
        shape1, strides1 = (ctypes.c_int64 * 2)(5, 4), (ctypes.c_int64 * 2)(4, 1)
        t = dl.DLTensor(x.data_ptr(), dl.DLDevice(1, 0), 2, dl.DLDataType(2, 32, 1),
                        ctypes.cast(shape0, ctypes.POINTER(ctypes.c_int64)),
                        ctypes.cast(strides0, ctypes.POINTER(ctypes.c_int64)), 0)
        u = dl.DLTensor(y.data_ptr(), dl.DLDevice(1, 0), 2, dl.DLDataType(2, 32, 1),
                        ctypes.cast(shape1, ctypes.POINTER(ctypes.c_int64)),
                        ctypes.cast(strides1, ctypes.POINTER(ctypes.c_int64)), 0)
        exec(mutate)
        ins = (ctypes.POINTER(dl.DLTensor) * 2)(ctypes.pointer(t), ctypes.pointer(u))
        outs = (ctypes.c_void_p * 1)()
        rc = lib.kiln_model_run(h, ins, 2, outs, 1)
        if rc:
            return rc, last_error(), None
        m = dl.DLManagedTensor.from_address(outs[0])
        val = torch.tensor([ctypes.cast(m.dl_tensor.data, ctypes.POINTER(ctypes.c_float))[i]
                            for i in range(4)])
        m.deleter(outs[0])
        return rc, "", val

    res = {}
    for name, mutate in cases.items():
        rc, msg, _ = run(mutate)
        rc2, msg2, val = run("pass")
        res[name] = {"rc": rc, "msg": msg, "after_ok": rc2 == 0 and
                     torch.allclose(val, want, atol=1e-5)}
    lib.kiln_model_free(h)
    print(json.dumps(res))
""")


class SumMax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.ones(4))

    def forward(self, x, y):
        return x.sum() * self.w + y.amax(0)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    n = torch.export.Dim("n", min=1, max=1 << 20)
    c = kiln.compile(SumMax(), (torch.randn(3, 4), torch.randn(5, 4)),
                     dynamic_shapes=(None, {0: n}))
    return c, c.save(tmp_path_factory.mktemp("hostile") / "m.kiln")


def _child(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=300)


def test_c_abi_hostile_tensors(compiled):
    _, pkg = compiled
    proc = _child(CHILD, str(pkg), json.dumps({k: v[0] for k, v in C_CASES.items()}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, words) in C_CASES.items():
        r = res[name]
        assert r["rc"] != 0, f"{name}: accepted"
        assert r["msg"].startswith("input ") and words in r["msg"], f"{name}: {r['msg']!r}"
        assert r["after_ok"], f"{name}: the next valid run went wrong"


def _write(compiled, path, weights=None, **manifest):
    c, _ = compiled
    files = {f"src/{k}": v.encode() for k, v in c.built.sources.items()}
    files["lib/model.so"] = c.built.library.read_bytes()
    write_package(path, {**c.manifest, **manifest}, files,
                  c.built.weights if weights is None else weights)
    return path


LOAD = textwrap.dedent("""
    import json, sys, kiln
    res = {}
    for path in sys.argv[1:]:
        try:
            kiln.load(path).close()
            res[path] = "loaded"
        except kiln.errors.KilnError as e:
            res[path] = type(e).__name__ + ": " + str(e)
    print(json.dumps(res))
""")
WEIGHT_CASES = ["renamed", "missing", "wrong_dtype", "wrong_shape", "same_bytes_other_shape",
                "extra"]


def test_bad_packages(compiled, tmp_path, monkeypatch):
    """One child process loads every tampered package; each must be refused, naming why."""
    c, _ = compiled
    monkeypatch.setattr(package_format, "FORMAT", "kiln.package/2")
    paths = {"format_v2": _write(compiled, tmp_path / "v2.kiln")}
    monkeypatch.undo()
    (name, w), = c.built.weights.items()
    for case in WEIGHT_CASES:
        weights = {"renamed": {name + "_x": w}, "missing": {}, "wrong_dtype": {name: w.double()},
                   "wrong_shape": {name: torch.ones(5)},
                   "same_bytes_other_shape": {name: w.reshape(2, 2)},
                   "extra": {name: w, "zz_unused": torch.ones(2)}}[case]
        paths[case] = _write(compiled, tmp_path / f"{case}.kiln", weights)
    proc = _child(LOAD, *map(str, paths.values()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    msgs = json.loads(proc.stdout.strip().splitlines()[-1])
    msg = {case: msgs[str(p)] for case, p in paths.items()}
    assert msg["format_v2"].startswith("PackageError") and "kiln.package/2" in msg["format_v2"]
    for case in WEIGHT_CASES[:4]:
        assert msg[case].startswith("PackageError") and name in msg[case], (case, msg[case])
    # libkiln checks each weight's shape against the manifest: a reshaped weight with the
    # same bytes is refused; an unused extra tensor in the file is ignored
    assert "has shape [2, 2], the model expects [4]" in msg["same_bytes_other_shape"], msg
    assert msg["extra"] == "loaded", msg


def test_python_entry_hostile(compiled):
    _, pkg = compiled
    with pytest.raises(kiln.errors.KilnError, match="device"):  # a CPU package on cuda
        kiln.load(pkg, device="cuda")
    with kiln.load(pkg) as r:
        for bad in (torch.randn(3, 4, device="meta"), torch.randn(3, 4).to_sparse(),
                    torch.randn(3, 4, dtype=torch.complex64), [[1.0] * 4] * 3):
            with pytest.raises(kiln.errors.KilnError):
                r(bad, torch.randn(5, 4))
        x, y = torch.randn(3, 4), torch.randn(5, 4)
        torch.testing.assert_close(r(x, y), x.sum() + y.amax(0))


def test_check_finite_option_names_the_first_non_finite_buffer(tmp_path):
    class M(torch.nn.Module):
        def forward(self, x):
            y = torch.log(x) * 2  # log of a negative number: nan
            return torch.relu(y) + 1

    x = torch.rand(4, 8) + 0.5
    cm = kiln.compile(M(), (x,), options=kiln.Options(check_finite=True))
    runner = cm.load(tmp_path / "m.kiln")
    torch.testing.assert_close(runner(x), M()(x))
    bad = x.clone()
    bad[2, 3] = -1.0
    with pytest.raises(kiln.errors.KilnError, match=r"check_finite: .*\[19\] is -?nan"):
        runner(bad)
    torch.testing.assert_close(runner(x), M()(x))  # the next run is unaffected
