"""A `GemmKernel` (kiln/gemm/fuse.py) -> one Triton function: kiln's GEMM template
(persistent, grouped tile order, masked edges; its configs and TMA rule in
kiln/gemm/triton_gemm.py) specialised to the GEMM's operands, with its epilogue printed into
the tile before the store.

Input: the GemmKernel, the Loop IR buffers. Output: a `TritonKernel` whose parameters are the
buffers (output first), the size symbols and the SM count (kind "sms"), whose constexprs are
the template config's block sizes, and whose `tiles` (batch x row tiles x column tiles, an
expression of the sizes) gives the persistent grid min(tiles, #SMs) at run time.

Mapping: operand offsets, leading dimensions and batch strides are printed as expressions of
the size symbols (any strides, so transposed or sliced operands are read in place); the
epilogue is printed by the row-kernel printer's `_Scope` with its index variables bound to the
tile (batch dims -> this tile's batch index, dim -2 -> rows [BLOCK_M, 1], dim -1 -> columns
[1, BLOCK_N]) and its read of the GEMM result bound to the accumulator rounded to the GEMM's
dtype (what reading the stored result would give). Every config is valid for every size
(masked loads), so one kernel serves a whole Dim range.

TMA configs (`TritonConfig.tma`): A and B tiles come through tensor descriptors made once per
program before the tile loop (`tl.make_tensor_descriptor`: Triton writes each descriptor into
the program's slice of the global scratch block the wrapper passes). Each operand is described
as [nonzero-stride batch dims..., rows, cols] with its real strides and sizes, so TMA's zero
fill replaces the masks at every edge (also along K, which must read zeros, and across batch
entries, which a flattened 2-D view would not stop at); an operand with contiguous rows is
described transposed and its tile used as `.T`. Only the loads change: the epilogue and the
masked store are the same. A TMA config given for a GEMM that `tma_refusal` refuses (a cache
entry of a problem with the same key but other batch strides) prints the pointer loads, with
a comment saying why."""

from __future__ import annotations

import sympy

from kiln.gemm.triton_gemm import tma_operands, tma_refusal
from kiln.targets.cuda.cse import render, text
from kiln.targets.cuda.kernel import Config, TritonKernel, _Scope
from kiln.targets.cuda.ops import SIG_PTR, TL_DTYPE, tl_compute, to_tl
from kiln.ir import loop as L
from kiln.ir.sym import FloorDiv, contiguous_strides, linear_index, product, unravel
from kiln.schedule.steps import GemmKernel
from kiln.errors import UnsupportedError

DTYPES = ("float16", "bfloat16", "float32")


def _small(gk: GemmKernel, buffers: dict[str, L.Buffer]) -> bool:
    names = [gk.out, *gk.reads()]
    return all(sympy.sympify(buffers[n].numel).is_Integer and
               int(buffers[n].numel) < 2**31 - 2**20 for n in names)


def _epilogue_names(g: L.Gemm, epi: L.Compute, flat: sympy.Expr) -> dict[str, str]:
    """The epilogue's index variables as expressions of the tile's (batch, row, column): the
    same when its shape is the GEMM's; else (a regrouping of the GEMM's dims, same row-major
    order) its last dim is the column when it spans N and the others unravel the row, or in
    general all of them unravel the flat position."""
    k = len(epi.shape)
    same = len(epi.shape) == len(g.shape) and all(
        sympy.simplify(sympy.sympify(a) - b) == 0 for a, b in zip(epi.shape, g.shape))
    if same:
        nb = len(g.batch)
        return {**{f"i{d}": f"b{d}" for d in range(nb)}, f"i{nb}": "i_m", f"i{nb + 1}": "i_n"}
    if not g.batch and sympy.simplify(sympy.sympify(epi.shape[-1]) - g.n) == 0:
        lead = unravel(sympy.Symbol("i_m"), epi.shape[:-1])
        return {**{f"i{d}": f"({to_tl(e)})" for d, e in enumerate(lead)}, f"i{k - 1}": "i_n"}
    return {f"i{d}": f"({to_tl(e)})" for d, e in enumerate(unravel(flat, epi.shape))}


def _scale_lines(sc: L.Operand, start: str, p: str) -> list[str]:
    """The accumulator times the mixed GEMM's scale, loaded once per tile as what it is: a
    [1, BLOCK_N] row (per output column), a [BLOCK_M, 1] column, a scalar or a full tile."""
    idx, masks = [], []
    for var, stride, bound in (("i_m", sc.rows, "M"), ("i_n", sc.cols, "N")):
        if sympy.sympify(stride) != 0:
            idx.append(f"{var} * {to_tl(stride)}")
            masks.append(f"({var} < {bound})")
    ptr = f"buf_{sc.buf} + {start}" + "".join(f" + {x}" for x in idx)
    load = f"tl.load({ptr}, mask={' & '.join(masks)}, other=0.0)" if masks else f"tl.load({ptr})"
    return [f"{p}# dequantisation scale {sc.buf} (it does not vary along K)",
            f"{p}acc = acc * {load}.to(tl.float32)"]


def _tma_dims(op: L.Operand) -> list[int]:
    """The batch dims an operand's descriptor has: those it does not broadcast (stride 0)."""
    return [d for d, st in enumerate(op.batch_strides) if sympy.sympify(st) != 0]


# (operand, transposed) -> the descriptor's last two dims: (size, block) rows then columns
_TMA_SHAPE = {("A", False): (("M", "BLOCK_M"), ("K", "BLOCK_K")),
              ("A", True): (("K", "BLOCK_K"), ("M", "BLOCK_M")),
              ("B", False): (("K", "BLOCK_K"), ("N", "BLOCK_N")),
              ("B", True): (("N", "BLOCK_N"), ("K", "BLOCK_K"))}
# the tile offset along each of M, N, K (int32, as descriptor loads take)
_TMA_OFF = {"M": "tm", "N": "tn", "K": "tk"}


def _descriptor_lines(g: L.Gemm) -> list[str]:
    """The two descriptors, made once per program before the tile loop."""
    lines = ["    # TMA descriptors, made once per program (in its slice of the global scratch):",
             "    # [batch dims, rows, cols] at the operand's strides; zeros outside, so no masks"]
    for name, op, tr in tma_operands(g):
        dims = _tma_dims(op)
        (r, br), (c, bc) = _TMA_SHAPE[(name, tr)]
        shape = [to_tl(g.batch[d]) for d in dims] + [r, c]
        strides = [to_tl(op.batch_strides[d]) for d in dims] + [
            to_tl(op.cols if tr else op.rows), "1"]
        block = ["1"] * len(dims) + [br, bc]
        off = sympy.sympify(op.offset)
        base = f"buf_{op.buf}" + (f" + {to_tl(off)}" if off != 0 else "")
        what = f"{op.buf}{' transposed' if tr else ''}"
        lines.append(f"    desc_{name.lower()} = tl.make_tensor_descriptor({base}, "
                     f"[{', '.join(shape)}], [{', '.join(strides)}], "
                     f"[{', '.join(block)}])  # {name} = {what}")
    return lines


def _tma_tile_lines(g: L.Gemm, p: str) -> list[str]:
    """The K loop of one tile reading A and B through their descriptors."""
    lines = [f"{p}tm = tl.cast(pid_m * BLOCK_M, tl.int32)",
             f"{p}tn = tl.cast(pid_n * BLOCK_N, tl.int32)"]
    used = sorted({d for _, op, _ in tma_operands(g) for d in _tma_dims(op)})
    lines += [f"{p}tb{d} = tl.cast(b{d}, tl.int32)" for d in used]
    lines += [f"{p}acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
              f"{p}for k0 in range(0, K, BLOCK_K):",
              f"{p}    tk = tl.cast(k0, tl.int32)"]
    for name, op, tr in tma_operands(g):
        dims = _tma_dims(op)
        (r, br), (c, bc) = _TMA_SHAPE[(name, tr)]
        idx = [f"tb{d}" for d in dims] + [_TMA_OFF[r], _TMA_OFF[c]]
        load = f"desc_{name.lower()}.load([{', '.join(idx)}])"
        if dims:
            load += f".reshape({br}, {bc})"
        lines.append(f"{p}    {name.lower()} = {load}{'.T' if tr else ''}")
    return lines


def print_gemm_kernel(gk: GemmKernel, buffers: dict[str, L.Buffer],
                      name: str | None = None) -> TritonKernel:
    """`name`: the function's name (default `gk.name`; the header comment keeps `gk.name`)."""
    g, epi, cfg = gk.gemm, gk.epilogue, gk.config
    name = name or gk.name
    if g.dtype.name not in DTYPES:
        raise UnsupportedError(f"GEMM {g.name} ({', '.join(g.source)}): the Triton GEMM "
                               f"template takes {', '.join(DTYPES)}, not {g.dtype.name}")
    out = gk.out
    params = gk.params()
    if gk.status:
        params.append(("status", "kiln_status"))
    params.append(("sms", "NUM_SMS"))
    sig: dict[str, str] = {}
    for kind, n in params:
        sig[n if kind in ("size", "sms", "status") else f"buf_{n}"] = \
            "i64" if kind == "size" else "i32" if kind == "sms" else "*i32" \
            if kind == "status" else SIG_PTR[buffers[n].dtype]
    consts = (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n),
              ("BLOCK_K", cfg.block_k), ("GROUP_M", cfg.group_m))
    for c, _ in consts:
        sig[c] = "constexpr"
    i64 = not _small(gk, buffers)
    cast = ".to(tl.int64)" if i64 else ""
    nb = len(g.batch)
    bnames = {f"b{d}": f"b{d}" for d in range(nb)}
    lines = [
        "@triton.jit",
        f"def {name}({', '.join(a for a in sig if sig[a] != 'constexpr')}, "
        + ", ".join(f"{c}: tl.constexpr" for c, _ in consts) + "):",
        f"    # {gk.name}: {g.name} = {g.a.buf} @ {g.b.buf}"
        + (f", epilogue {epi.name}" if epi is not None else ""),
        f"    #   from graph nodes: {', '.join(gk.source)}",
        f"    M = {to_tl(g.m)}",
        f"    N = {to_tl(g.n)}",
        f"    K = {to_tl(g.k)}",
        "    num_m = tl.cdiv(M, BLOCK_M)",
        "    num_n = tl.cdiv(N, BLOCK_N)",
        "    per_batch = num_m * num_n",
        f"    tiles = per_batch * {to_tl(product(g.batch))}",
        "    per_group = GROUP_M * num_n",
    ]
    refused = tma_refusal(g) if cfg.tma else None
    tma = cfg.tma and refused is None
    if refused is not None:
        lines.append(f"    # a TMA config, but {refused}: pointer loads")
    if tma:
        lines += _descriptor_lines(g)
    lines += [
        "    # persistent: program p computes tiles p, p + NUM_SMS, ... (grouped order: L2 reuse)",
        "    for tile in range(tl.program_id(0), tiles, NUM_SMS):",
        "        t = tile % per_batch",
    ]
    p = "        "
    if nb:
        lines.append(f"{p}bt = tile // per_batch")
        for s, e in zip(range(nb), unravel(sympy.Symbol("bt"), g.batch)):
            lines.append(f"{p}b{s} = {to_tl(e)}{cast}")
    lines += [
        f"{p}first_m = (t // per_group) * GROUP_M",
        f"{p}size_m = min(num_m - first_m, GROUP_M)",
        f"{p}pid_m = first_m + (t % per_group) % size_m",
        f"{p}pid_n = (t % per_group) // size_m",
        f"{p}rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)){cast}",
        f"{p}rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)){cast}",
    ]
    if not tma:
        lines.append(f"{p}rk = tl.arange(0, BLOCK_K){cast}")

    def base(op: L.Operand) -> str:
        e = sympy.sympify(op.offset) + sum(
            (sympy.Symbol(f"b{d}") * s for d, s in enumerate(op.batch_strides)), sympy.S.Zero)
        return to_tl(e, bnames)
    mx = g.mixed
    quant = {s: mx is not None and mx.side == s for s in ("a", "b")}
    conv = {s: f".to({TL_DTYPE[g.dtype]})  # {mx.qdtype.name} -> {g.dtype.name}, exact"
            if quant[s] else "" for s in quant}
    other = {s: "0" if quant[s] else "0.0" for s in quant}
    if tma:
        lines += _tma_tile_lines(g, p)
    else:
        lines += [
            f"{p}pa = buf_{g.a.buf} + {base(g.a)}",
            f"{p}pb = buf_{g.b.buf} + {base(g.b)}",
            f"{p}acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
            f"{p}for k0 in range(0, K, BLOCK_K):",
            f"{p}    kk = k0 + rk",
            f"{p}    a = tl.load(pa + rm[:, None] * {to_tl(g.a.rows)} + kk[None, :] * "
            f"{to_tl(g.a.cols)}, mask=(rm[:, None] < M) & (kk[None, :] < K), "
            f"other={other['a']}){conv['a']}",
            f"{p}    b = tl.load(pb + kk[:, None] * {to_tl(g.b.rows)} + rn[None, :] * "
            f"{to_tl(g.b.cols)}, mask=(kk[:, None] < K) & (rn[None, :] < N), "
            f"other={other['b']}){conv['b']}",
        ]
    lines += [
        f"{p}    acc = tl.dot(a, b, acc"
        + (", input_precision=\"ieee\")" if g.dtype.name == "float32" else ")"),
        f"{p}i_m = rm[:, None]",
        f"{p}i_n = rn[None, :]",
        f"{p}mask = (i_m < M) & (i_n < N)",
    ]
    if mx is not None and mx.scale is not None:
        lines += _scale_lines(mx.scale, base(mx.scale), p)
    tile = {**{f"i{d}": f"b{d}" for d in range(nb)}, f"i{nb}": "i_m", f"i{nb + 1}": "i_n"}
    flat = linear_index([sympy.Symbol(v) for v in tile.values()], contiguous_strides(g.shape))
    names = tile if epi is None else _epilogue_names(g, epi, flat)
    if epi is None:
        value = f"acc.to({TL_DTYPE[g.dtype]})"
    else:
        lines.append(f"{p}xidx = i_m * 0 + i_n * 0  # the tile's shape, for loads of scalars")
        rounded = "acc" if g.dtype.name == "float32" else \
            f"acc.to({TL_DTYPE[g.dtype]}).to({tl_compute(g.dtype.name)})"
        lines.append(f"{p}v_{g.name} = {rounded}  # the GEMM result, as its buffer would hold it")
        lines.append(f"{p}# epilogue {epi.name} <- {', '.join(epi.source)}")
        sc = _Scope(names, "mask", {g.name: f"v_{g.name}"}, [0])
        value = text(sc.value(epi.body))
        lines += render(sc.lines, p)
    lines.append(f"{p}tl.store(buf_{out} + {to_tl(flat)}, {value}, mask=mask)")
    bm, bn = cfg.block_m, cfg.block_n
    tiles = product(g.batch) * FloorDiv(g.m + bm - 1, bm) * FloorDiv(g.n + bn - 1, bn)
    warps = cfg.num_warps
    return TritonKernel(name, "\n".join(lines) + "\n", tuple(params), sig,
                        Config(1, 1, warps), tiles, gk.source, tiles=tiles, constexprs=consts,
                        num_stages=cfg.num_stages)
