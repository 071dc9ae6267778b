"""Lowering rules for views and data movement: reshape, permute, expand, slice, select, cat,
pad. Views compose index maps; when the source is an affine view of a buffer the result keeps
(buffer, offset, strides) so that no copy is ever made for it."""

from __future__ import annotations

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import FloorDiv, ModIdx, linear_index, product, unravel
from kiln.lowering.core import Index, Lazy, LowerCtx, View, from_view
from kiln.ops.build import cast, const, op
from kiln.ir.sym import contiguous_strides
from kiln.errors import UnsupportedError


def _same(a, b) -> bool:
    return sympy.expand(a - b) == 0


def _divides(big, small) -> bool:
    q = sympy.cancel(big / small)
    num, den = sympy.fraction(q)
    return den == 1 and (not num.is_Number or (num.is_Integer and int(num) >= 1))


def reshape_groups(old, new) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of `old` dims with runs of `new` dims of equal product (size-1 dims may sit in
    any group). None when the shapes cannot be matched run by run."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(old) or j < len(new):
        go, gn = [], []
        po = pn = sympy.Integer(1)
        while True:
            if i < len(old) and (not go or not _same(po, pn)) and (
                    not gn or _divides(pn, po * old[i]) or not go):
                go.append(i)
                po = po * old[i]
                i += 1
            elif j < len(new) and (not gn or not _same(po, pn)):
                gn.append(j)
                pn = pn * new[j]
                j += 1
            else:
                break
            if go and gn and _same(po, pn):
                # absorb trailing size-1 dims into this group
                while i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
                    go.append(i)
                    i += 1
                while j < len(new) and new[j] == 1 and (i >= len(old) or old[i] != 1):
                    gn.append(j)
                    j += 1
                break
            if i >= len(old) and j >= len(new):
                break
        if not _same(po, pn):
            return None
        groups.append((go, gn))
    return groups


def _group_strides(old_shape, old_strides, go, new_shape, gn):
    """Strides for the new dims of one group, when the old group is mergeable, else None."""
    dims = [k for k in go if old_shape[k] != 1]
    for a, b in zip(dims, dims[1:]):
        if not _same(old_strides[a], old_strides[b] * old_shape[b]):
            return None
    inner = old_strides[dims[-1]] if dims else sympy.Integer(1)
    out = []
    acc = inner
    for k in reversed(gn):
        out.append(acc)
        acc = acc * new_shape[k]
    return list(reversed(out))


def lower_view(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    new = node.type.shape
    shape = node.attr("shape", None)
    if shape is not None:
        new = tuple(sympy.sympify(s) for s in shape)
    groups = reshape_groups(x.shape, new)
    if x.view is not None and groups is not None:
        strides: list = [None] * len(new)
        ok = True
        for go, gn in groups:
            st = _group_strides(x.shape, x.view.strides, go, new, gn)
            if st is None:
                ok = False
                break
            for k, s in zip(gn, st):
                strides[k] = sympy.expand(s)
        if ok:
            return from_view(x.dtype, new, View(x.view.buf, x.view.offset, tuple(strides)))

    def fn(idx: Index) -> L.Expr:
        old_idx: list = [sympy.Integer(0)] * len(x.shape)
        if groups is None:
            flat = linear_index(idx, _contig(new))
            return x.load(unravel(flat, x.shape))
        for go, gn in groups:
            flat = linear_index([idx[k] for k in gn], _contig([new[k] for k in gn]))
            sub = [x.shape[k] for k in go]
            vals = unravel(flat, sub) if len(go) > 1 else (flat,)
            for k, v in zip(go, vals):
                old_idx[k] = v if x.shape[k] != 1 else sympy.Integer(0)
        return x.load(tuple(old_idx))

    return Lazy(x.dtype, new, fn, None, x.cost)


def _contig(shape):
    return contiguous_strides(shape)


def lower_permute(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    dims = node.attr("dims")
    shape = tuple(x.shape[d] for d in dims)
    if x.view is not None:
        v = x.view
        return from_view(x.dtype, shape, View(v.buf, v.offset, tuple(v.strides[d] for d in dims)))

    def fn(idx: Index) -> L.Expr:
        src = [None] * len(dims)
        for k, d in enumerate(dims):
            src[d] = idx[k]
        return x.load(tuple(src))

    return Lazy(x.dtype, shape, fn, None, x.cost)


def lower_expand(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    out = node.type.shape
    off = len(out) - x.rank
    if x.view is not None:
        strides = [sympy.Integer(0)] * off + [
            sympy.Integer(0) if (x.shape[k] == 1 and out[k + off] != 1) else x.view.strides[k]
            for k in range(x.rank)]
        return from_view(x.dtype, out, View(x.view.buf, x.view.offset, tuple(strides)))

    def fn(idx: Index) -> L.Expr:
        return x.load(tuple(sympy.Integer(0) if (x.shape[k] == 1 and out[k + off] != 1)
                            else idx[k + off] for k in range(x.rank)))

    return Lazy(x.dtype, out, fn, None, x.cost)


def _clamp_slice(start, end, size):
    def norm(v, default):
        if v is None:
            return default
        v = sympy.sympify(v)
        if v.is_Integer and int(v) < 0:
            v = size + v
        if v.is_Integer and size.is_Integer:
            return sympy.Integer(max(0, min(int(v), int(size))))
        if v.is_Integer and int(v) >= 2**62:
            return size
        return v
    return norm(start, sympy.Integer(0)), norm(end, size)


def lower_slice(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    dim, step = node.attr("dim"), node.attr("step")
    start, _ = _clamp_slice(node.attr("start"), node.attr("end"), x.shape[dim])
    shape = node.type.shape
    if x.view is not None:
        v = x.view
        strides = list(v.strides)
        strides[dim] = v.strides[dim] * step
        offset = sympy.expand(v.offset + start * v.strides[dim])
        return from_view(x.dtype, shape, View(v.buf, offset, tuple(strides)))

    def fn(idx: Index) -> L.Expr:
        src = list(idx)
        src[dim] = sympy.expand(start + step * idx[dim])
        return x.load(tuple(src))

    return Lazy(x.dtype, shape, fn, None, x.cost)


def lower_select(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    dim = node.attr("dim")
    index = sympy.sympify(node.attr("index"))
    if index.is_Integer and int(index) < 0:
        index = x.shape[dim] + index
    shape = node.type.shape
    if x.view is not None:
        v = x.view
        strides = tuple(s for k, s in enumerate(v.strides) if k != dim)
        offset = sympy.expand(v.offset + index * v.strides[dim])
        return from_view(x.dtype, shape, View(v.buf, offset, strides))

    def fn(idx: Index) -> L.Expr:
        return x.load(tuple(idx[:dim]) + (index,) + tuple(idx[dim:]))

    return Lazy(x.dtype, shape, fn, None, x.cost)


def lower_cat(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    dim = node.attr("dim")
    shape, dt = node.type.shape, node.type.dtype
    starts = []
    acc = sympy.Integer(0)
    for a in args:
        starts.append(acc)
        acc = acc + a.shape[dim]

    def fn(idx: Index) -> L.Expr:
        i = idx[dim]
        out = None
        for a, s in zip(args, starts):
            local = list(idx)
            local[dim] = sympy.expand(i - s)
            val = cast(_guarded_load(a, local, dim), dt)
            if out is None:
                out = val
            else:
                cond = op("ge", L.Index(i, dtypes.int64), L.Index(s, dtypes.int64),
                          dtype=dtypes.bool_)
                out = op("where", cond, val, out)
        return out

    return Lazy(dt, shape, fn, None, len(args) * 2 + sum(a.cost for a in args))


def _guarded_load(a: Lazy, idx, dim) -> L.Expr:
    """Load from `a` at an index that may be out of range on `dim` for lanes another branch
    selects: clamp it into range so the load is always in bounds."""
    i = idx[dim]
    idx = list(idx)
    idx[dim] = sympy.Max(sympy.Integer(0), sympy.Min(i, a.shape[dim] - 1))
    return a.load(tuple(idx))


def lower_pad(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    pad = node.attr("pad")
    value = node.attr("value")
    shape, dt = node.type.shape, node.type.dtype
    rank = len(shape)
    pads = {rank - 1 - k // 2: (pad[k], pad[k + 1]) for k in range(0, len(pad), 2)
            if (pad[k], pad[k + 1]) != (0, 0)}  # (a dim padded by nothing reads as it is)
    if not pads and tuple(shape) == tuple(x.shape) and x.dtype == dt:
        return x

    def fn(idx: Index) -> L.Expr:
        src = list(idx)
        conds = []
        for d, (lo, _hi) in pads.items():
            s = sympy.expand(idx[d] - lo)
            conds.append(op("ge", L.Index(s, dtypes.int64), const(0, dtypes.int64),
                            dtype=dtypes.bool_))
            conds.append(op("lt", L.Index(s, dtypes.int64),
                            L.Index(x.shape[d], dtypes.int64), dtype=dtypes.bool_))
            src[d] = sympy.Max(sympy.Integer(0), sympy.Min(s, x.shape[d] - 1))
        inside = conds[0]
        for c in conds[1:]:
            inside = op("logical_and", inside, c, dtype=dtypes.bool_)
        return op("where", inside, cast(x.load(tuple(src)), dt), const(value, dt))

    return Lazy(dt, shape, fn, None, x.cost + 4 * len(pads))


__all__ = ["lower_view", "lower_permute", "lower_expand", "lower_slice", "lower_select",
           "lower_cat", "lower_pad", "FloorDiv", "ModIdx", "product"]


# -- more views: flip, roll, diagonal, as_strided -----------------------------------------------
def _int_value(e) -> L.Expr:
    return L.Index(sympy.sympify(e), dtypes.int64)


def _all(conds: list[L.Expr]) -> L.Expr:
    out = conds[0]
    for c in conds[1:]:
        out = op("logical_and", out, c, dtype=dtypes.bool_)
    return out


def _cmp(name: str, a, b) -> L.Expr:
    return op(name, _int_value(a), _int_value(b), dtype=dtypes.bool_)


def lower_flip(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """An index map (not a strided view: extern consumers take only non-negative strides)."""
    (x,) = args
    dims = node.attr("dims")

    def fn(idx: Index) -> L.Expr:
        return x.load(tuple(sympy.expand(x.shape[d] - 1 - i) if d in dims else i
                            for d, i in enumerate(idx)))

    return Lazy(x.dtype, x.shape, fn, None, x.cost)


def lower_roll(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """out[i] = x[(i - shift) mod n] on each rolled dim (static sizes: shift taken mod n)."""
    (x,) = args
    shifts = dict(zip(node.attr("dims"), node.attr("shifts")))
    for d, s in list(shifts.items()):
        shifts[d] = s % int(x.shape[d]) if int(x.shape[d]) else 0

    def fn(idx: Index) -> L.Expr:
        src = []
        for d, i in enumerate(idx):
            s = shifts.get(d, 0)
            src.append(ModIdx(i + int(x.shape[d]) - s, x.shape[d]) if s else i)
        return x.load(tuple(src))

    return Lazy(x.dtype, x.shape, fn, None, x.cost)


def _diag_starts(offset: int):
    return (max(0, -offset), max(0, offset))


def lower_diagonal(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """Other dims in order, then the diagonal (dim1 = start1 + k, dim2 = start2 + k)."""
    (x,) = args
    d1, d2 = node.attr("dim1"), node.attr("dim2")
    s1, s2 = _diag_starts(node.attr("offset"))
    rest = [d for d in range(x.rank) if d not in (d1, d2)]
    shape = node.type.shape
    if x.view is not None:
        v = x.view
        strides = tuple(v.strides[d] for d in rest) + (v.strides[d1] + v.strides[d2],)
        offset = sympy.expand(v.offset + s1 * v.strides[d1] + s2 * v.strides[d2])
        return from_view(x.dtype, shape, View(v.buf, offset, strides))

    def fn(idx: Index) -> L.Expr:
        src: list = [None] * x.rank
        for d, i in zip(rest, idx):
            src[d] = i
        k = idx[-1]
        src[d1], src[d2] = s1 + k, s2 + k
        return x.load(tuple(src))

    return Lazy(x.dtype, shape, fn, None, x.cost)


def lower_as_strided(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """A view of the input's storage as torch lays it out (`src_strides`): taken as is when
    kiln's view of the input has those strides, else (a contiguous input) from a contiguous
    copy; other layouts are unsupported."""
    x = args[0]

    def layout(strides):  # strides of size-1 dims address nothing
        return tuple(sympy.expand(s) for s, d in zip(strides, x.shape) if d != 1)

    theirs = layout(node.attr("src_strides"))
    ours = layout(x.view.strides) if x.view is not None else None
    if ours != theirs:
        if theirs != layout(contiguous_strides(x.shape)):
            raise UnsupportedError(f"as_strided of a value whose layout kiln does not keep "
                                   f"(node {node.name}, strides {node.attr('src_strides')})")
        x = ctx.realize(x.origin or node.name + "_storage", x, (node.source or node.name,))
    v = x.view
    return from_view(x.dtype, node.type.shape, View(
        v.buf, sympy.expand(v.offset + node.attr("offset")), tuple(node.attr("stride"))))


# -- scatter into a view: where(element is in the view, src at its view index, input) ---------
def lower_slice_scatter(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x, src = args
    dim, step = node.attr("dim"), node.attr("step")
    start, _ = _clamp_slice(node.attr("start"), node.attr("end"), x.shape[dim])
    count = src.shape[dim]
    if count == 0:
        return x

    def fn(idx: Index) -> L.Expr:
        rel = sympy.expand(idx[dim] - start)
        pos = sympy.Max(sympy.Integer(0), rel)
        conds = [_cmp("ge", rel, 0), _cmp("lt", rel, count * step)]
        if step != 1:
            conds.append(_cmp("eq", ModIdx(pos, step), 0))
        k = sympy.Min(FloorDiv(pos, step), count - 1)
        s = list(idx)
        s[dim] = k
        return op("where", _all(conds), src.load(tuple(s)), x.load(idx))

    return Lazy(x.dtype, x.shape, fn, None, x.cost + src.cost + 4)


def lower_diagonal_scatter(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    x, src = args
    d1, d2 = node.attr("dim1"), node.attr("dim2")
    s1, s2 = _diag_starts(node.attr("offset"))
    count = src.shape[-1]
    rest = [d for d in range(x.rank) if d not in (d1, d2)]
    if count == 0:
        return x

    def fn(idx: Index) -> L.Expr:
        k = sympy.expand(idx[d1] - s1)
        conds = [_cmp("eq", k, idx[d2] - s2), _cmp("ge", k, 0), _cmp("lt", k, count)]
        at = tuple(idx[d] for d in rest) + (sympy.Max(sympy.Integer(0),
                                                      sympy.Min(k, count - 1)),)
        return op("where", _all(conds), src.load(at), x.load(idx))

    return Lazy(x.dtype, x.shape, fn, None, x.cost + src.cost + 6)


def lower_as_strided_scatter(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """Invert the strided map: with dims sorted by decreasing stride and each stride larger
    than the span of all smaller ones, element p - offset has at most one preimage, found
    digit by digit (p // stride, p % stride). Other layouts (overlapping) are unsupported."""
    x, src = args
    size, stride, offset = node.attr("size"), node.attr("stride"), node.attr("offset")
    if any(not sympy.sympify(v).is_Integer for v in (*size, *stride, offset)):
        raise UnsupportedError(f"as_strided_scatter with dynamic sizes (node {node.name})")
    size = [int(s) for s in size]
    stride = [int(s) for s in stride]
    if 0 in size:
        return x
    dims = sorted((d for d in range(len(size)) if size[d] != 1), key=lambda d: -stride[d])
    span = 0
    for d in reversed(dims):
        if stride[d] <= span:
            raise UnsupportedError(f"as_strided_scatter with overlapping strides {stride} "
                                   f"(node {node.name})")
        span += (size[d] - 1) * stride[d]
    flat_strides = contiguous_strides(x.shape)

    def fn(idx: Index) -> L.Expr:
        rel = sympy.expand(linear_index(idx, flat_strides) - int(offset))
        rem = sympy.Max(sympy.Integer(0), rel)
        at: list = [sympy.Integer(0)] * len(size)
        conds = [_cmp("ge", rel, 0)]
        for d in dims:
            q = FloorDiv(rem, stride[d])
            conds.append(_cmp("lt", q, size[d]))
            at[d] = sympy.Min(q, size[d] - 1)
            rem = ModIdx(rem, stride[d])
        if rem != 0:
            conds.append(_cmp("eq", rem, 0))
        return op("where", _all(conds), src.load(tuple(at)), x.load(idx))

    return Lazy(x.dtype, x.shape, fn, None, x.cost + src.cost + 2 * len(dims) + 2)
