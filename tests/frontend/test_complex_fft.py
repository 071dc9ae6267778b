"""complex64 / complex128 values and torch.fft ops (issue 16, class 5) through kiln's ATen
fallback (kiln stores and moves complex values, ATen computes), against eager."""

from __future__ import annotations

import torch

from difftest import Fn

import kiln


def _check(tmp_path, fn, make):
    kiln.compile(torch.export.export(Fn(fn), make())).save(tmp_path / "m.kiln")
    runner = kiln.load(tmp_path / "m.kiln")
    for _ in range(2):
        args = make()
        got, ref = runner(*args), fn(*args)
        for g, r in zip(got, ref, strict=True):
            assert g.dtype == r.dtype and g.shape == r.shape
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def ffts(x):
    f = torch.fft.fft(x)
    return (torch.fft.ifft(f * 2).real, torch.fft.fft2(x).abs(), torch.fft.rfft(x, dim=0).angle(),
            torch.fft.irfft(torch.fft.rfft(x), n=x.shape[-1]), torch.fft.fftshift(f))


def test_fft_family(tmp_path):
    _check(tmp_path, ffts, lambda: (torch.randn(6, 8),))


def complex128(z, w):
    # `z * w + 1`: a Python number added to complex values (scalar_ops' rewrite)
    return z * w + 1, (z @ w).conj() - 2j, torch.view_as_real(z).sum(-1), \
        torch.fft.fft(z, dim=0), z.abs()


def test_complex128_with_python_numbers(tmp_path):
    c = torch.complex128
    _check(tmp_path, complex128, lambda: (torch.randn(3, 3, dtype=c), torch.randn(3, 3, dtype=c)))
