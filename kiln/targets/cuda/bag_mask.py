"""`masked_scatter` and `embedding_bag` Extern steps -> Triton kernels for CUDA builds (issue 16:
both went to the ATen fallback on CUDA). The semantics are the CPU routines' (kiln_lib.h) and
eager's.

masked_scatter (`masked_scatter_<out>`; also x[mask] = v with one value per selected element,
lowering/library.py `_mask_scatter`): operands self and mask (strided, broadcast to the output's
shape), source (strided, any shape) and, fourth, the inclusive count of true elements of the
mask (flat, row-major: a `scan` call lowering puts before it, multi-block when long:
targets/cuda/scan.py). One lane per output element: a true element at flat position p takes
source.flatten()[count[p] - 1], the others self's. A mask that selects more elements than
source has sets the run's index status (no read past source): on CUDA the error is the index
status's "index out of range in <node>" (the CPU routine names the count).

embedding_bag (`embedding_bag_<out>`): operands weight [rows, D] (strided), indices and
offsets (int32 / int64, strided), per_sample_weights (sum only) optionally; attributes mode
(0 sum, 1 mean, 2 max), include_last_offset, padding_idx (-1: none). Program (bag b, column
tile) walks indices[offsets[b] .. end of bag) (the end: offsets[b + 1], or the number of
indices for the last bag without include_last_offset) JBLOCK rows at a time (their loads in
flight together) and combines the weight rows' RBLOCK columns: padding_idx rows are skipped
and not counted; an empty bag (or one of padding only) gives 0; mean divides by the count;
max takes a bag's first row, then each row greater than the maximum so far (eager's CPU and
CUDA kernels: a NaN is kept only where it comes first, a later NaN is passed over: the
maximum of the non-NaN rows unless the first taken row is NaN). Arithmetic as eager's CUDA
kernel (EmbeddingBag.cu `EmbeddingBag_updateOutputKernel_sum_mean`: `accscalar_t` =
at::acc_type<scalar_t, true>): sum and mean of float16 / bfloat16 / float32 accumulate in
float32 (float64 in float64), the per-sample weight multiplied in the accumulator's type, the
mean divided there, rounded to the weight's dtype once at the store (a block's rows summed as
a tree, then added: the order differs from eager's row-by-row sum within float32's rounding);
max compares the weight's values (exact in float32). An index outside the weight's rows, or
offsets that decrease or leave [0, number of indices], set the run's index status (an "index
out of range" error): such an index is not read, such a bag is left empty."""

from __future__ import annotations

import sympy

from kiln.errors import UnsupportedError
from kiln.frontend.aten_library import ACC_PUT_DTYPES, BAG_DTYPES
from kiln.ir import loop as L
from kiln.ir.sym import FloorDiv, evaluate, product
from kiln.targets.cuda.kernel import Config, TritonKernel, signature
from kiln.targets.cuda.ops import TL_DTYPE, canon, pow2, size_names, to_tl, unravel

MASKED_SCATTER = "masked_scatter"
EMBEDDING_BAG = "embedding_bag"
BAG_MASK_ROUTINES = (MASKED_SCATTER, EMBEDDING_BAG)
XBLOCK = 1024  # masked_scatter: elements a program
JBLOCK = 16  # embedding_bag: a bag's rows loaded at once (8 for column tiles of 256)
_BAG_MODE = {0: "sum", 1: "mean", 2: "max"}


def bag_mask_kernel_name(call: L.Extern) -> str:
    return f"{call.routine}_{call.name}"


def _offset(arg: L.LibArg, coords: list[str], var: str) -> str:
    parts = [] if canon(arg.offset) == 0 else [to_tl(canon(arg.offset))]
    for c, st in zip(coords, arg.strides):
        st = canon(st)
        if st != 0 and c != "0":
            parts.append(c if st == 1 else f"{c} * {to_tl(st)}")
    parts.append(f"{var} * 0")  # a block like `var` even when no coordinate varies
    return " + ".join(parts)


def _head(name: str, params, buffers, comment: list[str]):
    sig = signature(params, buffers)
    head = ["@triton.jit",
            f"def {name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}, "
            "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):", *comment,
            "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)"]
    return sig, head


def print_bag_mask_kernel(call: L.Extern, buffers, hints: dict[str, int]) -> TritonKernel:
    """The kernel of one masked_scatter or embedding_bag call."""
    if call.routine == MASKED_SCATTER:
        return print_masked_scatter_kernel(call, buffers)
    return print_embedding_bag_kernel(call, buffers, hints)


def print_masked_scatter_kernel(call: L.Extern, buffers) -> TritonKernel:
    """`masked_scatter_<out>` (see the module doc)."""
    out = call.name
    dt = buffers[out].dtype
    if len(call.args) != 4:
        raise UnsupportedError(f"masked_scatter {out} (for {', '.join(call.source)}) without "
                               "the count of its mask (lowering's `counted` attribute)")
    if dt.name not in ACC_PUT_DTYPES:
        raise UnsupportedError(f"masked_scatter of {dt.name} (for {', '.join(call.source)}) "
                               "has no CUDA kernel")
    self_, mask, source, count = call.args
    shape = self_.shape
    total = canon(product(shape)) if shape else sympy.Integer(1)
    avail = canon(product(source.shape)) if source.shape else sympy.Integer(1)
    name = bag_mask_kernel_name(call)
    exprs = [total, avail, self_.offset, *shape, *self_.strides, mask.offset, *mask.strides,
             source.offset, *source.shape, *source.strides, count.offset, *count.strides]
    syms = size_names(exprs)
    ins = [b for b in dict.fromkeys((self_.buf, mask.buf, source.buf, count.buf)) if b != out]
    params = tuple([("out", out)] + [("in", b) for b in ins] + [("size", s) for s in syms] +
                   [("status", "kiln_status")])
    sig, head = _head(name, params, buffers, [
        f"    # {name}: {out} = masked_scatter({self_.buf}, {mask.buf}, {source.buf}); "
        f"{count.buf}: the inclusive count of true elements of {mask.buf}",
        f"    #   from graph nodes: {', '.join(call.source)}"])
    coords = unravel("p", shape)
    cst = canon(count.strides[0]) if count.strides else sympy.Integer(1)
    body = [
        "    p = pid * XBLOCK + tl.arange(0, XBLOCK).to(tl.int64)",
        f"    ok = p < {to_tl(total)}",
        f"    m = (tl.load(buf_{mask.buf} + {_offset(mask, coords, 'p')}, mask=ok, other=0) "
        "!= 0) & ok",
        f"    x = tl.load(buf_{self_.buf} + {_offset(self_, coords, 'p')}, mask=ok)",
        f"    k = tl.load(buf_{count.buf} + {to_tl(canon(count.offset))} + p * {to_tl(cst)}, "
        "mask=m, other=1) - 1  # the true elements before p: its source element",
        f"    bad = m & (k >= {to_tl(avail)})  # the mask selects more than source has",
        f"    v = tl.load(buf_{source.buf} + {_offset(source, unravel('k', source.shape), 'k')}"
        ", mask=m & ~bad)",
        f"    tl.store(buf_{out} + p, tl.where(m & ~bad, v, x), mask=ok)",
        "    tl.store(kiln_status + p.to(tl.int32) * 0, 1, mask=bad)",
    ]
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, Config(XBLOCK, 1, 4), total, call.source)


def _bag_rblock(d, hints) -> int:
    try:
        d = max(1, evaluate(d, hints))
    except (KeyError, TypeError, ValueError):  # a size without a hint
        d = 128
    return min(pow2(d), 256)


def print_embedding_bag_kernel(call: L.Extern, buffers, hints: dict[str, int]) -> TritonKernel:
    """`embedding_bag_<out>` (see the module doc)."""
    out = call.name
    dt = buffers[out].dtype
    if dt.name not in BAG_DTYPES:
        raise UnsupportedError(f"embedding_bag of {dt.name} weights (for "
                               f"{', '.join(call.source)}) has no CUDA kernel")
    weight, indices, offsets, *psw = call.args
    mode = int(call.attr("mode"))
    include_last = bool(call.attr("include_last_offset"))
    pad = int(call.attr("padding_idx"))
    if mode not in _BAG_MODE or (psw and mode != 0):
        weighted = " with per_sample_weights" if psw else ""
        raise UnsupportedError(f"embedding_bag mode {mode}{weighted} (for "
                               f"{', '.join(call.source)}) has no CUDA kernel")
    nw, d = (canon(s) for s in weight.shape)
    n = canon(indices.shape[0]) if indices.shape else sympy.Integer(1)
    noff = canon(offsets.shape[0]) if offsets.shape else sympy.Integer(1)
    bags = canon(noff - 1) if include_last else noff
    rblock = _bag_rblock(d, hints)
    tiles = sympy.sympify(FloorDiv(d + rblock - 1, rblock))
    name = bag_mask_kernel_name(call)
    exprs = [nw, d, n, noff, weight.offset, *weight.strides, indices.offset, *indices.strides,
             offsets.offset, *offsets.strides, tiles]
    for a in psw:
        exprs += [a.offset, *a.strides]
    syms = size_names(exprs)
    ins = [b for b in dict.fromkeys(a.buf for a in call.args) if b != out]
    params = tuple([("out", out)] + [("in", b) for b in ins] + [("size", s) for s in syms] +
                   [("status", "kiln_status")])
    what = _BAG_MODE[mode] + (" weighted by " + psw[0].buf if psw else "")
    sig, head = _head(name, params, buffers, [
        f"    # {name}: {out} = embedding_bag({weight.buf}, {indices.buf}, {offsets.buf}): "
        f"the {what} of each bag's rows"
        f"{'' if pad < 0 else f', rows {pad} skipped'}"
        f"{' (include_last_offset)' if include_last else ''}",
        f"    #   from graph nodes: {', '.join(call.source)}"])
    acc = "tl.float64" if dt.name == "float64" else "tl.float32"
    ws0, ws1 = (canon(s) for s in weight.strides)
    tl_n, tl_noff, tl_t = to_tl(n), to_tl(noff), to_tl(tiles)

    def at(a: L.LibArg, var: str) -> str:
        st = canon(a.strides[0]) if a.strides else sympy.Integer(0)
        base = to_tl(canon(a.offset))
        return f"{base} + {var} * {to_tl(st)}" if st != 0 else f"{base} + {var} * 0"

    cols = "c" if ws1 == 1 else f"(c * {to_tl(ws1)})"
    ident = "float('-inf')" if mode == 2 else "0"
    body = [
        f"    b = pid // {tl_t}",
        f"    c = (pid % {tl_t}) * RBLOCK + tl.arange(0, RBLOCK).to(tl.int64)",
        f"    cm = c < {to_tl(d)}",
        f"    lo = tl.load(buf_{offsets.buf} + {at(offsets, 'b')}).to(tl.int64)",
        f"    more = b + 1 < {tl_noff}",
        "    nxt = tl.where(more, b + 1, b)",
        f"    hi = tl.load(buf_{offsets.buf} + {at(offsets, 'nxt')}).to(tl.int64)",
        f"    hi = tl.where(more, hi, {tl_n})",
        f"    bad = (lo < 0) | (lo > hi) | (hi > {tl_n})  # offsets out of order",
        "    hi = tl.where(bad, lo, hi)",
        f"    s = tl.full([RBLOCK], {ident}, {acc})",
        "    used = lo * 0  # rows taken (not padding)",
    ]
    if mode == 2:
        body.append("    nan_first = c < 0  # the bag's first row is NaN here")
    jb = JBLOCK if rblock <= 128 else JBLOCK // 2
    body += [
        "    j0 = lo",
        f"    while j0 < hi:  # {jb} rows at a time (a while loop: the bounds are data)",
        f"        j = j0 + tl.arange(0, {jb}).to(tl.int64)",
        "        jm = j < hi",
        f"        i = tl.load(buf_{indices.buf} + {at(indices, 'j')}, mask=jm, other=0)"
        ".to(tl.int64)",
        f"        out_of_range = jm & ((i < 0) | (i >= {to_tl(nw)}))",
        "        bad = bad | (tl.max(out_of_range.to(tl.int32), 0) > 0)",
        "        take = jm & ~out_of_range" + (f" & (i != {pad})" if pad >= 0 else ""),
        f"        w = tl.load(buf_{weight.buf} + {to_tl(canon(weight.offset))} + "
        f"i[:, None] * {to_tl(ws0)} + {cols}[None, :], mask=take[:, None] & cm[None, :], "
        f"other=0).to({acc})",
    ]
    if psw:
        body.append(f"        w = w * tl.load(buf_{psw[0].buf} + {at(psw[0], 'j')}, mask=take, "
                    f"other=0).to({acc})[:, None]")
    if mode == 2:  # eager: the first row, then each greater one (a later NaN passed over)
        body += [
            f"        first = tl.min(tl.where(take, j, {tl_n}), 0)",
            "        lead = take & (j == first) & (used == 0)",
            "        nan_first = nan_first | (tl.max(tl.where(lead[:, None] & (w != w), 1, 0), 0)"
            " > 0)",
            "        w = tl.where(take[:, None] & (w == w), w, float('-inf'))",
            "        s = tl.maximum(s, tl.max(w, 0))",
        ]
    else:
        body.append("        s = s + tl.sum(w, 0)")
    body += ["        used = used + tl.sum(take.to(tl.int64), 0)",
             f"        j0 = j0 + {jb}"]
    if mode == 2:
        body.append("    s = tl.where(nan_first, float('nan'), s)")
    if mode == 1:
        body.append(f"    s = s / tl.maximum(used, 1).to({acc})")
    body += [
        "    s = tl.where(used > 0, s, 0)  # an empty bag: 0",
        f"    tl.store(buf_{out} + b * {to_tl(d)} + c, s.to({TL_DTYPE[dt]}), mask=cm)",
        "    tl.store(kiln_status + tl.zeros([1], tl.int32), 1, mask=tl.zeros([1], tl.int1) | bad)",
    ]
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, Config(1, rblock, 4 if rblock >= 128 else 1),
                        canon(bags * tiles), call.source)
