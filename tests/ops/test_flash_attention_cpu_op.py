"""aten._scaled_dot_product_flash_attention_for_cpu (AOTAutograd's training graphs carry it):
kiln builds the attention and its logsumexp [B, H, L] itself, because torch's decomposition of
the op returns the attention weights where the logsumexp belongs. Checked against eager."""

import torch

import kiln

OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class Flash(torch.nn.Module):
    def __init__(self, causal=False, scale=None):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q, k, v, mask=None):
        return OP(q, k, v, 0.0, self.causal, attn_mask=mask, scale=self.scale)


CASES = [  # shape, causal, scale, mask
    ((2, 3, 5, 8), False, None, None),
    ((1, 2, 7, 16), True, None, None),
    ((2, 2, 4, 8), False, 0.3, "float"),
    ((1, 2, 6, 8), False, None, "empty_row"),
]


class AllCases(torch.nn.Module):
    """Every case of CASES in one program (one package; each case keeps its own static shapes
    and its own attention kernels): case i reads its q, k, v [, mask]."""

    def __init__(self):
        super().__init__()
        self.cases = torch.nn.ModuleList(Flash(causal, scale) for _, causal, scale, _ in CASES)
        self.arity = [3 + (masked is not None) for *_, masked in CASES]

    def forward(self, *args):
        out, i = [], 0
        for m, n in zip(self.cases, self.arity):
            out.append(m(*args[i:i + n]))
            i += n
        return out


def _case_args(shape, masked):
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
    fresh = [a.clone() for a in args]
    fresh[0] = torch.randn(b, h, lq, e, generator=g)
    return args, fresh


def test_flash_for_cpu_output_and_logsumexp(tmp_path):
    """Each case of CASES (plain, causal, a scale with a float mask, a mask that hides every
    key of a row): output and logsumexp [B, H, L] like eager's, at inputs other than the
    example's."""
    args, fresh = [], []
    for shape, _, _, masked in CASES:
        a, f = _case_args(shape, masked)
        args += a
        fresh += f
    model = AllCases()
    runner = kiln.load(kiln.compile(torch.export.export(model, tuple(args))).save(
        tmp_path / "flash.kiln"))
    got, want = runner(*fresh), model(*fresh)
    for (shape, *_), (out, lse), (ref_out, ref_lse) in zip(CASES, got, want, strict=True):
        b, h, lq, e = shape
        assert lse.shape == ref_lse.shape == (b, h, lq), shape
        assert lse.dtype == ref_lse.dtype, shape
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, s=shape: f"{s}: {m}")
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, s=shape: f"{s}: {m}")
