"""kr::exp, kr::sigmoid and kr::tanh (kiln_kernels.h: branch-free, no library calls, so loops
over them vectorise at every -march level) against float64 math over a dense sweep of float32
bit patterns (every exponent, subnormals, +-inf, NaN), at the plain x86-64 (SSE2) and AVX2
levels and the build machine's; and 16-bit float elementwise kernels (SiLU x up, tanh-GELU),
whose generated loops hold no storage-struct temporary, against eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln

# worst errors measured over every 61st float32 bit pattern: exp 1.00, sigmoid 2.30, tanh 1.85 ulp
ULP_BOUND = {"exp": 1.5, "sigmoid": 2.5, "tanh": 2.0}


class ExpSigmoidTanh(torch.nn.Module):
    def forward(self, x):
        return torch.exp(x), torch.sigmoid(x), torch.tanh(x)


def _sweep() -> np.ndarray:
    """Every 4099th float32 bit pattern (both signs, all exponents, NaN payloads) and edge
    values: zeros, the smallest subnormal, the overflow / underflow / rounding thresholds."""
    bits = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754944e-38,
                      -88.72, 88.72, 88.7228, 88.73, 89.0, -87.3, -87.34, -103.9, -104.0,
                      -104.5, 0.549, 0.55, 0.551, 9.0, 9.5, 9.6, -9.6, 1e-3, -1e-3, 3.4e38,
                      -3.4e38, -0.0, np.inf, -np.inf, -100.0], dtype=np.float32)
    return np.concatenate([bits.view(np.float32), edges])


def _ulps(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref| in units of the last place of the float32 nearest ref (subnormal spacing
    below the normal range)."""
    spacing = np.spacing(np.abs(ref.astype(np.float32))).astype(np.float64)
    return np.abs(got.astype(np.float64) - ref) / spacing


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "native"])
def test_exp_sigmoid_tanh_ulp_sweep(tmp_path, march):
    x = _sweep()
    xt = torch.from_numpy(x)
    runner = kiln.compile(ExpSigmoidTanh(), (xt,), options=kiln.Options(march=march)).load(
        tmp_path / "m.kiln")
    nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):  # NaN payloads, exp's overflow to inf
        x64 = x.astype(np.float64)
        refs = {"exp": np.exp(x64), "sigmoid": 1.0 / (1.0 + np.exp(-x64)), "tanh": np.tanh(x64)}
        for name, got in zip(refs, runner(xt)):
            got, ref = got.numpy(), refs[name]
            assert np.array_equal(np.isnan(got), nan), name  # NaN in, NaN out; nothing else
            inf = np.isinf(ref.astype(np.float32))  # exp's overflow: exactly inf
            assert np.array_equal(got[inf & ~nan], ref[inf & ~nan].astype(np.float32)), name
            ok = ~nan & ~inf
            err = _ulps(got[ok], ref[ok])
            worst = int(np.argmax(err))
            assert err[worst] <= ULP_BOUND[name], (name, float(x[ok][worst]), float(err[worst]))
    # signs and ends: tanh(-0.0) = -0.0, tanh(+-inf) = +-1, sigmoid(+-inf) = 1 / 0, exp(-inf) = 0
    e, s, t = (o.numpy()[-4:] for o in runner(xt))
    assert np.signbit(t[0]) and t[0] == 0 and t[1] == 1 and t[2] == -1
    assert s[1] == 1 and s[2] == 0 and e[2] == 0
    assert 0 < s[3] < 1e-38  # a subnormal result is kept, not flushed: sigmoid(-100) ~ 3.7e-44


class SiluUp(torch.nn.Module):
    def forward(self, gate, up):
        return F.silu(gate) * up


class GeluTanh(torch.nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 1001), (2, 4, 257)])
def test_silu_up_and_gelu_tanh_vs_eager(tmp_path, dtype, shape):
    g = torch.Generator().manual_seed(0)
    gate, up = ((torch.randn(*shape, generator=g) * 4).to(dtype) for _ in range(2))
    for i, (m, args) in enumerate([(SiluUp(), (gate, up)), (GeluTanh(), (gate,))]):
        runner = kiln.compile(m, args).load(tmp_path / f"m{i}.kiln")
        got = runner(*args)
        assert got.dtype == dtype
        if dtype == torch.float32:  # against float64 math: a few float32 roundings
            ref = m(*(a.double() for a in args))
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
        else:  # eager rounds each op's result to dtype, as kiln does: one rounding apart
            rtol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
            torch.testing.assert_close(got.double(), m(*args).double(), rtol=rtol, atol=1e-5)


def test_storage_type_loops_hold_no_struct_temporary(tmp_path):
    """The bfloat16 SiLU x up loop is printed without kr::bfloat16 temporaries (loads read in
    place, the rounding between the ops kr::round_as, the store through .bits), the form GCC
    vectorises under `omp simd` (kiln_kernels.h, to_bits)."""
    gate, up = (torch.randn(1, 4096).to(torch.bfloat16) for _ in range(2))
    compiled = kiln.compile(SiluUp(), (gate, up))
    src = "\n".join(text for name, text in compiled.sources.items()
                    if name.startswith("kernels"))
    assert "#pragma omp simd" in src
    assert "kr::round_as<kr::bfloat16>(" in src
    assert ".bits = kr::to_bits<kr::bfloat16>(" in src
    assert "const kr::bfloat16 " not in src
