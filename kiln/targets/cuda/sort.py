"""Sort and topk Extern steps -> Triton kernels for CUDA builds (issue 16: sort, argsort, msort,
topk, kthvalue and median went to the ATen fallback on CUDA; kthvalue and median are a stable
sort and a select, frontend/aten_library.py). The operand is a strided `LibArg` with the
sorted dim last (lowering/library.py `_row_call`); the outputs are contiguous [rows..., m]
(m: the row length for sort, k for topk).

Which calls come here: operands of at most 32 bits (bool, uint8, int8, int16, int32,
float16, bfloat16, float32) and rows of at most MAX_ROW elements, the bound known when the
program is built (a static length or a Dim's maximum): the frontend marks such a node with
attribute `row_max` (frontend/aten_library.py `sortable_on_cuda`); other sorts stay on ATen.

Algorithm: program p takes rows [p*XBLOCK, (p+1)*XBLOCK), a whole row in one RBLOCK-wide tile
(RBLOCK: row_max rounded up to a power of two). Each element becomes one int64 key,
(order << 32) | column, where `order` is a signed 32-bit integer whose order is the value order
(eager's: NaN above +inf, -0.0 equal to +0.0); columns past the row's length get the largest
key. `tl.sort` sorts the keys ascending along the row: ties are broken by the column, which
makes the sort stable (ascending and descending alike: a descending sort complements `order`,
not the column). The sorted columns are the indices; the values are loaded from the operand
at those columns (eager's values bit for bit: -0.0 stays -0.0, a NaN keeps its payload).

`order` of a value: integers and bools are their value as int32. A float's bits b (float16 /
bfloat16 bits sign-extended from 16 to 32 bits) become b ^ ((b >> 31) & 0x7fffffff): a
positive float keeps its bits, a negative one has the bits below its sign flipped, so every
negative float is below every positive one and larger magnitudes of either sign go outward.
Before that, both zeros become +0.0 (b = 0); after it, every NaN (either sign, any payload)
becomes 0x7fffffff, above +inf."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import loop as L
from kiln.ir.sym import evaluate, product
from kiln.targets.cuda.kernel import Config, TritonKernel
from kiln.targets.cuda.ops import canon, pow2, size_names, to_tl, unravel
from kiln.targets.cuda.scan import _head, _offset

SORT_ROUTINES = ("sort", "topk")
MAX_ROW = 4096  # the longest row one tile sorts (int64 keys: 32 KiB a row)
TILE = 4096  # keys of a tile (XBLOCK x RBLOCK)
# dtype -> (Triton type of its bits, mask of the bits below the sign, +inf's bits) for floats
_FLOAT_BITS = {"float32": ("tl.int32", 0x7FFFFFFF, 0x7F800000),
               "float16": ("tl.int16", 0x7FFF, 0x7C00),
               "bfloat16": ("tl.int16", 0x7FFF, 0x7F80)}
SORTABLE = frozenset({*_FLOAT_BITS, "bool", "uint8", "int8", "int16", "int32"})


def sort_kernel_name(call: L.Extern) -> str:
    return f"{call.routine}_{call.name}"


def order_lines(dtype_name: str, descending: bool) -> list[str]:
    """Kernel lines turning loaded values `v` into `o`: int32, ordered as the values (see the
    module doc), complemented for a descending sort."""
    if dtype_name == "bool":
        lines = ["    o = (v != 0).to(tl.int32)"]
    elif dtype_name in _FLOAT_BITS:
        bits, absmask, inf = _FLOAT_BITS[dtype_name]
        wide = "" if bits == "tl.int32" else ".to(tl.int32)  # sign-extended"
        lines = [f"    b = v.to({bits}, bitcast=True){wide}",
                 f"    mag = b & {absmask:#x}",
                 "    b = tl.where(mag == 0, 0, b)  # -0.0 as +0.0",
                 "    o = b ^ ((b >> 31) & 0x7fffffff)",
                 f"    o = tl.where(mag > {inf:#x}, 0x7fffffff, o)  # every NaN above +inf"]
    elif dtype_name in SORTABLE:
        lines = ["    o = v.to(tl.int32)"]
    else:
        raise UnsupportedError(f"a sort of {dtype_name} values in a Triton kernel (bits above "
                               "32: the ATen fallback sorts them)")
    if descending:
        lines.append("    o = ~o  # descending: the order reversed, ties still by column")
    return lines


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


def print_sort_kernel(call: L.Extern, buffers, hints: dict[str, int],
                      config: Config | None = None) -> TritonKernel:
    """The kernel of one `sort` / `topk` call: values and indices of each row's first m
    elements in sorted order (sort: all of them; topk: k, descending when `largest`)."""
    (x,) = call.args
    vals, idx = call.outs
    dt = buffers[x.buf].dtype
    row_max = call.attr("row_max")
    if row_max is None or int(row_max) > MAX_ROW:
        raise UnsupportedError(f"{call.routine} {call.name} (for {', '.join(call.source)}) "
                               f"without a row bound of at most {MAX_ROW} elements")
    descending = bool(call.attr("descending") if call.routine == "sort"
                      else call.attr("largest"))
    n = canon(x.shape[-1])
    m = n if call.routine == "sort" else canon(int(call.attr("k")))
    rows_shape = x.shape[:-1]
    rows = canon(product(rows_shape)) if rows_shape else sympy.Integer(1)
    sn = canon(x.strides[-1])
    name = sort_kernel_name(call)
    config = config or _config(max(2, pow2(int(row_max))), rows, hints)
    syms = size_names([n, rows, x.offset, *rows_shape, *x.strides])
    params = tuple([("out", vals), ("out", idx), ("in", x.buf)] + [("size", s) for s in syms])
    what = ("sort" + (" descending" if descending else "") if call.routine == "sort" else
            f"top {call.attr('k')} ({'largest' if descending else 'smallest'})")
    sig, head = _head(name, params, buffers, [
        f"    # {name}: {vals}, {idx} = {what} of {x.buf} along its last dim (stable: ties in "
        f"index order; routine {call.routine})",
        f"    #   from graph nodes: {', '.join(call.source)}"])
    ntl, mtl = to_tl(n), to_tl(m)
    def col(c: str) -> str:
        return c if sn == 1 else f"{c} * {to_tl(sn)}"

    body = [
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        "    xidx = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]",
        f"    xmask = xidx < {to_tl(rows)}",
        f"    xoff = {_offset(x.offset, unravel('xidx', rows_shape), x.strides[:-1], 'xidx')}",
        "    r = tl.arange(0, RBLOCK)[None, :].to(tl.int64)",
        f"    inrow = r < {ntl}",
        f"    v = tl.load(buf_{x.buf} + xoff + {col('r')}, mask=xmask & inrow, other=0)",
        *order_lines(dt.name, descending),
        "    key = (o.to(tl.int64) << 32) | r",
        "    key = tl.where(inrow, key, 0x7fffffffffffffff)  # past the row: last",
        "    key = tl.sort(key, 1)",
        "    i = (key & 0xffffffff).to(tl.int64)  # the sorted columns",
        f"    keep = xmask & (r < {mtl})",
        f"    sv = tl.load(buf_{x.buf} + xoff + {col('i')}, mask=keep, other=0)",
        f"    tl.store(buf_{vals} + xidx * {mtl} + r, sv, mask=keep)",
        f"    tl.store(buf_{idx} + xidx * {mtl} + r, i, mask=keep)",
    ]
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, config, rows, call.source)
