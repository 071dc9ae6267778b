"""GPU runs of the GEMM backends (kiln/gemm): (when prebuilt shared libraries are given in
$KILN_CUTLASS_SO_DIR) CUTLASS kernels against torch.mm; and CUDA packages that link the chosen
backend (Triton template with its epilogue absorbed, CUTLASS objects, cuBLAS) under each
backend alone and all together, for addmm + bias / relu / gelu + residual + cast over a
dynamic M, bmm in fp16 / bf16, fp32 through the template, and max_autotune choosing among all
three, against eager; CUTLASS alone with every epilogue kind fused as a visitor tree (fp16,
bf16), and max_autotune profiling the fused candidates."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from bench.gemm_gpu import Cutlass  # noqa: E402
from tests.gemm_models import FUSED, Bmm, Fused, Linear  # noqa: E402


@pytest.mark.skipif(not os.environ.get("KILN_CUTLASS_SO_DIR"), reason="no prebuilt CUTLASS")
@pytest.mark.parametrize("shape", [(256, 256, 256), (136, 264, 520), (1024, 8, 64)])
def test_cutlass_kernels(shape):
    m, n, k = shape
    libs = sorted(Path(os.environ["KILN_CUTLASS_SO_DIR"]).glob("*.so"))
    assert libs
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)
    want = (a.double() @ b.double())
    for lib in libs:
        c = torch.zeros(m, n, device="cuda", dtype=torch.float16)
        Cutlass(lib)(a, b, c)
        torch.cuda.synchronize()
        torch.testing.assert_close(c.double(), want.half().double(), rtol=2e-2,
                                   atol=2e-2 * k ** 0.5, msg=lib.name)


# -- packages that link the chosen backend (kiln/gemm/fuse.py, cutlass_link.py) ------

import kiln  # noqa: E402
from kiln.options import Options  # noqa: E402


BACKENDS = [("triton",), ("cutlass",), ("blas", "triton", "cutlass")]


def _check_pkg(tmp_path, ep, backends, calls, tol, **opts):
    cm = kiln.compile(ep, device="cuda", options=Options(gemm_backends=backends, **opts))
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    kinds = {k["kind"] for k in cm.manifest["kernels"] if k["kind"].endswith("gemm")}
    for args, want in calls:
        got = runner(*args)
        got = got if isinstance(got, (tuple, list)) else [got]
        want = want if isinstance(want, (tuple, list)) else [want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)
    return cm, kinds


@pytest.mark.slow
@pytest.mark.parametrize("backends", BACKENDS, ids="+".join)
@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
def test_package_linear_epilogues_dynamic_m(tmp_path, backends, act):
    torch.manual_seed(0)
    m = Linear(256, 128, act).half().cuda()
    x, r = torch.randn(64, 256).half().cuda(), torch.randn(64, 128).half().cuda()
    b = torch.export.Dim("b", min=1, max=1024)
    ep = torch.export.export(m, (x, r), dynamic_shapes={"x": {0: b}, "r": {0: b}})
    calls = []
    for rows in (1, 37, 64, 1000):
        xx, rr = torch.randn(rows, 256).half().cuda(), torch.randn(rows, 128).half().cuda()
        calls.append(((xx, rr), m(xx, rr)))
    cm, kinds = _check_pkg(tmp_path, ep, backends, calls, 2e-2)
    if backends == ("triton",):
        assert kinds == {"triton_gemm"}
        fused = [k for k in cm.manifest["kernels"] if k["kind"] == "triton_gemm"]
        assert any(len(k["members"]) == 2 for k in fused)  # an epilogue was absorbed
    if backends == ("cutlass",):
        assert kinds == {"cutlass_gemm"}


@pytest.mark.slow
@pytest.mark.parametrize("backends", BACKENDS, ids="+".join)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_package_bmm(tmp_path, backends, dtype):
    torch.manual_seed(1)
    a, b = torch.randn(3, 40, 72, dtype=dtype).cuda(), torch.randn(3, 72, 24, dtype=dtype).cuda()
    ep = torch.export.export(Bmm(), (a, b))
    _check_pkg(tmp_path, ep, backends, [((a, b), Bmm()(a, b))], 3e-2)


def test_package_triton_fp32_matches_eager(tmp_path):
    torch.manual_seed(2)
    m = Linear(96, 80, "relu").cuda()
    x, r = torch.randn(33, 96).cuda(), torch.randn(33, 80).cuda()
    ep = torch.export.export(m, (x, r))
    _, kinds = _check_pkg(tmp_path, ep, ("triton",), [((x, r), m(x, r))], 1e-4)
    assert kinds == {"triton_gemm"}


def test_package_max_autotune_all_backends(tmp_path):
    torch.manual_seed(3)
    m = Linear(512, 512, "gelu").half().cuda()
    x, r = torch.randn(256, 512).half().cuda(), torch.randn(256, 512).half().cuda()
    ep = torch.export.export(m, (x, r))
    cm, _ = _check_pkg(tmp_path, ep, ("blas", "triton", "cutlass"), [((x, r), m(x, r))], 2e-2,
                       max_autotune=True, cutlass_max_profiling_configs=1,
                       )
    g = [k["gemm"] for k in cm.manifest["kernels"] if "gemm" in k]
    assert g and all(c["how"] == "profiled" for c in g)
    assert all(set(c["timings"]) >= {"blas", "triton"} for c in g)


# -- CUTLASS with the epilogue fused as a visitor tree (kiln/gemm/cutlass_evt.py) --------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_package_cutlass_fused_epilogues(tmp_path, dtype):
    """Every epilogue kind under gemm_backends=("cutlass",): each GEMM is one CUTLASS kernel
    with its epilogue fused (no kiln kernel left), over a dynamic M, against eager."""
    torch.manual_seed(4)
    m = Fused(256, 128).to(dtype).cuda()
    x, r = torch.randn(64, 256, dtype=dtype).cuda(), torch.randn(64, 128, dtype=dtype).cuda()
    b = torch.export.Dim("b", min=1, max=512)
    ep = torch.export.export(m, (x, r), dynamic_shapes={"x": {0: b}, "r": {0: b}})
    calls = []
    for rows in (1, 37, 64, 300):
        xx = torch.randn(rows, 256, dtype=dtype).cuda() * 2
        rr = torch.randn(rows, 128, dtype=dtype).cuda()
        calls.append(((xx, rr), m(xx, rr)))
    tol = 2e-2 if dtype == torch.float16 else 5e-2
    cm, kinds = _check_pkg(tmp_path, ep, ("cutlass",), calls, tol)
    gk = [k for k in cm.manifest["kernels"] if k["kind"] == "cutlass_gemm"]
    assert len(gk) == len(FUSED) and kinds == {"cutlass_gemm"}
    assert all(len(k["members"]) == 2 and k["epilogue"].startswith("evt ") for k in gk), gk
    assert not [k for k in cm.manifest["kernels"] if k["kind"] == "triton"]


def test_package_max_autotune_profiles_fused_cutlass(tmp_path):
    """max_autotune profiles the CUTLASS candidates with their epilogue (the child checks
    them against the tree's torch twin) next to cuBLAS and the template; the package runs
    whichever wins."""
    torch.manual_seed(5)
    m = Linear(512, 512, "gelu").half().cuda()
    x, r = torch.randn(256, 512).half().cuda(), torch.randn(256, 512).half().cuda()
    ep = torch.export.export(m, (x, r))
    cm, _ = _check_pkg(tmp_path, ep, ("blas", "triton", "cutlass"), [((x, r), m(x, r))], 2e-2,
                       max_autotune=True, cutlass_max_profiling_configs=2)
    g = [k["gemm"] for k in cm.manifest["kernels"] if "gemm" in k]
    fused = [c for c in g if c.get("epilogue", "").startswith("cutlass fuses evt")]
    assert fused and all(c["how"] == "profiled" for c in g)
    for c in fused:
        assert c["timings"].get("cutlass"), c  # the fused candidates ran and were right
        assert not [d for d in c["dropped"] if "wrong answer" in d[1]], c["dropped"]
        if c["backend"] == "cutlass":
            assert "evt" in c["config"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_package_max_autotune_profiles_template_with_epilogue(tmp_path, dtype):
    """max_autotune times the template's candidates as the package prints them, epilogue
    included (kiln/gemm/printed.py): every config is checked against the product followed
    by the epilogue and none is dropped; cuBLAS is charged the epilogue's own kernel; the
    problem names the epilogue; the package runs the winner."""
    torch.manual_seed(6)
    m = Linear(384, 256, "gelu").to(dtype).cuda()
    x, r = torch.randn(96, 384, dtype=dtype).cuda(), torch.randn(96, 256, dtype=dtype).cuda()
    a, b = torch.randn(4, 40, 72, dtype=dtype).cuda(), torch.randn(4, 72, 24, dtype=dtype).cuda()
    tol = 2e-2 if dtype == torch.float16 else 5e-2
    for mod, args in ((m, (x, r)), (Bmm(), (a, b))):
        ep = torch.export.export(mod, args)
        cm, _ = _check_pkg(tmp_path, ep, ("blas", "triton"), [(args, mod(*args))], tol,
                           max_autotune=True, cache_dir=str(tmp_path / "cache"))
        g = [k["gemm"] for k in cm.manifest["kernels"] if "gemm" in k]
        assert g and all(c["how"] == "profiled" for c in g), g
        for c in g:
            assert c["timings"].get("triton") and c["timings"].get("blas"), c
            assert not [d for d in c["dropped"] if d[0].startswith("triton")], c["dropped"]
        if mod is m:
            assert any("+pw:" in c["problem"] for c in g), g
