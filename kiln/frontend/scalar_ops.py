"""Ops with Scalar arguments that kiln neither lowers nor can hand to ATen.

torch's stable C interface (`torch_call_dispatcher`, which kiln's ATen fallback calls) has no
encoding for a `Scalar` argument (its StableIValue <-> IValue conversion covers tensors, ints,
floats, bools, strings, dtypes, devices, layouts, optionals and lists; torch 2.13's
torch/csrc/shim_common.cpp), so an op such as `histc(min=, max=)`, `linalg_vector_norm(ord=)`
or a complex `add(..., alpha=)` cannot go through the fallback as it is. Such an op is
rewritten instead, by `ExportedProgram.run_decompositions`, into ops without Scalars, which
kiln lowers or passes to ATen:

- `REWRITES`: kiln's own exact rewrites (histc as eager's linear-interpolation binning, complex
  add / sub with alpha as the sum of two products, complex addmm with alpha / beta, complex
  full / full_like / scalar_tensor / constant_pad_nd as two real ops joined by `complex`,
  complex var as the sum of the parts' variances);
- otherwise the overload of the same op taking a Tensor for each Scalar (special_zeta with a
  number -> special_zeta of two tensors), the number as a 0-d tensor of eager's result type;
- otherwise torch's registered decomposition of the op (`torch._decomp.decomposition_table`:
  linalg_vector_norm, clamp, hardtanh, leaky_relu, elu, ...).

`rewrite_table(ops)` is the table for the ops the fallback refused; None when one has
neither. A rewrite that returns NotImplemented leaves that call as it is (complex-only
rewrites keep real adds native)."""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from kiln.errors import UnsupportedError

aten = torch.ops.aten


class ScalarArgument(UnsupportedError):
    """The ATen fallback met a Scalar argument: `op` may be rewritten (see rewrite_table)."""

    def __init__(self, message: str, op) -> None:
        super().__init__(message)
        self.op = op


def _histc(x, bins=100, min=0, max=0):
    """eager's histc (ATen histogram_histc_out, linear interpolation without local search):
    edges lo, hi in x's dtype (the data's min and max when min == max, widened by 1 each way
    when they are equal too); an element in [lo, hi] (NaN never) falls in bin
    int((x - lo) * bins / (hi - lo)), the last bin taking its right edge; counts in x's dtype."""
    flat = x.reshape(-1)
    if min == max:
        lo, hi = torch.amin(flat), torch.amax(flat)
        same = lo == hi
        lo, hi = torch.where(same, lo - 1, lo), torch.where(same, hi + 1, hi)
    else:
        lo = torch.full((), min, dtype=x.dtype, device=x.device)
        hi = torch.full((), max, dtype=x.dtype, device=x.device)
    pos = ((flat - lo) * bins / (hi - lo)).to(torch.int64)
    pos = torch.where(pos == bins, bins - 1, pos)
    inside = torch.logical_and(flat >= lo, flat <= hi)
    hit = torch.logical_and(pos.unsqueeze(0) == torch.arange(bins, device=x.device).unsqueeze(1),
                            inside.unsqueeze(0))
    return hit.sum(1).to(x.dtype)


def _complex_number(v, dt: torch.dtype, device) -> torch.Tensor:
    """A Python number as a 0-d complex tensor of type dt: real 0-d values (kiln's own `full`)
    made complex by ATen."""
    re, im = (torch.full((), p, dtype=dt.to_real(), device=device)
              for p in (complex(v).real, complex(v).imag))
    return torch.complex(re, im)


def _complex_filled(shape, v, dt: torch.dtype, device) -> torch.Tensor:
    """A tensor of `shape` filled with the number v, of complex type dt: two real fills."""
    re, im = (torch.full(shape, p, dtype=dt.to_real(), device=device)
              for p in (complex(v).real, complex(v).imag))
    return torch.complex(re, im)


def _complex_full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Complex full / scalar_tensor: the real and imaginary parts filled by kiln, joined by
    ATen (a complex fill value has no encoding in torch's stable C interface)."""
    if dtype is None and isinstance(fill_value, complex):
        dtype = torch.complex128 if torch.get_default_dtype() == torch.float64 \
            else torch.complex64
    if dtype is None or not dtype.is_complex:
        return NotImplemented
    return _complex_filled(tuple(size), fill_value, dtype, device)


def _complex_scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _complex_full((), s, dtype=dtype, layout=layout, device=device)


def _complex_full_like(x, fill_value, *, dtype=None, layout=None, device=None,
                       pin_memory=None, memory_format=None):
    dt = dtype or x.dtype
    if not dt.is_complex:
        return NotImplemented
    return _complex_filled(x.shape, fill_value, dt, device or x.device)


def _complex_pad(x, pad, value=0):
    """Complex constant_pad_nd: the real and imaginary parts padded (by kiln) with the value's
    parts, joined by ATen; torch's decomposition writes in place (prims.copy_to)."""
    if not x.is_complex():
        return NotImplemented
    v = complex(value)
    return torch.complex(torch.constant_pad_nd(x.real, pad, v.real),
                         torch.constant_pad_nd(x.imag, pad, v.imag))


def _complex_var(x, dim=None, *, correction=None, keepdim=False):
    """Complex var = var(real) + var(imag) (the squared modulus of the deviation splits into
    the parts'), each a real var kiln computes itself."""
    if not x.is_complex():
        return NotImplemented
    return (torch.var(x.real, dim, correction=correction, keepdim=keepdim) +
            torch.var(x.imag, dim, correction=correction, keepdim=keepdim))


def _complex_addmm(x, a, b, beta=1, alpha=1):
    """Complex addmm(x, a, b, beta=, alpha=) = beta * x + alpha * (a @ b) (beta == 0 ignores
    x, NaN included, as eager does): mm, products with 0-d tensors and a sum over a stacked
    pair carry no Scalar. torch's own decomposition leaves prims.mul behind."""
    if not (x.is_complex() or a.is_complex()):
        return NotImplemented  # real values: kiln's own GEMM
    dt = torch.result_type(x, a)
    prod = torch.mm(a, b)
    if alpha != 1:
        prod = prod * _complex_number(alpha, dt, a.device)
    if beta == 0:
        return prod
    x = x.to(dt) if beta == 1 else x.to(dt) * _complex_number(beta, dt, x.device)
    return torch.stack(torch.broadcast_tensors(prod, x)).sum(0)


def _complex_add(sign: int):
    def rewrite(x, y, alpha=1):
        if not (x.is_complex() or (y.is_complex() if isinstance(y, torch.Tensor) else
                                   isinstance(y, complex))):
            return NotImplemented  # real values: kiln's own add
        # x + alpha * y as the sum over a stacked pair: mul, stack and sum carry no Scalar
        # (both cast to the result type first: kiln only moves complex values, ATen casts)
        dt = torch.result_type(x, y)
        if dt == torch.complex32:  # ATen has no complex32 sum: in complex64 (eager's math
            # type for complex32), rounded once as eager does
            wide = rewrite(x.to(torch.complex64), y.to(torch.complex64) if isinstance(
                y, torch.Tensor) else y, alpha)
            return wide.to(torch.complex32)
        if not isinstance(y, torch.Tensor):  # a Python number (`z + 1`)
            y = _complex_number(y, dt, x.device)
        pair = torch.broadcast_tensors(x.to(dt), y.to(dt) * (sign * alpha))
        return torch.stack(pair).sum(0)
    return rewrite


REWRITES = {aten.histc.default: _histc, aten.add.Tensor: _complex_add(1),
            aten.sub.Tensor: _complex_add(-1), aten.addmm.default: _complex_addmm,
            aten.full.default: _complex_full, aten.full_like.default: _complex_full_like,
            aten.scalar_tensor.default: _complex_scalar_tensor,
            aten.constant_pad_nd.default: _complex_pad, aten.var.correction: _complex_var}


def _tensor_overload(op):
    """A rewrite calling the overload of `op`'s packet that takes a Tensor where `op` takes a
    Scalar (`special_zeta.other_scalar` -> `special_zeta.default`, `pow.Scalar` ->
    `pow.Tensor_Tensor`), the Scalar as a 0-d tensor of the type eager computes in; None
    when there is no such overload."""
    schema = op._schema
    names = [a.name for a in schema.arguments]
    scalars = {a.name for a in schema.arguments if a.type.kind() == "NumberType"}
    for name in op.overloadpacket.overloads():
        other = getattr(op.overloadpacket, name)
        args = other._schema.arguments
        if other is op or [a.name for a in args] != names or len(other._schema.returns) != \
                len(schema.returns):
            continue
        kinds = {a.name: a.type.kind() for a in args}
        same = all(kinds[a.name] == ("TensorType" if a.name in scalars else a.type.kind())
                   for a in schema.arguments)
        if same:
            def rewrite(*a, _other=other, **kw):
                bound = dict(zip(names, a), **kw)
                tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
                for n in scalars:
                    v = bound[n]
                    dt = torch.result_type(tensors[0], v) if tensors else \
                        torch.tensor(v).dtype
                    dev = tensors[0].device if tensors else None
                    bound[n] = torch.full((), v, dtype=dt, device=dev)  # (unlike torch.tensor:
                    # functional)
                return _other(**bound)
            return rewrite
    return None


def rewrite_table(ops) -> dict | None:
    """torch's default decompositions plus a rewrite for each of `ops`; None when one of them
    has none."""
    table = torch.export.default_decompositions()
    for op in ops:
        fn = REWRITES.get(op) or _tensor_overload(op) or decomposition_table.get(op)
        if fn is None:
            return None
        table[op] = fn
    return table
