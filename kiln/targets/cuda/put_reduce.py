"""Accumulating `put` / `put_mean` Extern steps -> Triton kernels for CUDA builds (issue 16:
index_put(accumulate=True), index_add, scatter_add, scatter(reduce="add" / "multiply") and
scatter_reduce (sum, prod, mean, amax, amin; include_self True or False) went to the ATen
fallback on CUDA). The semantics are the CPU routine's (kiln_lib.h `put_counted`) and
eager's: out = self, then out[dest(i)] = combine(out[dest(i)], values[i]) for every element i
of the iteration space, the destinations found as in targets/cuda/put.py (`destination`: an
index outside its dim sets the run's index status, an "index out of range" error; negative
indices wrap where the op allows them).

Kernels, in launch order (`put_reduce_kernel_names`):
- `put_copy_<out>` (put.py): out = self, launched only when out is not self's own storage;
- `put_count_<out>` (mean): count = 1 with include_self, else 0, at every element;
- `put_init_<out>` (without include_self): every destination takes the combine's identity
  (0, 1, the lowest or highest value), so it ends as the combination of its updates only;
- `put_<out>`: each update combined into its destination atomically (updates of one place in
  no fixed order, as eager's CUDA kernels); with mean, its count incremented;
- `put_div_<out>` (mean): out = out / count where count > 0 (floor division for integers).

Atomics: sums of int32, int64, float32 and float64 are `tl.atomic_add`, amax / amin of int32
and int64 `tl.atomic_max` / `tl.atomic_min`; every other combine is a compare-and-swap loop
(`tl.atomic_cas`) on the element's bits (32 and 64 bits) or, for 8- and 16-bit dtypes, on the
aligned 32-bit word holding the element (the other bytes written back as read). float16 and
bfloat16 combine in float32 and round each update to 16 bits: eager's CUDA scatter_add /
scatter_reduce (atomicAdd on half, a CAS loop on bfloat16) rounds the same way; eager's
index_put(accumulate=True) sums a place's duplicates in float32 first (its sort-based
kernel), so it may differ from kiln's by one rounding per duplicate. amax / amin propagate
NaN as eager's `safe_max` / `safe_min` (Atomic.cuh): a NaN update or a NaN already there
stays NaN. bool sums are logical or, products and amin logical and, amax or (the CPU
routine's arithmetic on bool); integer sums and products wrap."""

from __future__ import annotations


from kiln.errors import UnsupportedError
from kiln.frontend.aten_library import ACC_PUT_DTYPES
from kiln.ir import loop as L
from kiln.ir.sym import product
from kiln.targets.cuda.kernel import Config, TritonKernel, signature
from kiln.targets.cuda.ops import INT_LIMITS, TL_DTYPE, canon, size_names, to_tl
from kiln.targets.cuda.put import destination, print_put_copy, put_kernel_names

XBLOCK = 256
NUM_WARPS = 4
# lowering/library.py PUT_MODES
SET, SUM, PROD, MEAN, AMAX, AMIN = range(6)
_MODE = {SUM: "sum", PROD: "product", MEAN: "mean", AMAX: "amax", AMIN: "amin"}
_NATIVE_ADD = ("int32", "int64", "float32", "float64")
_NATIVE_MINMAX = ("int32", "int64")
_BITS = {"float16": 16, "bfloat16": 16, "int16": 16, "int8": 8, "uint8": 8, "bool": 8,
         "float32": 32, "int32": 32, "float64": 64, "int64": 64}


def is_reducing_put(call: L.Extern, dtype) -> bool:
    """A `put` that combines (mode other than set) or a `put_mean`, of a real dtype: this
    module's. `dtype`: its output's dtype."""
    return (call.routine == "put_mean" or
            (call.routine == "put" and call.attr("mode") != SET)) and not dtype.is_complex


def put_reduce_kernel_names(call: L.Extern, include_copy: bool = True) -> list[str]:
    """The kernels of a reducing put, in launch order (the copy first, where asked)."""
    name = call.name
    mean = call.routine == "put_mean"
    out = [put_kernel_names(call)[0]] if include_copy else []
    if mean:
        out.append(f"put_count_{name}")
    if not call.attr("include_self", True):
        out.append(f"put_init_{name}")
    out.append(f"put_{name}")
    if mean:
        out.append(f"put_div_{name}")
    return out


def _kernel(name: str, call: L.Extern, buffers, outs: list[str], ins: list[str], exprs,
            status: bool, body: list[str], rows, comment: str) -> TritonKernel:
    syms = size_names([rows, *exprs])
    params = tuple([("out", o) for o in outs] + [("in", b) for b in ins if b not in outs] +
                   [("size", s) for s in syms] + ([("status", "kiln_status")] if status else []))
    sig = signature(params, buffers)
    head = [
        "@triton.jit",
        f"def {name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}, "
        "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {name}: {comment}",
        f"    #   from graph nodes: {', '.join(call.source)}",
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        "    i = pid * XBLOCK + tl.arange(0, XBLOCK)",
        f"    ok = i < {to_tl(canon(rows))}",
    ]
    src = "\n".join(head + [f"    {x}" for x in body]) + "\n"
    return TritonKernel(name, src, params, sig, Config(XBLOCK, 1, NUM_WARPS), canon(rows),
                        call.source)


def _compute(dt) -> str:
    """The Triton type a combine of dtype `dt` computes in."""
    if dt.name == "float64":
        return "tl.float64"
    if dt.is_float:
        return "tl.float32"
    if dt.name == "int64":
        return "tl.int64"
    return "tl.int32"  # int32 and the 8- / 16-bit integers and bool (wrapped where stored)


def _identity(mode: int, dt) -> str:
    if mode in (SUM, MEAN):
        return "0"
    if mode == PROD:
        return "1"
    if dt.name == "bool":
        return "0" if mode == AMAX else "1"
    if dt.is_float:
        return "float('-inf')" if mode == AMAX else "float('inf')"
    lo, hi = INT_LIMITS[dt.name]
    return str(lo if mode == AMAX else hi)


def _combine(mode: int, dt, a: str, b: str) -> str:
    """combine(a, b) in the compute type (`_compute`)."""
    if dt.name == "bool":
        return f"({a} | {b})" if mode in (SUM, MEAN, AMAX) else f"({a} & {b})"
    if mode in (SUM, MEAN):
        return f"({a} + {b})"
    if mode == PROD:
        return f"({a} * {b})"
    fn = "tl.maximum" if mode == AMAX else "tl.minimum"
    if dt.is_float:  # NaN from either side (eager's safe_max / safe_min)
        return f"tl.where(({a} != {a}) | ({b} != {b}), {a} + {b}, {fn}({a}, {b}))"
    return f"{fn}({a}, {b})"


def _cas_lines(out: str, dt, mode: int, dest: str, todo: str) -> list[str]:
    """A compare-and-swap loop combining `vc` (the update in the compute type) into
    out[dest] for the lanes `todo`: on the element's bits (32 / 64 bits) or on the aligned
    32-bit word holding it (8 / 16 bits). Lanes not in `todo` swap 0 for 0 at word 0 of their
    place (no change)."""
    bits = _BITS[dt.name]
    word = "tl.int64" if bits == 64 else "tl.int32"
    lines = [f"wp = buf_{out}.to(tl.pointer_type({word}))",
             f"off = tl.where({todo}, {dest}, 0)"]
    if bits >= 32:
        lines.append("w = off")
        if dt.is_float:
            cur = f"old.to({TL_DTYPE[dt]}, bitcast=True)"
            new = f"nv.to({word}, bitcast=True)"
        else:
            cur, new = "old", "nv"
        merge = new
    else:
        per = 32 // bits
        mask = (1 << bits) - 1
        lines += [f"w = off // {per}", f"sh = ((off % {per}) * {bits}).to(tl.int32)"]
        raw = f"((old >> sh) & {mask})"
        if dt.name == "float16":
            cur = f"{raw}.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)"
            nb = f"(nv.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & {mask})"
        elif dt.name == "bfloat16":  # the high half of a float32; rounded to nearest even
            cur = f"({raw} << 16).to(tl.float32, bitcast=True)"
            nb = "_kl_bf16_bits(nv)"
        elif dt.name == "bool":
            cur = f"({raw} != 0).to(tl.int32)"
            nb = "(nv != 0).to(tl.int32)"
        elif dt.name == "uint8":
            cur, nb = raw, f"(nv & {mask})"
        else:  # int8, int16: sign-extended
            cur = f"{raw}.to({TL_DTYPE[dt]}).to(tl.int32)"
            nb = f"(nv & {mask})"
        merge = f"(old & ~({mask} << sh)) | ({nb} << sh)"
    lines += [
        f"old = tl.load(wp + w, mask={todo}, other=0)",
        f"while tl.max({todo}.to(tl.int32), 0) > 0:",
        f"    cur = {cur}",
        f"    nv = {_combine(mode, dt, 'cur', 'vc')}",
        f"    nw = {merge}",
        f"    got = tl.atomic_cas(wp + w, tl.where({todo}, old, 0), tl.where({todo}, nw, 0), "
        "sem=\"relaxed\")",
        f"    {todo} = {todo} & (got != old)",
        "    old = got",
    ]
    return lines


def print_put_reduce_kernels(call: L.Extern, buffers) -> list[TritonKernel]:
    """The kernels of one reducing put (see the module doc), the copy first."""
    out = call.name
    dt = buffers[out].dtype
    mode = int(call.attr("mode"))
    mean = call.routine == "put_mean"
    if mean:
        mode = MEAN
    if dt.name not in ACC_PUT_DTYPES or mode not in _MODE:
        raise UnsupportedError(f"index_put / scatter with {_MODE.get(mode, mode)} of "
                               f"{dt.name} (for {', '.join(call.source)}) has no CUDA kernel")
    include_self = bool(call.attr("include_self", True))
    what = (f"{out} = scatter {_MODE[mode]} of {call.args[1].buf} into {call.args[0].buf}"
            f"{'' if include_self else ' (without self)'}")
    kernels = [print_put_copy(call, buffers)]
    n = canon(product(buffers[out].shape))
    count = call.outs[1] if mean else None
    if mean:
        kernels.append(_kernel(f"put_count_{out}", call, buffers, [count], [], [], False, [
            f"tl.store(buf_{count} + i, tl.full([XBLOCK], {int(include_self)}, tl.int64), "
            "mask=ok)"], n, f"{count} = {int(include_self)} (the contributions to {out})"))
    body, dest, bufs, exprs, m = destination(call, buffers, indent="")
    ins = bufs[1:]
    status = ["tl.store(kiln_status + i.to(tl.int32) * 0, 1, mask=ok & bad)"]
    if not include_self:
        ident = _identity(mode, dt)
        kernels.append(_kernel(f"put_init_{out}", call, buffers, [out], ins, exprs, True, [
            *body,
            f"tl.store(buf_{out} + {dest}, tl.full([XBLOCK], {ident}, {_compute(dt)})"
            f".to({TL_DTYPE[dt]}), mask=ok & ~bad)", *status], m,
            f"{out}'s updated places = {ident}"))
    upd = [*body, "todo = ok & ~bad", *status]
    if mean:  # (before the update: a CAS loop consumes `todo`)
        upd.append(f"tl.atomic_add(buf_{count} + tl.where(todo, {dest}, 0), "
                   "tl.full([XBLOCK], 1, tl.int64), mask=todo, sem=\"relaxed\")")
    if mode in (SUM, MEAN) and dt.name in _NATIVE_ADD:
        upd.append(f"tl.atomic_add(buf_{out} + tl.where(todo, {dest}, 0), v, mask=todo, "
                   "sem=\"relaxed\")")
    elif mode in (AMAX, AMIN) and dt.name in _NATIVE_MINMAX:
        fn = "tl.atomic_max" if mode == AMAX else "tl.atomic_min"
        upd.append(f"{fn}(buf_{out} + tl.where(todo, {dest}, 0), v, mask=todo, "
                   "sem=\"relaxed\")")
    else:
        upd.append(f"vc = v.to({_compute(dt)})")
        upd += _cas_lines(out, dt, mode, dest, "todo")
    outs = [out] + ([count] if count else [])
    kernels.append(_kernel(f"put_{out}", call, buffers, outs, ins, exprs, True, upd, m, what))
    if count:
        ct = _compute(dt)
        if dt.is_float:
            q = f"(x.to({ct}) / c.to({ct})).to({TL_DTYPE[dt]})"
        else:
            q = f"_kl_floordiv_i(x.to(tl.int64), c).to({TL_DTYPE[dt]})"
        kernels.append(_kernel(f"put_div_{out}", call, buffers, [out, count], [], [], False, [
            f"c = tl.load(buf_{count} + i, mask=ok, other=1)",
            f"x = tl.load(buf_{out} + i, mask=ok)",
            f"tl.store(buf_{out} + i, tl.where(c > 0, {q}, x), mask=ok)",
        ], n, f"{out} = {out} / {count} (the mean of each place's contributions)"))
    return kernels
