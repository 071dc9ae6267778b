"""The Triton GEMM template (kiln/gemm/triton_gemm.py): its config space and ahead-of-time
compilation to cubin for sm_90 (no GPU needed). GPU runs are in bench/gemm_gpu.py."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
from kiln.gemm import triton_gemm as T  # noqa: E402


def test_config_space_fits_the_problem():
    big = T.config_space(4096, 4096, 4096)
    assert len(big) == 9 and len({c.name for c in big}) == 9
    skinny = T.config_space(16, 4096, 4096)
    assert skinny and all(c.block_m <= 16 for c in skinny)
    assert all(c.block_n <= 64 for c in T.config_space(512, 40, 512))


def test_signature_and_constexprs():
    sig = T.signature("bfloat16")
    assert sig["a_ptr"] == "*bf16" and sig["c_ptr"] == "*bf16" and sig["res_scale"] == "fp32"
    cx = T.constexprs(T.config_space(64, 64, 64)[0], bias=True, act="gelu", residual=True)
    assert cx["HAS_BIAS"] == 1 and cx["ACT"] == T.ACTIVATIONS["gelu"] and cx["HAS_RES"] == 1
    assert all(sig[k] == "constexpr" for k in cx)


def test_template_compiles_to_cubin(tmp_path):
    cfg = T.TritonConfig(64, 64, 32, 8, 3, 4)
    k = T.compile_cubin(cfg, "float16", cache=tmp_path)
    cubin = bytes(k.asm["cubin"])
    assert cubin[:4] == b"\x7fELF" and k.metadata.num_warps == 4
    assert "tl.dot" in T.SOURCE or "dot" in k.asm["ttir"]


@pytest.mark.slow  # three more Triton compiles (about 25 s each on the CI machine)
@pytest.mark.parametrize("dtype,act", [("float16", "gelu"), ("bfloat16", "relu6"),
                                       ("float16", "relu")])
def test_epilogue_variants_compile(tmp_path, dtype, act):
    cfg = T.config_space(512, 512, 512)[1]
    k = T.compile_cubin(cfg, dtype, bias=True, act=act, residual=True, cache=tmp_path)
    assert bytes(k.asm["cubin"])[:4] == b"\x7fELF"
    ttir = k.asm["ttir"]
    assert ("erf" in ttir) == (act == "gelu")
