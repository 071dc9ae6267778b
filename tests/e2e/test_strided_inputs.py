"""Inputs with other strides (issue 16, class 1): a CPU package reads its inputs compact
row-major, and libkiln copies any other layout in first (kiln/runtime/src/copy_in.h), so
transposed weights, step-2 slices, storage offsets, channels-last 4-D tensors, broadcast
(stride 0) and negative strides (numpy, raw DLPack from C) all give eager's values. Checked
against eager on fresh inputs, at several sizes and dtypes (element sizes 1, 2, 4 and 8), from
torch, from numpy, through DLPack capsules and through the C ABI with hand-made DLTensors; the
manifest says what the package reads."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import kiln
from kiln.runtime import dlpack_ctypes as dl
from kiln.runtime.loader import last_error, libkiln


class Mixed(torch.nn.Module):
    """Reads every input through every element (a copy-in bug changes some output value):
    a GEMM with a weight, a 4-D convolution, float64, bfloat16, int16 and bool inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x, w, img, d, h, k, m):
        y = torch.relu(x @ w) + x.sum(1, keepdim=True)
        z = self.conv(img) * 2.0 + img.mean()
        e = (d * d).cumsum(0) + d.flip(0)
        f = h.float() * 3.0 + (k.to(torch.float32) * m.float()).sum()
        return y, z, e, f


B = torch.export.Dim("B", min=1, max=64)
DYN = ({0: B}, None, {0: B}, {0: B}, None, None, None)


def _fresh(n: int, g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(n, 8, generator=g), torch.randn(8, 6, generator=g),
            torch.randn(n, 3, 5, 5, generator=g), torch.randn(n, 4, dtype=torch.float64,
                                                               generator=g),
            torch.randn(6, 7, generator=g).to(torch.bfloat16),
            torch.randint(-300, 300, (9, 5), dtype=torch.int16, generator=g),
            torch.rand(9, 5, generator=g) > 0.5]


def _layouts(args: list[torch.Tensor], g: torch.Generator) -> dict[str, list[torch.Tensor]]:
    """The same values in other layouts (each a view whose strides are not compact)."""
    x, w, img, d, h, k, m = args
    n = x.shape[0]

    def relaid(t, how):
        if how == "t":  # a transposed copy, viewed back: reversed strides
            return t.t().contiguous().t() if t.dim() == 2 else t
        if how == "step":  # every other element of a larger tensor, with a storage offset
            big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1] + 1, dtype=t.dtype)
            big[..., 1::2] = t
            return big[..., 1::2]
        raise AssertionError(how)

    cl = img.contiguous(memory_format=torch.channels_last)
    assert not cl.is_contiguous()
    rows = torch.randn(1, 6, generator=g)
    return {
        "transposed": [relaid(x, "t"), relaid(w, "t"), img, relaid(d, "t"), relaid(h, "t"),
                       relaid(k, "t"), relaid(m, "t")],
        "step2": [relaid(x, "step"), relaid(w, "step"), relaid(img, "step"), relaid(d, "step"),
                  relaid(h, "step"), relaid(k, "step"), relaid(m, "step")],
        "channels_last": [x, w, cl, d, h, k, m],
        "broadcast": [torch.randn(1, 8, generator=g).expand(n, 8), rows.expand(8, 6), img,
                      d[:1].expand(n, 4), h, k[:, :1].expand(9, 5), m],
        "permuted_4d": [x, w, img.permute(3, 1, 0, 2).contiguous().permute(2, 1, 3, 0), d, h,
                        k, m],
    }


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = Mixed().eval()
    c = kiln.compile(model, tuple(_fresh(3, g)), dynamic_shapes=DYN)
    return model, c.save(tmp_path_factory.mktemp("strided") / "mixed.kiln")


def _check(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        tol = {"rtol": 1e-10, "atol": 1e-10} if a.dtype == torch.float64 else \
            {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(a, b, **tol)


def test_manifest_names_the_layout(package):
    _, path = package
    for i in kiln.load(path).manifest["inputs"]:
        assert i["layout"] == "contiguous (other strides copied in)"


@pytest.mark.parametrize("n", [1, 5, 33])
def test_torch_views_match_eager(package, n):
    model, path = package
    runner = kiln.load(path)
    g = torch.Generator().manual_seed(100 + n)
    args = _fresh(n, g)
    with torch.no_grad():
        want = model(*args)
    _check(runner(*args), want)
    for name, relaid in _layouts(args, g).items():
        with torch.no_grad():
            want = model(*relaid)  # broadcast rows differ from args: eager on the same views
        assert any(not t.is_contiguous() for t in relaid), name
        _check(runner(*relaid), want)  # the fast path
        _check(runner._call_general(tuple(relaid), {}), want)


def test_inputs_are_not_written(package):
    model, path = package
    g = torch.Generator().manual_seed(7)
    args = _fresh(4, g)
    relaid = _layouts(args, g)["step2"]
    before = [t.clone() for t in relaid]
    kiln.load(path)(*relaid)
    for a, b in zip(relaid, before):
        assert torch.equal(a, b)


def test_numpy_arrays_with_negative_and_zero_strides(package):
    model, path = package
    runner = kiln.load(path)
    rng = np.random.default_rng(3)
    for n in (2, 7):
        x = rng.standard_normal((8, n), dtype=np.float32)[::-1].T  # negative strides
        w = rng.standard_normal((8, 12), dtype=np.float32)[:, ::-2]  # negative step 2
        img = rng.standard_normal((n, 5, 5, 3), dtype=np.float32).transpose(0, 3, 1, 2)
        d = np.broadcast_to(rng.standard_normal((1, 4)), (n, 4))  # stride 0
        h = torch.randn(6, 7).to(torch.bfloat16)  # numpy has no bfloat16: a torch input
        k = rng.integers(-300, 300, (9, 5), dtype=np.int16)[::-1, ::-1]
        m = (rng.random((5, 9)) > 0.5).T
        assert x.strides[1] < 0 and d.strides[0] == 0
        with torch.no_grad():
            want = model(*[torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray)
                           else a for a in (x, w, img, d, h, k, m)])
        _check(runner(x, w, img, d, h, k, m), want)


def test_dlpack_capsules(package):
    model, path = package
    runner = kiln.load(path)
    rng = np.random.default_rng(4)
    x = torch.from_dlpack(rng.standard_normal((8, 6), dtype=np.float32).T)  # via __dlpack__
    args = [x] + _fresh(6, torch.Generator().manual_seed(5))[1:]
    assert not x.is_contiguous()
    with torch.no_grad():
        want = model(*args)
    _check(runner(*args), want)


def test_c_abi_takes_any_strides(tmp_path):
    """A C caller's DLTensors: negative, zero and padded strides, a byte offset, size-1 dims with
    odd strides, a rank-1 input; the values against eager."""
    def f(a, b):
        return a * 2.0 + b.sum(), (a.sum(0) * b[0]).double()

    c = kiln.compile(f, (torch.randn(3, 4), torch.randn(1, 4)))
    path = c.save(tmp_path / "f.kiln")
    lib = libkiln()
    h = ctypes.c_void_p()
    assert lib.kiln_model_load(str(path).encode(), b"cpu", ctypes.byref(h)) == 0, last_error()
    store = torch.randn(64)
    cases = [  # (strides of a [3, 4], element offset of a, strides of b [1, 4])
        ((4, 1), 0, (4, 1)), ((1, 3), 0, (99, 1)), ((-4, 1), 8, (0, -1)), ((8, 2), 5, (1, 0)),
        ((0, 0), 7, (1, 2)), ((-1, -3), 63, (-7, 5)), ((5, 1), 20, (4, -1)),
    ]
    try:
        for sa, off, sb in cases:
            ia = torch.tensor([[off + i * sa[0] + j * sa[1] for j in range(4)] for i in range(3)])
            ib = torch.tensor([[30 + j * sb[1] for j in range(4)]])
            a, b = store[ia], store[ib]
            want = f(a, b)
            keep = []

            def dlt(offset, shape, strides):
                sh, st = (ctypes.c_int64 * 2)(*shape), (ctypes.c_int64 * 2)(*strides)
                keep.extend([sh, st])
                return dl.DLTensor(store.data_ptr(), dl.DLDevice(1, 0), 2,
                                   dl.DLDataType(2, 32, 1), ctypes.cast(sh, dl.ctypes.POINTER(
                                       ctypes.c_int64)), ctypes.cast(st, ctypes.POINTER(
                                           ctypes.c_int64)), 4 * offset)

            ta, tb = dlt(off, (3, 4), sa), dlt(30, (1, 4), sb)
            ins = (ctypes.POINTER(dl.DLTensor) * 2)(ctypes.pointer(ta), ctypes.pointer(tb))
            outs = (ctypes.c_void_p * 2)()
            assert lib.kiln_model_run(h, ins, 2, outs, 2) == 0, (sa, sb, last_error())
            got = [torch.from_dlpack(_capsule(p)) for p in outs]
            _check(got, want)
    finally:
        lib.kiln_model_free(h)


def _capsule(ptr: int):
    new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                            ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
    return new(ptr, b"dltensor", None)


def test_bad_inputs_still_refused(package):
    """Copy-in never hides an error: wrong dtype, rank and sizes are reported on views too."""
    _, path = package
    runner = kiln.load(path)
    args = _fresh(3, torch.Generator().manual_seed(9))
    for k, bad, words in [(0, torch.randn(8, 3).t().double(), "expected dtype float32"),
                          (1, torch.randn(7, 8)[:, ::2][:, :3].t(), "expected size"),
                          (2, torch.randn(3, 5, 5, 4).permute(0, 3, 1, 2), "expected size"),
                          (3, torch.randn(100, 4, dtype=torch.float64)[::2], "got 50")]:
        relaid = list(args)
        relaid[k] = bad
        with pytest.raises(kiln.errors.InputError, match=f"input {k} ") as info:
            runner(*relaid)
        assert words in str(info.value)


class AB(torch.nn.Module):
    def forward(self, a, b):
        return a * 2 + 1, b.sum(0)


def test_large_transposed_inputs_take_the_tiled_copy(tmp_path):
    """Last two dims transposed in memory and at least 16 x 16 (copy_in.cpp copies those in
    tiles), sizes that are not multiples of the tile, with a batch dim, a storage offset and
    padded rows; small ones below the tile size take the row copy."""
    n = torch.export.Dim("n", min=1, max=512)
    c = kiln.compile(AB(), (torch.randn(3, 20, 17), torch.randn(20, 40, dtype=torch.float64)),
                     dynamic_shapes=({1: n}, {0: n}))
    runner = kiln.load(c.save(tmp_path / "t.kiln"))
    for rows in (20, 47, 16, 130, 5):
        a = torch.randn(3, 17, rows).transpose(1, 2)
        b = torch.randn(45, rows + 3, dtype=torch.float64)[2:42, 1:rows + 1].t()
        assert not a.is_contiguous() and not b.is_contiguous() and b.storage_offset() > 0
        _check(runner(a, b), AB()(a, b))
