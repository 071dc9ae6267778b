"""The CUDA variants of scaled_dot_product_attention that a GPU export carries after
decomposition (`_scaled_dot_product_cudnn_attention` for bf16 / fp16 programs; also the flash
and memory-efficient ones): lowered like scaled_dot_product_attention. Exported here on the CPU
(their meta kernels), checked on the CPU target against a float64 reference of the math, with
the logsumexp where it is used; for CUDA they compile to kiln's fused attention kernel, and a
use of the other results (RNG state, sequence offsets) is refused by name."""

import pytest
import torch

import kiln
from kiln.errors import UnsupportedError

A = torch.ops.aten
OPS = {
    "cudnn": lambda q, k, v, bias, causal, scale, lse: A._scaled_dot_product_cudnn_attention(
        q, k, v, bias, lse, 0.0, causal, False, scale=scale),
    "efficient": lambda q, k, v, bias, causal, scale, lse:
        A._scaled_dot_product_efficient_attention(q, k, v, bias, lse, 0.0, causal, scale=scale),
    "flash": lambda q, k, v, bias, causal, scale, lse: A._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale),
}


class Op(torch.nn.Module):
    def __init__(self, kind, causal, scale, results=(0,)):
        super().__init__()
        self.kind, self.causal, self.scale, self.results = kind, causal, scale, results

    def forward(self, q, k, v, bias=None):
        out = OPS[self.kind](q, k, v, bias, self.causal, self.scale, 1 in self.results)
        return tuple(out[i] for i in self.results)


def _reference(q, k, v, bias, causal, scale):
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if bias is not None:
        s = s + bias.double()
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("kind", ["cudnn", "efficient", "flash"])
@pytest.mark.parametrize("dtype,causal,scale,biased", [
    (torch.float32, False, None, False),
    (torch.float32, True, 0.3, False),
    (torch.bfloat16, False, None, True),
])
def test_cuda_sdpa_variant_output_on_cpu(tmp_path, kind, dtype, causal, scale, biased):
    if kind == "flash" and biased:
        pytest.skip("the flash op takes no mask")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g).to(dtype) for _ in range(3))
    args = [q, k, v] + ([torch.randn(1, 1, 5, 5, generator=g).to(dtype)] if biased else [])
    model = Op(kind, causal, scale)
    runner = kiln.load(kiln.compile(torch.export.export(model, tuple(args))).save(
        tmp_path / "m.kiln"))
    fresh = [torch.randn(a.shape, generator=g).to(dtype) for a in args]
    (got,) = runner(*fresh)
    want, _ = _reference(*fresh[:3], fresh[3] if biased else None, causal, scale)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["cudnn", "flash"])
def test_cuda_sdpa_variant_logsumexp_on_cpu(tmp_path, kind):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    model = Op(kind, True, None, results=(0, 1))
    ep = torch.export.export(model, (q, k, v))
    runner = kiln.load(kiln.compile(ep).save(tmp_path / "m.kiln"))
    out, lse = runner(q, k, v)
    want, want_lse = _reference(q, k, v, None, True, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    node = next(n for n in ep.graph.nodes if "attention" in str(n.target))
    want_shape = tuple(node.meta["val"][1].shape)  # cudnn: [B, H, L, 1]; flash: [B, H, L]
    assert tuple(lse.shape) == want_shape
    torch.testing.assert_close(lse.double().reshape(want_lse.shape), want_lse, rtol=1e-5,
                               atol=1e-5)


def test_cuda_sdpa_variant_other_results_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(UnsupportedError, match="result 6 of .*cudnn.*attention \\(0\\) and its "
                       "logsumexp"):
        kiln.compile(torch.export.export(Op("cudnn", False, None, results=(0, 6)), (q, q, q)),
                     options=kiln.Options(aten_fallback=False))


def test_cudnn_sdpa_compiles_to_fused_attention_for_cuda():
    pytest.importorskip("triton")
    q = torch.randn(1, 4, 1, 32, dtype=torch.bfloat16)
    kv = torch.randn(1, 4, 16, 32, dtype=torch.bfloat16)
    bias = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    cm = kiln.compile(torch.export.export(Op("cudnn", False, 0.2), (q, kv, kv, bias)),
                      device="cuda", options=kiln.Options(cuda_archs=(90,)))
    src = cm.sources["kernels_triton.py"]
    assert "tl.dot(q, kt" in src  # kiln's flash-attention kernel, no decomposition
    assert cm.report["extern_calls"] == 1  # the fused attention call, no GEMM


def test_efficient_sdpa_padded_logsumexp_refused():
    """The memory-efficient op pads the logsumexp's query dim to a multiple of 32 (here
    [1, 2, 32] for 6 queries); kiln builds [B, H, L] only and says so."""
    q = torch.randn(1, 2, 6, 8)
    ep = torch.export.export(Op("efficient", True, None, results=(0, 1)), (q, q, q))
    with pytest.raises(UnsupportedError, match=r"logsumexp of .*efficient.* \(1, 2, 32\)"):
        kiln.compile(ep, options=kiln.Options(aten_fallback=False))
