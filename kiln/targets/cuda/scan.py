"""Scan and nonzero Extern steps -> Triton kernels for CUDA builds (issue 16: they went to the
ATen fallback on CUDA). `scan` (cumsum, cumprod, logcumsumexp of real values) and
`scan_extreme` (cummax, cummin: values and indices) along the operand's last dim
(lowering/library.py permutes the op's dim last: the operand is a strided `LibArg`, the
outputs contiguous [rows..., n]); `nonzero` (the coordinates of a bool mask's true elements,
lowering/library.py `lower_nonzero`).

Scans: program p takes rows [p*XBLOCK, (p+1)*XBLOCK) and walks each row in RBLOCK-wide tiles:
a tile is scanned by `tl.associative_scan` along its columns, combined with the carry (the
inclusive result at the end of the tiles before it) and stored; the carry becomes the tile's
last column. Any length, static or dynamic: a row longer than a tile takes several tiles in
order (rows are spread over programs; a tile's columns over threads). Arithmetic as eager's
CUDA kernels: 16-bit floats accumulate in float32, float32 in float32, float64 in float64,
integers and bools in int64 and are rounded to the output dtype where stored (wrapping
arithmetic: the same bits as accumulating in the output type); logcumsumexp combines with
ATen's `_log_add_exp_helper` (NaN from either side, equal infinities kept); cummax / cummin
take the later element on ties and on NaN (eager's `binary_op_update`, CPU and CUDA: the index
of the most recent NaN once one is seen).

nonzero: one program over the flattened mask in tiles: the exclusive count of true elements
before each one (a tile's cumsum plus the carry) is its output row, where its row-major
coordinates are stored; the count the program bound the row count with (a read_size) is
checked against the total (a mismatch sets the run's index status: never a write past the
output)."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.ir import loop as L
from kiln.ir.sym import FloorDiv, evaluate, product
from kiln.targets.cuda.kernel import Config, TritonKernel, signature
from kiln.targets.cuda.ops import INT_LIMITS, TL_DTYPE, canon, pow2, size_names, to_tl, unravel

SCAN_ROUTINES = ("scan", "scan_extreme")
NONZERO_ROUTINE = "nonzero"
# lowering/library.py SCAN_KINDS: sum, prod, logsumexp (prod_own: complex values only)
_COMBINE = {0: "_kl_add", 1: "_kl_mul", 2: "_kl_lse"}
_IDENT = {0: "0", 1: "1", 2: "float('-inf')"}
_KIND = {0: "sum", 1: "product", 2: "log-sum-exp"}
TILE = 2048  # elements of a tile (XBLOCK x RBLOCK)
CHUNK = 2048  # the multi-block scan: elements of a row one program scans
# output dtypes the multi-block scan may carry through the output (rounding a chunk's total
# to the output once more is exact or the accumulator's own rounding)
_BLOCK_DTYPES = ("float32", "float64", "int64", "int32", "int16", "int8", "uint8")
NZ_BLOCK = 1024  # nonzero: elements of the mask per tile


def scan_kernel_name(call: L.Extern) -> str:
    return f"{call.routine}_{call.name}"


def _offset(offset, coords: list[str], strides, var: str) -> str:
    parts = [] if canon(offset) == 0 else [to_tl(canon(offset))]
    for c, st in zip(coords, strides):
        st = canon(st)
        if st != 0 and c != "0":
            parts.append(c if st == 1 else f"{c} * {to_tl(st)}")
    parts.append(f"{var} * 0")  # a block like `var` even when no coordinate varies
    return " + ".join(parts)


def _acc(dt) -> str:
    """The Triton type a scan of output dtype `dt` accumulates in."""
    if dt.name == "float64":
        return "tl.float64"
    if dt.is_float:
        return "tl.float32"
    return "tl.int64"  # integers and bool: wrapping, rounded to the output where stored


def _to_out(x: str, out) -> str:
    """`x` (in the compute type) converted for a store into dtype `out`."""
    return f"({x} != 0)" if out.name == "bool" else f"{x}.to({TL_DTYPE[out]})"


def _config(n, rows, stride_one: bool, hints) -> Config:
    """Tile shape from the example sizes: long rows read along the row when the scanned dim
    is contiguous, else many rows a tile (neighbouring rows are neighbours in memory)."""
    try:
        n, rows = max(1, evaluate(n, hints)), max(1, evaluate(rows, hints))
    except (KeyError, TypeError, ValueError):  # sizes without a hint
        n, rows = 1024, 1
    if stride_one:
        rblock = min(pow2(n), 1024)
    else:
        rblock = min(pow2(n), 16)
    xblock = max(1, min(TILE // rblock, pow2(rows)))
    while xblock > 1 and -(-rows // xblock) < 132:  # programs for every H100 SM
        xblock //= 2
    warps = max(1, min(8, pow2(xblock * rblock // 256)))
    return Config(xblock, rblock, warps)


def _head(name: str, params, buffers, comment: list[str]):
    sig = signature(params, buffers)
    head = ["@triton.jit",
            f"def {name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}, "
            "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):", *comment]
    return sig, head


def print_scan_kernels(call: L.Extern, buffers, hints: dict[str, int]) -> list[TritonKernel]:
    """The kernels of one `scan` / `scan_extreme` call (real values): one kernel walking
    each row's tiles in order, or, for few long rows (by the example sizes), the multi-block
    scan's three (`_print_scan_blocks`)."""
    (x,) = call.args
    n = canon(x.shape[-1])
    rows = canon(product(x.shape[:-1])) if x.shape[:-1] else sympy.Integer(1)
    out_dt = buffers[call.outs[0]].dtype
    try:
        nh, rh = evaluate(n, hints), evaluate(rows, hints)
    except (KeyError, TypeError, ValueError):
        nh, rh = 0, 0
    exact = call.routine == "scan_extreme" or out_dt.name in _BLOCK_DTYPES
    if exact and nh > 2 * CHUNK and rh < 132:
        return _print_scan_blocks(call, buffers)
    return [print_scan_kernel(call, buffers, hints)]


def print_scan_kernel(call: L.Extern, buffers, hints: dict[str, int],
                      config: Config | None = None) -> TritonKernel:
    """The single kernel of one `scan` / `scan_extreme` call (real values)."""
    (x,) = call.args
    src_dt = buffers[x.buf].dtype
    out_dt = buffers[call.outs[0]].dtype
    if src_dt.is_complex or out_dt.is_complex:
        raise UnsupportedError(f"complex {call.routine} (for {', '.join(call.source)}) in a "
                               "Triton kernel: the frontend writes complex scans as doubling")
    n = canon(x.shape[-1])
    rows_shape = x.shape[:-1]
    rows = canon(product(rows_shape)) if rows_shape else sympy.Integer(1)
    sn = canon(x.strides[-1])
    name = scan_kernel_name(call)
    config = config or _config(n, rows, sn == 1, hints)
    exprs = [n, rows, x.offset, *rows_shape, *x.strides]
    syms = size_names(exprs)
    params = tuple([("out", o) for o in call.outs] + [("in", x.buf)] +
                   [("size", s) for s in syms])
    extreme = call.routine == "scan_extreme"
    what = (f"cum{'max' if call.attr('is_max') else 'min'}" if extreme
            else f"cumulative {_KIND[call.attr('kind')]}")
    sig, head = _head(name, params, buffers, [
        f"    # {name}: {', '.join(call.outs)} = {what} of {x.buf} along its last dim "
        f"(routine {call.routine})",
        f"    #   from graph nodes: {', '.join(call.source)}"])
    ntl, stl = to_tl(n), to_tl(sn)
    row_off = _offset(x.offset, unravel("xidx", rows_shape), x.strides[:-1], "xidx")
    body = [
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        "    xidx = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]",
        f"    xmask = xidx < {to_tl(rows)}",
        f"    xoff = {row_off}",
        "    last = tl.arange(0, RBLOCK)[None, :] == RBLOCK - 1",
    ]
    load = (f"tl.load(buf_{x.buf} + xoff + r * {stl}, mask=m, other=0)" if sn != 1
            else f"tl.load(buf_{x.buf} + xoff + r, mask=m, other=0)")
    if not extreme:
        kind = int(call.attr("kind"))
        if kind not in _COMBINE:
            raise UnsupportedError(f"scan kind {kind} (for {', '.join(call.source)}) has no "
                                   "Triton kernel")
        if kind == 2 and not out_dt.is_float:
            raise UnsupportedError(f"logcumsumexp of {out_dt.name} (for "
                                   f"{', '.join(call.source)})")
        # the element as the output dtype (eager converts first), then the accumulator's
        fn, ident, acc, conv = _ops(call, buffers)
        body += [
            f"    carry = tl.full([XBLOCK, 1], {ident}, {acc})",
            f"    for r0 in range(0, {ntl}, RBLOCK):",
            "        r = r0 + tl.arange(0, RBLOCK)[None, :].to(tl.int64)",
            f"        m = xmask & (r < {ntl})",
            f"        v = {load}",
            f"        v = {conv}",
            f"        s = {fn}(carry, tl.associative_scan(v, 1, {fn}))",
            f"        tl.store(buf_{call.outs[0]} + xidx * {ntl} + r, {_to_out('s', out_dt)}, "
            "mask=m)",
            f"        carry = tl.sum(tl.where(last, s, 0), 1, keep_dims=True).to({acc})",
        ]
    else:
        vals, idx = call.outs
        is_max = bool(call.attr("is_max"))
        if src_dt.name == "bool":
            vt, conv = "tl.int8", "v.to(tl.int8)"
            ident = "0" if is_max else "1"
        elif src_dt.is_float:
            vt = "tl.float64" if src_dt.name == "float64" else "tl.float32"
            conv = f"v.to({vt})"
            ident = "float('-inf')" if is_max else "float('inf')"
        else:
            vt, conv = TL_DTYPE[src_dt], "v"
            lo, hi = INT_LIMITS[src_dt.name]
            ident = str(lo if is_max else hi)
        fn = "_kl_cummax" if is_max else "_kl_cummin"
        body += [
            f"    cv = tl.full([XBLOCK, 1], {ident}, {vt})",
            "    ci = tl.full([XBLOCK, 1], 0, tl.int64)",
            f"    for r0 in range(0, {ntl}, RBLOCK):",
            "        r = r0 + tl.arange(0, RBLOCK)[None, :].to(tl.int64)",
            f"        m = xmask & (r < {ntl})",
            f"        v = {load}",
            f"        v = {conv}",
            "        i = tl.broadcast_to(r, [XBLOCK, RBLOCK])",
            f"        sv, si = tl.associative_scan((v, i), 1, {fn})",
            f"        sv, si = {fn}(cv, ci, sv, si)",
            f"        tl.store(buf_{vals} + xidx * {ntl} + r, {_to_out('sv', src_dt)}, mask=m)",
            f"        tl.store(buf_{idx} + xidx * {ntl} + r, si, mask=m)",
            f"        cv = tl.sum(tl.where(last, sv, 0), 1, keep_dims=True).to({vt})",
            "        ci = tl.sum(tl.where(last, si, 0), 1, keep_dims=True).to(tl.int64)",
        ]
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, config, rows, call.source)


def print_nonzero_kernel(call: L.Extern, buffers, config: Config | None = None
                         ) -> TritonKernel:
    """The kernel of one `nonzero` call: one program over the flattened mask (operand 0, a
    strided bool LibArg) in tiles; operand 1 the count (int64, 0-d) the row count was bound
    with."""
    mask, count, *csum = call.args
    out = call.name
    if csum:
        return _print_nonzero_parallel(call, buffers)
    rank = len(mask.shape)
    total = canon(product(mask.shape)) if rank else sympy.Integer(1)
    name = scan_kernel_name(call)
    exprs = [total, mask.offset, *mask.shape, *mask.strides, count.offset]
    syms = size_names(exprs)
    params = tuple([("out", out), ("in", mask.buf)] +
                   ([("in", count.buf)] if count.buf != mask.buf else []) +
                   [("size", s) for s in syms] + [("status", "kiln_status")])
    sig, head = _head(name, params, buffers, [
        f"    # {name}: {out} = nonzero({mask.buf}), {count.buf}: the count of true elements "
        "(routine nonzero)",
        f"    #   from graph nodes: {', '.join(call.source)}"])
    coords = unravel("p", mask.shape)
    ttl = to_tl(total)
    body = [
        f"    want = tl.load(buf_{count.buf} + {to_tl(canon(count.offset))})",
        "    carry = tl.full([1], 0, tl.int64)",
        f"    for p0 in range(0, {ttl}, RBLOCK):",
        "        p = p0 + tl.arange(0, RBLOCK).to(tl.int64)",
        f"        ok = p < {ttl}",
        f"        v = tl.load(buf_{mask.buf} + {_offset(mask.offset, coords, mask.strides, 'p')}, "
        "mask=ok, other=0)",
        "        v = (v != 0).to(tl.int64)",
        "        pos = carry + tl.associative_scan(v, 0, _kl_add) - v  # true elements before",
        "        sel = ok & (v != 0) & (pos < want)",
    ]
    for d, c in enumerate(coords):
        body.append(f"        tl.store(buf_{out} + pos * {rank} + {d}, ({c}).to(tl.int64) + p * 0,"
                    " mask=sel)")
    body += [
        "        carry = carry + tl.sum(v, 0)",
        "    bad = carry != want  # the count the output was sized by",
        "    tl.store(kiln_status + tl.zeros([1], tl.int32), 1, mask=bad)",
    ]
    config = config or Config(1, NZ_BLOCK, 4)
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, config, sympy.Integer(1), call.source)


# -- complex scatter products -------------------------------------------------------------------

_PART_FLOAT = {"complex64": "tl.float32", "complex128": "tl.float64"}


def is_complex_product(call: L.Extern, dtype) -> bool:
    """A `put` call multiplying complex values (scatter(reduce="multiply"),
    scatter_reduce("prod") of complex64 / complex128): `print_cput_kernel`'s. `dtype`: its
    output's dtype."""
    return call.routine == "put" and call.attr("mode") == 2 and dtype.name in _PART_FLOAT


def cput_kernel_name(call: L.Extern) -> str:
    return f"cput_{call.name}"


def print_cput_kernel(call: L.Extern, buffers) -> TritonKernel:
    """The kernel of a complex scatter product: one lane per output element, each walking
    the updates in row-major order of the index (eager's CPU order: the products of one place
    in update order, with eager's contracted product re = fma(a, c, -(b d)), im = fma(a, d,
    b c); without include_self a place's first update starts from 1 + 0i); an index out of
    its dim sets the run's index status (an error, as the CPU routine's)."""
    self_, values, index = call.args
    out = call.name
    dt = buffers[out].dtype
    F = _PART_FLOAT[dt.name]
    bits = "tl.int32" if dt.name == "complex64" else "tl.int64"
    dims = tuple(call.attr("dims"))
    include_self = bool(call.attr("include_self", True))
    if sum(1 for d in dims if d < 0) != 1 or len(dims) != len(self_.shape):
        raise UnsupportedError(f"complex scatter product {out} (for {', '.join(call.source)})"
                               " with other than one index tensor")
    shape = self_.shape
    total = canon(product(shape)) if shape else sympy.Integer(1)
    iters = values.shape
    m = canon(product(iters)) if iters else sympy.Integer(1)
    name = cput_kernel_name(call)
    exprs = [total, m, self_.offset, *shape, *self_.strides, values.offset, *iters,
             *values.strides, index.offset, *index.strides]
    syms = size_names(exprs)
    bufs = [out] + [b for b in dict.fromkeys((self_.buf, values.buf, index.buf)) if b != out]
    params = tuple([("out", out)] + [("in", b) for b in bufs[1:]] +
                   [("size", s) for s in syms] + [("status", "kiln_status")])
    sig, head = _head(name, params, buffers, [
        f"    # {name}: {out} = scatter product of {values.buf} into {self_.buf} at "
        f"{index.buf} (complex, in update order)",
        f"    #   from graph nodes: {', '.join(call.source)}"])
    oc = unravel("o", shape)
    it = unravel("j", iters)
    ostr, st = [], sympy.Integer(1)
    for n in reversed(shape):
        ostr.append(st)
        st = st * canon(n)
    ostr = ostr[::-1]
    dest = []
    for d, k in enumerate(dims):
        c = "v" if k < 0 else it[k]
        if c != "0" and canon(ostr[d]) != 0 and not (k >= 0 and canon(shape[d]) == 1):
            dest.append(c if canon(ostr[d]) == 1 else f"{c} * {to_tl(canon(ostr[d]))}")
    dsize = to_tl(canon(shape[dims.index(next(d for d in dims if d < 0))]))
    soff = _offset(self_.offset, oc, self_.strides, "o")
    body = [
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        "    o = pid * XBLOCK + tl.arange(0, XBLOCK).to(tl.int64)",
        f"    ok = o < {to_tl(total)}",
        f"    re = tl.load(buf_{self_.buf} + 2 * ({soff}), mask=ok, other=0)"
        f".to({F}, bitcast=True)",
        f"    im = tl.load(buf_{self_.buf} + 2 * ({soff}) + 1, mask=ok, other=0)"
        f".to({F}, bitcast=True)",
        "    seen = o < 0  # (a place's first update, without include_self)",
        f"    for j in range(0, {to_tl(m)}):",
        f"        v = tl.load(buf_{index.buf} + {_scalar_off(index.offset, it, index.strides)})"
        ".to(tl.int64)",
        f"        bad = (v < 0) | (v >= {dsize})",
        "        tl.store(kiln_status + tl.zeros([1], tl.int32), 1, mask=tl.full([1], 0, tl.int1) "
        "| bad)",
        f"        hit = ok & (o == ({' + '.join(dest) or '0'})) & ~bad",
        f"        voff = 2 * ({_scalar_off(values.offset, it, values.strides)})",
        f"        sr = tl.load(buf_{values.buf} + voff).to({F}, bitcast=True)",
        f"        si = tl.load(buf_{values.buf} + voff + 1).to({F}, bitcast=True)",
    ]
    if not include_self:
        body += ["        first = hit & ~seen",
                 "        re = tl.where(first, 1.0, re)",
                 "        im = tl.where(first, 0.0, im)",
                 "        seen = seen | hit"]
    body += [
        "        nr = tl.fma(re, sr, -(im * si))",
        "        ni = tl.fma(re, si, im * sr)",
        "        re = tl.where(hit, nr, re)",
        "        im = tl.where(hit, ni, im)",
        f"    tl.store(buf_{out} + 2 * o, re.to({bits}, bitcast=True), mask=ok)",
        f"    tl.store(buf_{out} + 2 * o + 1, im.to({bits}, bitcast=True), mask=ok)",
    ]
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, Config(128, 1, 4), total, call.source)


def _scalar_off(offset, coords: list[str], strides) -> str:
    parts = [] if canon(offset) == 0 else [to_tl(canon(offset))]
    for c, s in zip(coords, strides):
        s = canon(s)
        if s != 0 and c != "0":
            parts.append(c if s == 1 else f"{c} * {to_tl(s)}")
    return " + ".join(parts) or "0"


def _ops(call: L.Extern, buffers):
    """(combine helper, identity, compute type, element conversion `v` -> compute) of a scan
    call: eager's arithmetic (see the module doc)."""
    (x,) = call.args
    src_dt = buffers[x.buf].dtype
    out_dt = buffers[call.outs[0]].dtype
    if call.routine == "scan_extreme":
        is_max = bool(call.attr("is_max"))
        fn = "_kl_cummax" if is_max else "_kl_cummin"
        if src_dt.name == "bool":
            return fn, "0" if is_max else "1", "tl.int8", "v.to(tl.int8)"
        if src_dt.is_float:
            vt = "tl.float64" if src_dt.name == "float64" else "tl.float32"
            return fn, "float('-inf')" if is_max else "float('inf')", vt, f"v.to({vt})"
        lo, hi = INT_LIMITS[src_dt.name]
        return fn, str(lo if is_max else hi), TL_DTYPE[src_dt], "v"
    kind = int(call.attr("kind"))
    acc = _acc(out_dt)
    if src_dt == out_dt or out_dt.name in ("float32", "float64", "int64"):
        conv = f"v.to({acc})" if src_dt.name != "bool" else f"v.to(tl.int8).to({acc})"
    elif out_dt.name == "bool":
        conv = f"(v != 0).to({acc})"
    else:
        first = "v.to(tl.int8)" if src_dt.name == "bool" else "v"
        conv = f"{first}.to({TL_DTYPE[out_dt]}).to({acc})"
    return _COMBINE[kind], _IDENT[kind], acc, conv


def _print_scan_blocks(call: L.Extern, buffers) -> list[TritonKernel]:
    """The multi-block scan of few long rows: three kernels over chunks of CHUNK elements
    (NB of them a row), the output carrying the partial results (no scratch buffer):
    `_local`: program (row, chunk) scans its chunk and stores it; `_carry`: a program per row
    scans the chunks' last elements (NB - 1 of them, in tiles with a carry) and stores them
    back, now inclusive over the row; `_fix`: program (row, chunk >= 1) combines the last
    element before its chunk (final) with its chunk's other elements (a full chunk's last is
    already final)."""
    (x,) = call.args
    extreme = call.routine == "scan_extreme"
    fn, ident, vt, conv = _ops(call, buffers)
    out_dt = buffers[call.outs[0]].dtype
    n = canon(x.shape[-1])
    rows_shape = x.shape[:-1]
    rows = canon(product(rows_shape)) if rows_shape else sympy.Integer(1)
    sn = canon(x.strides[-1])
    nb = sympy.sympify(FloorDiv(n + CHUNK - 1, CHUNK))
    base = scan_kernel_name(call)
    ntl, nbt = to_tl(n), to_tl(nb)
    exprs = [n, rows, x.offset, *rows_shape, *x.strides, nb]
    syms = size_names(exprs)
    outs = list(call.outs)
    vals = outs[0]
    what = f"{call.routine} of {x.buf} ({', '.join(call.source)})"
    stored = _to_out("s", out_dt) if not extreme else _to_out("sv", buffers[x.buf].dtype)
    back = conv if extreme else f"v.to({vt})"  # what the output holds, as computed values
    kernels = []

    def kernel(suffix, params, body, rows_expr, xblock, rblock, comment):
        name = f"{base}_{suffix}"
        sig, head = _head(name, params, buffers, [f"    # {name}: {comment}",
                                                  f"    #   {what}"])
        head.append("    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + "
                    "tl.program_id(0)")
        src = "\n".join(head + body) + "\n"
        kernels.append(TritonKernel(name, src, params, sig, Config(xblock, rblock, 4),
                                    rows_expr, call.source))

    size_params = [("size", s_) for s_ in syms]
    # 1. each chunk on its own
    row_off = _offset(x.offset, unravel("r", rows_shape), x.strides[:-1], "r")
    load = f"tl.load(buf_{x.buf} + xoff + col{'' if sn == 1 else ' * ' + to_tl(sn)}, mask=m, " \
        "other=0)"
    body = [f"    r = pid // {nbt}",
            f"    c = pid % {nbt}",
            f"    xoff = {row_off}",
            "    col = c * RBLOCK + tl.arange(0, RBLOCK)[None, :].to(tl.int64)",
            f"    m = col < {ntl}",
            f"    v = {load}",
            f"    v = {conv}"]
    if extreme:
        body += ["    i = col + r * 0",
                 f"    sv, si = tl.associative_scan((v, i), 1, {fn})",
                 f"    tl.store(buf_{vals} + r * {ntl} + col, {stored}, mask=m)",
                 f"    tl.store(buf_{outs[1]} + r * {ntl} + col, si, mask=m)"]
    else:
        body += [f"    s = tl.associative_scan(v, 1, {fn})",
                 f"    tl.store(buf_{vals} + r * {ntl} + col, {stored}, mask=m)"]
    kernel("local", tuple([("out", o) for o in outs] + [("in", x.buf)] + size_params), body,
           rows * nb, 1, CHUNK, "each chunk scanned on its own")
    # 2. the chunks' last elements, inclusive over the row
    oparams = tuple([("out", o) for o in outs] + size_params)
    body = ["    r = pid",
            "    last = tl.arange(0, RBLOCK)[None, :] == RBLOCK - 1",
            f"    cv = tl.full([1, 1], {ident}, {vt})"]
    if extreme:
        body.append("    ci = tl.full([1, 1], 0, tl.int64)")
    body += [f"    for c0 in range(0, {nbt} - 1, RBLOCK):",
             "        c = c0 + tl.arange(0, RBLOCK)[None, :].to(tl.int64)",
             f"        m = c < {nbt} - 1",
             f"        at = r * {ntl} + c * {CHUNK} + {CHUNK - 1}",
             f"        v = tl.load(buf_{vals} + at, mask=m, other=0)",
             f"        v = {back}"]
    if extreme:
        body += [f"        i = tl.load(buf_{outs[1]} + at, mask=m, other=0)",
                 f"        sv, si = tl.associative_scan((v, i), 1, {fn})",
                 f"        sv, si = {fn}(cv, ci, sv, si)",
                 f"        tl.store(buf_{vals} + at, {stored}, mask=m)",
                 f"        tl.store(buf_{outs[1]} + at, si, mask=m)",
                 f"        cv = tl.sum(tl.where(last, sv, 0), 1, keep_dims=True).to({vt})",
                 "        ci = tl.sum(tl.where(last, si, 0), 1, keep_dims=True).to(tl.int64)"]
    else:
        body += [f"        s = {fn}(cv, tl.associative_scan(v, 1, {fn}))",
                 f"        tl.store(buf_{vals} + at, {stored}, mask=m)",
                 f"        cv = tl.sum(tl.where(last, s, 0), 1, keep_dims=True).to({vt})"]
    kernel("carry", oparams, body, rows, 1, 1024, "the chunks' last elements, inclusive")
    # 3. every other element of chunks 1 .. NB-1
    body = [f"    r = pid // ({nbt} - 1)",
            f"    c = pid % ({nbt} - 1) + 1",
            f"    prev = r * {ntl} + c * {CHUNK} - 1",
            "    col = c * RBLOCK + tl.arange(0, RBLOCK)[None, :].to(tl.int64)",
            f"    m = (col < {ntl}) & ((col != c * RBLOCK + RBLOCK - 1) | (c == {nbt} - 1))",
            f"    v = tl.load(buf_{vals} + prev + col * 0)",
            f"    cv = {back}",
            f"    v = tl.load(buf_{vals} + r * {ntl} + col, mask=m, other=0)",
            f"    v = {back}"]
    if extreme:
        body += [f"    ci = tl.load(buf_{outs[1]} + prev + col * 0)",
                 f"    i = tl.load(buf_{outs[1]} + r * {ntl} + col, mask=m, other=0)",
                 f"    sv, si = {fn}(cv, ci, v, i)",
                 f"    tl.store(buf_{vals} + r * {ntl} + col, {stored}, mask=m)",
                 f"    tl.store(buf_{outs[1]} + r * {ntl} + col, si, mask=m)"]
    else:
        body += [f"    s = {fn}(cv, v)",
                 f"    tl.store(buf_{vals} + r * {ntl} + col, {stored}, mask=m)"]
    kernel("fix", oparams, body, rows * (nb - 1), 1, CHUNK, "chunks 1.. combined with the "
           "final element before them")
    return kernels


def scan_kernel_names(call: L.Extern, kernels) -> list[str]:
    """The kernels a scan call launches, in order (those of `kernels`, by name)."""
    base = scan_kernel_name(call)
    if f"{base}_local" in kernels:
        return [f"{base}_local", f"{base}_carry", f"{base}_fix"]
    return [base]


def _print_nonzero_parallel(call: L.Extern, buffers) -> TritonKernel:
    """nonzero with the inclusive count before each element given (operand 2, a flat int64
    scan of the mask): one lane per element, a true one stored at row count - 1; the total
    (the scan's last element) checked against the count the output was sized by."""
    mask, count, csum = call.args
    out = call.name
    rank = len(mask.shape)
    total = canon(product(mask.shape)) if rank else sympy.Integer(1)
    name = scan_kernel_name(call)
    exprs = [total, mask.offset, *mask.shape, *mask.strides, count.offset, csum.offset,
             *csum.strides]
    syms = size_names(exprs)
    bufs = [b for b in dict.fromkeys((mask.buf, count.buf, csum.buf))]
    params = tuple([("out", out)] + [("in", b) for b in bufs] + [("size", s) for s in syms] +
                   [("status", "kiln_status")])
    sig, head = _head(name, params, buffers, [
        f"    # {name}: {out} = nonzero({mask.buf}); {csum.buf}: the inclusive count of true "
        f"elements, {count.buf}: their number (routine nonzero)",
        f"    #   from graph nodes: {', '.join(call.source)}"])
    coords = unravel("p", mask.shape)
    cst = canon(csum.strides[0]) if csum.strides else sympy.Integer(1)
    csoff = to_tl(canon(csum.offset))
    body = [
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        "    p = pid * XBLOCK + tl.arange(0, XBLOCK).to(tl.int64)",
        f"    ok = p < {to_tl(total)}",
        f"    want = tl.load(buf_{count.buf} + {to_tl(canon(count.offset))})",
        f"    have = tl.load(buf_{csum.buf} + {csoff} + ({to_tl(total)} - 1) * {to_tl(cst)})",
        f"    v = tl.load(buf_{mask.buf} + {_offset(mask.offset, coords, mask.strides, 'p')}, "
        "mask=ok, other=0) != 0",
        f"    pos = tl.load(buf_{csum.buf} + {csoff} + p * {to_tl(cst)}, mask=ok, other=0) - 1",
        "    sel = ok & v & (pos < want)",
    ]
    for d, c in enumerate(coords):
        body.append(f"    tl.store(buf_{out} + pos * {rank} + {d}, ({c}).to(tl.int64) + p * 0, "
                    "mask=sel)")
    body.append("    tl.store(kiln_status + p.to(tl.int32) * 0, 1, mask=(p == 0) & "
                "(have != want))  # the count the output was sized by")
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, Config(1024, 1, 4), total, call.source)
