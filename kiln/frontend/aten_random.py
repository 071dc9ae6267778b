"""Converters for random ops: rand/randn (and _like), randint, bernoulli, native_dropout,
normal, uniform.

Every random value is a Graph IR `random` node (uniform in [0, 1) or standard normal), a pure
function of (seed, run counter, the node's stream number, the element's row-major index)
through kiln's Philox4x32-10 (lowering/random.py); the distributions' parameters are ordinary
pointwise nodes after it, so everything fuses. The seed and the run counter live in one state
buffer (`Builder.rng_state`, initialised to [Options.seed, 0]); each run adds 1 to the
counter, so successive runs draw fresh numbers and a freshly loaded model replays the same
sequence. Values are not bit-equal to torch's generator (which kiln does not use)."""

from __future__ import annotations

import torch

from kiln.errors import UnsupportedError
from kiln.frontend.aten_table import register
from kiln.ir import dtypes


def _random(b, n, dist: str, like=None, result=None, shape_of=None) -> str:
    """A `random` node of n's shape (or `shape_of`'s), in n's dtype when that is a float."""
    dt = b.meta_dtype(n) if result is None else n.meta["val"][result].dtype
    compute = dt if dt in (torch.float32, torch.float64) else torch.float32
    name = b.emit("random", [b.rng_state()], None, like=n, result=result, shape_of=shape_of,
                  dtype=dtypes.from_torch(compute), dist=dist,
                  stream=b.rng_stream())
    return name


def _finish(b, n, value: str, result=None) -> str:
    """Cast to n's dtype, naming the last node after n (or n's result)."""
    if result is not None:
        return b.emit("cast", [value], None, like=n, result=result)
    return b.emit("cast", [value], n)


@register("aten.rand.default", "aten.rand_like.default", "aten.randn.default",
          "aten.randn_like.default")
def _rand(b, n):
    dist = "normal" if "randn" in str(n.target) else "uniform"
    return _finish(b, n, _random(b, n, dist))


@register("aten.uniform.default")
def _uniform(b, n):
    low = float(n.args[1] if len(n.args) > 1 else n.kwargs.get("from", 0.0))
    high = float(n.args[2] if len(n.args) > 2 else n.kwargs.get("to", 1.0))
    u = _random(b, n, "uniform")
    dt = b.types[u].dtype
    scaled = b.emit("mul", [u, _scalar(b, high - low, dt)], None, like=n, dtype=dt)
    return _finish(b, n, b.emit("add", [scaled, _scalar(b, low, dt)], None, like=n, dtype=dt))


def _scalar(b, value, dt: dtypes.DType) -> str:
    return b.scalar(value, dt.torch)


@register("aten.normal.Tensor_Tensor", "aten.normal.Tensor_float", "aten.normal.float_Tensor",
          "aten.normal.float_float", "aten.normal_functional.default")
def _normal(b, n):
    """mean + std * z, broadcasting tensor mean / std like eager."""
    name = str(n.target)
    if "normal_functional" in name:
        mean = n.args[1] if len(n.args) > 1 else n.kwargs.get("mean", 0.0)
        std = n.args[2] if len(n.args) > 2 else n.kwargs.get("std", 1.0)
    else:
        mean = n.args[0] if n.args else n.kwargs.get("mean", 0.0)
        std = n.args[1] if len(n.args) > 1 else n.kwargs.get("std", 1.0)
    z = _random(b, n, "normal")
    dt = b.types[z].dtype
    t = dt.torch

    def operand(v):
        return _scalar(b, float(v), dt) if isinstance(v, (int, float)) else \
            b.cast_to(b.tensor(v), t, n)

    scaled = b.emit("mul", [z, operand(std)], None, like=n, dtype=dt)
    return _finish(b, n, b.emit("add", [scaled, operand(mean)], None, like=n, dtype=dt))


@register("aten.randint.default", "aten.randint.low", "aten.randint_like.default",
          "aten.randint_like.low_dtype")
def _randint(b, n):
    """low + floor(u * (high - low)) with u uniform in [0, 1) as float64 (53 random bits)."""
    name = str(n.target)
    if name in ("aten.randint.low", "aten.randint_like.low_dtype"):
        low, high = n.args[1 if "like" in name else 0], n.args[2 if "like" in name else 1]
    else:
        low, high = 0, n.args[1 if "like" in name else 0]
    if not isinstance(low, int) or not isinstance(high, int):
        raise UnsupportedError(f"randint with symbolic bounds (node {n.name})")
    if high <= low:
        raise UnsupportedError(f"randint with an empty range [{low}, {high}) (node {n.name})")
    f64 = dtypes.float64
    u = b.emit("random", [b.rng_state()], None, like=n, dtype=f64, dist="uniform",
               stream=b.rng_stream())
    scaled = b.emit("mul", [u, _scalar(b, float(high - low), f64)], None, like=n, dtype=f64)
    fl = b.emit("floor", [scaled], None, like=n, dtype=f64)
    shifted = b.emit("add", [fl, _scalar(b, float(low), f64)], None, like=n, dtype=f64)
    return _finish(b, n, shifted)


@register("aten.bernoulli.default", "aten.bernoulli.p")
def _bernoulli(b, n):
    """1 where u < p (p a tensor of probabilities, or a float), else 0, in n's dtype."""
    x = n.args[0]
    p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", x)
    u = _random(b, n, "uniform")
    dt = b.types[u].dtype
    pv = _scalar(b, float(p), dt) if isinstance(p, (int, float)) else \
        b.cast_to(b.tensor(p), dt.torch, n)
    keep = b.emit("lt", [u, pv], None, like=n, dtype=dtypes.bool_)
    return _finish(b, n, keep)


@register("aten.native_dropout.default")
def _native_dropout(b, n):
    """(x * mask / (1 - p), mask) with mask = u >= p: each element kept with probability
    1 - p; train=False gives (x, all true); p = 1 drops everything."""
    x, p = n.args[0], float(n.args[1])
    train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
    xs = b.tensor(x)
    if train is False or p == 0.0:
        ones = b.emit("full", [], None, like=n, result=1, value=True)
        return [b.emit("cast", [xs], None, like=n, result=0), ones]
    u = _random(b, n, "uniform", result=0)
    dt = b.types[u].dtype
    mask = b.emit("ge", [u, _scalar(b, p, dt)], None, like=n, result=1)
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    odt = b.meta_dtype(n)
    kept = b.emit("where", [mask, xs, b.scalar(0.0, odt)], None, like=n, result=0)
    out = b.emit("mul", [kept, b.scalar(scale, odt)], None, like=n, result=0)
    return [out, mask]
