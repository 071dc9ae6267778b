"""aten._scaled_dot_product_flash_attention_for_cpu (AOTAutograd's training graphs carry it):
kiln builds the attention and its logsumexp [B, H, L] itself, because torch's decomposition of
the op returns the attention weights where the logsumexp belongs. Checked against eager."""

import pytest
import torch

import kiln

OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class Flash(torch.nn.Module):
    def __init__(self, causal=False, scale=None):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q, k, v, mask=None):
        return OP(q, k, v, 0.0, self.causal, attn_mask=mask, scale=self.scale)


@pytest.mark.parametrize("shape,causal,scale,masked", [
    ((2, 3, 5, 8), False, None, None),
    ((1, 2, 7, 16), True, None, None),
    ((2, 2, 4, 8), False, 0.3, "float"),
    ((1, 2, 6, 8), False, None, "empty_row"),
])
def test_flash_for_cpu_output_and_logsumexp(tmp_path, shape, causal, scale, masked):
    b, h, lq, e = shape
    g = torch.Generator().manual_seed(lq)
    q, k, v = (torch.randn(b, h, lq, e, generator=g) * 2 for _ in range(3))
    args = [q, k, v]
    if masked == "float":
        args.append(torch.randn(b, h, lq, lq, generator=g))
    elif masked == "empty_row":
        m = torch.zeros(1, 1, lq, lq)
        m[..., 2, :] = float("-inf")  # query row 2 sees no key
        args.append(m)
    model = Flash(causal, scale)
    runner = kiln.load(kiln.compile(torch.export.export(model, tuple(args))).save(
        tmp_path / "flash.kiln"))
    fresh = [a.clone() for a in args]
    fresh[0] = torch.randn(b, h, lq, e, generator=g)
    out, lse = runner(*fresh)
    ref_out, ref_lse = model(*fresh)
    assert lse.shape == ref_lse.shape == (b, h, lq)
    assert lse.dtype == ref_lse.dtype
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-5)
