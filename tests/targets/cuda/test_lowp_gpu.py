"""Low-precision GEMMs and 8-bit float storage on a GPU (skipped without CUDA): kiln's CUDA
packages against eager CUDA. `torch._scaled_mm` (e4m3 x e4m3 -> bf16 / fp32, with and without
bias, e5m2 x e4m3, row-wise scales, a row-major mat2 that kiln copies transposed) and
`torch._int_mm` through cuBLASLt at several sizes of a dynamic M; float8 casts in Triton kernels
bit for bit against eager's conversions."""

from __future__ import annotations

import pytest
import torch

import kiln
from difftest import Fn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
MS = [64, 17, 1, 200]  # sizes of the dynamic M


def _compile(fn, args, tmp_path, dyn=None):
    cm = kiln.compile(Fn(fn), args, device="cuda",
                      dynamic_shapes=(tuple(dyn),) if dyn is not None else None)
    return kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")


def _m():
    return torch.export.Dim("m", min=1, max=512)


CASES = [  # (a dtype, b dtype, out dtype, bias, row-wise, mat2 computed in the program)
    (E4, E4, torch.bfloat16, True, False, False),
    (E4, E4, torch.bfloat16, False, False, False),
    (E4, E4, torch.float16, True, False, False),  # (eager refuses a bias with float32 out)
    (E4, E4, torch.float32, False, False, True),
    (E5, E4, torch.bfloat16, False, False, False),
    (E4, E4, torch.bfloat16, True, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).removeprefix("torch.")
                                                               for x in c))
def test_scaled_mm_gpu(case, tmp_path):
    da, db, out, with_bias, rowwise, computed = case
    g = torch.Generator(device="cuda").manual_seed(1)
    k, n = 96, 80
    w = (torch.randn(n, k, device="cuda", generator=g) * 2)
    w = w.bfloat16() if computed else w.to(db)
    bias = torch.randn(n, device="cuda", generator=g).to(out) if with_bias else None

    def fn(a, w, sa, sb, *b):
        # computed: mat2 is a cast, no buffer yet: kiln stores it in cuBLASLt's layout itself
        mat2 = w.to(db).t() if computed else w.t()
        return torch._scaled_mm(a, mat2, sa, sb, bias=b[0] if b else None, out_dtype=out)

    def inputs(m):  # a starts 96 bytes into its allocation: 32-byte aligned, not 256
        a = (torch.randn(m + 1, k, device="cuda", generator=g) * 2).to(da)[1:]
        if rowwise:
            sa = torch.rand(m, 1, device="cuda", generator=g) + 0.5
            sb = torch.rand(1, n, device="cuda", generator=g) + 0.5
        else:
            sa, sb = torch.tensor(0.37, device="cuda"), torch.tensor(1.93, device="cuda")
        return (a, w, sa, sb, *([bias] if with_bias else []))

    dyn = [{0: _m()}, None, {0: _m()} if rowwise else None, None] + ([None] if with_bias else [])
    runner = _compile(fn, inputs(MS[0]), tmp_path, dyn)
    for m in MS:
        args = inputs(m)
        got, want = runner(*args), fn(*args)
        assert got.dtype == out and got.shape == want.shape
        tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}.get(out, 1e-4)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 8)


def test_int_mm_gpu(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(2)
    k, n = 64, 48
    b = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8, generator=g)

    def fn(a, b):  # mat2 column-major (b.t() of a row-major [N, K])
        return torch._int_mm(a, b.t())

    def fn_rowmajor(a, b2):
        return torch._int_mm(a, b2)

    a0 = torch.randint(-128, 128, (32, k), device="cuda", dtype=torch.int8, generator=g)
    dyn = [{0: torch.export.Dim("m", min=17, max=512)}, None]
    runner = _compile(fn, (a0, b), tmp_path, dyn)
    (tmp_path / "r").mkdir()
    runner2 = _compile(fn_rowmajor, (a0, b.t().contiguous()), tmp_path / "r", dyn)
    for m in (32, 17, 100, 256):
        a = torch.randint(-128, 128, (m, k), device="cuda", dtype=torch.int8, generator=g)
        want = torch._int_mm(a.cpu(), b.t().cpu()).cuda()
        assert torch.equal(runner(a, b), want)
        assert torch.equal(runner2(a, b.t().contiguous()), want)


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3fn", "e5m2"])
def test_float8_storage_gpu(dtype, tmp_path):
    """All 256 bytes widened, rounded back and converted to the other format; float32 and
    bfloat16 values rounded to 8 bits (subnormals, ties, overflow, NaN), bit for bit."""
    every = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8).view(dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    special = torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 448.0,
                            463.9, 464.0, 480.0, 1e6, 57344.0, 61439.0, 61440.0, 65536.0,
                            2.0 ** -10, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -17, 2.0 ** -16,
                            3 * 2.0 ** -18, 1e-30], device="cuda")
    wide = torch.cat([special, -special, torch.randn(5000, device="cuda", generator=g) *
                      10.0 ** torch.randint(-8, 6, (5000,), device="cuda", generator=g).float()])
    other = E5 if dtype == E4 else E4

    def fn(v, x):
        return {"up": v.float(), "trip": v.float().to(dtype), "down": x.to(dtype),
                "bf16": x.bfloat16().to(dtype), "other": v.to(other),
                "scaled": (v.float() * 3).to(dtype)}

    runner = _compile(fn, (every, wide), tmp_path)
    got, want = runner(every, wide), fn(every, wide)
    for key in want:
        w, o = want[key], got[key]
        assert o.dtype == w.dtype and o.device == w.device
        view = torch.int32 if w.element_size() == 4 else torch.uint8
        same = (o.view(view) == w.view(view)) | (o.float().isnan() & w.float().isnan())
        assert same.all(), (key, o[~same][:6].tolist(), w[~same][:6].tolist(),
                            (wide if key in ("down", "bf16") else every.float())[~same][:6])
