"""Attention rows whose every key is masked (issue 16, class 3: a wrong answer before).

Eager's semantics, per op:
- `scaled_dot_product_attention` gives 0 for such a row on every CPU path (math:
  aten._safe_softmax; the CPU flash kernel) with a bool mask, a float mask of -inf, or both;
  kiln's decomposition (frontend/aten_high.py `_safe_softmax`) and the CUDA fused kernel
  (targets/cuda/attention.py) give 0 too, a NaN score still NaN;
- a plain `softmax` over all -inf gives NaN (nn.MultiheadAttention with need_weights=True
  exports that), and kiln keeps the NaN;
- `aten._native_multi_head_attention` (the eager fast path of nn.MultiheadAttention and
  nn.TransformerEncoderLayer in inference) gives NaN; a program calling it gets it through the
  ATen fallback, so the same NaN.
`torch.export` never records the fast path: an exported TransformerEncoderLayer calls
scaled_dot_product_attention, so its all-padding rows are finite in `ep.module()` and in kiln,
while the eager module (fast path) gives NaN; kiln matches the program it is given.

Checked against eager on fresh inputs at several shapes and dtypes on the CPU, and the CUDA
package's Triton kernels (fused and decomposed) in Triton's interpreter."""

from __future__ import annotations

import copy
import pathlib
import textwrap

import pytest
import torch
import torch.nn.functional as F

import kiln
from difftest import run_interpreted


class Sdpa(torch.nn.Module):
    def __init__(self, kind: str, scale: float | None = None) -> None:
        super().__init__()
        self.kind, self.scale = kind, scale

    def forward(self, q, k, v, m):
        if self.kind == "float":  # the same mask as 0 / -inf, added
            m = torch.zeros(m.shape, dtype=q.dtype).masked_fill(~m, float("-inf"))
        elif self.kind == "finfo":  # HF's masks: the dtype's lowest finite value, added
            m = torch.zeros(m.shape, dtype=q.dtype).masked_fill(~m, torch.finfo(q.dtype).min)
        elif self.kind == "both":  # a float mask with some -inf, then rows emptied by a bool
            m = torch.where(m, torch.randn_like(m, dtype=q.dtype) * 0 + 0.5, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=self.scale)


def _inputs(b, h, lq, s, e, dt, mask_shape, seed, empty_rows=(1,)):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, e, generator=g).to(dt) for n in (lq, s, s))
    m = torch.rand(*mask_shape, generator=g) > 0.4
    for r in empty_rows:
        m[..., r, :] = False
    return q, k, v, m


def _check(got, want, want64, dt):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dt]
    torch.testing.assert_close(got.double(), want64.double(), rtol=tol, atol=tol,
                               equal_nan=True)


@pytest.mark.parametrize("kind", ["bool", "float", "both"])
@pytest.mark.parametrize("dt", [torch.float32, torch.float64, torch.bfloat16])
def test_sdpa_fully_masked_rows_are_zero(kind, dt, tmp_path):
    model = Sdpa(kind, scale=0.7 if kind == "both" else None)
    lq_dim = torch.export.Dim("L", min=3, max=32)
    args = _inputs(2, 2, 5, 4, 8, dt, (2, 1, 5, 4), 0)
    c = kiln.compile(model, args, dynamic_shapes=({2: lq_dim}, None, None, {2: lq_dim}))
    runner = kiln.load(c.save(tmp_path / "sdpa.kiln"))
    for seed, lq, empty in ((1, 5, (1,)), (2, 9, (0, 8)), (3, 17, (4, 5, 6))):
        q, k, v, m = _inputs(2, 2, lq, 4, 8, dt, (2, 1, lq, 4), seed, empty)
        got = runner(q, k, v, m)
        want = model(q, k, v, m)
        want64 = model(*(t.double() if t.is_floating_point() else t for t in (q, k, v)), m)
        assert torch.equal(want[:, :, list(empty)], torch.zeros_like(want[:, :, list(empty)]))
        _check(got, want, want64, dt)
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_sdpa_rows_masked_by_finfo_min_average_the_values(dt, tmp_path):
    """A row masked by finfo.min (finite) is uniform over its keys in eager: the mean of V,
    not an empty row (the fused CUDA kernels scale the mask by log2(e), which overflowed
    finfo.min to -inf: checked in the interpreter test below)."""
    model = Sdpa("finfo")
    args = _inputs(2, 2, 5, 4, 8, dt, (2, 1, 5, 4), 0)
    runner = kiln.load(kiln.compile(model, args).save(tmp_path / "f.kiln"))
    q, k, v, m = _inputs(2, 2, 5, 4, 8, dt, (2, 1, 5, 4), 1, (0, 3))
    got, want = runner(q, k, v, m), model(q, k, v, m)
    mean_v = v.double().mean(2)
    torch.testing.assert_close(want[:, :, 3].double(), mean_v, rtol=2e-2, atol=2e-2)
    _check(got, want, model(q.double(), k.double(), v.double(), m), dt)


def test_nan_scores_stay_nan(tmp_path):
    model = Sdpa("bool")
    q, k, v, m = _inputs(1, 2, 4, 3, 8, torch.float32, (4, 3), 0)
    runner = kiln.load(kiln.compile(model, (q, k, v, m)).save(tmp_path / "n.kiln"))
    q[0, 1, 2, 3] = float("nan")
    got, want = runner(q, k, v, m), model(q, k, v, m)
    assert torch.isnan(want[0, 1, 2]).all() and torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got, want, equal_nan=True)


def test_softmax_of_all_minus_inf_is_nan_like_eager(tmp_path):
    """nn.MultiheadAttention with need_weights (the default) exports a plain softmax."""
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    pad = torch.tensor([[False, False, True], [True, True, True]])
    with torch.no_grad():
        ep = torch.export.export(mha, (x, x, x), {"key_padding_mask": pad})
        runner = kiln.load(kiln.compile(ep).save(tmp_path / "mha.kiln"))
        for _ in range(3):
            x = torch.randn(2, 3, 8)
            pad = torch.rand(2, 3) > 0.5
            pad[1] = True
            got, want = runner(x, x, x, key_padding_mask=pad), mha(x, x, x,
                                                                     key_padding_mask=pad)
            for g, w in zip(got, want):
                assert torch.isnan(w[1]).all()
                torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-5)


def test_native_multi_head_attention_keeps_eager_nan(tmp_path):
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()

    class Native(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x, pad):
            m = self.mha
            return torch._native_multi_head_attention(
                x, x, x, 8, 2, m.in_proj_weight, m.in_proj_bias, m.out_proj.weight,
                m.out_proj.bias, pad, False, False, 1)[0]

    x, pad = torch.randn(2, 3, 8), torch.tensor([[False, False, True], [True, True, True]])
    with torch.no_grad():
        ep = torch.export.export(Native(), (x, pad))
        c = kiln.compile(ep, options=kiln.Options(aten_fallback=True))
        runner = kiln.load(c.save(tmp_path / "native.kiln"))
        x = torch.randn(2, 3, 8)
        got, want = runner(x, pad), Native()(x, pad)
    assert torch.isnan(want[1]).all() and torch.isfinite(want[0]).all()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_transformer_encoder_layer_all_padding_matches_its_program(tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    pad = torch.tensor([[False, False, True], [True, True, True]])
    with torch.no_grad():
        ep = torch.export.export(layer, (x,), {"src_key_padding_mask": pad})
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert "aten.scaled_dot_product_attention.default" in ops
        runner = kiln.load(kiln.compile(ep).save(tmp_path / "enc.kiln"))
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(2, 3, 8, generator=g)
            got = runner(x, src_key_padding_mask=pad)
            want = ep.module()(x, src_key_padding_mask=pad)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.isfinite(got).all()
            # the eager module takes its fast path (_transformer_encoder_layer_fwd): NaN there
            assert torch.isnan(layer(x, src_key_padding_mask=pad)[1]).all()


_INTERP = textwrap.dedent("""
    import sys, torch, kiln
    sys.path.insert(0, sys.argv[1])
    from test_masked_attention import Sdpa, _inputs
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels
    bad = []
    for fused, kind, lq in ((True, "bool", 5), (True, "float", 5), (True, "finfo", 5),
                            (True, "finfo", 20), (False, "bool", 5), (False, "float", 5),
                            (False, "finfo", 5)):
        model = Sdpa(kind)
        args = _inputs(2, 2, lq, 4, 16, torch.float32, (2, 1, lq, 4), 0, (1, 3))
        opts = kiln.Options(cuda_archs=(90,), fused_attention=fused)
        b = kiln.compile(torch.export.export(model, args), device="cuda",
                         options=opts).built
        kinds = {s.routine for s in b.steps if hasattr(s, "routine")}
        assert ("attention" in kinds) == fused, kinds
        mod = import_triton_module(b.sources["kernels_triton.py"])
        hints = {s.name: s.example for s in b.graph.symbols}
        bufs = {x.name: x for x in b.loop.buffers}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
        args = _inputs(2, 2, lq, 4, 16, torch.float32, (2, 1, lq, 4), 7, (1, 3))
        out = run_program(b.program, ks, mod, b.weights, list(args))[0]
        want = model(*args)
        out = out.reshape(want.shape)
        if not torch.allclose(out, want, rtol=1e-4, atol=1e-4, equal_nan=True) or \\
                not torch.isfinite(out).all():
            bad.append(f"fused={fused} {kind}: {out[0, 0, 1]} vs {want[0, 0, 1]}")
        print(fused, kind, "checked", flush=True)
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


@pytest.mark.slow
def test_cuda_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    for fused, kind, lq in ((True, "bool", 5), (True, "float", 5), (True, "finfo", 5),
                            (True, "finfo", 20), (False, "bool", 5), (False, "float", 5),
                            (False, "finfo", 5)):  # cubins built here: the child runs them
        args = _inputs(2, 2, lq, 4, 16, torch.float32, (2, 1, lq, 4), 0, (1, 3))
        kiln.compile(torch.export.export(Sdpa(kind), args), device="cuda",
                     options=kiln.Options(cuda_archs=(90,), fused_attention=fused))
    run_interpreted(_INTERP, str(pathlib.Path(__file__).parent))


__all__ = ["Sdpa", "_inputs", "copy"]
