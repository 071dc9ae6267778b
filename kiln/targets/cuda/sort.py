"""Sort and topk Extern steps -> Triton kernels for CUDA builds (issue 16: sort, argsort, msort,
topk, kthvalue and median went to the ATen fallback on CUDA; kthvalue and median are a stable
sort and a select, frontend/aten_library.py). The operand is a strided `LibArg` with the
sorted dim last (lowering/library.py `_row_call`); the outputs are contiguous [rows..., m]
(m: the row length for sort, k for topk). Every sort here is stable (ties in index order,
ascending and descending alike), so it serves sort(stable=True) and the unstable forms.

Which calls come here: every dtype of SORTABLE (bool, the integers up to int64, float16,
bfloat16, float32, float64), any row length. The frontend gives each node attribute `row_max`
(frontend/aten_library.py `_row_max`): the sorted dim's largest length, 0 where it has no
bound. A row bound of at most MAX_ROW takes one kernel (`_single`); a larger or missing bound
takes the merge sort (`_tiles`, then `_merge` once a pass with `_next` between), whose call
has three scratch outputs from the arena (lowering/library.py: keys and indices, [2, rows...,
n] int64 each, and a one-element pass counter).

`order` of a value (`order_lines`): an integer whose order is the value order (eager's: NaN
above +inf, -0.0 equal to +0.0), 32 bits for dtypes of at most 32 bits, else 64. Integers and
bools are their value. A float's bits b (float16 / bfloat16 bits sign-extended to 32 bits)
become b ^ ((b >> top) & mask-below-the-sign): a positive float keeps its bits, a negative one
has the bits below its sign flipped, so every negative float is below every positive one and
larger magnitudes of either sign go outward. Before that, both zeros become +0.0 (b = 0);
after it, every NaN (either sign, any payload) becomes the largest order, above +inf. A
descending sort complements the order (~o), never the column, so ties stay in index order.

One tile (`tile_lines`): a row's columns [c0, c0 + RBLOCK) sorted by `tl.sort` of int64
keys. 32-bit orders: one sort of (order << 32) | column. 64-bit orders: two sorts (a
least-significant-digit pass): first (low 32 bits of the order, as unsigned) << 32 | column,
whose sorted position j and column p[j] go into the second's key (high 32 bits of the order)
<< 32 | j << 16 | p[j] (columns below 2^16): sorted by (high, low, column). Columns past the
row get the largest key. The sorted columns index the operand: the values are loaded from it
(eager's values bit for bit: -0.0 stays -0.0, a NaN keeps its payload).

The merge sort (rows of any length): `_tiles` sorts each TILE-column tile of a row, stores
(order as int64, column) at the tile's place in scratch half 0 and sets the pass counter to 0.
`_merge` reads pass p from the counter and merges pairs of sorted runs of W = TILE << p
elements from half p % 2 into half (p + 1) % 2: an element of the left run goes to its own
offset plus the count of right-run elements below its order, one of the right run to its own
offset plus the count of left-run elements at or below its order (binary searches), which
keeps the merge stable. A row of a single run (n <= W) stores nothing in that pass. The kernel
that completes the row (n <= 2W, or n <= TILE for `_tiles`) stores the first m elements into
the outputs instead of the scratch. `_next` (one program) moves the counter on; the wrappers
launch `_merge` once a pass the bound may need (`sort_kernel_names`; no bound: rows up to 2^31
elements), so a call is three kernels whatever its bound."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import loop as L
from kiln.ir.sym import FloorDiv, evaluate, product
from kiln.targets.cuda.kernel import Config, TritonKernel
from kiln.targets.cuda.ops import canon, pow2, size_names, to_tl, unravel
from kiln.targets.cuda.scan import _head, _offset

SORT_ROUTINES = ("sort", "topk")
MAX_ROW = 4096  # the longest row one tile sorts (int64 keys: 32 KiB a row)
TILE = 4096  # keys of a tile (XBLOCK x RBLOCK); the merge sort's tiles
MERGE_BLOCK = 1024  # elements a program of a merge pass places
UNBOUNDED = 1 << 31  # the row length the merge passes cover where the dim has no bound
# dtype -> (Triton type of its bits, the sign's shift, mask of the bits below the sign, +inf's
# bits) for floats
_FLOAT_BITS = {"float32": ("tl.int32", 31, 0x7FFFFFFF, 0x7F800000),
               "float16": ("tl.int16", 31, 0x7FFF, 0x7C00),
               "bfloat16": ("tl.int16", 31, 0x7FFF, 0x7F80),
               "float64": ("tl.int64", 63, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}
WIDE = frozenset({"float64", "int64"})  # 64-bit orders
SORTABLE = frozenset({*_FLOAT_BITS, *WIDE, "bool", "uint8", "int8", "int16", "int32"})


def sort_kernel_name(call: L.Extern) -> str:
    return f"{call.routine}_{call.name}"


def order_lines(dtype_name: str, descending: bool, v: str = "v", o: str = "o",
                nan_high: bool = True) -> list[str]:
    """Kernel lines turning loaded values `v` into `o`: int32 (int64 for WIDE dtypes),
    ordered as the values (see the module doc), complemented for a descending sort.
    `nan_high` False (a call's attribute `nan_bits`: unique on CUDA, frontend/aten_unique.py):
    NaNs keep the order of their bits, as eager's CUDA radix sorts (cub) order them: a NaN
    with the sign bit set below -inf, one without above +inf, larger payloads outward."""
    if dtype_name == "bool":
        lines = [f"    {o} = ({v} != 0).to(tl.int32)"]
    elif dtype_name in _FLOAT_BITS:
        bits, top, absmask, inf = _FLOAT_BITS[dtype_name]
        wide = ".to(tl.int32)  # sign-extended" if bits == "tl.int16" else ""
        lines = [f"    {o} = {v}.to({bits}, bitcast=True){wide}",
                 f"    mag = {o} & {absmask:#x}",
                 f"    {o} = tl.where(mag == 0, 0, {o})  # -0.0 as +0.0",
                 f"    {o} = {o} ^ (({o} >> {top}) & {absmask if top == 63 else 0x7FFFFFFF:#x})"]
        if nan_high:
            lines.append(f"    {o} = tl.where(mag > {inf:#x}, "
                         f"{absmask if top == 63 else 0x7FFFFFFF:#x}, {o})  # every NaN above +inf")
    elif dtype_name == "int64":
        lines = [f"    {o} = {v}.to(tl.int64)"]
    elif dtype_name in SORTABLE:
        lines = [f"    {o} = {v}.to(tl.int32)"]
    else:
        raise UnsupportedError(f"a sort of {dtype_name} values in a Triton kernel (sortable: "
                               f"{', '.join(sorted(SORTABLE))})")
    if descending:
        lines.append(f"    {o} = ~{o}  # descending: the order reversed, ties still by column")
    return lines


def tile_lines(x: L.LibArg, dt: str, descending: bool, c0: str, n: str,
               nan_high: bool = True) -> list[str]:
    """Lines sorting the tile of columns `c0` + r (r = tl.arange over RBLOCK, `inrow`: the
    column is below `n`) of rows at offsets `xoff` (`xmask`): `i`, the tile's columns in
    sorted order (relative to `c0`; see the module doc)."""
    sn = canon(x.strides[-1])

    def load(c: str, m: str) -> str:
        at = f"{c0} + {c}" if c0 != "0" else c
        at = at if sn == 1 else f"({at}) * {to_tl(sn)}"
        return f"tl.load(buf_{x.buf} + xoff + {at}, mask={m}, other=0)"

    lines = [f"    inrow = {c0} + r < {n}", f"    v = {load('r', 'xmask & inrow')}"]
    lines += order_lines(dt, descending, nan_high=nan_high)
    if dt not in WIDE:
        return lines + [
            "    key = (o.to(tl.int64) << 32) | r",
            "    key = tl.where(inrow, key, 0x7fffffffffffffff)  # past the row: last",
            "    key = tl.sort(key, 1)",
            "    i = key & 0xffffffff  # the sorted columns"]
    return lines + [
        "    key = (((o & 0xffffffff) - 0x80000000) << 32) | r  # the low half, as unsigned",
        "    key = tl.where(inrow, key, 0x7fffffffffffffff)  # past the row: last",
        "    key = tl.sort(key, 1)",
        "    p = key & 0xffffffff  # columns by the low half (then column)",
        f"    v = {load('p', 'xmask & inrow')}",
        *order_lines(dt, descending, nan_high=nan_high),
        "    key = ((o >> 32) << 32) | (r << 16) | p  # the high half, then the first order",
        "    key = tl.where(inrow, key, 0x7fffffffffffffff)",
        "    key = tl.sort(key, 1)",
        "    i = key & 0xffff  # the sorted columns"]


def _parts(call: L.Extern, buffers):
    (x,) = call.args
    dt = buffers[x.buf].dtype.name
    descending = bool(call.attr("descending") if call.routine == "sort"
                      else call.attr("largest"))
    n = canon(x.shape[-1])
    m = n if call.routine == "sort" else canon(int(call.attr("k")))
    rows_shape = x.shape[:-1]
    rows = canon(product(rows_shape)) if rows_shape else sympy.Integer(1)
    what = ("sort" + (" descending" if descending else "") if call.routine == "sort" else
            f"top {call.attr('k')} ({'largest' if descending else 'smallest'})")
    return x, dt, descending, n, m, rows, what


def _nan_high(call: L.Extern) -> bool:
    """Whether the call orders every NaN above +inf (eager's CPU order), not by its bits
    (attribute `nan_bits`; see `order_lines`)."""
    return not call.attr("nan_bits", False)


def _config(row_block: int, rows, hints) -> Config:
    try:
        rows = max(1, evaluate(rows, hints))
    except (KeyError, TypeError, ValueError):  # sizes without a hint
        rows = 1
    xblock = max(1, min(TILE // row_block, pow2(rows)))
    while xblock > 1 and -(-rows // xblock) < 132:  # programs for every H100 SM
        xblock //= 2
    warps = max(1, min(8, pow2(xblock * row_block // 256)))
    return Config(xblock, row_block, warps)


def merge_passes(row_max: int, tile: int | None = None) -> int:
    """The merge passes of the merge sort for rows of up to `row_max` elements (0: no
    bound) in tiles of `tile` (default TILE)."""
    n, p, tile = (row_max or UNBOUNDED), 0, tile or TILE
    while tile << p < n:
        p += 1
    return p


def print_sort_kernels(call: L.Extern, buffers, hints: dict[str, int]) -> list[TritonKernel]:
    """The kernels of one `sort` / `topk` call, in launch order: values and indices of each
    row's first m elements in sorted order (sort: all of them; topk: k, descending when
    `largest`)."""
    row_max = call.attr("row_max")
    if row_max is None:
        raise UnsupportedError(f"{call.routine} {call.name} (for {', '.join(call.source)}) "
                               "without attribute row_max (frontend/aten_library.py)")
    if len(call.outs) == 2:
        if not 0 < int(row_max) <= MAX_ROW:
            raise UnsupportedError(f"{call.routine} {call.name}: rows of up to {row_max} "
                                   f"elements in one tile (at most {MAX_ROW})")
        return [_single(call, buffers, hints)]
    return _merge_sort(call, buffers, int(row_max))


def _single(call: L.Extern, buffers, hints: dict[str, int]) -> TritonKernel:
    """One kernel: program p takes rows [p*XBLOCK, (p+1)*XBLOCK), a whole row a tile."""
    x, dt, descending, n, m, rows, what = _parts(call, buffers)
    vals, idx = call.outs
    rows_shape = x.shape[:-1]
    sn = canon(x.strides[-1])
    name = sort_kernel_name(call)
    config = _config(max(2, pow2(int(call.attr("row_max")))), rows, hints)
    syms = size_names([n, rows, x.offset, *rows_shape, *x.strides])
    params = tuple([("out", vals), ("out", idx), ("in", x.buf)] + [("size", s) for s in syms])
    sig, head = _head(name, params, buffers, [
        f"    # {name}: {vals}, {idx} = {what} of {x.buf} along its last dim (stable: ties in "
        f"index order; routine {call.routine})",
        f"    #   from graph nodes: {', '.join(call.source)}"])
    mtl = to_tl(m)
    at = "i" if sn == 1 else f"i * {to_tl(sn)}"
    body = [
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        "    xidx = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]",
        f"    xmask = xidx < {to_tl(rows)}",
        f"    xoff = {_offset(x.offset, unravel('xidx', rows_shape), x.strides[:-1], 'xidx')}",
        "    r = tl.arange(0, RBLOCK)[None, :].to(tl.int64)",
        *tile_lines(x, dt, descending, "0", to_tl(n), _nan_high(call)),
        f"    keep = xmask & (r < {mtl})",
        f"    sv = tl.load(buf_{x.buf} + xoff + {at}, mask=keep, other=0)",
        f"    tl.store(buf_{vals} + xidx * {mtl} + r, sv, mask=keep)",
        f"    tl.store(buf_{idx} + xidx * {mtl} + r, i, mask=keep)",
    ]
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, config, rows, call.source)


def _final_or_scratch(x: L.LibArg, vals: str, idx: str, keys: str, inds: str, pos: str,
                      done: str, m, n, mask: str, key: str, col: str) -> list[str]:
    """Lines storing element (order `key`, column `col`) at position `pos` of its row:
    into the outputs (its first m positions) where `done` (the row is complete), else into
    the scratch half at offset `dst` of `keys` / `inds`."""
    sn = canon(x.strides[-1])
    at = col if sn == 1 else f"{col} * {to_tl(sn)}"
    return [f"    if {done}:  # the row is complete: the outputs",
            f"        keep = {mask} & ({pos} < {to_tl(m)})",
            f"        sv = tl.load(buf_{x.buf} + xoff + {at}, mask=keep, other=0)",
            f"        tl.store(buf_{vals} + row * {to_tl(m)} + {pos}, sv, mask=keep)",
            f"        tl.store(buf_{idx} + row * {to_tl(m)} + {pos}, {col}, mask=keep)",
            "    else:",
            f"        tl.store(buf_{keys} + dst + row * {to_tl(n)} + {pos}, {key}, mask={mask})",
            f"        tl.store(buf_{inds} + dst + row * {to_tl(n)} + {pos}, {col}, mask={mask})"]


def _merge_sort(call: L.Extern, buffers, row_max: int) -> list[TritonKernel]:
    """`_tiles`, `_merge` and `_next` (see the module doc)."""
    x, dt, descending, n, m, rows, what = _parts(call, buffers)
    vals, idx, keys, inds, count = call.outs
    rows_shape = x.shape[:-1]
    base = sort_kernel_name(call)
    ntl = to_tl(n)
    nt = sympy.sympify(FloorDiv(n + TILE - 1, TILE))
    syms = size_names([n, rows, x.offset, *rows_shape, *x.strides])
    sizes = [("size", s) for s in syms]
    params = tuple([("out", o) for o in call.outs] + [("in", x.buf)] + sizes)
    row_off = _offset(x.offset, unravel("row", rows_shape), x.strides[:-1], "row")
    half = to_tl(canon(rows * n))
    kernels = []

    def kernel(suffix, body, grid, rblock, comment):
        name = f"{base}_{suffix}"
        sig, head = _head(name, params, buffers, [
            f"    # {name}: {comment}",
            f"    #   {vals}, {idx} = {what} of {x.buf} along its last dim (stable; merge "
            f"sort through {keys}, {inds}, pass counter {count})",
            f"    #   from graph nodes: {', '.join(call.source)}",
            "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)"])
        src = "\n".join(head + body) + "\n"
        warps = max(1, min(8, rblock // 256))
        kernels.append(TritonKernel(name, src, params, sig, Config(1, rblock, warps), grid,
                                    call.source))

    ntiles = to_tl(nt)
    sn = canon(x.strides[-1])
    body = [f"    row = pid // {ntiles}",
            f"    c0 = (pid % {ntiles}) * RBLOCK",
            "    xmask = row * 0 == 0",
            f"    xoff = {row_off}",
            "    r = tl.arange(0, RBLOCK)[None, :].to(tl.int64)",
            f"    tl.store(buf_{count} + r * 0, r * 0, mask=(pid == 0) & (r == 0))  # pass 0",
            *tile_lines(x, dt, descending, "c0", ntl, _nan_high(call)),
            "    col = c0 + i  # the row's columns, sorted within the tile",
            f"    v = tl.load(buf_{x.buf} + xoff + {'col' if sn == 1 else 'col * ' + to_tl(sn)}"
            ", mask=inrow, other=0)",
            *order_lines(dt, descending, nan_high=_nan_high(call)),
            "    o = o.to(tl.int64)",
            "    dst = 0",
            *_final_or_scratch(x, vals, idx, keys, inds, "c0 + r", f"{ntl} <= RBLOCK", m, n,
                               "inrow", "o", "col")]
    kernel("tiles", body, rows * nt, TILE, f"each tile of {TILE} columns sorted")
    nb = to_tl(sympy.sympify(FloorDiv(n + MERGE_BLOCK - 1, MERGE_BLOCK)))
    body = [f"    p = tl.load(buf_{count})  # this pass: runs of w = {TILE} << p merged in pairs",
            f"    w = tl.full([], {TILE}, tl.int64) << p",
            f"    row = pid // {nb}",
            f"    c = (pid % {nb}) * RBLOCK + tl.arange(0, RBLOCK).to(tl.int64)",
            f"    cm = (c < {ntl}) & ({ntl} > w)  # (a row of one run: nothing to merge)",
            f"    xoff = {row_off}",
            f"    src = (p % 2) * {half}",
            f"    dst = ((p + 1) % 2) * {half}",
            f"    k = tl.load(buf_{keys} + src + row * {ntl} + c, mask=cm, other=0)",
            f"    col = tl.load(buf_{inds} + src + row * {ntl} + c, mask=cm, other=0)",
            "    s = c // (2 * w) * (2 * w)  # the pair of runs: [s, s + w), the rest",
            "    left = c - s < w",
            "    lo = tl.where(left, s + w, s)  # the other run",
            f"    hi = tl.where(left, tl.minimum(s + 2 * w, {ntl}), s + w)",
            "    hi = tl.where(cm, hi, lo)",
            "    first = lo",
            f"    for _ in range({TILE.bit_length() + merge_passes(row_max)}):  # the other "
            "run's elements below k (left: strictly; once found, no-ops)",
            "        on = lo < hi",
            "        mid = (lo + hi) // 2",
            f"        km = tl.load(buf_{keys} + src + row * {ntl} + mid, mask=on, other=0)",
            "        right = tl.where(left, km < k, km <= k)",
            "        lo = tl.where(on & right, mid + 1, lo)",
            "        hi = tl.where(on & ~right, mid, hi)",
            "    pos = tl.where(left, c, c - w) + (lo - first)",
            *_final_or_scratch(x, vals, idx, keys, inds, "pos", f"{ntl} <= 2 * w", m, n, "cm",
                               "k", "col")]
    kernel("merge", body, rows * sympy.sympify(FloorDiv(n + MERGE_BLOCK - 1, MERGE_BLOCK)),
           MERGE_BLOCK, "one merge pass (the pass counter's)")
    body = [f"    tl.store(buf_{count}, tl.load(buf_{count}) + 1, mask=pid == 0)"]
    kernel("next", body, sympy.Integer(1), 16, "the pass counter moved on")
    return kernels


def sort_kernel_names(call: L.Extern, kernels) -> list[str]:
    """The kernels a sort call launches, in order (those of `kernels`, by name): the merge
    sort's `_merge` once a pass its row bound may need, `_next` between."""
    base = sort_kernel_name(call)
    if f"{base}_tiles" not in kernels:
        return [base]
    tile = kernels[f"{base}_tiles"].config.rblock  # (the tiles it was printed for)
    passes = merge_passes(int(call.attr("row_max")), tile)
    return [f"{base}_tiles"] + [f"{base}_{k}" for p in range(passes)
                                for k in (("next", "merge") if p else ("merge",))]
