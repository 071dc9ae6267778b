"""GPU runs of the GEMM templates (kiln/autotune): the Triton template under every epilogue
and dtype against eager, for square, skinny, odd and transposed operands, and (when prebuilt
shared libraries are given in $KILN_CUTLASS_SO_DIR) CUTLASS kernels against torch.mm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from bench.gemm_gpu import Cutlass, _kernel, triton_call  # noqa: E402
from kiln.autotune import triton_gemm as T  # noqa: E402

ACTS = {"none": lambda x: x, "relu": torch.relu, "relu6": lambda x: torch.clamp(x, 0, 6),
        "gelu": torch.nn.functional.gelu}


@pytest.fixture(scope="module")
def kern(tmp_path_factory):
    return _kernel(tmp_path_factory.mktemp("tri"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 256, 256), (7, 300, 65), (1, 64, 1024),
                                   (513, 17, 129)])
@pytest.mark.parametrize("act,bias,res", [("none", False, False), ("relu", True, False),
                                          ("relu6", True, True), ("gelu", True, True)])
def test_triton_template_epilogues(kern, dtype, shape, act, bias, res):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=dtype, generator=g).t()  # a Linear weight
    bv = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    r = torch.randn(m, n, device="cuda", dtype=dtype, generator=g) if res else None
    want = a.double() @ b.double()
    if bias:
        want = want + bv.double()
    want = ACTS[act](want)
    if res:
        want = want + 0.5 * r.double()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in T.config_space(m, n, k)[:2]:
        c = torch.empty(m, n, device="cuda", dtype=dtype)
        triton_call(kern, a, b, c, cfg, bv, act, r, 0.5, sms)
        tol = 2e-2 if dtype == torch.float16 else 6e-2
        torch.testing.assert_close(c.double(), want.to(dtype).double(), rtol=tol,
                                   atol=tol * k ** 0.5, msg=f"{cfg.name}")


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
