"""8-bit floats and low-precision GEMMs on the CPU (kiln issues 5 and 6): float8_e4m3fn /
float8_e5m2 as storage types (conversions bit for bit, weights, inputs, outputs), and
`torch._scaled_mm` / `torch._int_mm` against eager. CUDA packages with them are compiled here
(no GPU needed); tests/targets/cuda/test_lowp_gpu.py runs them on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import UnsupportedError
from difftest import Checker, Fn, dim, gen

F8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("lowp"))


def _ids(v) -> str:
    return str(v).removeprefix("torch.")


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[want.element_size()]
    same = got.view(view) == want.view(view)
    assert same.all(), (got.view(view)[~same][:5], want.view(view)[~same][:5],
                        (~same).nonzero()[:5].flatten())


@pytest.mark.parametrize("dtype", F8, ids=_ids)
def test_float8_conversions_exact(check, dtype):
    """All 256 bytes -> float32 -> back, and float32 / float64 / bfloat16 -> 8 bits (nearest-even,
    subnormals, overflow: e4m3fn saturates to +-448, e5m2 becomes +-inf; NaN) bit for bit."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    g = gen("f8conv", dtype)
    special = torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 448.0,
                            463.9, 464.0, 480.0, 1e6, -1e6, 57344.0, 61439.0, 61440.0, 65536.0,
                            2.0 ** -10, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -17, 2.0 ** -16,
                            3 * 2.0 ** -18, 1e-30])
    wide = torch.cat([special, -special, torch.randn(3000, generator=g) * 10.0 ** torch.randint(
        -8, 6, (3000,), generator=g).float()])

    def fn(v, x):
        return {"up": v.float(), "trip": v.float().to(dtype), "down": x.to(dtype),
                "f64": x.double().to(dtype), "bf16": x.bfloat16().to(dtype),
                "other": v.to(F8[1 - F8.index(dtype)]), "slice": v[::3].contiguous()}

    _, runner = check.compile(Fn(fn), (every, wide))
    got = runner(every, wide)
    want = fn(every, wide)
    for k in want:  # NaN payloads too: kiln widens 8-bit NaNs as eager does
        if k == "bf16":  # eager's float32 -> bfloat16 makes every NaN 0xFFFF; kiln keeps signs
            nan = want[k].float().isnan()
            assert torch.equal(got[k].float().isnan(), nan), k
            got[k], want[k] = got[k][~nan], want[k][~nan]
        _bits_equal(got[k], want[k])


def test_float8_e4m3fn_overflow_nan_mode(check, monkeypatch):
    """Under a torch whose e4m3fn conversion makes overflow NaN (torch 2.11), kiln's does too:
    past 464 and +-inf -> NaN (sign kept), 464 itself -> 448; everything else unchanged."""
    from kiln.targets import float8
    monkeypatch.setattr(float8, "e4m3fn_saturates", lambda: False)
    x = torch.tensor([463.9, 464.0, 464.01, 480.0, 1e6, -1e6, float("inf"), float("-inf"),
                      448.0, 1.0, -300.0, 2.0 ** -10, 3 * 2.0 ** -10])
    _, runner = check.compile(Fn(lambda x: (x.to(torch.float8_e4m3fn),
                                            x.bfloat16().to(torch.float8_e4m3fn))), (x,))
    def old_torch(v):
        over = (v.abs() > 464) & ~v.isnan()
        sat = v.to(torch.float8_e4m3fn).view(torch.uint8).int()
        return torch.where(over, torch.where(v < 0, 0xFF, 0x7F), sat).tolist()

    got = runner(x)
    assert got[0].view(torch.uint8).tolist() == old_torch(x)
    assert got[1].view(torch.uint8).tolist() == old_torch(x.bfloat16().float())


class F8Net(nn.Module):
    """A float8 weight (safetensors F8_E4M3 / F8_E5M2) dequantised in the program, a float8
    input and a float8 output."""

    def __init__(self, dtype) -> None:
        super().__init__()
        self.w = nn.Parameter((torch.randn(8, 5) * 4).to(dtype), requires_grad=False)

    def forward(self, x, q, scale):
        y = x @ (self.w.float() * scale)
        return y, (y * 2).to(self.w.dtype), q.float().sum(0)


@pytest.mark.parametrize("dtype", F8, ids=_ids)
def test_float8_weights_inputs_outputs(check, dtype, tmp_path):
    torch.manual_seed(0)
    net = F8Net(dtype)
    x, q, s = torch.randn(3, 8), (torch.randn(4, 5) * 8).to(dtype), torch.tensor(0.25)
    # without constant folding, which would ship the dequantised float32 weight instead
    compiled, runner = check.compile(net, (x, q, s), options=kiln.Options(fold_constants=False),
                                     dynamic_shapes=({0: dim("n", 1, 16)}, None, None))
    name = str(dtype).removeprefix("torch.")
    weights = {w["fqn"]: w["dtype"] for w in compiled.manifest["weights"]}
    assert weights["w"] == name, weights
    assert name in str(compiled.manifest["inputs"]), compiled.manifest["inputs"]
    for xx in (x, torch.randn(11, 8)):
        got, want = runner(xx, q, s), net(xx, q, s)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        _bits_equal(got[1], want[1])
        torch.testing.assert_close(got[2], want[2])
    with pytest.raises(Exception, match=f"input 1 .*expected dtype {name}, got "):
        runner(x, q.float(), s)
    other = F8[1 - F8.index(dtype)]
    with pytest.raises(Exception, match=f"expected dtype {name}, got "
                                        f"{str(other).removeprefix('torch.')}"):
        runner(x, q.to(other), s)


def _int_mm(a, b):
    return torch._int_mm(a, b)


@pytest.mark.parametrize("shape", [(32, 64, 48), (17, 24, 40)])
def test_int_mm_cpu(check, shape):
    m, k, n = shape
    g = gen("int_mm", *shape)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=g)
    _, runner = check.compile(Fn(_int_mm), (a, b), dynamic_shapes=(
        {0: dim("m", 1, 64)}, None))
    for aa in (a, torch.randint(-128, 128, (5, k), dtype=torch.int8, generator=g)):
        got = runner(aa, b)
        assert got.dtype == torch.int32
        assert torch.equal(got, torch._int_mm(aa, b))


def _fp8(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


SCALED = [  # (a dtype, b dtype, out dtype, bias, row-wise)
    (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, True, False),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, False, False),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, True, False),
    (torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16, False, False),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, False, True),
]


@pytest.mark.parametrize("case", SCALED, ids=lambda c: "-".join(map(_ids, c)))
def test_scaled_mm_cpu(check, case):
    da, db, out, with_bias, rowwise = case
    g = gen("scaled_mm", *map(str, case))
    m, k, n = 32, 64, 48
    a, w = _fp8((m, k), da, g), _fp8((n, k), db, g)  # mat2 = w.t(): column-major, as eager wants
    if rowwise:
        sa, sb = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
    else:
        sa, sb = torch.tensor(0.37), torch.tensor(1.93)
    bias = torch.randn(n, generator=g).to(out) if with_bias else None

    def fn(a, w, sa, sb, *bias):
        return torch._scaled_mm(a, w.t(), sa, sb, bias=bias[0] if bias else None, out_dtype=out)

    args = (a, w, sa, sb, *([bias] if with_bias else []))
    dyn = ({0: dim("m", 1, 64)}, None, {0: dim("m", 1, 64)} if rowwise else None, None) + (
        (None,) if with_bias else ())
    _, runner = check.compile(Fn(fn), args, dynamic_shapes=dyn)
    for mm in (m, 7):
        aa = a[:mm]
        sa2 = sa[:mm] if rowwise else sa
        got, want = runner(aa, w, sa2, sb, *args[4:]), fn(aa, w, sa2, sb, *args[4:])
        assert got.dtype == out
        tol = 1.6e-2 if out == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 4)


def test_scaled_mm_float8_output_rejected():
    """An 8-bit output (eager's default out_dtype) is refused clearly, naming the node (with
    the ATen fallback on, the op calls eager's kernel instead)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    with pytest.raises(UnsupportedError, match=r"_scaled_mm.*out_dtype must be bfloat16, "
                                               r"float16 or float32.*got torch.float8_e4m3fn"):
        kiln.compile(Fn(lambda a, s: torch._scaled_mm(a, a.t(), s, s)), (a, torch.tensor(1.0)),
                     options=kiln.Options(aten_fallback=False))


# -- CUDA packages, compiled without a GPU (Triton -> cubin for sm_90, the wrapper by g++) ------

def _cuda(fn, args, dynamic_shapes=None):
    pytest.importorskip("triton")
    return kiln.compile(Fn(fn), args, device="cuda", options=kiln.Options(cuda_archs=(90,)),
                        dynamic_shapes=(tuple(dynamic_shapes),) if dynamic_shapes else None)


def test_cuda_scaled_mm_compiles_to_cublaslt():
    """Tensor-wise scales and a bias of the output dtype go to cuBLASLt (scale pointers, bias
    epilogue): no kernel at all; mat2 given row-major is copied transposed by a kiln kernel."""
    a = torch.ones(32, 64).to(torch.float8_e4m3fn)
    w = torch.ones(48, 64).to(torch.float8_e4m3fn)
    s, bias = torch.tensor(1.0), torch.ones(48).bfloat16()
    cm = _cuda(lambda a, w, s, bias: torch._scaled_mm(a, w.t(), s, s, bias=bias,
                                                      out_dtype=torch.bfloat16),
               (a, w, s, bias), ({0: dim("m", 1, 256)}, None, None, None))
    src = cm.sources["model_cuda.cpp"]
    assert "kc::lt_gemm(e, self->lt, stream" in src and "kc::kR8F_E4M3" in src
    assert "buf_args_3, kc::kR16BF" in src  # the bias epilogue
    assert "kc::blaslt().create(&self->lt)" in src
    assert not [k for k in cm.manifest["kernels"] if k["kind"] == "triton"]
    # a row-major mat2 (w2 is [K, N] contiguous): one transposed copy, then cuBLASLt
    w2 = torch.ones(64, 48).to(torch.float8_e5m2)
    cm = _cuda(lambda a, w2, s: torch._scaled_mm(a, w2.contiguous().t().contiguous().t(), s, s,
                                                 out_dtype=torch.float32), (a, w2, s))
    assert "kc::kR8F_E5M2" in cm.sources["model_cuda.cpp"]


def test_cuda_rowwise_and_int_mm_compile():
    """Row-wise scales: a float32 cuBLASLt GEMM and a fused epilogue kernel; _int_mm: an int8
    cuBLASLt GEMM into int32; float8 casts in Triton use kiln's rounding helpers."""
    a = torch.ones(32, 64).to(torch.float8_e4m3fn)
    w = torch.ones(48, 64).to(torch.float8_e4m3fn)
    cm = _cuda(lambda a, w, sa, sb, x: (torch._scaled_mm(a, w.t(), sa, sb,
                                                         out_dtype=torch.bfloat16),
                                        x.to(torch.float8_e5m2), x.to(torch.float8_e4m3fn)),
               (a, w, torch.ones(32, 1), torch.ones(1, 48), torch.randn(5, 7)))
    triton_src = cm.sources["kernels_triton.py"]
    assert "_kl_f8e5m2(" in triton_src and "_kl_f8e4m3(" in triton_src
    assert "kc::kR32F" in cm.sources["model_cuda.cpp"]
    ai = torch.ones(32, 64, dtype=torch.int8)
    cm = _cuda(lambda a, b: torch._int_mm(a, b), (ai, torch.ones(64, 32, dtype=torch.int8)))
    src = cm.sources["model_cuda.cpp"]
    assert "kc::kR8I" in src and "kc::kR32I" in src
    # b ([K, N] contiguous) is not column-major: exactly one copy kernel (its transpose)
    assert len([k for k in cm.manifest["kernels"] if k["kind"] == "triton"]) == 1
