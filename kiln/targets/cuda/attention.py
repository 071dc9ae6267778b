"""Attention `Extern` steps (routine "attention", lowering/attention.py) -> Triton flash-attention
kernels for CUDA builds.

Input: the Extern (q, k, v and an optional [B, H, L, S] mask as strided operands; attributes
causal, scale, mask kind), the Loop IR buffers, size hints and a launch config. Output: a
`TritonKernel` named `attn_<output buffer>` that the CUDA wrapper launches like any other
(targets/cuda/wrapper.py) and triton_aot compiles to cubin ahead of time.

Mapping: program p handles XBLOCK query rows of one (batch, head): p = (b * H + h) * n_m + m
for query block m of n_m = ceil(L / XBLOCK) (causal: m counted from the last block, so each
head's heaviest program starts first); the grid is `rows` / XBLOCK programs, rows = B * H * n_m
* XBLOCK. Neighbouring programs read the same keys and values, which stay in L2 (a block-major
order, all heads of one query block side by side, measured 5.2 ms against 2.8 ms at B=8, H=16,
L=4096, E=128, bf16: the keys and values of 128 heads do not fit in L2; that measurement also
changed the loop, see below). It walks the keys in RBLOCK-wide tiles with an online softmax in
base 2 (scores scaled by scale * log2(e); running row maximum m_i, running sum l_i, an [XBLOCK,
Ev] float32 accumulator rescaled when the maximum grows): the L x S score matrix is never
stored. Two loops: whole tiles below `lo` need no bounds or causal masks (causal: the keys
below the block's first query), the tail [lo, hi) is masked (causal: hi stops at the block's
last query). Head dims are padded to a power of two (at least 16, tl.dot's minimum) with masked
loads. Strides, offsets and sizes are printed as expressions of the size symbols, which are
kernel parameters, so one kernel serves every run size.

Grouped-query attention (attribute `group`, passes/gqa_attention.py): k and v have H / group
heads and query head h reads kv head h // group, in place (no repeat_kv copy).

Decode (a mask and one query block, L <= XBLOCK, static): a first pass over the mask finds the
key range [lo_live, hi_live) the mask keeps for some row, and the two loops visit only its
tiles: a step over a static cache reads the filled part, not the whole cache. A tile outside
the range would add nothing (p = 0 for every row, so m, l and acc keep their values).

Precision: scores and the accumulator are float32. 16-bit inputs multiply on tensor cores with
float32 accumulation (probabilities are rounded to the input type for the second product, as
flash-attention kernels do); float32 inputs use 3xTF32 products (`DOT_PRECISION`: float32-level
error on tensor cores, never the single-TF32 product Triton defaults to). A row whose keys are
all masked outputs zeros, as eager's scaled_dot_product_attention does.

Config: XBLOCK = BLOCK_M (queries per program), RBLOCK = BLOCK_N (keys per step), num_warps,
num_stages (software pipelining of the key / value loads). `choose_attention_config` is the
heuristic; targets/cuda/launch_tune.py times `attention_candidates` on the local GPU."""

from __future__ import annotations

import sympy

from kiln.targets.cuda.kernel import Config, TritonKernel
from kiln.targets.cuda.ops import SIG_PTR, TL_DTYPE, to_tl
from kiln.ir import loop as L
from kiln.ir.sym import evaluate
from kiln.ir.sym import FloorDiv

LOG2E = 1.4426950408889634
SHARED_LIMIT = 232448  # bytes of shared memory one sm_90 block may use (227 KiB)


# tl.dot's input precision per operand dtype where Triton's default is not eager's: float32
# products as 3xTF32 (each operand split into a TF32 head and a TF32 tail, three tensor-core
# products: float32-level error, unlike Triton's default single TF32 product). On the H100,
# gpt fp32 (bench/attention_fp32.py): 3xTF32 0.202 ms, max error vs float64 1.14e-6; IEEE
# float32 (FMA, no tensor cores) 0.263 ms, 1.23e-6; eager float32 attention 1.45e-6
DOT_PRECISION = {"float32": "tf32x3"}


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def head_dims(call: L.Extern) -> tuple[int, int]:
    """(E, Ev): the static head dims of q / k and of v."""
    return int(call.args[0].shape[3]), int(call.args[2].shape[3])


def _itemsize(call: L.Extern, buffers) -> int:
    return buffers[call.args[0].buf].dtype.itemsize


def _shared_estimate(cfg: Config, e_pad: int, ev_pad: int, size: int) -> int:
    """Shared memory the pipelined key / value tiles need (Triton's own layout may add a little;
    the compiled kernel's figure is checked by the callers that compile it)."""
    stages = max(1, cfg.num_stages - 1) if cfg.num_stages else 2
    return stages * cfg.rblock * (e_pad + ev_pad) * size + cfg.xblock * e_pad * size


def choose_attention_config(call: L.Extern, buffers, hints: dict[str, int]) -> Config:
    """BLOCK_M 128 (64 for head dims above 128), BLOCK_N 64 (32 for float32 operands with head
    dims above 64: their tiles are twice as large), 4 warps up to head dim 64 and 8 above,
    3 pipeline stages (2 above head dim 128); both blocks shrink to the run's query / key count
    (at least 16) when the example is shorter."""
    e, ev = head_dims(call)
    width = max(_pow2(e), _pow2(ev))
    size = _itemsize(call, buffers)
    bm = 64 if width > 128 else 128
    bn = 32 if width > 128 or (size == 4 and width > 64) else 64
    warps = 4 if width <= 64 else 8
    stages = 2 if width > 128 else 3
    lq = evaluate(call.args[0].shape[2], hints)
    s = evaluate(call.args[1].shape[2], hints)
    return Config(min(bm, _pow2(lq)), min(bn, _pow2(s)), warps, stages)


def attention_candidates(call: L.Extern, buffers, hints: dict[str, int]) -> list[Config]:
    """The heuristic config first, then a small space around it: BLOCK_M in {64, 128}, BLOCK_N
    in {32, 64, 128}, 4 or 8 warps (8 only with at least 128 query rows), 2-4 stages, kept where
    the estimated shared memory fits."""
    base = choose_attention_config(call, buffers, hints)
    e, ev = head_dims(call)
    size = _itemsize(call, buffers)
    lq = evaluate(call.args[0].shape[2], hints)
    s = evaluate(call.args[1].shape[2], hints)
    out = [base]
    for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4),
                          (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 4), (64, 64, 8, 2)):
        c = Config(min(bm, _pow2(lq)), min(bn, _pow2(s)), w, st)
        # 8 warps need 16 query rows each: a 64 x 16 float32 tile on 8 warps faulted (illegal
        # address, H200, Triton 3.6: segformer's 4-key attention), and a fault while timing
        # leaves the process's CUDA context unusable
        if w > max(4, c.xblock // 16):
            continue
        if c not in out and _shared_estimate(c, _pow2(e), _pow2(ev), size) <= SHARED_LIMIT:
            out.append(c)
    return out


def _c(e) -> sympy.Expr:
    return sympy.expand(sympy.sympify(e))


def print_attention_kernel(call: L.Extern, buffers, hints: dict[str, int],
                           config: Config | None = None) -> TritonKernel:
    config = config or choose_attention_config(call, buffers, hints)
    q, k, v = call.args[:3]
    mask = call.args[3] if len(call.args) > 3 else None
    kind = call.attr("mask", 0)
    causal = bool(call.attr("causal"))
    scale = float(call.attr("scale"))
    name = f"attn_{call.name}"
    out = buffers[call.name]
    dt = buffers[q.buf].dtype.name
    e, ev = head_dims(call)
    ep, evp = _pow2(e), _pow2(ev)
    B, H, Lq, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]

    bufs: list[str] = [call.name]
    for a in call.args:
        if a.buf not in bufs:
            bufs.append(a.buf)
    exprs = [B, H, Lq, S] + [x for a in call.args for x in (a.offset, *a.strides)]
    syms = sorted({str(s) for x in exprs for s in sympy.sympify(x).free_symbols})
    params = (("out", call.name), *(("in", b) for b in bufs[1:]),
              *(("size", s) for s in syms))
    sig = {f"buf_{b}": SIG_PTR[buffers[b].dtype] for b in bufs}
    sig.update({s: "i64" for s in syms})
    sig["XBLOCK"] = sig["RBLOCK"] = "constexpr"

    t = to_tl
    prec = f', input_precision="{DOT_PRECISION[dt]}"' if dt in DOT_PRECISION else ""
    pmask_e = f" & (d[None, :] < {e})" if ep != e else ""
    kmask_e = f" & (d[:, None] < {e})" if ep != e else ""
    vmask_e = f" & (dv[None, :] < {ev})" if evp != ev else ""

    def term(var: str, stride) -> list[str]:
        st = _c(stride)
        return [] if st == 0 else [var] if st == 1 else [f"{var} * {t(st)}"]

    group = int(call.attr("group", 1))

    def base(a: L.LibArg, head: str = "h") -> str:
        off = [] if _c(a.offset) == 0 else [t(_c(a.offset))]
        return " + ".join([f"buf_{a.buf}", *off, *term("b", a.strides[0]),
                           *term(head, a.strides[1])])

    def tile(ptr: str, rvar: str, rstride, cvar: str, cstride) -> str:
        """ptr + a 2-D tile of offsets (a zero stride keeps its index: the tile's shape)."""
        parts = [ptr]
        for var, st in ((rvar, rstride), (cvar, cstride)):
            if var:
                parts += term(var, st) or [f"{var} * 0"]
        return " + ".join(parts)

    qs, ks, vs = q.strides, k.strides, v.strides
    lines = [
        "@triton.jit",
        f"def {name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}, "
        "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {name}: flash attention (online softmax) -> {call.name}",
        f"    #   from graph nodes: {', '.join(call.source)}",
        f"    #   {dt}, head dims {e} / {ev} (padded to {ep} / {evp}), "
        f"{'causal' if causal else 'not causal'}, "
        f"mask {['none', 'bool (keep where true)', 'float (added)'][kind]}, scale {scale!r}",
        "    #   XBLOCK queries per program, keys in RBLOCK-wide tiles",
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        f"    n_m = ({t(_c(Lq))} + XBLOCK - 1) // XBLOCK",
        # the query blocks of one (batch, head) are neighbours (they share its keys and values
        # in L2); causal: its heaviest block (most keys) starts first
        "    bh = pid // n_m",
        f"    b = bh // {t(_c(H))}",
        f"    h = bh % {t(_c(H))}",
        "    m_blk = n_m - 1 - pid % n_m" if causal else "    m_blk = pid % n_m",
        "    rows = m_blk * XBLOCK + tl.arange(0, XBLOCK)",
        f"    d = tl.arange(0, {ep})",
        f"    dv = tl.arange(0, {evp})",
        f"    row_ok = rows < {t(_c(Lq))}",
        f"    q = tl.load({tile(base(q), 'rows[:, None]', qs[2], 'd[None, :]', qs[3])}, "
        f"mask=row_ok[:, None]{pmask_e}, other=0.0)",
        "    m_i = tl.full([XBLOCK], float(\"-inf\"), tl.float32)",
        "    l_i = tl.zeros([XBLOCK], tl.float32)",
        f"    acc = tl.zeros([XBLOCK, {evp}], tl.float32)",
    ]
    if group > 1:  # grouped queries (passes/gqa_attention.py): kv head h // group
        lines.append(f"    hk = h // {group}")
    lines += [f"    k_ptr = {base(k, 'hk' if group > 1 else 'h')}",
              f"    v_ptr = {base(v, 'hk' if group > 1 else 'h')}"]
    if mask is not None:
        ms = mask.strides
        lines.append(f"    m_ptr = {tile(base(mask), 'rows[:, None]', ms[2], '', 0)}")
    def _step(tail: bool) -> list[str]:
        """One key tile of the online softmax; `tail` adds the bounds and causal masks."""
        cmask = "col_ok[None, :]" if tail else ""
        vmask = "col_ok[:, None]" if tail else ""
        km = " & ".join(x for x in (cmask, kmask_e[3:]) if x)
        vm = " & ".join(x for x in (vmask, vmask_e[3:]) if x)
        out = ["        cols = start + tl.arange(0, RBLOCK)"]
        if tail:
            out.append(f"        col_ok = cols < {S_}")
        mld = None
        if mask is not None:
            bounds = "row_ok[:, None] & col_ok[None, :]" if tail else "row_ok[:, None]"
            mld = (f"tl.load({tile('m_ptr', 'cols[None, :]', mask.strides[3], '', 0)}, "
                   f"mask={bounds}, other=0)")
        out += [
            f"        kt = tl.load({tile('k_ptr', 'cols[None, :]', ks[2], 'd[:, None]', ks[3])}"
            + (f", mask={km}, other=0.0)" if km else ")"),
            f"        s = tl.dot(q, kt{prec}) * qk_scale",
        ]
        keep = ["col_ok[None, :]"] if tail else []
        if causal and tail:
            keep.append("(cols[None, :] <= rows[:, None])")
        if mask is not None:
            if kind == 1:
                keep.append(f"({mld} != 0)")
            else:
                out.append(f"        s = s + {mld}.to(tl.float32) * {LOG2E!r}")
        if keep:
            out.append(f"        s = tl.where({' & '.join(keep)}, s, float(\"-inf\"))")
        out += [
            "        m_new = tl.maximum(m_i, tl.max(s, 1))",
            "        m_use = tl.where(m_new == float(\"-inf\"), 0.0, m_new)  # all masked so far",
            "        p = tl.exp2(s - m_use[:, None])",
            "        alpha = tl.exp2(m_i - m_use)",
            "        l_i = l_i * alpha + tl.sum(p, 1)",
            f"        vt = tl.load({tile('v_ptr', 'cols[:, None]', vs[2], 'dv[None, :]', vs[3])}"
            + (f", mask={vm}, other=0.0)" if vm else ")"),
            f"        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None]{prec})",
            "        m_i = m_new",
        ]
        return out

    S_ = t(_c(S))
    lines.append("    # base-2 softmax: scores scaled by scale * log2(e), exp2 instead of exp")
    lines.append(f"    qk_scale = {scale * LOG2E!r}")
    if causal:
        lines += [
            "    first = m_blk * XBLOCK",
            "    # keys below the block's first query are kept for every row: no causal mask",
            f"    lo = tl.minimum({S_} // RBLOCK * RBLOCK, first // RBLOCK * RBLOCK)",
            f"    hi = tl.minimum({S_}, first + XBLOCK)",
        ]
    else:
        lines += [f"    lo = {S_} // RBLOCK * RBLOCK  # whole key tiles: no bounds masks",
                  f"    hi = {S_}"]
    end_t = None
    if mask is not None and _c(Lq).is_Integer and int(_c(Lq)) <= config.xblock:
        # one query block (decode): the keys the mask keeps for some row span [lo_live,
        # hi_live); only those tiles are read (a decode step's mask hides the cache past the
        # current position). A tile left out adds nothing to the online softmax (p = 0).
        pb = max(config.rblock, 2048 // config.xblock)
        ld = (f"tl.load({tile('m_ptr', 'pc[None, :]', mask.strides[3], '', 0)}, "
              "mask=row_ok[:, None] & (pc[None, :] < " + S_ + "), other=0)")
        alive = f"({ld} != 0)" if kind == 1 else \
            f"({ld}.to(tl.float32) * {LOG2E!r} > float(\"-inf\"))"
        lines += [
            f"    lo_live = {S_}",
            "    hi_live = 0",
            f"    for pi in range(0, ({S_} + {pb - 1}) // {pb}):",
            f"        pc = pi * {pb} + tl.arange(0, {pb})",
            f"        alive = tl.max((row_ok[:, None] & (pc[None, :] < {S_}) & {alive})"
            ".to(tl.int32), 0) > 0",
            f"        lo_live = tl.minimum(lo_live, tl.min(tl.where(alive, pc, {S_})))",
            "        hi_live = tl.maximum(hi_live, tl.max(tl.where(alive, pc + 1, 0)))",
            "    first_t = lo_live // RBLOCK * RBLOCK",
            "    end_t = (hi_live + RBLOCK - 1) // RBLOCK * RBLOCK",
        ]
        end_t = "end_t"
    if end_t is None:
        lines.append("    for start in range(0, lo, RBLOCK):")
    else:
        lines += ["    whole_lo = first_t", "    whole_hi = tl.minimum(lo, end_t)",
                  "    for start in range(whole_lo, whole_hi, RBLOCK):"]
    lines += _step(False)
    if end_t is None:
        lines.append("    for start in range(lo, hi, RBLOCK):  # the tail: bounds (and causal) "
                     "masks")
    else:
        lines += ["    tail_lo = tl.maximum(lo, first_t)", "    tail_hi = tl.minimum(hi, end_t)",
                  "    for start in range(tail_lo, tail_hi, RBLOCK):  # the tail: bounds (and "
                  "causal) masks"]
    lines += _step(True)
    lines += [
        "    # rows whose keys were all masked: zeros (l_i == 0), as eager gives",
        "    o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)",
        f"    o_ptr = buf_{call.name} + (bh * {t(_c(Lq))} + rows[:, None]) * {ev} + dv[None, :]",
        f"    tl.store(o_ptr, o.to({TL_DTYPE[out.dtype]}), "
        f"mask=row_ok[:, None]{vmask_e})",
    ]
    src = "\n".join(lines) + "\n"
    n_m = _ceil_div(_c(Lq), config.xblock)
    rows = _c(B * H) * n_m * config.xblock
    return TritonKernel(name, src, params, sig, config, rows, call.source)


def _ceil_div(x: sympy.Expr, n: int) -> sympy.Expr:
    if x.is_Integer:
        return sympy.Integer(-(-int(x) // n))
    return FloorDiv(x + n - 1, n)
