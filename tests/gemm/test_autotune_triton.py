"""The Triton GEMM template: its config space (kiln/gemm/triton_gemm.py) and, for one config,
the kernel a package prints (kiln/targets/cuda/gemm_template.py) compiled ahead of time to
cubin for sm_90 (no GPU needed). GPU runs are in bench/gemm_gpu.py."""

from __future__ import annotations

import pytest
import sympy

pytest.importorskip("triton")
from kiln.gemm import triton_gemm as T  # noqa: E402
from kiln.gemm.printed import gemm_buffers  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.ir.dtypes import dtype as kdtype  # noqa: E402
from kiln.schedule.steps import GemmKernel  # noqa: E402
from kiln.targets.cuda.gemm_template import print_gemm_kernel  # noqa: E402
from kiln.targets.cuda.kernel import print_triton_module  # noqa: E402
from kiln.targets.cuda.ops import PRELUDE  # noqa: E402
from kiln.toolchain.triton_aot import compile_cubins  # noqa: E402


def test_config_space_fits_the_problem():
    big = T.config_space(4096, 4096, 4096)
    assert len(big) == 9 and len({c.name for c in big}) == 9
    skinny = T.config_space(16, 4096, 4096)
    assert skinny and all(c.block_m <= 16 for c in skinny)
    assert all(c.block_n <= 64 for c in T.config_space(512, 40, 512))


def test_template_compiles_to_cubin(tmp_path):
    i = sympy.Integer  # c[64, 96] = a[64, 80] @ b[96, 80].T (a Linear weight)
    g = L.Gemm("c", kdtype("float16"), (), i(64), i(96), i(80),
               L.Operand("a", i(0), (), i(80), i(1)), L.Operand("b", i(0), (), i(1), i(80)))
    cfg = T.TritonConfig(64, 64, 32, 8, 3, 4)
    k = print_gemm_kernel(GemmKernel(g, None, cfg), gemm_buffers(g, {}))
    assert dict(k.constexprs) == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}
    assert k.config.num_warps == 4 and k.num_stages == 3
    cubins, _ = compile_cubins(print_triton_module([k]), [k], (90,), tmp_path, prelude=PRELUDE)
    assert cubins[(k.name, 90)].cubin[:4] == b"\x7fELF"


def test_config_space_fits_shared_memory():
    """float32 tiles are twice bfloat16's: a config keeps fewer pipeline stages (down to 2)
    or is dropped, so that every config's tiles fit a block's shared memory (the heuristic's
    first float32 config used to need 262,144 bytes and failed the sm_90 compile)."""
    for item, limit in ((2, T.SM90_SHARED), (4, T.SM90_SHARED), (4, 101376), (2, 101376)):
        space = T.config_space(4096, 4096, 4096, itemsize=item, shared_limit=limit)
        assert space and all(T.pipeline_bytes(c, item) <= limit for c in space)
        assert all(c.num_stages >= 2 for c in space)
    # bfloat16 on sm_90: every config as listed (nothing to shrink)
    assert T.config_space(4096, 4096, 4096) == T.config_space(4096, 4096, 4096, itemsize=2)
    f32 = T.config_space(4096, 4096, 4096, itemsize=4)
    assert f32[0].num_stages == 2 and (f32[0].block_m, f32[0].block_n) == (128, 256)


def test_float32_triton_gemm_builds_for_sm90(tmp_path):
    """A float32 Linear with the Triton template only (no profiling: the heuristic's first
    config) compiles for sm_90 and its kernel fits the block's shared memory."""
    import torch
    import kiln
    from kiln.options import Options

    class Lin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(256, 512)

        def forward(self, x):
            return self.fc(x)

    ep = torch.export.export(Lin(), (torch.randn(256, 256),))
    cm = kiln.compile(ep, device="cuda", options=Options(
        cuda_archs=(90,), autotune=False, gemm_backends=("triton",), cache_dir=str(tmp_path)))
    assert any(k["name"].startswith("gemm_") for k in cm.manifest["kernels"])
