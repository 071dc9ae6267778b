"""Lowering rules for ops computed by kiln runtime routines (`Extern` nodes, kiln_lib.h):
sort / topk, scans (cumsum, cumprod, logcumsumexp, cummax, cummin), scatters (scatter,
scatter_reduce, index_put: index_add / index_copy / index_fill decompose into it),
masked_scatter, embedding_bag and nonzero.

Operands are passed as strided views (`LibArg`): a transposed or sliced input is not copied;
a value that is not a view of a buffer (a fused pointwise expression) is materialised first.
Row routines work along the operand's last dim, so the op's dim is permuted last; their outputs
are written in that permuted order and read back through a permuted view (free).

A multi-result op (sort: values, indices) is one graph node per result; the first one lowered
emits the call, the others find it in `LowerCtx.shared`."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.graph import Node
from kiln.ir.sym import contiguous_strides, ivars
from kiln.lowering.core import Lazy, LowerCtx, View, from_view, pointwise
from kiln.lowering.indexing import _broadcast_shapes
from kiln.ops.build import cast, const, op

# kiln_lib.h enumerations (ScanKind, PutMode, BagMode)
SCAN_KINDS = {"sum": 0, "prod": 1, "logsumexp": 2, "prod_own": 3}
PUT_MODES = {"set": 0, "sum": 1, "prod": 2, "mean": 3, "amax": 4, "amin": 5}
BAG_MODES = {"sum": 0, "mean": 1, "max": 2}


def _src(node: Node) -> tuple[str, ...]:
    return (node.source or node.name,)


def _viewed(ctx: LowerCtx, lz: Lazy, name: str, node: Node, dtype=None) -> Lazy:
    """`lz` as a view of a buffer (cast to `dtype` first when given): materialised unless it
    already is one, once per value and dtype (a KV cache's keys and values share their index:
    one buffer)."""
    key = ("viewed", id(lz), dtype)
    hit = ctx.shared.get(key)
    if hit is not None and hit[0] is lz:  # (the entry keeps `lz` alive: its id stays its own)
        return hit[1]
    given = lz
    if dtype is not None and lz.dtype != dtype:
        src = lz
        lz = pointwise(dtype, src.shape, lambda idx: cast(src.load(idx), dtype), src)
    if lz.view is None:
        lz = as_view(lz) or ctx.realize(name, lz, _src(node))
    if lz is not given:
        ctx.shared[key] = (given, lz)
    return lz


def _unit_free(e: L.Expr, zero: dict) -> L.Expr:
    """`e` with the index variables of size-1 dims set to 0 and `idx(0) + x` folded to x."""
    if isinstance(e, L.Load) and not e.indirect:
        return L.Load(e.buf, sympy.sympify(e.index).xreplace(zero), e.dtype)
    if isinstance(e, L.Index):
        return L.Index(sympy.sympify(e.expr).xreplace(zero), e.dtype)
    if isinstance(e, L.Op):
        args = tuple(_unit_free(a, zero) for a in e.args)
        if e.op == "add" and len(args) == 2:
            for a, b in (args, args[::-1]):
                if isinstance(a, L.Index) and sympy.sympify(a.expr) == 0 and \
                        b.dtype == e.dtype:
                    return b
        return L.Op(e.op, args, e.dtype)
    return e


def as_view(lz: Lazy) -> Lazy | None:
    """`lz` as a view when each element is one direct load of a buffer at an index affine in
    the element's indices (size-1 dims read at 0): e.g. a one-token step's KV-cache position
    `arange(1) + cache_position[0]`, which then costs no kernel. None otherwise."""
    iv = ivars(lz.rank)
    zero = {v: sympy.Integer(0) for v, n in zip(iv, lz.shape) if sympy.sympify(n) == 1}
    e = _unit_free(lz.load(iv), zero)
    if not isinstance(e, L.Load) or e.indirect or e.dtype != lz.dtype:
        return None
    idx = sympy.expand(sympy.sympify(e.index))
    strides = []
    try:
        for v in iv:
            c = sympy.Integer(0) if v in zero else sympy.expand(sympy.diff(idx, v))
            if c.free_symbols & set(iv):
                return None
            strides.append(c)
    except (TypeError, ValueError, NotImplementedError):
        return None
    off = sympy.expand(idx.xreplace({v: sympy.Integer(0) for v in iv}))
    if sympy.expand(off + sum(c * v for c, v in zip(strides, iv)) - idx) != 0 or \
            off.free_symbols & set(iv):
        return None
    return from_view(lz.dtype, lz.shape, View(e.buf, off, tuple(strides)))


def _arg(lz: Lazy, perm=None, shape=None) -> L.LibArg:
    """The LibArg of view `lz`, its dims permuted by `perm`, broadcast to `shape` (trailing
    alignment, stride 0 along broadcast dims)."""
    v = lz.view
    sizes, strides = list(lz.shape), list(v.strides)
    if perm is not None:
        sizes, strides = [sizes[p] for p in perm], [strides[p] for p in perm]
    if shape is not None:
        lead = len(shape) - len(sizes)
        if lead < 0:
            raise ValueError(f"cannot broadcast {sizes} to {list(shape)}")
        out = [sympy.Integer(0)] * lead
        for s, st, o in zip(sizes, strides, shape[lead:]):
            out.append(sympy.Integer(0) if s == 1 and o != 1 else st)
        sizes, strides = list(shape), out
    return L.LibArg(v.buf, v.offset, tuple(sizes), tuple(strides))


def _key(node: Node) -> tuple:
    """The call a result node reads: the same op, operands and attributes (but `part`) and
    the same result dtype (cumsum(x) and cumsum(x, dtype=float64) are two calls)."""
    dt = node.type.dtype if node.op == "scan" else None  # (one result: no `part`)
    return (node.op, node.inputs, tuple((k, v) for k, v in node.attrs if k != "part"), dt)


def _emit(ctx: LowerCtx, node: Node, routine: str, outs, args, attrs) -> tuple[str, ...]:
    """Declare the output buffers [(suffix, dtype, shape)] and append the call."""
    names = []
    base = node.source or node.name
    for suffix, dt, shape in outs:
        name = ctx.unique(f"{base}_{suffix}" if suffix else base)
        ctx.declare(name, dt, shape, "temp")
        names.append(name)
    ctx.nodes.append(L.Extern(routine, tuple(names), tuple(args), tuple(attrs), _src(node)))
    return tuple(names)


# --- row routines: sort, topk, scans ----------------------------------------------------------

def _row_call(ctx: LowerCtx, node: Node, x: Lazy, routine: str, attrs, outs, length=None,
              scratch=()):
    """Call a row routine along node's `dim`; returns the Lazy of output `node.attr(part)`.
    outs: [(suffix, dtype)]; every output is [rows..., length (default: the dim's size)];
    `scratch` [(suffix, dtype, lead)]: more outputs after them, of shape `lead` followed by
    [rows..., the dim's size] (lead None: the shape (1,))."""
    key = _key(node)
    if key not in ctx.shared:
        rank = x.rank
        x = _viewed(ctx, x, (node.source or node.name) + "_input", node)
        if rank == 0:
            perm, arg = [], L.LibArg(x.view.buf, x.view.offset, (sympy.Integer(1),),
                                     (sympy.Integer(0),))
            shape = (sympy.Integer(1),)
        else:
            dim = node.attr("dim")
            perm = [d for d in range(rank) if d != dim] + [dim]
            arg = _arg(x, perm)
            shape = arg.shape[:-1] + ((length if length is not None else arg.shape[-1]),)
        full = arg.shape
        names = _emit(ctx, node, routine, [(s, dt, shape) for s, dt in outs] +
                      [(s, dt, (sympy.Integer(1),) if lead is None else lead + tuple(full))
                       for s, dt, lead in scratch], [arg], attrs)
        ctx.shared[key] = (names, shape, perm)
    names, shape, perm = ctx.shared[key]
    r = node.attr("part", 0)
    dt = node.type.dtype
    if not perm:
        return from_view(dt, node.type.shape, View(names[r], sympy.Integer(0), ()))
    flat = contiguous_strides(shape)
    strides = [sympy.Integer(0)] * len(perm)
    for i, p in enumerate(perm):
        strides[p] = flat[i]
    return from_view(dt, node.type.shape, View(names[r], sympy.Integer(0), tuple(strides)))


def _row_max(node: Node) -> list:
    """The row bound CUDA's sort kernels are printed for (frontend/aten_library.py
    `_row_max`; 0: no bound)."""
    return [] if node.attr("row_max") is None else [("row_max", int(node.attr("row_max")))]


def _sort_scratch(node: Node) -> list:
    """CUDA's merge sort (targets/cuda/sort.py): keys and indices, twice ([2, rows..., n]),
    and its pass counter, as int64."""
    if not node.attr("merge"):
        return []
    two = (sympy.Integer(2),)
    return [("keys", dtypes.int64, two), ("index", dtypes.int64, two),
            ("pass", dtypes.int64, None)]


def lower_sort(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    attrs = [("descending", bool(node.attr("descending"))), ("stable", bool(node.attr("stable")))]
    if node.attr("nan_bits"):  # NaNs by their bits (unique on CUDA: frontend/aten_unique.py)
        attrs.append(("nan_bits", True))
    return _row_call(ctx, node, x, "sort", attrs + _row_max(node),
                     [("values", x.dtype), ("indices", dtypes.int64)],
                     scratch=_sort_scratch(node))


def lower_topk(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    k = node.attr("k")
    attrs = [("k", int(k)), ("largest", node.attr("largest")), ("sorted", node.attr("sorted"))]
    return _row_call(ctx, node, x, "topk", attrs + _row_max(node),
                     [("values", x.dtype), ("indices", dtypes.int64)], length=sympy.Integer(k),
                     scratch=_sort_scratch(node))


def lower_scan(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    return _row_call(ctx, node, x, "scan", [("kind", SCAN_KINDS[node.attr("kind")])],
                     [("", node.type.dtype)])


def lower_scan_extreme(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    (x,) = args
    return _row_call(ctx, node, x, "scan_extreme", [("is_max", node.attr("kind") == "max")],
                     [("values", x.dtype), ("indices", dtypes.int64)])


# --- scatters ---------------------------------------------------------------------------------

def _put(ctx: LowerCtx, node: Node, self_: Lazy, values: L.LibArg, index: list[L.LibArg],
         dims: tuple[int, ...], mode: str, include_self: bool, wrap: bool) -> Lazy:
    dt = node.type.dtype
    self_ = _viewed(ctx, self_, (node.source or node.name) + "_self", node)
    attrs = [("mode", PUT_MODES[mode]), ("include_self", include_self), ("wrap", wrap),
             ("dims", dims)]
    outs = [("", dt, self_.shape)]
    if mode == "mean":
        outs.append(("count", dtypes.int64, self_.shape))
    names = _emit(ctx, node, "put_mean" if mode == "mean" else "put", outs,
                  [_arg(self_), values, *index], attrs)
    return ctx.buffer_lazy(names[0], dt, self_.shape)


def lower_scatter(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """out = self; out[..., index[i], ...] (at dim) <-combine- src[i] for every i in index's
    shape (src may be larger than index: only its leading part is read)."""
    self_, index, src = args
    if self_.rank == 0:
        raise UnsupportedError(f"scatter into a 0-d tensor (node {node.name})")
    dim = node.attr("dim")
    base = node.source or node.name
    index = _viewed(ctx, index, base + "_index", node, dtypes.int64)
    src = _viewed(ctx, src, base + "_src", node, node.type.dtype)
    iters = tuple(index.shape)
    values = L.LibArg(src.view.buf, src.view.offset, iters, tuple(src.view.strides))
    dims = tuple(-1 if d == dim else d for d in range(self_.rank))
    return _put(ctx, node, self_, values, [_arg(index)], dims, node.attr("mode"),
                bool(node.attr("include_self", True)), wrap=False)


def lower_index_put(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """out = self; out[indices] = values (or += with accumulate). The iteration space is the
    broadcast index shape followed by self's dims that are not indexed; `values` (broadcast
    to torch's result shape) is permuted to that order."""
    self_, values, *indices = args
    positions = tuple(node.attr("positions"))
    base = node.source or node.name
    if len(indices) == 1 and indices[0].dtype.name == "bool":
        return _mask_put(ctx, node, self_, values, indices[0], positions[0])
    for t in indices:
        if t.dtype.name == "bool":
            raise UnsupportedError(f"index_put with a boolean mask among other indices (node "
                                   f"{node.name})")
    bshape = _broadcast_shapes([t.shape for t in indices])
    nb = len(bshape)
    rest = [d for d in range(self_.rank) if d not in positions]
    adjacent = list(positions) == list(range(positions[0], positions[0] + len(positions)))
    first = positions[0] if adjacent else 0
    rest_shape = [self_.shape[d] for d in rest]
    result = tuple(rest_shape[:first]) + bshape + tuple(rest_shape[first:])
    # result dim of each iteration dim: bshape dims first, then the non-indexed dims
    order = list(range(first, first + nb)) + list(range(first)) + list(
        range(first + nb, len(result)))
    vals = _viewed(ctx, values, base + "_values", node, node.type.dtype)
    varg = _arg(vals, shape=result)
    varg = L.LibArg(varg.buf, varg.offset, tuple(varg.shape[k] for k in order),
                    tuple(varg.strides[k] for k in order))
    iters = varg.shape
    index_args = []
    for k, t in enumerate(indices):
        t = _viewed(ctx, t, f"{base}_index{k}", node, dtypes.int64)
        a = _arg(t, shape=bshape)
        zeros = (sympy.Integer(0),) * (len(iters) - nb)
        index_args.append(L.LibArg(a.buf, a.offset, iters, a.strides + zeros))
    dims = tuple(-(positions.index(d) + 1) if d in positions else nb + rest.index(d)
                 for d in range(self_.rank))
    mode = "sum" if node.attr("accumulate") else "set"
    return _put(ctx, node, self_, varg, index_args, dims, mode, True, wrap=True)


def _mask_put(ctx: LowerCtx, node: Node, self_: Lazy, values: Lazy, mask: Lazy,
              p: int) -> Lazy:
    """x[mask] = v (or += v) where v does not vary along the selected elements (torch's result
    dim of the mask, which has a data-dependent size, is broadcast in v): a pointwise select,
    out[i] = mask[i_p..] ? v : x[i]. With one value per selected element and the mask over
    x's leading dims, x[mask] = v is masked_scatter(x, mask broadcast over x, v)."""
    dt, m, rank = node.type.dtype, mask.rank, self_.rank
    res_rank = rank - m + 1
    j = p - (res_rank - values.rank)  # the dim of v along the selected elements
    if j >= 0 and values.shape[j] != 1:
        return _mask_scatter(ctx, node, self_, values, mask, p)

    def fn(idx):
        res = list(idx[:p]) + [sympy.Integer(0)] + list(idx[p + m:])
        vidx = [sympy.Integer(0) if values.shape[k] == 1 else res[k + res_rank - values.rank]
                for k in range(values.rank)]
        x = self_.load(idx)
        v = cast(values.load(tuple(vidx)), dt)
        if node.attr("accumulate"):
            v = op("add", x, v) if dt.name != "bool" else op("logical_or", x, v)
        return op("where", mask.load(tuple(idx[p:p + m])), v, x)

    return pointwise(dt, node.type.shape, fn)


def _mask_scatter(ctx: LowerCtx, node: Node, self_: Lazy, values: Lazy, mask: Lazy,
                  p: int) -> Lazy:
    """x[..., mask, ...] = v with the mask over x's dims p .. p + m - 1 and v[..., k, ...]
    (dim p of the result, aligned from the right) the k-th selected element's value:
    masked_scatter(x, mask broadcast over x's shape, v broadcast to [x's dims before p,
    selected, x's dims after the mask]). masked_scatter fills the selection in row-major
    order of x's shape, which for every index of the dims before p runs through the mask's
    selected positions in order, then the trailing dims: v's own row-major order.
    With accumulate (x[mask] += v) a mask selects each element at most once, so the values
    are scattered into zeros and added where the mask is set (elsewhere x is kept as is, -0
    and NaN included)."""
    dt, m, shape = node.type.dtype, mask.rank, node.type.shape
    base = node.source or node.name
    full = pointwise(dtypes.bool_, shape, lambda idx: mask.load(tuple(idx[p:p + m])), mask)
    res_rank = len(shape) - m + 1
    off = res_rank - values.rank  # v's dims align with the result's from the right
    j = p - off  # v's dim along the selected elements
    src_shape = (*shape[:p], values.shape[j], *shape[p + m:])

    def src(idx):  # v broadcast over the result's other dims
        vidx = tuple(sympy.Integer(0) if k != j and values.shape[k] == 1 else idx[k + off]
                     for k in range(values.rank))
        return cast(values.load(vidx), dt)

    source = _viewed(ctx, pointwise(dt, src_shape, src, values), base + "_source", node)
    accumulate = bool(node.attr("accumulate"))
    into = pointwise(dt, shape, lambda idx: const(0, dt)) if accumulate else self_
    into = _viewed(ctx, into, base + ("_zeros" if accumulate else "_self"), node, dt)
    full = _viewed(ctx, full, base + "_mask", node)
    names = _emit(ctx, node, "masked_scatter", [("", dt, shape)],
                  [_arg(into, shape=shape), _arg(full, shape=shape), _arg(source),
                   *_mask_count(ctx, node, full, shape)], [])
    scattered = ctx.buffer_lazy(names[0], dt, shape)
    if not accumulate:
        return scattered

    def add(idx):
        x = self_.load(idx)
        total = op("logical_or" if dt.name == "bool" else "add", x, scattered.load(idx))
        return op("where", full.load(idx), total, x)

    return pointwise(dt, shape, add)


def lower_masked_scatter(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    self_, mask, source = args
    base = node.source or node.name
    shape = node.type.shape
    self_ = _viewed(ctx, self_, base + "_self", node)
    mask = _viewed(ctx, mask, base + "_mask", node, dtypes.bool_)
    source = _viewed(ctx, source, base + "_source", node, node.type.dtype)
    names = _emit(ctx, node, "masked_scatter", [("", node.type.dtype, shape)],
                  [_arg(self_, shape=shape), _arg(mask, shape=shape), _arg(source),
                   *_mask_count(ctx, node, mask, shape)], [])
    return ctx.buffer_lazy(names[0], node.type.dtype, shape)


def _mask_count(ctx: LowerCtx, node: Node, mask: Lazy, shape) -> list[L.LibArg]:
    """With node attribute `counted` (CUDA builds: frontend/aten_library.py), the masked_scatter
    call's fourth operand: the inclusive count of true elements of `mask` broadcast to `shape`
    (flat, row-major: a `scan` call, multi-block when long: targets/cuda/scan.py), from which
    each true element finds its source element. [] otherwise (the CPU routine walks the mask
    in order)."""
    if not node.attr("counted", False):
        return []
    # one scan for the calls of one mask: a view by what it reads, else by identity (the
    # entry keeps `mask` alive, so its id stays its own)
    v = mask.view
    key = ("mask_count", tuple(shape), tuple(mask.shape)) + (
        (v.buf, v.offset, tuple(v.strides)) if v is not None else (id(mask),))
    hit = ctx.shared.get(key)
    if hit is not None and (v is not None or hit[0] is mask):
        return [hit[1]]
    base = node.source or node.name
    numel = sympy.Integer(1)
    for n in shape:
        numel = numel * n
    off = len(shape) - mask.rank  # (the mask broadcast from the right)

    def one(idx):
        return cast(mask.load(tuple(sympy.Integer(0) if mask.shape[k] == 1 else idx[k + off]
                                    for k in range(mask.rank))), dtypes.int64)

    full = pointwise(dtypes.int64, tuple(shape), one, mask)
    flat = ctx.realize(base + "_mask_i64", full, _src(node)).view
    if tuple(flat.strides) != tuple(contiguous_strides(shape)):
        raise ValueError(f"masked_scatter {base}: the realized mask is not contiguous")
    arg = L.LibArg(flat.buf, flat.offset, (numel,), (sympy.Integer(1),))
    names = _emit(ctx, node, "scan", [("mask_csum", dtypes.int64, (numel,))], [arg],
                  [("kind", SCAN_KINDS["sum"])])
    ctx.shared[key] = (mask, L.LibArg(names[0], sympy.Integer(0), (numel,),
                                      (sympy.Integer(1),)))
    return [ctx.shared[key][1]]


def lower_nonzero(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    """The coordinates of a bool mask's true elements (kiln_lib.h `nonzero`); the second
    operand, the count a read_size bound the row count with, orders the call after it."""
    mask, count, *csum = args  # (CUDA: the inclusive count before each element, flat)
    base = node.source or node.name
    mask = _viewed(ctx, mask, base + "_mask", node, dtypes.bool_)
    count = _viewed(ctx, count, base + "_count", node, dtypes.int64)
    ops = [_arg(mask), _arg(count)]
    if csum:
        ops.append(_arg(_viewed(ctx, csum[0], base + "_csum", node, dtypes.int64)))
    shape = node.type.shape
    names = _emit(ctx, node, "nonzero", [("", dtypes.int64, shape)], ops, [])
    return ctx.buffer_lazy(names[0], dtypes.int64, shape)


def lower_embedding_bag(ctx: LowerCtx, node: Node, args: list[Lazy]) -> Lazy:
    weight, indices, offsets, *psw = args
    base = node.source or node.name
    weight = _viewed(ctx, weight, base + "_weight", node)
    idt = indices.dtype if indices.dtype.name in ("int32", "int64") else dtypes.int64
    indices = _viewed(ctx, indices, base + "_indices", node, idt)
    offsets = _viewed(ctx, offsets, base + "_offsets", node, idt)
    ops = [_arg(weight), _arg(indices), _arg(offsets)]
    if psw:
        ops.append(_arg(_viewed(ctx, psw[0], base + "_weights", node, weight.dtype)))
    attrs = [("mode", BAG_MODES[node.attr("mode")]),
             ("include_last_offset", bool(node.attr("include_last_offset"))),
             ("padding_idx", int(node.attr("padding_idx")))]
    names = _emit(ctx, node, "embedding_bag", [("", node.type.dtype, node.type.shape)], ops,
                  attrs)
    return ctx.buffer_lazy(names[0], node.type.dtype, node.type.shape)


RULES = {
    "sort": lower_sort,
    "topk": lower_topk,
    "scan": lower_scan,
    "nonzero": lower_nonzero,
    "scan_extreme": lower_scan_extreme,
    "scatter": lower_scatter,
    "index_put": lower_index_put,
    "masked_scatter": lower_masked_scatter,
    "embedding_bag": lower_embedding_bag,
}
