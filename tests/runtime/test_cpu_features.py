"""Packages record the CPU features their code uses (manifest requires.cpu_features, from the
compiler's flags) and loading checks them before mapping the code: a CPU without one fails
with an error naming it, never an illegal instruction. The runtime's CPUID detection is
compared with the kernel's view (/proc/cpuinfo) and with the compiler's -march=native."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import torch

import kiln
from kiln.errors import KilnError
from kiln.runtime.cbin import read_tensor_bin, write_tensor_bin
from kiln.runtime import cpu_supports
from kiln.toolchain.cxx import CPU_FEATURES, cpu_features

# the kernel's names (/proc/cpuinfo "flags") where they differ from the compiler's
PROC_NAME = {"sse3": "pni", "bmi": "bmi1", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "lzcnt": "abm",
             "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
             "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bitalg": "avx512_bitalg",
             "avx512vbmi2": "avx512_vbmi2", "avx512vnni": "avx512_vnni",
             "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avxvnni": "avx_vnni"}


def _proc_flags() -> set[str] | None:
    p = pathlib.Path("/proc/cpuinfo")
    if not p.exists():
        return None
    for line in p.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def _compile(tmp_path, march: str | None = None):
    opts = kiln.Options(num_threads=1) if march is None else kiln.Options(march=march)
    return kiln.compile(lambda x: torch.relu(x) * 2, (torch.randn(8),), options=opts)


def test_runtime_detection_agrees_with_the_kernel():
    flags = _proc_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    for name in CPU_FEATURES.values():
        got = cpu_supports(name)
        assert got is not None, f"libkiln does not know {name}"
        assert got == (PROC_NAME.get(name, name) in flags), name
    assert cpu_supports("not-a-feature") is None


def test_manifest_lists_what_the_flags_enable_and_this_cpu_has_it(tmp_path):
    cm = _compile(tmp_path)
    got = cm.manifest["requires"]["cpu_features"]
    assert got == list(cpu_features("c++", ("-march=native",)))
    assert all(cpu_supports(f) for f in got), got  # native: this CPU runs its own build
    assert "cpu" not in cm.manifest  # stated once, under requires
    portable = _compile(tmp_path, march="")
    assert portable.manifest["requires"]["cpu_features"] == []
    x = torch.randn(8)
    path = portable.save(tmp_path / "p.kiln")
    torch.testing.assert_close(kiln.load(path)(x), torch.relu(x) * 2)


def test_a_cpu_without_a_feature_refuses_the_package_by_name(tmp_path, run_model_exe):
    """From Python and from C (examples/c/run_model.c): a clear error, exit status 1."""
    missing = [f for f in CPU_FEATURES.values() if cpu_supports(f) is False]
    if not missing:
        pytest.skip("this CPU has every feature kiln knows")
    cm = _compile(tmp_path)
    cm.manifest["requires"]["cpu_features"] += missing[:2]
    path = cm.save(tmp_path / "m.kiln")
    with pytest.raises(KilnError) as e:
        kiln.load(path)
    msg = str(e.value)
    assert all(f in msg for f in missing[:2]) and "lacks" in msg and "march" in msg, msg
    write_tensor_bin(str(tmp_path / "in0.bin"), torch.randn(8))
    proc = subprocess.run([str(run_model_exe), "-o", str(tmp_path / "out"), str(path),
                           str(tmp_path / "in0.bin")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert all(f in proc.stderr for f in missing[:2]) and "lacks" in proc.stderr, proc.stderr


def test_unknown_features_are_refused_by_name(tmp_path):
    cm = _compile(tmp_path)
    cm.manifest["requires"]["cpu_features"] = ["avx2-from-the-future"]
    path = cm.save(tmp_path / "m.kiln")
    with pytest.raises(KilnError, match="avx2-from-the-future"):
        kiln.load(path)


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (Debian)")
def test_emulated_older_cpu_gets_an_error_not_an_illegal_instruction(tmp_path, run_model_exe):
    """Under `qemu-x86_64 -cpu Haswell` (AVX2, no AVX-512): from C, a package built for this
    machine fails to load naming what Haswell lacks (where this machine has AVX-512), and one
    built for x86-64-v3 runs and matches eager."""
    x = torch.randn(64)
    write_tensor_bin(str(tmp_path / "in0.bin"), x)

    def run(march: str) -> subprocess.CompletedProcess:
        path = kiln.compile(lambda x: torch.relu(x) * 2 + 1, (x,),
                            options=kiln.Options(march=march)).save(tmp_path / f"{march}.kiln")
        return subprocess.run(["qemu-x86_64", "-cpu", "Haswell", str(run_model_exe), "-o",
                               str(tmp_path / "out"), str(path), str(tmp_path / "in0.bin")],
                              capture_output=True, text=True, timeout=300)

    if cpu_supports("avx512f"):
        proc = run("native")
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
        assert "lacks: " in proc.stderr and "avx512f" in proc.stderr, proc.stderr[-2000:]
    proc = run("x86-64-v3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch.testing.assert_close(read_tensor_bin(str(tmp_path / "out0.bin")), torch.relu(x) * 2 + 1)
