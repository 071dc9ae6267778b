"""float16 and bfloat16 on the CPU: storage types, computed in float32 and rounded on store
(passes/widen_half.py), like eager on the CPU for most ops.

Tolerances, justified against a float64 reference computed from the same (exactly
representable) half inputs: kiln's error may exceed eager's by at most `ULPS` units in the
last place of the half type (relative: float16 2**-10, bfloat16 2**-7) plus a tiny absolute
slack for results near zero. Kiln rounds after each op like eager does, so most outputs are
bit-identical; the slack covers different float32 evaluation orders (GEMM blocking, fused
reductions) that move a result across a rounding boundary. Conversions are checked exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from difftest import Checker, Fn, dim, gen, rand

HALVES = (torch.float16, torch.bfloat16)
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
ULPS = 2


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("half"))


def _ids(v) -> str:
    return str(v).replace(" ", "").removeprefix("torch.")


def _close_as_eager(got: dict, want: dict, ref: dict, dtype, what: str) -> None:
    """|kiln - ref64| <= |eager - ref64| + ULPS * eps * |ref64| + eps * 1e-3 per element."""
    assert got.keys() == want.keys(), what
    for k in want:
        g, w, r = got[k], want[k], ref[k]
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} {k}: {g.dtype}{g.shape}"
        if not w.is_floating_point():
            assert torch.equal(g, w), f"{what} {k}"
            continue
        if w.dtype not in HALVES:
            torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=1e-4)
            continue
        g64, w64, r64 = g.double(), w.double(), r.double()
        assert torch.equal(g64.isnan(), w64.isnan()), f"{what} {k}: NaN positions"
        ok = ~w64.isnan()
        err_k, err_e = (g64 - r64).abs()[ok], (w64 - r64).abs()[ok]
        bound = err_e + ULPS * EPS[dtype] * r64.abs()[ok] + EPS[dtype] * 1e-3
        bad = err_k > bound
        assert not bad.any(), (f"{what} {k} ({dtype}): {int(bad.sum())} elements, worst "
                               f"kiln error {float((err_k - bound).max()):.3g} over bound; "
                               f"got {g64[ok][bad][:4].tolist()} want {w64[ok][bad][:4].tolist()}"
                               f" ref {r64[ok][bad][:4].tolist()}")


def _run(check: Checker, module: nn.Module, args, dtype, what: str, more=(), **kw):
    """Compile at `args`; compare at `args` and each of `more` with eager and float64; returns
    the compiled model."""
    compiled, runner = check.compile(module, args, **kw)
    ref_module = copy.deepcopy(module).double()  # half weights convert to float64 exactly
    for a in [tuple(args), *more]:
        with torch.no_grad():
            want = module(*a)
            ref = ref_module(*[t.double() if t.is_floating_point() else t for t in a])
        _close_as_eager(runner(*a), want, ref, dtype, what)
    return compiled


def ops(x, y, w):
    return {
        "chain": torch.tanh(x * 1.5 + 0.25) - torch.exp(-x.abs()) / 3,
        "add_mixed": x + y.t(),
        "sum": x.sum(-1), "mean": x.mean(0), "amax": x.amax(1), "argmax": x.argmax(1),
        "softmax": torch.softmax(x, -1), "layer_norm": F.layer_norm(x, (x.shape[-1],)),
        "mm": x @ w, "bmm": torch.bmm(x.view(1, *x.shape).expand(2, -1, -1).contiguous(),
                                       w.expand(2, -1, -1)),
        "linear_t": x @ y,
        "where": torch.where(x > 0, x, y.t() * 2),
        "to_f32": x.float() * 3, "from_f32": (x.float() * 3).to(x.dtype),
        "view_t": x.t(), "slice": x[1::2, :3], "cat": torch.cat([x, y.t()], 0),
        "pad": F.pad(x, (1, 2), value=0.5), "to_int": (x * 10).to(torch.int64),
        "int_to_half": (x * 10).to(torch.int32).to(x.dtype),
    }


OPS_SHAPES = [(7, 13), (1, 1), (33, 64)]


def ops_at_each_shape(*args):
    """`ops` on each (x, y, w) triple of `args` (one per shape of OPS_SHAPES), in one program:
    one package instead of one per shape, same kernels (every shape static and separate)."""
    return {f"{_ids(s)}:{k}": v for i, s in enumerate(OPS_SHAPES)
            for k, v in ops(*args[3 * i:3 * i + 3]).items()}


@pytest.mark.parametrize("dtype", HALVES, ids=_ids)
def test_half_ops(check, dtype):
    """`ops` at (7, 13), (1, 1) and (33, 64); outputs named "<shape>:<op>"."""
    args = []
    for shape in OPS_SHAPES:
        g = gen("half", dtype, shape)
        x, y = rand(shape, dtype, g), rand(shape[::-1], dtype, g)
        args += [x, y, rand((shape[1], 5), dtype, g)]
    _run(check, Fn(ops_at_each_shape), args, dtype, "ops")


class Net(nn.Module):
    """Weights stored in the half type (safetensors F16 / BF16)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 3 * 3, 6)

    def forward(self, x):
        y = F.max_pool2d(torch.relu(self.conv(x)), 2)
        y = F.interpolate(y, size=(3, 3), mode="bilinear")
        return {"out": self.fc(y.flatten(1)), "pool": F.avg_pool2d(y, 2, ceil_mode=True)}


@pytest.mark.parametrize("dtype", HALVES, ids=_ids)
def test_half_weights(check, dtype, tmp_path):
    torch.manual_seed(0)
    net = Net().to(dtype).eval()
    x = rand((2, 3, 7, 6), dtype, gen("half-net", dtype))
    # one (dynamic) package both stores the weights and is checked against eager
    compiled = _run(check, net, (x,), dtype, "net",
                    more=[(rand((1, 3, 9, 8), dtype, gen("n2", dtype)),)],
                    dynamic_shapes=({0: dim("n", 1, 4), 2: dim("h", 4, 16), 3: dim("w", 4, 16)},))
    weights = {w["name"]: w["dtype"] for w in compiled.manifest["weights"]}
    assert set(weights.values()) == {dtype.__repr__().removeprefix("torch.")}, weights


@pytest.mark.parametrize("dtype", HALVES, ids=_ids)
def test_half_conversions_exact(check, dtype):
    """float32 -> half rounds to nearest-even with subnormals, overflow to inf, NaN and signed
    zeros; half -> float32 is exact. Compared bit for bit with torch's conversions."""
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"),
                            info.max, info.max * 1.01, -info.max * 2, info.tiny,
                            info.tiny / 3, info.tiny * 0.49, info.eps / 2, 1 + info.eps / 2,
                            1 + info.eps * 1.5, 65519.0, 65520.0, 3.0e38, 1e-45])
    g = gen("conv", dtype)
    wide = torch.cat([special, torch.randn(4000, generator=g) * 10.0 ** torch.randint(
        -12, 12, (4000,), generator=g).float()])
    _, runner = check.compile(Fn(lambda a: {"down": a.to(dtype), "round_trip": a.to(dtype).float(),
                                            "f64": a.double().to(dtype)}), (wide,))
    got = runner(wide)
    for k, want in {"down": wide.to(dtype), "round_trip": wide.to(dtype).float(),
                    "f64": wide.double().to(dtype)}.items():
        assert got[k].dtype == want.dtype
        same = (got[k].view(torch.int16 if want.dtype in HALVES else torch.int32)
                == want.view(torch.int16 if want.dtype in HALVES else torch.int32))
        nan = want.isnan() & got[k].isnan()
        assert (same | nan).all(), (k, wide[~(same | nan)][:5].tolist(),
                                    got[k][~(same | nan)][:5].tolist())


def test_half_input_dtype_checked(check):
    _, runner = check.compile(Fn(lambda a: a * 2), (torch.ones(3, dtype=torch.float16),))
    with pytest.raises(Exception, match="float16"):
        runner(torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(Exception, match="bfloat16|float16"):
        runner(torch.ones(3))


class Lookups(nn.Module):
    """Half tables read by embedding, gather and advanced indexing (moves: exact), then
    computed on (rounded like eager)."""

    def __init__(self, dtype) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8).to(dtype)

    def forward(self, ids, table, idx):
        e = self.emb(ids)
        g = torch.gather(table, 1, idx)
        r = table[ids.reshape(-1) % table.shape[0]]
        return e, g, r, e * 2 + 1


@pytest.mark.parametrize("dtype", HALVES, ids=_ids)
def test_half_lookups_read_half(dtype):
    """Gathers keep the half type (passes/widen_half.py MOVES): equal to eager bit for bit,
    and no float32 copy of a table is made (no float32 buffer the size of one)."""
    from kiln.ir import program as P  # noqa: PLC0415 - test-local

    g = gen("half-lookups", dtype)
    torch.manual_seed(1)
    m = Lookups(dtype).eval()
    ids = torch.randint(0, 50, (3, 4), generator=g)
    table = rand((6, 9), dtype, g)
    idx = torch.randint(0, 9, (6, 5), generator=g)
    compiled = kiln.compile(m, (ids, table, idx))
    got = compiled.load()(ids, table, idx)
    with torch.no_grad():
        want = m(ids, table, idx)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    big = [x for x in P.walk(compiled.built.program.lines) if isinstance(x, P.Alloc)
           and x.dtype.name == "float32" and int(x.numel) >= 50 * 8]
    assert big == [], big
