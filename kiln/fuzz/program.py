"""A fuzz program: a small JSON-able op list, the nn.Module that runs it, and its inputs.

A spec is a dict::

    {"seed": int, "dynamic": bool,
     "inputs": [{"shape": [int | "B", ...], "dtype": "float32", "high": int | None}, ...],
     "params": {"p0": {"shape": [...], "init": "w" | "ln"}, ...},
     "ops": [[op, [value ids], {attrs}], ...], "outputs": [value ids]}

Values are numbered inputs first, then one per op. "B" is the one dynamic dimension
(`torch.export.Dim("B", min=B_MIN, max=B_MAX)`); it only ever appears as dim 0 of an input.
`FuzzModule(spec, ref64=True)` is the float64 reference: float32 inputs, parameters and casts
become float64, everything else is the same program. Int inputs with a "high" are indices in
[0, high); other ints are in [-20, 20)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.ir import dtypes

B_MIN, B_MAX, B_EXAMPLE = 2, 9, 3
# input layouts the runner gives programs besides the contiguous one (`runner.relaid`), and
# that gen_coverage.export_layout exports some programs with
LAYOUTS = ("transposed", "step", "offset", "channels_last")

UNARY = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1), "hardswish": F.hardswish,
    "exp_c": lambda x: torch.exp(torch.clamp(x, -8, 8)),
    "log_s": lambda x: torch.log(torch.abs(x) + 1), "sqrt_s": lambda x: torch.sqrt(torch.abs(x)),
    "recip_s": lambda x: torch.reciprocal(torch.abs(x) + 0.5), "square": lambda x: x * x,
    "clamp": lambda x: torch.clamp(x, -1, 1), "rsqrt_s": lambda x: torch.rsqrt(x * x + 1),
    "log1p_s": lambda x: torch.log1p(torch.abs(x)), "expm1_c": lambda x: torch.expm1(
        torch.clamp(x, max=5)), "atan": torch.atan, "hardsigmoid": F.hardsigmoid,
    # discontinuous: only applied to exactly known values (see generator)
    "floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "sign": torch.sign,
    "trunc": torch.trunc,
}
INT_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "rem_c": lambda x: torch.remainder(x, 7),
    "fdiv_c": lambda x: torch.floor_divide(x, 3), "fmod_c": lambda x: torch.fmod(x, 5),
    "bnot": torch.bitwise_not, "square": lambda x: x * x,
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum,
    "minimum": torch.minimum, "div_s": lambda a, b: a / (torch.abs(b) + 0.5),
    "atan2": torch.atan2, "add_alpha": lambda a, b: torch.add(a, b, alpha=2),
    "bitwise_and": torch.bitwise_and, "bitwise_xor": torch.bitwise_xor,
    "bitwise_or": torch.bitwise_or, "lt": torch.lt, "gt": torch.gt, "eq": torch.eq,
    "ge": torch.ge, "ne": torch.ne, "logical_and": torch.logical_and,
    "logical_or": torch.logical_or, "logical_xor": torch.logical_xor,
}
REDUCE = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin,
          "prod": torch.prod, "any": torch.any, "all": torch.all}


def _apply(op: str, xs: list, a: dict, p, ref64: bool):
    x = xs[0] if xs else None
    if op in ("unary", "int_unary"):
        return (UNARY if op == "unary" else INT_UNARY)[a["fn"]](x)
    if op == "binary":
        return BINARY[a["fn"]](x, xs[1])
    if op == "logical_not":
        return torch.logical_not(x)
    if op == "where":
        return torch.where(x, xs[1], xs[2])
    if op == "cast":
        dt = a["dtype"]
        return x.to(torch.float64 if ref64 and dt == "float32" else dtypes.dtype(dt).torch)
    if op == "reduce":
        fn = REDUCE[a["fn"]]
        if a["fn"] in ("prod", "any", "all"):  # single-dim overloads only
            return fn(x, a["dims"][0], keepdim=a["keep"])
        return fn(x, a["dims"], keepdim=a["keep"])
    if op == "var":
        return torch.var(x, a["dims"], correction=a["corr"], keepdim=a["keep"])
    if op == "argmax":
        return (torch.argmax if a["max"] else torch.argmin)(x, a["dim"], keepdim=a["keep"])
    if op == "permute":
        return x.permute(*a["dims"])
    if op == "transpose":
        return x.transpose(a["d0"], a["d1"])
    if op == "slice":
        idx = [slice(None)] * x.dim()
        idx[a["dim"]] = slice(a["start"], a["end"], a["step"])
        return x[tuple(idx)]
    if op == "select":
        return x.select(a["dim"], a["index"])
    if op == "unsqueeze":
        return x.unsqueeze(a["dim"])
    if op == "squeeze":
        return x.squeeze(a["dim"])
    if op == "reshape":
        return x.reshape([-1 if d == "B" else d for d in a["shape"]])
    if op == "expand":
        return x.expand(*a["shape"])
    if op == "cat":
        return torch.cat(xs, a["dim"])
    if op == "chunk":
        return torch.chunk(x, a["n"], a["dim"])[a["k"]]
    if op == "pad":
        return F.pad(x, a["pad"], value=a["value"])
    if op == "contiguous":
        return x.contiguous()
    if op == "softmax":
        return (F.log_softmax if a["log"] else F.softmax)(x, a["dim"])
    if op == "layer_norm":
        w = p[a["w"]] if a.get("w") else None
        b = p[a["b"]] if a.get("b") else None
        return F.layer_norm(x, x.shape[-a["rank"]:], w, b, eps=1e-5)
    if op == "linear":
        return F.linear(x, p[a["w"]], p[a["b"]] if a.get("b") else None)
    if op == "mm_w":
        w = p[a["w"]]
        return x @ (w.t() if a.get("t") else w)
    if op == "matmul":
        return torch.matmul(x, xs[1])
    if op == "self_mm":
        return x @ x.transpose(-1, -2)
    if op == "conv2d":
        return F.conv2d(x, p[a["w"]], p[a["b"]] if a.get("b") else None, a["stride"],
                        a["padding"], a["dilation"], a["groups"])
    if op == "pool":
        if a["max"]:
            return F.max_pool2d(x, a["k"], a["s"], a["pad"])
        return F.avg_pool2d(x, a["k"], a["s"], a["pad"])
    if op == "embedding":
        return F.embedding(x, p[a["w"]])
    if op == "index_select":
        return torch.index_select(x, a["dim"], xs[1])
    if op == "gather":
        return torch.gather(x, a["dim"], xs[1])
    if op == "adv_index":
        idx = [slice(None)] * a["dim"] + [xs[1]]
        return x[tuple(idx)]
    if op == "attention":
        m = xs[3] if len(xs) > 3 else None
        if m is not None and a.get("empty_row"):  # query row 0 keeps no key
            m = torch.logical_and(m, (torch.arange(m.shape[-2]) != 0).unsqueeze(-1))
        if m is not None and a["mask"] == "float":  # the same mask as 0 / -inf, added
            m = torch.zeros(m.shape, dtype=x.dtype).masked_fill(~m, float("-inf"))
        elif m is not None and a["mask"] == "finfo":  # HF's form: the lowest finite value
            m = torch.zeros(m.shape, dtype=x.dtype).masked_fill(~m, torch.finfo(x.dtype).min)
        return F.scaled_dot_product_attention(x, xs[1], xs[2], attn_mask=m,
                                              is_causal=a.get("causal", False))
    if op == "repeat_interleave":  # a length known only from the data, without a bound
        return torch.repeat_interleave(x, xs[1])
    if op == "item_rows":  # k = repeats.sum().item() rows, checked only k >= 0
        k = x.sum().item()
        torch._check(k >= 0)
        return torch.ones(k, xs[1].shape[0], dtype=xs[1].dtype) * xs[1]
    if op == "ragged_scale":
        return torch.tanh(x) * 2 + 1
    if op == "ragged_sum":
        return x.sum(0)
    if op == "complex":
        za = torch.complex(x, xs[1]) if x.shape == xs[1].shape else torch.complex(
            *torch.broadcast_tensors(x, xs[1]))
        zb = torch.complex(za.imag, za.real)
        fn = a["fn"]
        if fn == "mul_abs":
            return (za * zb).abs()
        if fn == "conj_mul_real":
            return (za * zb.conj()).real
        if fn == "exp_imag":
            return torch.exp(za * 0.25).imag
        if fn == "add_real":
            return (za + zb * 2).real
        if fn == "fft_abs":
            return torch.fft.fft(za, dim=-1).abs()
        return za * 2  # "keep": a complex output
    if op in SCATTERS or op in SORTS:
        return (SCATTERS.get(op) or SORTS[op])(x, xs, a)
    raise ValueError(f"unknown fuzz op {op!r}")


def _index_put(x, xs, a, acc: bool):
    return x.index_put((xs[1],), xs[2], accumulate=acc)


# kiln/fuzz/gen_index_sort.py's ops: (x, [x, index, src], attrs) -> value
SCATTERS = {
    "index_put": lambda x, xs, a: _index_put(x, xs, a, False),
    "index_put_acc": lambda x, xs, a: _index_put(x, xs, a, True),
    "index_add": lambda x, xs, a: torch.index_add(x, a["dim"], xs[1], xs[2], alpha=a["alpha"]),
    "index_copy": lambda x, xs, a: torch.index_copy(x, a["dim"], xs[1], xs[2]),
    "scatter": lambda x, xs, a: torch.scatter(x, a["dim"], xs[1], xs[2]),
    "scatter_add": lambda x, xs, a: torch.scatter_add(x, a["dim"], xs[1], xs[2]),
    "scatter_reduce": lambda x, xs, a: torch.scatter_reduce(
        x, a["dim"], xs[1], xs[2], a["reduce"], include_self=a["include_self"]),
}


def _unique(x, a):
    if a["dim"] is None:
        out = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    else:
        out = torch.unique_consecutive(x, return_inverse=True, return_counts=True, dim=a["dim"])
    return out[a["part"]]


SORTS = {
    "sort": lambda x, xs, a: torch.sort(x, dim=a["dim"], descending=a["descending"],
                                        stable=True)[a["part"]],
    "argsort": lambda x, xs, a: torch.argsort(x, dim=a["dim"], descending=a["descending"],
                                              stable=True),
    "msort": lambda x, xs, a: torch.msort(x),
    "topk": lambda x, xs, a: torch.topk(x, a["k"], a["dim"], largest=a["largest"])[0],
    "kthvalue": lambda x, xs, a: torch.kthvalue(x, a["k"], a["dim"], a["keepdim"])[0],
    "median": lambda x, xs, a: torch.median(x, a["dim"], a["keepdim"])[0],
    "unique": lambda x, xs, a: _unique(x, a),
    "unique_consecutive": lambda x, xs, a: torch.unique_consecutive(
        x, return_inverse=True, return_counts=True, dim=a["dim"])[a["part"]],
}


def _init(shape, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "ln":
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    fan = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return (torch.rand(shape, generator=g) * 2 - 1) / math.sqrt(max(fan, 1))


@dataclass
class V:
    """A value of a spec being generated: its shape ("B" a dynamic dim), dtype and whether
    it is exact (integers, or floats computed without rounding)."""

    shape: tuple
    dtype: str
    exact: bool


class FuzzModule(nn.Module):
    """Runs a spec's op list (parameters seeded from the spec)."""

    def __init__(self, spec: dict, ref64: bool = False) -> None:
        super().__init__()
        self.spec, self.ref64 = spec, ref64
        g = torch.Generator().manual_seed(int(spec["seed"]) & 0xFFFFFFFF)
        self.p = nn.ParameterDict({
            k: nn.Parameter(_init(tuple(v["shape"]), v["init"], g), requires_grad=False)
            for k, v in sorted(spec["params"].items())})
        if ref64:
            self.double()
        self.eval()

    def forward(self, *inputs):
        vals = list(inputs)
        for op, args, attrs in self.spec["ops"]:
            vals.append(_apply(op, [vals[i] for i in args], attrs, self.p, self.ref64))
        return tuple(vals[i] for i in self.spec["outputs"])


def bshape(a: tuple, b: tuple) -> tuple:
    """The broadcast of shapes a and b ("B" a dim like any other); ValueError if none."""
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ValueError(f"shapes {a} and {b} do not broadcast")
    return tuple(out)


def concrete(shape, b: int) -> tuple[int, ...]:
    return tuple(b if d == "B" else int(d) for d in shape)


def make_inputs(spec: dict, seed: int, b: int = B_EXAMPLE) -> tuple[torch.Tensor, ...]:
    """Fresh contiguous inputs for `spec` with the dynamic dim at `b`."""
    g = torch.Generator().manual_seed(seed & 0xFFFFFFFF)
    out = []
    for i in spec["inputs"]:
        shape, dt = concrete(i["shape"], b), i["dtype"]
        if dt.startswith("float"):
            x = torch.randn(shape, generator=g, dtype=torch.float64)
            out.append(x.to(dtypes.dtype(dt).torch))
        elif dt == "bool":
            out.append(torch.randint(0, 2, shape, generator=g).bool())
        elif i.get("high"):
            out.append(torch.randint(0, int(i["high"]), shape, generator=g))
        else:
            out.append(torch.randint(-20, 20, shape, generator=g))
    return tuple(out)


def to_ref64(args) -> tuple:
    return tuple(a.double() if a.dtype == torch.float32 else a for a in args)


def dynamic_shapes(spec: dict):
    if not spec.get("dynamic"):
        return None
    # how the Dim is declared varies: bounded, no max, default min, neither
    kind = spec.get("dim", "bounded")
    kw = {"bounded": {"min": B_MIN, "max": B_MAX}, "no_max": {"min": B_MIN},
          "default_min": {"max": B_MAX}, "default": {}}[kind]
    dim = torch.export.Dim("B", **kw)
    return (tuple({0: dim} if i["shape"] and i["shape"][0] == "B" else None
                  for i in spec["inputs"]),)


def uses_float32(spec: dict) -> bool:
    return any(i["dtype"] == "float32" for i in spec["inputs"]) or bool(spec["params"]) or any(
        op == "cast" and a["dtype"] == "float32" for op, _, a in spec["ops"])


def clone(spec: dict) -> dict:
    return copy.deepcopy(spec)
