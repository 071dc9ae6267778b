"""CUTLASS GEMM candidates (kiln/gemm/cutlass.py): enumeration from cutlass_library for a
problem, filtering by dtype / layout / alignment and by the Options (regexes, size threshold,
count), rendering with the `extern "C"` entries, and (slow) nvcc compiling two configs."""

from __future__ import annotations

import shutil

import pytest

from kiln.gemm.problem import GemmProblem
from kiln.errors import UnsupportedError
from kiln.options import Options

cutlass = pytest.importorskip("kiln.gemm.cutlass")
if not cutlass.available():
    pytest.skip("nvidia-cutlass is not installed", allow_module_level=True)

P = GemmProblem("float16", (), 512, 256, 1024, "n", "t", 16)


def test_enumerates_hopper_schedules_for_the_problem():
    cands = cutlass.enumerate_candidates(P, Options())
    assert cands
    assert {c.schedule for c in cands} == {"cooperative", "ping-pong", "stream-K"}
    for c in cands:
        op = c.op
        assert c.name.startswith("cutlass3x_sm90_tensorop_gemm_f16_f16_f32_")
        # kiln (A n, B t) -> CUTLASS (A = kiln B: t, B = kiln A: n, D: n)
        assert "_tnn_" in c.name
        assert max(op.A.alignment, op.B.alignment) <= 16
    bf = cutlass.enumerate_candidates(GemmProblem("bfloat16", (), 64, 64, 64, "n", "n", 8),
                                      Options())
    assert bf and all("bf16" in c.name and "_nnn_" in c.name and "align8" in c.name
                      for c in bf)
    with_c = cutlass.enumerate_candidates(P, Options(), with_c=True)
    assert with_c and all("_void_" not in c.name for c in with_c)
    assert "float(1)" in cutlass.render(with_c[0])


def test_alignment_filters():
    low = cutlass.enumerate_candidates(GemmProblem("float16", (), 64, 64, 66, "n", "n", 2),
                                       Options())
    assert low and all(c.op.A.alignment <= 2 and c.op.B.alignment <= 2 for c in low)
    assert all(c.schedule.startswith("cp.async") for c in low)
    # D needs 8-element rows even in the low-alignment kernels
    assert not cutlass.enumerate_candidates(
        GemmProblem("float16", (), 64, 66, 64, "n", "n", 2, alignment_out=2), Options())
    assert not cutlass.enumerate_candidates(
        GemmProblem("float16", (), 63, 63, 63, "n", "n", 1), Options())


def test_option_filters():
    allc = cutlass.enumerate_candidates(P, Options())
    deny = cutlass.enumerate_candidates(P, Options(cutlass_op_denylist_regex="pingpong"))
    assert deny and len(deny) < len(allc) and not any("pingpong" in c.name for c in deny)
    allow = cutlass.enumerate_candidates(P, Options(cutlass_op_allowlist_regex="stream_k"))
    assert allow and all(c.schedule == "stream-K" for c in allow)
    assert len(cutlass.enumerate_candidates(P, Options(cutlass_max_profiling_configs=3))) == 3
    assert cutlass.enumerate_candidates(P, Options(cutlass_min_gemm_size=512 * 256 * 1024))
    assert not cutlass.enumerate_candidates(P, Options(cutlass_min_gemm_size=512 * 256 * 1024
                                                       + 1))
    dyn = GemmProblem("float16", (), (1, 4096), 256, 1024, "n", "t", 16)
    assert cutlass.enumerate_candidates(dyn, Options(cutlass_min_gemm_size=4096 * 256 * 1024))


def test_unsupported_dtype():
    with pytest.raises(UnsupportedError, match="float32"):
        cutlass.enumerate_candidates(GemmProblem("float32", (), 8, 8, 8, "n", "n", 8), Options())


def test_render_has_c_entries():
    c = cutlass.enumerate_candidates(P, Options(cutlass_op_allowlist_regex="void.*cooperative"))[0]
    src = cutlass.render(c)
    assert f"struct {c.name} :" in src
    assert 'extern "C" int kiln_cutlass_run(' in src
    assert 'extern "C" size_t kiln_cutlass_workspace(' in src
    assert "KernelTmaWarpSpecializedCooperative" in src
    assert "float(0)" in src  # no C operand: beta = 0


@pytest.mark.slow  # two CUTLASS kernels through nvcc: minutes on the 2-core CI machine
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_two_configs_compile_with_nvcc(tmp_path):
    cands = cutlass.enumerate_candidates(P, Options())
    pick = [next(c for c in cands if c.schedule == "ping-pong"),
            next(c for c in cands if c.schedule == "stream-K")]
    srcs = {f"k{i}": cutlass.render(c) for i, c in enumerate(pick)}
    srcs["broken"] = srcs["k0"].replace("using Gemm =", "using Gemm = not_a_type;")
    out = cutlass.compile_all(srcs, tmp_path)
    for k in ("k0", "k1"):
        assert not isinstance(out[k], str), out[k]
        assert out[k].stat().st_size > 0
        syms = __import__("subprocess").run(["nm", str(out[k])], capture_output=True,
                                            text=True).stdout
        assert "kiln_cutlass_run" in syms and "kiln_cutlass_workspace" in syms
    assert isinstance(out["broken"], str) and "nvcc failed" in out["broken"]
