"""float8_e4m3fnuz / float8_e5m2fnuz ("finite, no negative zero") as storage types on the CPU
(issue 16 class 5), differential against eager bit for bit: all 256 patterns -> float32 (the one
NaN 0x80 with eager's payload), float32 -> fnuz on a dense sweep (every subnormal and normal,
the halfway points between neighbours and one ulp either side, overflow -> NaN, +-inf, NaN,
+-0 and negative underflow -> +0), casts to and from every other dtype, moves (view, cat,
index, copy), float32 math, a weight (safetensors F8_E4M3FNUZ / F8_E5M2FNUZ), an input and an
output of the type. CUDA (bytes converted by kiln's Triton helpers):
tests/targets/cuda/test_float8_fnuz_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import UnsupportedError
from difftest import Cases, Checker, Fn, dim, gen

FNUZ = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
OTHERS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
          torch.bool]


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("fnuz"))


def _ids(v) -> str:
    return str(v).removeprefix("torch.")


def _bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    g, w = got.contiguous().view(view), want.contiguous().view(view)
    same = g == w
    assert same.all(), (what, g[~same][:5], w[~same][:5], (~same).nonzero()[:5].flatten())


def _sweep(dtype) -> torch.Tensor:
    """float32 values around every representable value of `dtype`: the values, the halfway
    points between neighbours and one float32 ulp either side of each, a coarse sweep of every
    float32 binade from 2^-40 to 2^40, and the special values; both signs."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    fin = every[~every.isnan()].unique().double()  # sorted
    top = torch.finfo(dtype).max
    step = top - fin[-2].item()
    fin = torch.cat([fin, torch.tensor([top + step], dtype=torch.float64)])  # the next binade
    half = ((fin[1:] + fin[:-1]) / 2).float()  # exact in float32
    near = torch.cat([fin.float(), half, half.nextafter(torch.tensor(float("inf"))),
                      half.nextafter(torch.tensor(float("-inf")))])
    bits = (torch.arange(97 - 40 + 30, 127 + 41, dtype=torch.int32)[:, None] << 23) | \
        (torch.arange(0, 1 << 23, 1 << 12, dtype=torch.int32) + 0x5A5)[None, :]
    coarse = bits.flatten().view(torch.float32)
    special = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 1e-30, 3e38, 1e6, 65536.0,
                            float.fromhex("0x1.fffffep127")])
    pos = torch.cat([near, coarse, special])
    return torch.cat([pos, -pos, torch.tensor([-0.0, -float("nan")])])


def conversions_of(dtype):
    def fn(v, x, f, i):
        out = {"up": v.float(), "trip": v.float().to(dtype), "down": x.to(dtype),
               "f64": x.double().to(dtype), "bf16": x.bfloat16().to(dtype),
               "f16": x.half().to(dtype), "slice": v[::3].contiguous()}
        for o in OTHERS:  # ints from the values they hold (float -> int overflow is UB)
            name = _ids(o)
            src = v if o.is_floating_point or o == torch.bool else \
                f.float().abs().to(dtype) if o == torch.uint8 else f
            out[f"to_{name}"] = src.to(o)
            out[f"from_{name}"] = (x.to(o) if o.is_floating_point else i.to(o)).to(dtype)
        for other in FNUZ:
            out[f"to_{_ids(other)}"] = v.to(other)
        return out
    return fn


def test_fnuz_conversions_exact(check):
    """All 256 bytes -> float32 (bits, NaN payload too) and back; the float32 sweep, its
    float64 and bfloat16 roundings -> fnuz; fnuz -> and <- every other dtype. Both fnuz types
    in one difftest.Cases program (one package; outputs "<type>__<output>")."""
    cases, args, wides = {}, [], {}
    for dtype in FNUZ:
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        wide = wides[_ids(dtype)] = _sweep(dtype)
        finite = every[every.float().abs() < 127]  # no NaN; fits int8
        ints = torch.arange(-130, 300, dtype=torch.int64)
        cases[_ids(dtype)] = (Fn(conversions_of(dtype)), 4)
        args += [every, wide, finite, ints]
    program = Cases(cases)
    _, runner = check.compile(program, args)
    got = runner(*args)
    want = program(*args)
    assert set(got) == set(want)
    for k in want:
        if want[k].dtype in (torch.float16, torch.bfloat16):
            # eager's float32 -> 16-bit float makes every NaN one pattern; kiln keeps payloads
            nan = want[k].float().isnan()
            assert torch.equal(got[k].float().isnan(), nan), k
            got[k], want[k] = got[k][~nan], want[k][~nan]
        _bits_equal(got[k], want[k], k)
    # the facts the conversions rest on, stated once against eager itself
    for name, wide in wides.items():
        assert got[f"{name}__down"][wide == 0].view(torch.uint8).eq(0).all()  # -0.0 -> +0
        assert got[f"{name}__up"][128].view(torch.int32).item() == 0x7F800001


def fnuz_program(a, b, idx):
    """Math via float32, eager's own mul on fnuz, moves (view, cat, index, copy, where)."""
    dt = a.dtype
    s = (a.float() * 1.5 - b.float()).to(dt)
    m = a * b  # eager multiplies fnuz in float32 and rounds once
    c = torch.cat([a, b], 0)
    g = a[idx]
    e = torch.empty(a.shape[1], a.shape[0], dtype=dt).copy_(a.t())
    w = torch.where(a.float() > b.float(), a, b)
    return s, m, c, g, e, w, a.view(-1)[1:], (a.float().exp() + b.float()).sum(1).to(dt)


@pytest.mark.parametrize("dtype", FNUZ, ids=_ids)
def test_fnuz_math_and_moves(check, dtype):
    g = gen("fnuz_math", dtype)

    def args(n):
        a = (torch.randn(n, 6, generator=g) * 4).to(dtype)
        b = (torch.randn(6, n, generator=g) * 4).to(dtype)
        return a, b.t().contiguous(), torch.randint(0, n, (5,), generator=g)

    _, runner = check.compile(Fn(fnuz_program), args(4),
                              dynamic_shapes=({0: dim("n", 1, 64)}, {0: dim("n", 1, 64)}, None))
    for n in (4, 1, 37):
        x = args(n)
        for k, (gg, ww) in enumerate(zip(runner(*x), fnuz_program(*x))):
            _bits_equal(gg, ww, f"n={n} output {k}")


class FnuzNet(nn.Module):
    """A fnuz weight dequantised in the program, a fnuz input and a fnuz output."""

    def __init__(self, dtype) -> None:
        super().__init__()
        self.w = nn.Parameter((torch.randn(8, 5) * 4).to(dtype), requires_grad=False)

    def forward(self, x, q, scale):
        y = x @ (self.w.float() * scale)
        return y, (y * 2).to(self.w.dtype), q.float().sum(0), torch.cat([q, self.w[:2]])


def test_fnuz_weights_inputs_outputs(check):
    """FnuzNet of each fnuz type (its own weight, input, output and dynamic batch dim), both in
    one difftest.Cases program (one package; case k's inputs are inputs 3k .. 3k + 2)."""
    cases, args, shapes, nets = {}, [], [], {}
    for k, dtype in enumerate(FNUZ):
        torch.manual_seed(0)
        net = nets[dtype] = FnuzNet(dtype)
        x, q, s = torch.randn(3, 8), (torch.randn(4, 5) * 8).to(dtype), torch.tensor(0.25)
        cases[_ids(dtype)] = (Outputs(net), 3)
        args += [x, q, s]
        shapes += [{0: dim(f"n{k}", 1, 16)}, None, None]
    program = Cases(cases)
    compiled, runner = check.compile(program, args, options=kiln.Options(fold_constants=False),
                                     dynamic_shapes=(tuple(shapes),))  # forward(*args)
    weights = {w["fqn"]: w["dtype"] for w in compiled.manifest["weights"]}
    for k, dtype in enumerate(FNUZ):
        name = _ids(dtype)
        assert weights[f"mods.{name}.inner.w"] == name, weights
        assert name in str(compiled.manifest["inputs"][3 * k + 1]), compiled.manifest["inputs"]
    x2 = [torch.randn(11, 8) for _ in FNUZ]
    for xs in ([args[0], args[3]], x2):
        run = [xs[0], *args[1:3], xs[1], *args[4:6]]
        got = runner(*run)
        for k, dtype in enumerate(FNUZ):
            name = _ids(dtype)
            want = nets[dtype](*run[3 * k:3 * k + 3])
            torch.testing.assert_close(got[f"{name}__o0"], want[0], rtol=1e-5, atol=1e-5)
            _bits_equal(got[f"{name}__o1"], want[1], name)
            torch.testing.assert_close(got[f"{name}__o2"], want[2])
            _bits_equal(got[f"{name}__o3"], want[3], name)
    # the other fn / fnuz type of the same width is refused, naming both
    for k, dtype in enumerate(FNUZ):
        name = _ids(dtype)
        other = {torch.float8_e4m3fnuz: torch.float8_e4m3fn,
                 torch.float8_e5m2fnuz: torch.float8_e5m2}[dtype]
        bad = list(args)
        bad[3 * k + 1] = args[3 * k + 1].to(other)
        with pytest.raises(Exception,
                           match=f"input {3 * k + 1} .*expected dtype {name}, got {_ids(other)}"):
            runner(*bad)


class Outputs(nn.Module):
    """`inner`'s tuple of outputs as a dict "o0", "o1", ... (a difftest.Cases case)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return {f"o{k}": v for k, v in enumerate(self.inner(*args))}


def test_fnuz_constants_and_folded_weight(check):
    """fnuz literals in the program (-0.0 -> +0, a rounded 0.3) and a fnuz weight whose
    dequantisation constant folding computes at compile time; both fnuz types' literals and
    nets in one difftest.Cases program (one package)."""
    def consts_of(dtype):
        def consts(x):
            return (torch.full((3,), -0.0, dtype=dtype), torch.full((2,), 0.3, dtype=dtype),
                    (x + torch.ones(3, dtype=dtype).float()).to(dtype))
        return consts

    cases, example, args = {}, [], []
    for dtype in FNUZ:
        cases[f"consts_{_ids(dtype)}"] = (Outputs(Fn(consts_of(dtype))), 1)
        example.append(torch.randn(3))
        args.append(torch.randn(3) * 100)
        torch.manual_seed(1)
        net = FnuzNet(dtype)
        x, q, s = torch.randn(3, 8), (torch.randn(4, 5) * 8).to(dtype), torch.tensor(0.25)
        cases[f"net_{_ids(dtype)}"] = (Outputs(net), 3)
        example += [x, q, s]
        args += [x, q, s]
    program = Cases(cases)
    _, runner = check.compile(program, example)
    got, want = runner(*args), program(*args)
    assert set(got) == set(want) and len(want) == 2 * (3 + 4), sorted(got)
    for k in want:
        if k.endswith(("__o0", "__o2")) and k.startswith("net_"):  # float32 results
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
        else:
            _bits_equal(got[k], want[k], k)


def test_fnuz_other_overflow_rule_is_refused(monkeypatch):
    """A torch whose fnuz conversion differed from kiln's rule (probed, not assumed) is refused
    rather than silently mismatched."""
    from kiln.targets import float8
    monkeypatch.setattr(float8, "fnuz_rule_matches", lambda name: False)
    with pytest.raises(UnsupportedError, match=r"converts float32 to float8_e5m2fnuz with "
                                               r"another overflow rule"):
        kiln.compile(Fn(lambda x: (x * 2).to(torch.float8_e5m2fnuz)), (torch.randn(4, 3),))
