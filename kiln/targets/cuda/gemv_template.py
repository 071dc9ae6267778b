"""A `GemmKernel` whose config is a `GemvConfig` (M = 1; kiln/gemm/gemv.py) -> one Triton
function: the GEMV template, with its prologue (the A row's producer, recomputed; kiln/gemm/
prologue.py) and its epilogue (as the GEMM template's, gemm_template.py) printed in.

Input: the GemmKernel, the Loop IR buffers. Output: a row-style `TritonKernel` (no SM count:
its grid is ceil(N / XBLOCK) programs, XBLOCK = BLOCK_N outputs a program, RBLOCK = BLOCK_K
elements of K a step), parameters the buffers (output first) and the size symbols.

Mapping: program p computes outputs rn = [p * XBLOCK, (p + 1) * XBLOCK) as an [XBLOCK, 1]
column. Each step loads the [XBLOCK, RBLOCK] tile of B at (k, n) = (kk, rn) (contiguous along
kk for nn.Linear's W [N, K]: 16-byte loads) and the [1, RBLOCK] slice of the A row, multiplies
in float32 and accumulates lane-wise; the lanes are reduced once after the loop. With a
prologue, the A slice is the producer's member computed at those K positions (the scope
printer of row kernels, `_Scope`, its index variables unravelled from kk), rounded to A's
dtype as the stored row would be; the whole-row reductions it reads are computed first by
an RBLOCK-wide loop over the row, kept as [1, 1] registers. Masked lanes of the row are
zeroed (the producer may give NaN outside the row). The epilogue's index variables are bound
to (row 0, column rn); its read of the GEMM result to the sum rounded to the GEMM's dtype.

Quantised weights (weight-only, a `MixedGemm` on side "b"; kiln/gemm/gemv.py):
  int8 / uint8  the [XBLOCK, RBLOCK] tile loads bytes (16-byte vectors), converted exactly in
                registers without an int-to-float instruction: the byte's bits under the
                exponent of 2^23 are the float 2^23 + byte (+ 128 for int8, sign bit
                flipped), less that constant; the row sums are multiplied by the scale
                (per output channel) at the end.
  int4          each step covers RBLOCK // G whole groups of G values: the tile is
                [XBLOCK, groups, G / 8] 32-bit words of 8 nibbles (nibble i of a word: k =
                8 * word + i), the A slice [1, groups, G / 8, 8] (rk, the prologue: the row's
                positions in that shape). Each nibble is masked in place and its bits read as
                a float32: bits * 2^-149 (a subnormal, or at bits 20-23 the smallest normal
                exponent, where the step is the same), so one FMA by 2^(126 - 4 * place) less
                8 * 2^-23 gives (nibble - 8) * 2^-23 exactly (nibbles 6 and 7 are read from
                the word >> 16); 3 instructions a weight (mask, that FMA, the product's FMA)
                and no int-to-float convert. A word's 8 products are summed in registers,
                each group's sums times its scale [XBLOCK, groups, 1], the 2^23 restored at
                the end; the outputs are [XBLOCK, 1, 1]. The loop is software-pipelined by
                hand: the next step's words, scales and x (the prologue) are loaded before
                this step's products, so a step's weight loads are in flight while the
                previous step is converted (`_prefetch`; KILN_GEMV_PREFETCH=2 / 3 keep
                that many steps in flight, in slots rotated each step: measured slower).
  int4, tensor-core order (`MixedGemm.tc`, Options.cuda_int4_tensor_core; bf16, groups >= 128)
                config variant "": kiln/gemm/int4_tc.py's mma kernel with the prologue and
                epilogue (`_print_int4_tc_gemv`); variant "cc": the loop above, its x
                positions permuted to that order. The launch tuner picks per GEMV."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import sympy

from kiln.errors import UnsupportedError
from kiln.gemm import gemv as GV
from kiln.gemm.configs import GemvConfig
from kiln.gemm.gemv import applies
from kiln.gemm.prologue import factor_row
from kiln.ir import loop as L
from kiln.ir.sym import contiguous_strides, linear_index, product, unravel
from kiln.schedule.steps import GemmKernel
from kiln.targets.cuda.cse import render, text
from kiln.targets.cuda.gemm_template import _epilogue_names, _small, print_gemm_kernel
from kiln.targets.cuda.kernel import PDL_MARK, Config, TritonKernel, _Scope
from kiln.targets.cuda.ops import COMPUTE, SIG_PTR, TL_DTYPE, tl_compute, to_tl


def _rounded(v: str, dtype) -> str:
    """A float32 value as a buffer of `dtype` would hold it."""
    return f"{v}.to({TL_DTYPE[dtype]}).to(tl.float32)" if dtype.name in COMPUTE else v


def _unravel_lines(prefix: str, flat: str, shape, sym: str, p: str) -> tuple[dict, list[str]]:
    """Index variables `<sym><d>` of a space of `shape` at flat positions `flat`: names for
    `_Scope` (dims of size 1 are "0") and the lines that define them."""
    names, lines = {}, []
    for d, e in enumerate(unravel(sympy.Symbol("FLAT"), shape)):
        if sympy.sympify(shape[d]) == 1:
            names[f"{sym}{d}"] = "0"
            continue
        var = f"{prefix}{sym}{d}"
        names[f"{sym}{d}"] = var
        lines.append(f"{p}{var} = {to_tl(e, {'FLAT': flat})}")
    return names, lines


def _prologue_lines(gk: GemmKernel, counter: list[int], row: str = "[1, RBLOCK]",
                    total: str = "tl.sum({}, 1, keep_dims=True)"
                    ) -> tuple[list[str], dict[str, str]]:
    """The whole-row reductions, each an RBLOCK-wide loop; their registers by name. `row`:
    the shape of rk, `total`: the sum of a tile of that shape kept as [1, 1(, 1)]."""
    pro = gk.prologue
    lines: list[str] = []
    regs: dict[str, str] = {}
    for j, r in enumerate(pro.reductions):
        n = product(r.reduce.sizes)
        acc = f"acc_{r.name}"
        lines += [f"    # prologue: {r.name} <- {', '.join(r.source)} (whole row, in registers)",
                  f"    {acc} = tl.zeros({row}, dtype={tl_compute(r.dtype.name)})",
                  f"    for qs{j} in range(0, {to_tl(n)}, RBLOCK):",
                  f"        q{j} = qs{j} + rk",
                  f"        qmask{j} = q{j} < {to_tl(n)}"]
        names, defs = _unravel_lines(f"p{j}_", f"q{j}", r.reduce.sizes, "r", "        ")
        names.update({f"i{d}": "0" for d in range(len(r.shape))})
        lines += defs
        sc = _Scope(names, f"qmask{j}", dict(regs), counter)
        v = text(sc.value(r.body))
        lines += render(sc.lines, "        ")
        lines.append(f"        {acc} = {acc} + tl.where(qmask{j}, {v}, 0)")
        regs[r.name] = f"v_{r.name}"
        lines.append(f"    v_{r.name} = {_rounded(total.format(acc), r.dtype)}")
    return lines, regs


def _row_start(gk: GemmKernel, lines: list[str], counter: list[int], row: str, total: str):
    """(`_factored(gk)`, the registers of the prologue's whole-row reductions): appends to
    `lines` those reductions' loops (run before the K loop), or, where they factor into the K
    loop, their [row] accumulators."""
    factored = _factored(gk)
    regs: dict[str, str] = {}
    if gk.prologue is not None and factored is None:
        more, regs = _prologue_lines(gk, counter, row, total)
        lines += more
    elif factored is not None:
        lines += [f"    acc_{r.name} = tl.zeros({row}, dtype=tl.float32)"
                  for r in gk.prologue.reductions]
    return factored, regs


def _factored(gk: GemmKernel):
    """(scale, rest) of the prologue's row (gemm/prologue.py `factor_row`) when its whole-row
    reductions can accumulate in the GEMV's own K loop: each a sum over exactly K elements
    (its flat position is the row's k); None otherwise (the reductions then run first)."""
    pro = gk.prologue
    if pro is None or not pro.reductions:
        return None
    k = sympy.sympify(gk.gemm.k)
    if not k.is_Integer or any(r.reduce is None or r.reduce.kind != "sum" or
                               sympy.sympify(product(r.reduce.sizes)) != k
                               for r in pro.reductions):
        return None
    return factor_row(pro.row.body, {r.name for r in pro.reductions})


def _fused_reduction_lines(gk: GemmKernel, counter: list[int]) -> list[str]:
    """The prologue's whole-row reductions accumulated at the K loop's positions kk."""
    lines = []
    for j, r in enumerate(gk.prologue.reductions):
        lines.append(f"        # prologue: {r.name} <- {', '.join(r.source)} "
                     f"(whole row, accumulated in the K loop)")
        names, defs = _unravel_lines(f"p{j}_", "kk", r.reduce.sizes, "r", "        ")
        names.update({f"i{d}": "0" for d in range(len(r.shape))})
        lines += defs
        sc = _Scope(names, "kmask", {}, counter)
        v = text(sc.value(r.body))
        lines += render(sc.lines, "        ")
        lines.append(f"        acc_{r.name} = acc_{r.name} + tl.where(kmask, {v}, 0)")
    return lines


def _head(gk: GemmKernel, name: str, sig: dict, what: list[str]) -> list[str]:
    """The GEMV function's first lines: its signature, what it computes (`what`, then the
    prologue and epilogue) and the static N and K."""
    g, pro, epi = gk.gemm, gk.prologue, gk.epilogue
    what = list(what)
    if pro is not None:
        what.append(f"prologue {', '.join([*(r.name for r in pro.reductions), pro.row.name])}")
    if epi is not None:
        what.append(f"epilogue {epi.name}")
    return [
        "@triton.jit",
        f"def {name}({', '.join(sig)}, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {gk.name} (GEMV): {', '.join(what)}",
        f"    #   from graph nodes: {', '.join(gk.source)}",
        "    # XBLOCK outputs a program, RBLOCK of K a step",
        f"    N = {to_tl(g.n)}",
        f"    K = {to_tl(g.k)}",
    ]


def print_gemv_kernel(gk: GemmKernel, buffers: dict[str, L.Buffer],
                      name: str | None = None) -> TritonKernel:
    """`name`: the function's name (default `gk.name`)."""
    g, epi, cfg, pro = gk.gemm, gk.epilogue, gk.config, gk.prologue
    name = name or gk.name
    if not applies(g):  # (a cached choice of another GEMM with the same problem key)
        raise UnsupportedError(f"GEMM {g.name} ({', '.join(g.source)}): the GEMV template "
                               f"takes M = 1 without batch dims, static N and K, float16 / "
                               f"bfloat16 / float32 (B also int8 / int4 weights); got M = "
                               f"{g.m}, batch {g.batch}, {g.dtype.name}"
                               + (f", {g.mixed}" if g.mixed is not None else ""))
    if g.mixed is not None and g.mixed.tc and cfg.variant != "cc":
        return _print_int4_tc_gemv(gk, buffers, name)
    if g.mixed is not None:
        return _print_quant_gemv(gk, buffers, name)
    out = gk.out
    params = gk.params()
    if gk.status:
        params.append(("status", "kiln_status"))
    sig: dict[str, str] = {}
    for kind, n in params:
        sig[n if kind in ("size", "status") else f"buf_{n}"] = \
            "i64" if kind == "size" else "*i32" if kind == "status" else SIG_PTR[buffers[n].dtype]
    i64 = not _small(gk, buffers)
    cast = ".to(tl.int64)" if i64 else ""
    what = [f"{g.name} = {g.a.buf if pro is None else pro.row.name} @ {g.b.buf} (M = 1)"]
    lines = _head(gk, name, sig, what) + [
        f"    rn = (tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]){cast}",
        "    nmask = rn < N",
        f"    rk = tl.arange(0, RBLOCK)[None, :]{cast}",
        "    xidx = rk * 0  # the row's shape, for loads of scalars",
    ]
    counter = [0]
    regs: dict[str, str] = {}
    factored = _factored(gk)
    if pro is not None and factored is None:
        more, regs = _prologue_lines(gk, counter)
        lines += more
    rows = sympy.sympify(g.b.rows)
    kstep = "kk" if rows == 1 else f"kk * {to_tl(rows)}"
    sub = _vector(cfg.block_k, g.dtype.itemsize)
    lines += [
        f"    pb = buf_{g.b.buf} + {to_tl(g.b.offset)} + rn * {to_tl(g.b.cols)}",
        f"    acc = tl.zeros((XBLOCK, RBLOCK // {sub}), dtype=tl.float32)  # {_SUB_NOTE}",
    ]
    if factored is not None:
        lines += [f"    acc_{r.name} = tl.zeros([1, RBLOCK], dtype=tl.float32)"
                  for r in pro.reductions]
    lines += [
        "    for k0 in range(0, K, RBLOCK):",
        "        kk = k0 + rk",
        "        kmask = kk < K",
    ]
    if factored is not None:
        lines += _fused_reduction_lines(gk, counter)
        row = pro.row
        lines.append(f"        # prologue: {row.name} <- {', '.join(row.source)} at K positions "
                     f"kk, without its whole-row factor (applied to the dot product)")
        names, defs = _unravel_lines("a_", "kk", row.shape, "i", "        ")
        lines += defs
        sc = _Scope(names, "kmask", {}, counter)
        v = text(sc.value(factored[1]))
        lines += render(sc.lines, "        ")
        lines.append(f"        x = tl.where(kmask, {_rounded(v, row.dtype)}, 0.0)")
    elif pro is None:
        lines.append(f"        x = tl.load(buf_{g.a.buf} + {to_tl(g.a.offset)} + kk * "
                     f"{to_tl(g.a.cols)}, mask=kmask, other=0.0).to(tl.float32)")
    else:
        row = pro.row
        lines.append(f"        # prologue: {row.name} <- {', '.join(row.source)} at K positions kk")
        names, defs = _unravel_lines("a_", "kk", row.shape, "i", "        ")
        lines += defs
        sc = _Scope(names, "kmask", regs, counter)
        v = text(sc.value(row.body))
        lines += render(sc.lines, "        ")
        lines.append(f"        x = tl.where(kmask, {_rounded(v, row.dtype)}, 0.0)")
    lines += [
        f"        w = tl.load(pb + {kstep}, mask=nmask & kmask, other=0.0).to(tl.float32)",
        f"        acc += {_presum('w * x', sub)}",
    ]
    dot = "tl.sum(acc, 1, keep_dims=True)"
    if factored is not None:
        scale = _row_factor(lines, pro, regs, "tl.sum({}, 1, keep_dims=True)", factored,
                            counter, "nmask")
        lines.append(f"    dot = tl.sum(acc, 1, keep_dims=True) * {scale}")
        dot = "dot"
    lines += [
        "    i_m = rn * 0",
        "    i_n = rn",
        "    mask = nmask",
    ]
    flat = linear_index([sympy.Symbol("i_m"), sympy.Symbol("i_n")],
                        contiguous_strides(g.shape))
    lines += _stored(g, epi, flat, out, counter, "rn", dot)
    return _gemv_kernel(name, lines, params, sig, cfg, gk)


#: why the accumulators are narrower than the tile
_SUB_NOTE = "each thread's 16 bytes of B summed in registers first"


def _vector(elements: int, itemsize: int) -> int:
    """Elements of B one thread loads as a 16-byte vector (at most `elements`, a power of
    two): the products over them are summed in registers before they reach the accumulator,
    so it holds RBLOCK / that many lanes a row, not RBLOCK (fewer registers: more rows and
    longer steps fit, and the tuner can pick configs where the whole program spans K and
    each thread computes the A row's prologue once for all XBLOCK rows)."""
    v = max(1, 16 // itemsize)
    while v > 1 and elements % v:
        v //= 2
    return v


def _presum(value: str, sub: int) -> str:
    """`value` ([XBLOCK, RBLOCK]) summed over runs of `sub` neighbouring K positions."""
    if sub == 1:
        return value
    return f"tl.sum(tl.reshape({value}, [XBLOCK, RBLOCK // {sub}, {sub}]), 2)"


#: float32 bits of 2^23 (a byte ORed under them gives the float 2^23 + byte, exactly)
_EXP23 = "0x4B000000"
#: an int4 word of 8 nibbles 8 (zeros), as int32; 8 * 2^-23 (the nibbles' zero point, scaled)
_NIB8 = "-2004318072"
_EIGHT_EPS = "9.5367431640625e-07"


def _prefetch() -> int:
    """Steps of operands an int4 GEMV loads ahead of its products (KILN_GEMV_PREFETCH: 0 the
    plain loop, 1 the default, 2 or 3 deeper, for A/B runs). Measured on an H100
    (BENCHMARKS.md, thirteenth session): with 1, int4's down, q/k/v and gate/up GEMVs 4-11%
    faster; int8's unchanged or slower (its loop is short, already near the copy bandwidth),
    so int8 keeps the plain loop. 2 and 3 made the 2-layer int4 step 4% and 12% slower
    (sixteenth session): more registers, and the loads were not what the loop waited for."""
    v = os.environ.get("KILN_GEMV_PREFETCH", "1")
    if v not in ("0", "1", "2", "3"):
        raise UnsupportedError(f"KILN_GEMV_PREFETCH: expected 0, 1, 2 or 3 (steps loaded "
                               f"ahead), got {v!r}")
    return int(v)


def _early_loads() -> bool:
    """KILN_GEMV_EARLY_LOADS=1 (not measured yet, so off): with the prefetch, an int4 GEMV's
    first weight words and scales are loaded before its programmatic-dependent-launch wait
    (kernel.py `PDL_MARK`: they are package constants no kernel writes), so their latency
    overlaps the previous kernel's last programs."""
    return os.environ.get("KILN_GEMV_EARLY_LOADS", "0") == "1"


def _renamed(line: str, names: dict[str, str]) -> str:
    """`line` with the whole-word names of `names` replaced (not in its comment)."""
    code, hash_, note = line.partition("  #")
    return re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b",
                  lambda m: names[m.group(1)], code) + hash_ + note


def _quant_sig(gk: GemmKernel, buffers) -> tuple[list, dict[str, str]]:
    params = gk.params()
    if gk.status:
        params.append(("status", "kiln_status"))
    sig: dict[str, str] = {}
    for kind, n in params:
        sig[n if kind in ("size", "status") else f"buf_{n}"] = \
            "i64" if kind == "size" else "*i32" if kind == "status" else SIG_PTR[buffers[n].dtype]
    return params, sig


def _print_quant_gemv(gk: GemmKernel, buffers: dict[str, L.Buffer], name: str) -> TritonKernel:
    """The GEMV of a quantised B (module docstring): int8 / uint8 rows, or int4 groups."""
    g, epi, cfg, pro, mx = gk.gemm, gk.epilogue, gk.config, gk.prologue, gk.gemm.mixed
    out = gk.out
    params, sig = _quant_sig(gk, buffers)
    i64 = not _small(gk, buffers)
    cast = ".to(tl.int64)" if i64 else ""
    gs = mx.group
    if gs and (cfg.block_k % gs or cfg.block_k < gs):
        raise UnsupportedError(f"GEMV {gk.name}: BLOCK_K {cfg.block_k} is no multiple of the "
                               f"int4 group {gs}")
    what = [f"{g.name} = {g.a.buf if pro is None else pro.row.name} @ {g.b.buf} (M = 1)",
            f"B {'int4 in groups of ' + str(gs) if gs else mx.qdtype.name}"
            + (" (tensor-core order, read by the CUDA-core loop)" if mx.tc else "")
            + (f", scales {mx.scale.buf}" if mx.scale is not None else "")]
    lines = _head(gk, name, sig, what)
    if gs:
        wg = gs // 8
        lines += [
            f"    # int4: RBLOCK // {gs} groups of {wg} words (8 nibbles each) a step; the "
            f"row's positions as [1, groups, words, 8]",
            f"    rn = (tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None, None]){cast}",
            "    nmask = rn < N",
            f"    rg = tl.arange(0, RBLOCK // {gs})[None, :, None]{cast}",
            f"    rw = rg * {wg} + tl.arange(0, {wg})[None, None, :]{cast}  # the step's words",
            "    ri = tl.arange(0, 8)[None, None, None, :]  # a word's nibbles",
            # k of nibble i of word w: 8 w + i, or in the tensor-core order (MixedGemm.tc)
            # 32 (w // 4) + 4 i + w % 4
            f"    rk = (rw[:, :, :, None] // 4) * 32 + ri * 4 + rw[:, :, :, None] % 4{cast}"
            if mx.tc else f"    rk = rw[:, :, :, None] * 8 + ri{cast}",
            "    xidx = rk * 0  # the row's shape, for loads of scalars",
            "    # nibble i: bits 4i..4i+3 of the word (i < 6) or of the word >> 16 (place "
            "i - 4); as a float32",
            "    # (bits * 2^-149) times 2^(126 - 4 * place), less 8 * 2^-23: "
            "(nibble - 8) * 2^-23, exact",
            "    nsh = tl.where(ri >= 6, 16, 0)",
            "    place = ri - nsh // 4",
            "    nbits = 15 << (4 * place)",
            "    nmul = ((253 - 4 * place) << 23).to(tl.float32, bitcast=True)",
        ]
        row, total = f"[1, RBLOCK // {gs}, {wg}, 8]", \
            "tl.sum(tl.sum(tl.sum({}, 3), 2, keep_dims=True), 1, keep_dims=True)"
    else:
        lines += [
            f"    rn = (tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]){cast}",
            "    nmask = rn < N",
            f"    rk = tl.arange(0, RBLOCK)[None, :]{cast}",
            "    xidx = rk * 0  # the row's shape, for loads of scalars",
        ]
        row, total = "[1, RBLOCK]", "tl.sum({}, 1, keep_dims=True)"
    counter = [0]
    factored, regs = _row_start(gk, lines, counter, row, total)
    lines.append(f"    pb = buf_{g.b.buf} + {to_tl(g.b.offset)} + rn * {to_tl(g.b.cols)}")
    sc = mx.scale
    sub = _vector(cfg.block_k, 1)  # 16 bytes of B a thread
    if gs:
        if sympy.sympify(g.b.rows) != 1 or any(
                not (sympy.sympify(e) % 4).is_zero for e in (g.b.offset, g.b.cols)):
            raise UnsupportedError(f"GEMV {gk.name}: the int4 weight's rows are read as "
                                   f"32-bit words (contiguous along K, 4-byte aligned); got "
                                   f"offset {g.b.offset}, strides {g.b.rows}, {g.b.cols}")
        lines += [
            "    pw = pb.to(tl.pointer_type(tl.int32), bitcast=True)  # 8 nibbles a word",
            f"    ps = buf_{sc.buf} + {to_tl(sc.offset)} + rn * {to_tl(sc.cols)}",
            f"    acc = tl.zeros((XBLOCK, RBLOCK // {gs}, {gs // 8}), dtype=tl.float32)"
            f"  # a word's 8 products summed in registers first",
        ]
    else:
        lines.append(f"    acc = tl.zeros((XBLOCK, RBLOCK // {sub}), dtype=tl.float32)  "
                     f"# {_SUB_NOTE}")
    step: list[str] = [  # one step's operands at k0: x (the prologue's or loaded), B (, scales)
        "        kk = k0 + rk",
        "        kmask = kk < K",
    ]
    if pro is None:
        step.append(f"        x = tl.load(buf_{g.a.buf} + {to_tl(g.a.offset)} + kk * "
                    f"{to_tl(g.a.cols)}, mask=kmask, other=0.0).to(tl.float32)")
    else:
        prow = pro.row
        if factored is not None:
            step += _fused_reduction_lines(gk, counter)
        step.append(f"        # prologue: {prow.name} <- {', '.join(prow.source)} at K positions "
                    f"kk" + (", without its whole-row factor" if factored is not None else ""))
        names, defs = _unravel_lines("a_", "kk", prow.shape, "i", "        ")
        step += defs
        scope = _Scope(names, "kmask", {} if factored is not None else regs, counter)
        v = text(scope.value(prow.body if factored is None else factored[1]))
        step += render(scope.lines, "        ")
        step.append(f"        x = tl.where(kmask, {_rounded(v, prow.dtype)}, 0.0)")
    rows = to_tl(g.b.rows)
    wload: list[str] = []
    if gs:
        wload = [
            f"        gi = k0 // {gs} + rg  # the step's groups",
            f"        gmask = nmask & (gi < {to_tl(g.k)} // {gs})",
            f"        w = tl.load(pw + k0 // 8 + rw, mask=gmask, other={_NIB8})  "
            f"# {mx.qdtype.name}: 8 nibbles (+ 8) a word",
            f"        s = tl.load(ps + gi * {to_tl(sc.rows)}, mask=gmask, other=0.0)"
            f".to(tl.float32)",
        ]
        step += wload
        use = [
            "        v = ((w[:, :, :, None] >> nsh) & nbits).to(tl.float32, bitcast=True) * nmul"
            f" - {_EIGHT_EPS}",
            "        acc += tl.sum(v * x, 3) * s",
        ]
        carried = ("x", "w", "s")
        tot = "tl.sum(tl.sum(acc, 2, keep_dims=True), 1, keep_dims=True) * 8388608.0"  # 2^23
    else:
        kstep = "kk" if sympy.sympify(g.b.rows) == 1 else f"kk * {rows}"
        if mx.qdtype.name == "int8":
            conv = ("(q.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x4B000080).to(tl.float32, "
                    "bitcast=True) - 8388736.0")
        else:
            conv = f"(q.to(tl.int32) | {_EXP23}).to(tl.float32, bitcast=True) - 8388608.0"
        step.append(f"        q = tl.load(pb + {kstep}, mask=nmask & kmask, other=0)")
        use = [
            f"        w = {conv}  # {mx.qdtype.name} -> float32, exact",
            f"        acc += {_presum('w * x', sub)}",
        ]
        carried = ("x", "q")
        tot = "tl.sum(acc, 1, keep_dims=True)"
        if sc is not None:
            idx = f" + rn * {to_tl(sc.cols)}" if sympy.sympify(sc.cols) != 0 else " + rn * 0"
            tot += (f" * tl.load(buf_{sc.buf} + {to_tl(sc.offset)}{idx}, mask=nmask, "
                    f"other=0.0).to(tl.float32)")
    depth = min(_prefetch(), int(sympy.sympify(g.k)) // cfg.block_k) if gs else 0
    if depth == 1:
        # the next step's operands are loaded (and the prologue computed) before this step's
        # products: the weight loads of one step are in flight while the previous one's are
        # converted (no pipelining otherwise: a program waits for each step's loads)
        cur = {c: f"{c}_c" for c in carried}
        lines += ["    # the first step's operands"]
        first = [_renamed(t, {"k0": "0"})[4:] for t in step]
        if _early_loads() and not (pro is not None and factored is None and pro.reductions):
            # the weights' and scales' loads before the PDL wait (not where the prologue's
            # whole-row reductions, which read activations, run before the loop)
            lines += first[:2] + first[-len(wload):] + [PDL_MARK] + first[2:-len(wload)]
        else:
            lines += first
        lines.append("    for k0 in range(RBLOCK, K, RBLOCK):  # k0: the next step")
        lines += [f"        {c} = {v}  # this step's" for v, c in cur.items()]
        lines += ["        # the next step's operands"] + step
        lines += [_renamed(t, cur) for t in use]
        lines += ["    # the last step"] + [t[4:] for t in use]
    elif depth > 1:
        # `depth` steps' operands in flight: slot j holds the step `j` steps ahead of the one
        # whose products are computed (K spans at least `depth` steps)
        slot = [{c: f"{c}_{j}" for c in carried} for j in range(depth)]
        cur = {c: f"{c}_c" for c in carried}
        for j in range(depth):
            lines.append(f"    # step {j}'s operands")
            lines += [_renamed(_renamed(t, slot[j]), {"k0": str(j * cfg.block_k)})[4:]
                      for t in step]
        lines.append(f"    for k0 in range({depth * cfg.block_k}, K, RBLOCK):  # k0: the step "
                     f"loaded")
        lines += [f"        {cur[c]} = {slot[0][c]}  # this step's" for c in carried]
        for j in range(depth - 1):
            lines += [f"        {slot[j][c]} = {slot[j + 1][c]}" for c in carried]
        lines += [f"        # the operands {depth} steps ahead"]
        lines += [_renamed(t, slot[depth - 1]) for t in step]
        lines += [_renamed(t, cur) for t in use]
        for j in range(depth):
            lines.append(f"    # the last steps: {j + 1} of {depth}")
            lines += [_renamed(t, slot[j])[4:] for t in use]
    else:
        lines += ["    for k0 in range(0, K, RBLOCK):"] + step + use
    if factored is not None:
        factor = _row_factor(lines, pro, regs, total, factored, counter, "nmask")
        tot = f"{tot} * {factor}"
    lines += [
        f"    tot = {tot}",
        "    i_m = rn * 0",
        "    i_n = rn",
        "    mask = nmask",
    ]
    flat = linear_index([sympy.Symbol("i_m"), sympy.Symbol("i_n")],
                        contiguous_strides(g.shape))
    lines += _stored(g, epi, flat, out, counter, "rn")
    return _gemv_kernel(name, lines, params, sig, cfg, gk)


def _tc_depth(n: int, steps: int) -> int:
    """Steps of words and scales the tensor-core int4 GEMV loads ahead of its products: 2
    where few programs share the SMs (N <= 4096: o, k / v, down at the 8B widths, 4-24%
    faster standalone on an H100 than 1, BENCHMARKS.md seventeenth session), 1 for more rows
    (q / k / v, gate / up: 2-5% slower at 2), less where K has fewer steps.
    KILN_GEMV_PREFETCH (0-2) overrides it, for A/B runs."""
    v = os.environ.get("KILN_GEMV_PREFETCH")
    depth = 2 if n <= 4096 else 1
    if v is not None:
        depth = min(_prefetch(), 2)
    return min(depth, steps - 1)


def _print_int4_tc_gemv(gk: GemmKernel, buffers: dict[str, L.Buffer], name: str
                        ) -> TritonKernel:
    """The GEMV of an int4 B in pack_tc's order (`MixedGemm.tc`) on the tensor cores: kiln/
    gemm/int4_tc.py's kernel with the template's prologue and epilogue.

    A program's XBLOCK rows are two halves of H = XBLOCK / 2 (rows r0 and r0 + H); a step's
    tile is [T, H, 4] 32-bit words (T = RBLOCK / 32 chunks of 32 values, 4 words a chunk),
    chunks before rows so that Triton lays a quad of lanes along the chunks, and every
    operand of `_kl_i4mma` (the words, x at the 8 nibble places k = 32 t + 4 i + j of word j,
    computed in the tile's shape by the prologue where there is one) has that one layout.
    Rows past N read row N - 1 (not stored). The prologue's whole-row reductions run on
    [1, 1, RBLOCK] rows (before the loop, or in it where they factor out: gemm/prologue.py),
    so each value counts once. Each half's [1, H, 1] sums go through the epilogue and are
    stored on their own."""
    g, epi, cfg, pro, mx = gk.gemm, gk.epilogue, gk.config, gk.prologue, gk.gemm.mixed
    out = gk.out
    params, sig = _quant_sig(gk, buffers)
    gs, k, n = mx.group, int(sympy.sympify(g.k)), int(sympy.sympify(g.n))
    xb, rb = cfg.block_n, cfg.block_k
    bad = []
    if xb < 2 or xb & (xb - 1):
        bad.append(f"BLOCK_N a power of two >= 2 (got {xb})")
    if rb < gs or rb % gs or k % rb:
        bad.append(f"BLOCK_K a multiple of the group {gs} dividing K {k} (got {rb})")
    if sympy.sympify(g.b.rows) != 1 or any(
            not (sympy.sympify(e) % 4).is_zero for e in (g.b.offset, g.b.cols)):
        bad.append(f"the weight's rows contiguous along K, 4-byte aligned (got offset "
                   f"{g.b.offset}, strides {g.b.rows}, {g.b.cols})")
    if g.dtype.name != "bfloat16" or (pro is None and buffers[g.a.buf].dtype.name != "bfloat16"):
        bad.append(f"bfloat16 operands (got {g.dtype.name})")
    if bad:
        raise UnsupportedError(f"GEMV {gk.name} (int4 on tensor cores): expected "
                               + "; ".join(bad))
    i64 = not _small(gk, buffers)
    cast = ".to(tl.int64)" if i64 else ""
    sc = mx.scale
    what = [f"{g.name} = {g.a.buf if pro is None else pro.row.name} @ {g.b.buf} (M = 1)",
            f"B int4 in groups of {gs} (tensor-core order), scales {sc.buf}"]
    lines = _head(gk, name, sig, what) + [
        "    # int4 on the tensor cores (kiln/gemm/int4_tc.py): rows r0 and r0 + H, a step's "
        "words [T, H, 4]",
        "    H: tl.constexpr = XBLOCK // 2",
        "    T: tl.constexpr = RBLOCK // 32",
        f"    r0 = (tl.program_id(0) * XBLOCK + tl.arange(0, H)[None, :, None]){cast}",
        "    ra = tl.minimum(r0, N - 1)  # rows past N read the last one (not stored)",
        "    rb = tl.minimum(r0 + H, N - 1)",
        f"    rt = tl.arange(0, T)[:, None, None]{cast}",
        f"    rw = rt * 4 + tl.arange(0, 4)[None, None, :]{cast}  # the step's words",
        "    rx = rt * 32 + rw % 4 + r0 * 0  # nibble 0's K position of each word, in its shape",
        f"    pw = (buf_{g.b.buf} + {to_tl(g.b.offset)}).to(tl.pointer_type(tl.int32), "
        f"bitcast=True)",
        f"    pwa = pw + ra * ({to_tl(g.b.cols)} // 4) + rw",
        f"    pwb = pw + rb * ({to_tl(g.b.cols)} // 4) + rw",
        f"    ps = buf_{sc.buf} + {to_tl(sc.offset)} + (rt * 32 // {gs}) * {to_tl(sc.rows)}",
        f"    psa = ps + ra * {to_tl(sc.cols)}",
        f"    psb = ps + rb * {to_tl(sc.cols)}",
        "    xmask = rx < K",
    ]
    counter = [0]
    row, total = "[1, 1, RBLOCK]", "tl.sum({}, 2, keep_dims=True)"
    if pro is not None and pro.reductions:
        lines += [f"    rk = tl.arange(0, RBLOCK)[None, None, :]{cast}  # a row's slice",
                  "    xidx = rk * 0  # the row's shape, for loads of scalars"]
    factored, regs = _row_start(gk, lines, counter, row, total)
    if pro is not None:  # (the loop ends with this shape too)
        lines.append("    xidx = rx * 0  # the tile's shape, for loads of scalars")
    # a thread's 4 words of a chunk summed in registers each step: [T, H, 1] accumulators
    lines += ["    acc_a = tl.zeros((T, H, 1), dtype=tl.float32)",
              "    acc_b = tl.zeros((T, H, 1), dtype=tl.float32)"]
    # one step's loads at k0 (carried: words and scales), and its products at kc
    load = ["        wa = tl.load(pwa + k0 // 8)  # rows r0: 8 nibbles (+ 8) a word",
            "        wb = tl.load(pwb + k0 // 8)  # rows r0 + H",
            f"        sa = tl.load(psa + (k0 // {gs}) * {to_tl(sc.rows)})",
            f"        sb = tl.load(psb + (k0 // {gs}) * {to_tl(sc.rows)})"]
    carried = ("wa", "wb", "sa", "sb")
    use: list[str] = []
    if factored is not None:  # the whole-row sums over this step's K slice, once each
        use += ["        kk = kc + rk", "        kmask = kk < K",
                "        xidx = rk * 0"]
        use += _fused_reduction_lines(gk, counter)
    if pro is not None:
        use.append("        xidx = rx * 0  # the tile's shape, for loads of scalars")
    for i in range(8):
        flat = f"kx{i}"
        use.append(f"        {flat} = kc + rx + {4 * i}  # x at nibble {i}")
        if pro is None:
            use.append(f"        x{i} = tl.load(buf_{g.a.buf} + {to_tl(g.a.offset)} + {flat} * "
                       f"{to_tl(g.a.cols)})")
            continue
        prow = pro.row
        names, defs = _unravel_lines(f"a{i}_", flat, prow.shape, "i", "        ")
        use += defs
        scope = _Scope(names, "xmask", {} if factored is not None else regs, counter)
        v = text(scope.value(prow.body if factored is None else factored[1]))
        use += render(scope.lines, "        ")
        use.append(f"        x{i} = ({v}).to(tl.bfloat16)")
    use += ["        da, db = _kl_i4mma(wa, wb, " + ", ".join(f"x{i}" for i in range(8)) + ")",
            "        acc_a += tl.sum(da, 2, keep_dims=True) * sa",
            "        acc_b += tl.sum(db, 2, keep_dims=True) * sb"]
    depth = _tc_depth(n, k // rb)
    slot = [{c: f"{c}_{j}" for c in carried} for j in range(depth + 1)]
    for j in range(depth):
        lines.append(f"    # step {j}'s words and scales")
        lines += [_renamed(_renamed(t, slot[j]), {"k0": str(j * rb)})[4:] for t in load]
    cur = slot[depth] if depth == 0 else {c: f"{c}_c" for c in carried}
    lines.append(f"    for k0 in range({depth * rb}, K, RBLOCK):  # k0: the step loaded")
    if depth:
        lines += [f"        {cur[c]} = {slot[0][c]}  # this step's" for c in carried]
        for j in range(depth - 1):
            lines += [f"        {slot[j][c]} = {slot[j + 1][c]}" for c in carried]
        lines.append(f"        # the words and scales {depth} steps ahead")
        lines += [_renamed(t, slot[depth - 1]) for t in load]
        lines.append(f"        kc = k0 - {depth * rb}  # this step's")
    else:
        lines += [_renamed(t, cur) for t in load] + ["        kc = k0"]
    lines += [_renamed(t, cur) for t in use]
    for j in range(depth):
        lines.append(f"    # the last steps: {j + 1} of {depth}")
        lines.append(f"    kc = K - {(depth - j) * rb}")
        lines += [_renamed(t, slot[j])[4:] for t in use]
    if factored is not None:
        factor = _row_factor(lines, pro, regs, total, factored, counter, "(r0 < N)")
    flat = linear_index([sympy.Symbol("i_m"), sympy.Symbol("i_n")],
                        contiguous_strides(g.shape))
    for half, rows, acc in (("r0", "r0", "acc_a"), ("r0 + H", "r0 + H", "acc_b")):
        lines += [f"    # rows {half}",
                  f"    tot = tl.sum(tl.sum({acc}, 2, keep_dims=True), 0, keep_dims=True)"
                  + (f" * {factor}" if factored is not None else ""),
                  f"    i_n = {rows}",
                  "    i_m = i_n * 0",
                  "    mask = i_n < N"]
        lines += _stored(g, epi, flat, out, counter, "i_n")
    return _gemv_kernel(name, lines, params, sig, cfg, gk)


def _row_factor(lines: list[str], pro, regs: dict, total: str, factored, counter,
                mask: str) -> str:
    """Appends to `lines` the prologue's whole-row reductions (each `total` of its
    accumulator, rounded to its dtype) and the factor computed from them; returns the
    factor's expression."""
    for r in pro.reductions:
        regs[r.name] = f"v_{r.name}"
        lines.append(f"    v_{r.name} = {_rounded(total.format(f'acc_{r.name}'), r.dtype)}")
    lines.append(f"    # the row's whole-row factor, from {', '.join(regs)}")
    scope = _Scope({}, mask, dict(regs), counter)
    factor = text(scope.value(factored[0]))
    lines += render(scope.lines, "    ")
    return factor


def _stored(g, epi, flat, out: str, counter, rows: str, total: str = "tot") -> list[str]:
    """The lines storing a GEMV's sums `total` (outputs `rows`, masked by `mask`) at `flat`:
    rounded to the output's dtype, or through the epilogue `epi` (None: none)."""
    lines: list[str] = []
    if epi is None:
        value = f"{total}.to({TL_DTYPE[g.dtype]})"
    else:
        names = _epilogue_names(g, epi, flat)
        lines.append(f"    xidx = {rows} * 0  # the outputs' shape, for loads of scalars")
        lines.append(f"    v_{g.name} = {_rounded(total, g.dtype)}  # the GEMM result, as its "
                     f"buffer would hold it")
        lines.append(f"    # epilogue {epi.name} <- {', '.join(epi.source)}")
        scope = _Scope(names, "mask", {g.name: f"v_{g.name}"}, counter)
        value = text(scope.value(epi.body))
        lines += render(scope.lines, "    ")
    lines.append(f"    tl.store(buf_{out} + {to_tl(flat)}, {value}, mask=mask)")
    return lines


def _gemv_kernel(name: str, lines: list[str], params, sig: dict, cfg, gk) -> TritonKernel:
    sig["XBLOCK"] = sig["RBLOCK"] = "constexpr"
    return TritonKernel(name, "\n".join(lines) + "\n", tuple(params), sig,
                        Config(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                               cfg.variant),
                        gk.gemm.n, gk.source)


def print_template_kernel(gk: GemmKernel, buffers: dict[str, L.Buffer],
                          name: str | None = None) -> TritonKernel:
    """The GEMV template's kernel for a `GemvConfig`, else the GEMM template's."""
    if getattr(gk.config, "gemv", False):
        return print_gemv_kernel(gk, buffers, name)
    if gk.gemm.mixed is not None and gk.gemm.mixed.group:
        raise UnsupportedError(f"GEMM {gk.gemm.name} ({', '.join(gk.gemm.source)}): its int4 "
                               f"weight is read by the GEMV template only")
    return print_gemm_kernel(gk, buffers, name)


def gemv_steps(steps) -> list[GemmKernel]:
    """The GEMV template's kernels among `steps` (regions' too)."""
    return [s for s in L.flat_steps(steps)
            if isinstance(s, GemmKernel) and getattr(s.config, "gemv", False)]


def _as_gemv(c: Config) -> GemvConfig:
    return GemvConfig(c.xblock, c.rblock, c.num_warps, c.num_stages, c.variant)


def gemv_candidates(gk: GemmKernel, buffers=None, hints=None) -> list[Config]:
    """Launch configs the compile-time tuner times for a GEMV kernel (launch_tune's template
    family "gemv"): the kernel's own config first (the heuristic's, or a profiled choice),
    then kiln/gemm/gemv.py's variations, as `Config(BLOCK_N, BLOCK_K, warps, stages)`."""
    g = gk.gemm
    own = gk.config
    out = [Config(own.block_n, own.block_k, own.num_warps, own.num_stages, own.variant)]
    for c in GV.gemv_configs(g):
        cand = Config(c.block_n, c.block_k, c.num_warps, c.num_stages, c.variant)
        if cand not in out:
            out.append(cand)
    return out


def print_gemv_candidate(gk: GemmKernel, buffers: dict[str, L.Buffer], hints=None,
                         config: Config | None = None) -> TritonKernel:
    """The GEMV kernel of `gk` launched with `config` (a tuning candidate or the tuner's pick;
    None: its own config)."""
    if config is not None:
        gk = replace(gk, config=_as_gemv(config))
    return print_gemv_kernel(gk, buffers)
