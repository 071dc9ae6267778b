"""complex32 (torch.chalf) and the float8 `fnuz` variants (issue 16 class 5).

complex32 is a storage type like complex64 (two float16 per element, torch's layout): kiln moves
and copies it, ATen computes on it as eager does (the fallback calls eager's own kernels);
addition, which kiln rewrites for complex values as a sum over a stacked pair, runs in
complex64 (eager's math type for complex32) and is rounded once, as eager rounds it.
A complex32 weight is refused (safetensors cannot store it), naming the weight.

float8_e8m0fnu is refused with an error naming the dtype and what to do (eager on the CPU only
converts it and multiplies it); the fnuz variants are storage types
(tests/ops/test_float8_fnuz.py)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import kiln
from difftest import Fn


def _c32(*shape):
    return torch.randn(*shape, dtype=torch.complex64).to(torch.complex32)


def _exact(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        # eager has no == for complex32: compare the float16 pairs bit for bit
        view = (lambda t: torch.view_as_real(t).view(torch.int16)) if w.is_complex() else \
            (lambda t: t)
        assert torch.equal(view(g.contiguous()), view(w.contiguous()))


def chalf_program(x, y):
    z = x * y + x  # mul by ATen, add in complex64 rounded once
    w = (x.to(torch.complex64) * 2).to(torch.complex32)  # widened and narrowed by the model
    r = torch.view_as_real(x).float().sum(-1)  # float16 parts read as reals
    c = torch.view_as_complex(torch.stack([y.real, -y.imag], -1).contiguous())
    return z, w, r, torch.cat([x.t(), c.t()], 1), x - 1


def test_complex32_matches_eager_bit_for_bit(tmp_path):
    ep = torch.export.export(Fn(chalf_program), (_c32(4, 3), _c32(4, 3)),
                             dynamic_shapes=(({0: Dim("n", min=1, max=32)},
                                              {0: Dim("n", min=1, max=32)}),))
    kiln.compile(ep, options=kiln.Options(num_threads=1)).save(tmp_path / "m.kiln")
    runner = kiln.load(tmp_path / "m.kiln")
    for n in (4, 1, 17):
        x, y = _c32(n, 3), _c32(n, 3)
        _exact(runner(x, y), chalf_program(x, y))


class ChalfWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", _c32(4, 3))

    def forward(self, x):
        return x * self.w


def test_complex32_weight_is_refused_clearly():
    ep = torch.export.export(ChalfWeight(), (_c32(4, 3),))
    with pytest.raises(kiln.errors.UnsupportedError, match=r"weight w is complex32.*safetensors"):
        kiln.compile(ep)


def test_e8m0fnu_is_refused_naming_the_dtype():
    dt = torch.float8_e8m0fnu
    ep = torch.export.export(Fn(lambda x: x.float() * 2), (torch.rand(4, 3).to(dt),))
    with pytest.raises(kiln.errors.UnsupportedError,
                       match=r"dtype float8_e8m0fnu is not supported \(eager on the CPU computes "
                             r"little on it.*float8_e4m3fn, float8_e5m2 and their fnuz"):
        kiln.compile(ep)
