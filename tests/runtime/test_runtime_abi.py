"""Tests of libkiln (kiln.h), the ctypes loader (kiln.runtime.load) and the C example, on the
hand-written toy model tests/fixtures/toy_model.cpp. Crash-prone cases run in subprocesses."""
from __future__ import annotations

import ctypes
import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
import zipfile
from collections.abc import Callable, Iterator

import pytest
import torch

import kiln.runtime
from kiln.errors import InputError, KilnError, PackageError, UnsupportedError
from kiln.package.format import data_offset
from kiln.runtime import dlpack_ctypes as dl
from kiln.runtime import loader
from kiln.runtime.cbin import read_tensor_bin, write_tensor_bin

ROOT = pathlib.Path(__file__).resolve().parents[2]
MakePkg = Callable[..., pathlib.Path]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("kiln_cache")


@pytest.fixture(autouse=True)
def _isolated_cache(libkiln_path: pathlib.Path, cache_dir: pathlib.Path,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache_dir))
    yield


def _toy_lib(cache_dir: pathlib.Path) -> ctypes.CDLL:
    """The extracted toy model.so (same handle libkiln dlopen'ed) for its test counters."""
    libs = sorted((cache_dir / "lib").glob("*/model.so"))
    assert libs
    for p in libs:
        lib = ctypes.CDLL(str(p))
        if hasattr(lib, "toy_live_outputs"):
            lib.toy_live_outputs.restype = ctypes.c_long
            lib.toy_live_instances.restype = ctypes.c_long
            return lib
    raise AssertionError("toy model library not found in the cache")


def test_run_matches_eager(make_toy_package: MakePkg, toy_reference: Callable) -> None:
    with kiln.runtime.load(make_toy_package()) as runner:
        assert runner.manifest["inputs"][0]["name"] == "x"
        assert (runner.num_inputs, runner.num_outputs) == (2, 2)
        for n in (1, 3, 64):
            x, s = torch.randn(n, 4), torch.tensor(1.7)
            y, rs = runner(x, scale=s)
            ry, rrs = toy_reference(x, s)
            assert y.dtype == torch.float32 and y.shape == (n, 4)
            torch.testing.assert_close(y, ry, rtol=0, atol=0)
            torch.testing.assert_close(rs, rrs)
        xt = torch.randn(4, 5).t()  # other strides: libkiln copies them in for the model
        torch.testing.assert_close(runner(xt, scale=s)[0], toy_reference(xt, s)[0], rtol=0,
                                   atol=0)
        y2, _ = runner(x, scale=s)
    torch.testing.assert_close(y2 * 1, toy_reference(x, s)[0])  # outputs outlive the runner
    with pytest.raises(KilnError, match="closed"):
        runner(x, scale=s)


def test_outputs_freed_once(make_toy_package: MakePkg, cache_dir: pathlib.Path) -> None:
    runner = kiln.runtime.load(make_toy_package())
    toy = _toy_lib(cache_dir)
    gc.collect()
    base_out, base_inst = toy.toy_live_outputs(), toy.toy_live_instances()
    outs = [runner(torch.randn(2, 4), scale=torch.tensor(2.0)) for _ in range(10)]
    assert toy.toy_live_outputs() == base_out + 20
    del outs
    gc.collect()
    assert toy.toy_live_outputs() == base_out
    with pytest.raises(InputError):
        runner(torch.randn(2, 5), scale=torch.tensor(2.0))
    assert toy.toy_live_outputs() == base_out
    runner.close()
    runner.close()
    assert toy.toy_live_instances() == base_inst - 1


def test_input_errors(make_toy_package: MakePkg) -> None:
    runner = kiln.runtime.load(make_toy_package())
    x, s = torch.randn(3, 4), torch.tensor(1.0)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: runner(x.long(), scale=s), "input 0 (x): expected dtype float32, got int64"),
        (lambda: runner(x, scale=s.double()), "input 1 (scale): expected dtype float32"),
        (lambda: runner(x, s), "1 extra positional argument (the model takes 1: `x`; got 2); "
                                "missing keyword argument `scale`"),
        (lambda: runner(x, x, scale=s), "1 extra positional argument"),
        (lambda: runner(x), "missing keyword argument `scale`"),
        (lambda: runner(x, scale=1.0), "input 1 (scale): expected a torch.Tensor, got float"),
        (lambda: runner(torch.randn(65, 4), scale=s), "input 0 (x): expected size in [1, 64]"),
        (lambda: runner(torch.randn(2, 4, 1), scale=s), "input 0 (x): expected rank 2"),
        (lambda: runner(x, scale=torch.ones(1)), "input 1 (scale): expected rank 0"),
        (lambda: runner(x.to_sparse(), scale=s), "input 0 (x): expected a strided tensor"),
        (lambda: runner(x.to("meta"), scale=s), "input 0 (x): unsupported dtype/device"),
    ]
    for call, fragment in cases:
        with pytest.raises(InputError) as info:
            call()
        assert fragment in str(info.value)
        assert isinstance(info.value, ValueError)
    runner.close()


def test_keyword_order(make_toy_package: MakePkg, toy_reference: Callable) -> None:
    from torch.utils._pytree import tree_flatten, treespec_dumps

    x, s = torch.randn(3, 4), torch.tensor(2.0)
    spec = treespec_dumps(tree_flatten(((), {"x": x, "scale": s}))[1])
    with kiln.runtime.load(make_toy_package(in_spec=spec)) as runner:
        for y, _ in (runner(x=x, scale=s), runner(scale=s, x=x)):
            torch.testing.assert_close(y, toy_reference(x, s)[0])
        with pytest.raises(InputError, match="1 extra positional argument .*missing keyword "
                                             "argument `x`"):
            runner(x, scale=s)


def test_load_errors(make_toy_package: MakePkg, tmp_path: pathlib.Path) -> None:
    with pytest.raises(PackageError, match="does not exist"):
        kiln.runtime.load(tmp_path / "missing.kiln")
    with pytest.raises(UnsupportedError):
        kiln.runtime.load(make_toy_package(), device="tpu")
    with pytest.raises(PackageError, match='compiled for device "cpu"'):
        kiln.runtime.load(make_toy_package(), device="cuda")
    bad = make_toy_package("w.kiln", weights={"w": torch.zeros(4, dtype=torch.float64),
                                              "b": torch.zeros(4)})
    with pytest.raises(PackageError, match="weight 'w' has dtype F64, the model expects F32"):
        kiln.runtime.load(bad)
    bad = make_toy_package("n.kiln", weights={"w": torch.zeros(5), "b": torch.zeros(4)})
    with pytest.raises(PackageError, match="weight 'w' has 20 bytes, the model expects 16"):
        kiln.runtime.load(bad)
    bad = make_toy_package("m.kiln", weights={"b": torch.zeros(4)})
    with pytest.raises(PackageError, match="missing weight 'w'"):
        kiln.runtime.load(bad)
    bad = make_toy_package("s.kiln", so=b"\x7fELF not really")
    with pytest.raises(PackageError, match="cannot load"):
        kiln.runtime.load(bad)
    path = make_toy_package("c.kiln")
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        info = zf.getinfo("lib/model.so")
        off = data_offset(f, info.header_offset)
    data[off + 1000] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="lib/model.so"):
        kiln.runtime.load(path)


def test_no_weights_model(make_toy_package: MakePkg, toy_so_no_weights: bytes,
                          toy_reference: Callable) -> None:
    path = make_toy_package("nw.kiln", weights={}, so=toy_so_no_weights)
    with kiln.runtime.load(path) as runner:
        x, s = torch.randn(5, 4), torch.tensor(0.5)
        torch.testing.assert_close(runner(x, scale=s)[0], toy_reference(x, s)[0])


def test_zip64_package_loads(make_toy_package: MakePkg, monkeypatch: pytest.MonkeyPatch,
                             toy_reference: Callable) -> None:
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 1000)
    path = make_toy_package("z.kiln")
    monkeypatch.undo()
    assert b"PK\x06\x06" in path.read_bytes()
    with kiln.runtime.load(path) as runner:
        x, s = torch.randn(2, 4), torch.tensor(3.0)
        torch.testing.assert_close(runner(x, scale=s)[0], toy_reference(x, s)[0])


def test_reload_no_fd_leak(make_toy_package: MakePkg, cache_dir: pathlib.Path) -> None:
    path = make_toy_package()
    kiln.runtime.load(path).close()
    toy = _toy_lib(cache_dir)
    base_inst = toy.toy_live_instances()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(40):
        with kiln.runtime.load(path) as runner:
            runner(torch.randn(1, 4), scale=torch.tensor(1.0))
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
    assert toy.toy_live_instances() == base_inst


def test_threads(make_toy_package: MakePkg, toy_reference: Callable) -> None:
    runner = kiln.runtime.load(make_toy_package())
    errors: list[str] = []

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(100):
            n = int(torch.randint(1, 65, (1,), generator=g))
            x, s = torch.randn(n, 4, generator=g), torch.randn((), generator=g)
            y, rs = runner(x, scale=s)
            ry, rrs = toy_reference(x, s)
            if not (torch.equal(y, ry) and torch.allclose(rs, rrs)):
                errors.append(f"thread {seed}: wrong result")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runner.close()
    assert not errors


def test_cache_reuse_and_repair(make_toy_package: MakePkg, cache_dir: pathlib.Path) -> None:
    path = make_toy_package()
    kiln.runtime.load(path).close()
    libs = {p: p.stat().st_mtime_ns for p in (cache_dir / "lib").glob("*/model.so")}
    kiln.runtime.load(path).close()
    assert {p: p.stat().st_mtime_ns for p in libs} == libs  # reused, not rewritten
    for p in libs:  # damage the cache (by rename, never in place: the library is mapped)
        tmp = p.with_name("junk")
        tmp.write_bytes(b"\0" * p.stat().st_size)
        os.replace(tmp, p)
    kiln.runtime.load(path).close()
    assert any(p.read_bytes()[:4] == b"\x7fELF" for p in libs)
    assert not [p for p in (cache_dir / "lib").rglob("*") if p.name.startswith(".model.so")]


def test_dlpack_layout_and_torch_capsule(make_toy_package: MakePkg,
                                         toy_reference: Callable) -> None:
    assert ctypes.sizeof(dl.DLTensor) == 48 and ctypes.sizeof(dl.DLManagedTensor) == 64
    lib = loader.libkiln()
    handle = ctypes.c_void_p()
    assert lib.kiln_model_load(str(make_toy_package()).encode(), b"cpu",
                               ctypes.byref(handle)) == 0
    getp = ctypes.pythonapi.PyCapsule_GetPointer
    getp.restype, getp.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    x, s = torch.randn(6, 4), torch.tensor(-1.25)
    caps = [torch.utils.dlpack.to_dlpack(t) for t in (x, s)]
    managed = [dl.DLManagedTensor.from_address(getp(c, b"dltensor")) for c in caps]
    ins = (ctypes.POINTER(dl.DLTensor) * 2)(*[ctypes.pointer(m.dl_tensor) for m in managed])
    outs = (ctypes.c_void_p * 2)()
    assert lib.kiln_model_run(handle, ins, 2, outs, 2) == 0, loader.last_error()
    y, rs = loader._adopt_outputs(outs, 2)
    torch.testing.assert_close(y, toy_reference(x, s)[0])
    lib.kiln_model_free(handle)


def test_libkiln_exports_only_api(libkiln_path: pathlib.Path) -> None:
    if not shutil.which("nm"):
        pytest.skip("nm not available")
    out = subprocess.run(["nm", "-D", "--defined-only", str(libkiln_path)], check=True,
                         capture_output=True, text=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert names == {"kiln_abi_version", "kiln_abi_minor", "kiln_model_load",
                     "kiln_model_num_inputs", "kiln_model_num_outputs", "kiln_model_run",
                     "kiln_last_error",
                     "kiln_model_free", "kiln_model_update_weights",
                     "kiln_model_run_on_stream", "kiln_model_set_num_threads",
                     "kiln_model_num_threads", "kiln_cpu_supports", "kiln_model_set_comm",
                     "kiln_model_cpu_level",
                     # minor 5: entry points, state, sampling
                     "kiln_model_num_entries", "kiln_model_entry_name",
                     "kiln_model_entry_num_inputs", "kiln_model_entry_num_outputs",
                     "kiln_model_run_entry", "kiln_model_run_entry_on_stream",
                     "kiln_model_reset_state", "kiln_model_num_state", "kiln_model_state_name",
                     "kiln_model_state_nbytes", "kiln_model_read_state",
                     "kiln_model_write_state", "kiln_model_copy_state", "kiln_sample",
                     # minor 6: per-step profiling
                     "kiln_model_set_profiling", "kiln_model_profile_num_steps",
                     "kiln_model_profile_runs", "kiln_model_profile_step",
                     "kiln_model_profile_write",
                     # minor 7: input and state records
                     "kiln_model_entry_input_name", "kiln_model_entry_input_shape",
                     "kiln_model_state_shape"}


# --- C level, in subprocesses (a crash fails the test instead of killing pytest) ----------------

_C_SCRIPT = textwrap.dedent("""
    import ctypes, json, sys
    lib = ctypes.CDLL(sys.argv[1])
    vp = ctypes.c_void_p
    lib.kiln_last_error.restype = ctypes.c_char_p
    lib.kiln_model_num_inputs.restype = ctypes.c_int64
    lib.kiln_model_num_inputs.argtypes = [vp]
    lib.kiln_model_num_outputs.restype = ctypes.c_int64
    lib.kiln_model_num_outputs.argtypes = [vp]
    lib.kiln_model_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(vp)]
    lib.kiln_model_run.argtypes = [vp, vp, ctypes.c_int64, vp, ctypes.c_int64]
    lib.kiln_model_free.argtypes = [vp]
    err = lambda: lib.kiln_last_error().decode()
    results = []
    for case in json.loads(sys.argv[2]):
        h = vp(12345)
        rc = lib.kiln_model_load(case["path"].encode() if case["path"] else None,
                                 case.get("device", "cpu").encode(), ctypes.byref(h))
        results.append([rc, h.value, err()])
        if rc == 0:
            lib.kiln_model_free(h)
    if len(sys.argv) > 3:  # NULL-argument checks on a valid package
        h = vp()
        r = []
        r.append([lib.kiln_model_load(sys.argv[3].encode(), b"cpu", None), err()])
        r.append([lib.kiln_model_load(sys.argv[3].encode(), None, ctypes.byref(h)), err()])
        r.append([lib.kiln_model_num_inputs(None), err()])
        r.append([lib.kiln_model_num_outputs(None), err()])
        r.append([lib.kiln_model_run(None, None, 2, None, 2), err()])
        assert lib.kiln_model_load(sys.argv[3].encode(), b"cpu", ctypes.byref(h)) == 0
        outs = (vp * 2)()
        ins = (vp * 2)()
        r.append([lib.kiln_model_run(h, None, 2, outs, 2), err()])
        r.append([lib.kiln_model_run(h, ins, 2, outs, 2), err()])
        r.append([lib.kiln_model_run(h, ins, 2, None, 2), err()])
        r.append([lib.kiln_model_run(h, ins, 3, outs, 2), err()])
        r.append([lib.kiln_model_run(h, ins, 2, outs, 1), err()])
        r.append([lib.kiln_model_run(h, ins, -1, outs, 2), err()])
        lib.kiln_model_free(None)
        lib.kiln_model_free(h)
        results.append(r)
    print(json.dumps(results))
""")


def _run_c(libkiln_path: pathlib.Path, cases: list[dict], *extra: str) -> list:
    proc = subprocess.run([sys.executable, "-c", _C_SCRIPT, str(libkiln_path), json.dumps(cases),
                           *extra], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"subprocess died ({proc.returncode}): {proc.stderr}"
    return json.loads(proc.stdout)


def test_c_null_arguments(libkiln_path: pathlib.Path, make_toy_package: MakePkg) -> None:
    path = make_toy_package()
    null_path, r = _run_c(libkiln_path, [{"path": None}], str(path))
    assert null_path[0] != 0 and null_path[1] is None and "package_path is NULL" in null_path[2]
    expect = ["out is NULL", "device is NULL", "model is NULL", "model is NULL",
              "model is NULL", "inputs is NULL", "input 0 is NULL", "outputs is NULL",
              "expected 2 inputs, got 3", "expected 2 outputs, got 1", "expected 2 inputs, got -1"]
    assert len(r) == len(expect)
    for (rc, msg), fragment in zip(r, expect):
        assert rc != 0 and fragment in msg, (rc, msg, fragment)


def test_c_corrupt_packages(libkiln_path: pathlib.Path, make_toy_package: MakePkg,
                            tmp_path: pathlib.Path) -> None:
    good = make_toy_package()
    data = good.read_bytes()
    with zipfile.ZipFile(good) as zf, open(good, "rb") as f:
        where = {i.filename: (i.header_offset, data_offset(f, i.header_offset), i.file_size)
                 for i in zf.infolist()}
    cases: list[dict] = [{"path": str(tmp_path / "missing.kiln"), "expect": ["cannot open"]},
                         {"path": str(good), "device": "tpu", "expect": ["unsupported device"]},
                         {"path": str(good), "device": "cuda", "expect": ["compiled for device"]},
                         {"path": str(tmp_path), "expect": ["not a regular file"]}]

    def add(name: str, blob: bytes, *expect: str) -> None:
        p = tmp_path / name
        p.write_bytes(blob)
        cases.append({"path": str(p), "expect": [str(p), *expect]})

    for cut in [0, 1, 21, 200, len(data) // 2, len(data) - 200, len(data) - 22, len(data) - 1]:
        add(f"cut{cut}.kiln", data[:cut])
    for entry in ["manifest.json", "lib/model.so", "weights.safetensors"]:
        hdr, off, size = where[entry]
        for pos, what in [(off + size // 2, "CRC32 mismatch"), (off + size - 1, "CRC32"),
                          (hdr, "bad local header signature")]:
            blob = bytearray(data)
            blob[pos] ^= 0x40
            add(f"flip{len(cases)}.kiln", bytes(blob), entry, what)
    cd = data.rfind(b"PK\x01\x02")
    blob = bytearray(data)
    blob[cd] ^= 1
    add("cd.kiln", bytes(blob), "central directory")
    with zipfile.ZipFile(good) as zf:
        entries = {i.filename: zf.read(i) for i in zf.infolist()}
    deflated = tmp_path / "deflated.kiln"
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as zf:
        for k, v in entries.items():
            zf.writestr(k, v)
    cases.append({"path": str(deflated), "expect": ["compressed", "manifest.json"]})
    for label, manifest in [("format", json.dumps({"format": "kiln.package/9"})),
                            ("nojson", "{\"format\": "), ("array", "[]")]:
        p = tmp_path / f"man_{label}.kiln"
        with zipfile.ZipFile(p, "w") as zf:
            for name, v in entries.items():
                zf.writestr(name, manifest if name == "manifest.json" else v)
        cases.append({"path": str(p), "expect": ["manifest.json"]})
    for label, st in [("hlen", (10**9).to_bytes(8, "little") +
                       entries["weights.safetensors"][8:]),
                      ("json", entries["weights.safetensors"][:8] + b"{\"w\": [" +
                       entries["weights.safetensors"][15:]),
                      ("short", b"\x01\x00"),
                      ("offsets", b"{\"w\":{\"dtype\":\"F32\",\"shape\":[4],"
                       b"\"data_offsets\":[0,99999]}}")]:
        blob = st if label != "offsets" else len(st).to_bytes(8, "little") + st
        p = tmp_path / f"st_{label}.kiln"
        with zipfile.ZipFile(p, "w") as zf:
            for name, v in entries.items():
                if name == "manifest.json":
                    continue  # C does not need the file table: leave it stale
                zf.writestr(name, blob if name == "weights.safetensors" else v)
            zf.writestr("manifest.json", entries["manifest.json"])
        cases.append({"path": str(p), "expect": ["weights.safetensors"]})
    results = _run_c(libkiln_path, cases)
    if os.environ.get("KILN_SHOW_ERRORS"):
        print("\n".join(r[2] for r in results))
    for case, (rc, handle, msg) in zip(cases, results):
        assert rc != 0 and handle is None, (case, msg)
        for fragment in case["expect"]:
            assert fragment in msg, (fragment, msg)


# --- the C example ------------------------------------------------------------------------------

def test_c_example(run_model_exe: pathlib.Path, make_toy_package: MakePkg,
                   tmp_path: pathlib.Path, toy_reference: Callable,
                   cache_dir: pathlib.Path) -> None:
    pkg = make_toy_package()
    x, s = torch.randn(7, 4), torch.tensor(0.75)
    write_tensor_bin(tmp_path / "x.bin", x)
    write_tensor_bin(tmp_path / "s.bin", s)
    env = {**os.environ, "KILN_CACHE_DIR": str(cache_dir)}
    args = [str(pkg), str(tmp_path / "x.bin"), str(tmp_path / "s.bin")]
    proc = subprocess.run([str(run_model_exe), "-o", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["output[0] float32 [7,4]", "output[1] float32 [7]"]
    ry, rs = toy_reference(x, s)
    y = read_tensor_bin(tmp_path / "out0.bin")
    torch.testing.assert_close(y, ry, rtol=0, atol=0)
    torch.testing.assert_close(read_tensor_bin(tmp_path / "out1.bin"), rs)
    text = subprocess.run([str(run_model_exe), *args], capture_output=True, text=True, env=env,
                          check=True).stdout.splitlines()
    assert text[0] == "output[0] float32 [7,4]" and text[29] == "output[1] float32 [7]"
    vals = torch.tensor([float(v) for v in text[1:29]]).reshape(7, 4)
    torch.testing.assert_close(vals, ry, rtol=0, atol=0)
    write_tensor_bin(tmp_path / "x.bin", x.long())
    bad = subprocess.run([str(run_model_exe), *args], capture_output=True, text=True, env=env)
    assert bad.returncode == 1
    assert "input 0 (x): expected dtype float32, got int64" in bad.stderr
    bad = subprocess.run([str(run_model_exe), str(tmp_path / "nope.kiln")], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 1 and "nope.kiln" in bad.stderr
    write_tensor_bin(tmp_path / "x.bin", x)
    one = subprocess.run([str(run_model_exe), "-t", "1", *args], capture_output=True, text=True,
                         env=env)
    assert one.returncode == 0 and one.stdout.splitlines() == text, one.stderr
    for threads, rc, msg in (("-1", 1, "num_threads must be in [0, 4096]"),
                             ("5000", 1, "got 5000"), ("x", 2, "usage"), ("", 2, "usage")):
        bad = subprocess.run([str(run_model_exe), "-t", threads, *args], capture_output=True,
                             text=True, env=env)
        assert bad.returncode == rc and msg in bad.stderr, (threads, bad.stderr)


def test_c_fuzz_never_crashes(libkiln_path: pathlib.Path, make_toy_package: MakePkg,
                              tmp_path: pathlib.Path) -> None:
    import random

    rng = random.Random(1234)
    good = make_toy_package()
    data = good.read_bytes()
    with zipfile.ZipFile(good) as zf:
        entries = {i.filename: zf.read(i) for i in zf.infolist()}
    st = entries["weights.safetensors"]
    hlen = int.from_bytes(st[:8], "little")
    cases: list[dict] = []
    for i in range(120):  # raw damage anywhere: flips, cuts, middle excisions
        blob = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
        if i % 3 == 1:
            blob = blob[:rng.randrange(len(blob))]
        elif i % 3 == 2:
            a = rng.randrange(len(blob))
            blob = blob[:a] + blob[a + rng.randint(1, 500):]
        p = tmp_path / f"raw{i}.kiln"
        p.write_bytes(bytes(blob))
        cases.append({"path": str(p)})
    for i in range(120):  # damaged safetensors headers with valid CRCs: exercises the JSON parser
        header = bytearray(st[8:8 + hlen])
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(header))
            header[pos] = rng.choice(b'{}[]",:0123456789-eE.\\u \x00\xff')
        body = hlen.to_bytes(8, "little") + bytes(header) + st[8 + hlen:]
        if i % 4 == 0:
            body = len(header[:-5]).to_bytes(8, "little") + bytes(header[:-5]) + st[8 + hlen:]
        p = tmp_path / f"st{i}.kiln"
        with zipfile.ZipFile(p, "w") as zf:
            for name, v in entries.items():
                zf.writestr(name, body if name == "weights.safetensors" else v)
        cases.append({"path": str(p)})
    results = _run_c(libkiln_path, cases)
    assert len(results) == len(cases)
    for rc, handle, msg in results:
        assert (rc == 0) == (handle is not None)
        assert rc == 0 or msg.startswith("kiln")
