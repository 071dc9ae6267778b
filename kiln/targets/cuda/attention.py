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

The decode path (L static, at most DECODE_MAX_L = 16 query rows: `print_decode_kernel`, see
the comment above it) is a kernel of its own, for calls whose few programs (B x H) would each
walk every key with a tile meant for many query rows: one program per (batch, kv head, key
split) holds all G x L query rows of a kv head (GQA packing: each key / value tile read once
per kv head), the keys are split among programs (flash-decoding: XBLOCK is the number of
splits, partial states in the call's float32 scratch, `attn_<call>_combine` merges them), and
a key tile that a bool mask (or causality) hides for every row is skipped before its keys and
values are loaded: a step over a static cache reads the filled part, whatever the model.
A decode step's KV-cache writes and the one-row kernel before them (rotary queries and keys,
the mask) run in the decode kernel's launch where the pattern allows (`fuse_decode_puts`, see
the comment above it; fifteenth session): the kernel then computes those values where it
reads them and writes the new key / value rows itself.

Longer static query blocks with a mask (16 < L <= XBLOCK, one query block): a first pass over
the mask finds the key range [lo_live, hi_live) the mask keeps for some row, and the two loops
visit only its tiles. A tile outside the range would add nothing (p = 0 for every row, so m,
l and acc keep their values).

Precision: scores and the accumulator are float32. 16-bit inputs multiply on tensor cores with
float32 accumulation (probabilities are rounded to the input type for the second product, as
flash-attention kernels do); float32 inputs use 3xTF32 products (`DOT_PRECISION`: float32-level
error on tensor cores, never the single-TF32 product Triton defaults to). A row whose keys are
all masked outputs zeros, as eager's scaled_dot_product_attention does.

Config: XBLOCK = BLOCK_M (queries per program; the decode path: key splits), RBLOCK = BLOCK_N
(keys per step), num_warps, num_stages (software pipelining of the key / value loads).
`choose_attention_config` is the heuristic; targets/cuda/launch_tune.py times
`attention_candidates` on the local GPU (the decode path's candidates vary the split; the
tuner times the attention kernel, not the combine after it). `attention_kernels` lists what
the wrappers launch for a call: the attention kernel, then the combine when split.

Modules: this one holds the prefill kernel and the dispatch (`attention_kernels`,
`attention_candidates`, `choose_attention_config`); the decode path and the KV-cache writes
fused into it live in targets/cuda/attention_decode.py, and what both use (constants, head
dims, shared-memory estimate) in targets/cuda/attention_parts.py, so that imports flow one way
(parts <- decode <- this module)."""

from __future__ import annotations

import sympy

from kiln.targets.cuda.attention_parts import (DOT_PRECISION, LOG2E, SHARED_LIMIT, finite_log2,
                                               head_dims, itemsize, operands, pow2)
from kiln.targets.cuda.kernel import Config, TritonKernel
from kiln.targets.cuda.ops import SIG_PTR, TL_DTYPE, canon, to_tl
from kiln.ir import loop as L
from kiln.ir.sym import evaluate
from kiln.ir.sym import FloorDiv
from kiln.targets.cuda.attention_decode import (decode_candidates, decode_config, is_decode,
                                                print_decode_combine, print_decode_kernel)

#: programs that fill an H100's 132 SMs once: fewer query rows per program until a
#: prefill call has this many (or its blocks are 16 rows)
FILL_PROGRAMS = 132


def _mask_itemsize(call: L.Extern, buffers) -> int:
    """The mask operand's element size (0 without a mask)."""
    return buffers[call.args[3].buf].dtype.itemsize if len(call.args) > 3 else 0


def _prefill_shared(cfg: Config, e_pad: int, ev_pad: int, size: int, mask_size: int) -> int:
    """Shared memory of the prefill kernel as Triton 3.6 lays it out for sm_90, fitted to the
    compiled kernels' figures (exact on 40 configs: float32 / bfloat16, head dims 64-256; an
    upper bound where one key tile covers every key): the pipelined key / value (and mask)
    tiles, q (twice for float32: 3xTF32 splits it into high and low parts) and two key-tile
    copies for the transposed operand of q @ k^T."""
    stages = max(1, cfg.num_stages - 1) if cfg.num_stages else 2
    q_copies = 2 if size == 4 else 1
    return (stages * cfg.rblock * ((e_pad + ev_pad) * size + cfg.xblock * mask_size)
            + q_copies * cfg.xblock * e_pad * size + 2 * cfg.rblock * e_pad * size)


def _fits(call: L.Extern, buffers, cfg: Config) -> bool:
    e, ev = head_dims(call)
    return _prefill_shared(cfg, pow2(e), pow2(ev), itemsize(call, buffers),
                           _mask_itemsize(call, buffers)) <= SHARED_LIMIT


def choose_attention_config(call: L.Extern, buffers, hints: dict[str, int]) -> Config:
    """The decode path's config (`decode_config`) for few query rows, else: BLOCK_M 128 (64
    for head dims above 128), BLOCK_N 64 (32 for float32 operands with head dims above 64:
    their tiles are twice as large), 4 warps up to head dim 64 and 8 above, 3 pipeline stages
    (2 above head dim 128); both blocks shrink to the run's query / key count (at least 16)
    when the example is shorter; BLOCK_M halves (down to 16, at most 4 warps under 64 rows)
    while the batch x heads x query blocks are fewer than FILL_PROGRAMS (ViT-Base's 12 heads
    x 197 queries made 24 programs of 128 rows on 132 SMs); then, while the shared memory would
    not fit an sm_90 block, fewer stages (down to 2), a narrower key tile, fewer query rows
    (float32 at head dim 128 with a mask: 2 stages)."""
    e, ev = head_dims(call)
    width = max(pow2(e), pow2(ev))
    size = itemsize(call, buffers)
    bm = 64 if width > 128 else 128
    bn = 32 if width > 128 or (size == 4 and width > 64) else 64
    warps = 4 if width <= 64 else 8
    stages = 2 if width > 128 else 3
    if is_decode(call):
        return decode_config(call, buffers, hints)
    lq = evaluate(call.args[0].shape[2], hints)
    s = evaluate(call.args[1].shape[2], hints)
    bm = min(bm, pow2(lq))
    heads = evaluate(call.args[0].shape[0], hints) * evaluate(call.args[0].shape[1], hints)
    while bm > 16 and heads * -(-lq // bm) < FILL_PROGRAMS:
        bm //= 2
    cfg = Config(bm, min(bn, pow2(s)), min(warps, max(4, bm // 16)), stages)
    while not _fits(call, buffers, cfg):
        if cfg.num_stages > 2:
            cfg = Config(cfg.xblock, cfg.rblock, cfg.num_warps, cfg.num_stages - 1)
        elif cfg.rblock > 16:
            cfg = Config(cfg.xblock, cfg.rblock // 2, cfg.num_warps, cfg.num_stages)
        elif cfg.xblock > 16:
            cfg = Config(cfg.xblock // 2, cfg.rblock, min(cfg.num_warps, 4), cfg.num_stages)
        else:
            break
    return cfg


def attention_candidates(call: L.Extern, buffers, hints: dict[str, int]) -> list[Config]:
    """The heuristic config first, then a small space around it: BLOCK_M in {16 .. 128}, BLOCK_N
    in {32, 64, 128}, 4 or 8 warps (8 only with at least 128 query rows), 2-4 stages, kept where
    the estimated shared memory fits. The decode path has its own (`decode_candidates`)."""
    if is_decode(call):
        return decode_candidates(call, buffers, hints)
    base = choose_attention_config(call, buffers, hints)
    lq = evaluate(call.args[0].shape[2], hints)
    s = evaluate(call.args[1].shape[2], hints)
    out = [base]
    for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4),
                          (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 4), (64, 64, 8, 2),
                          (32, 64, 4, 3), (32, 32, 4, 2), (16, 64, 4, 3), (16, 32, 4, 2)):
        c = Config(min(bm, pow2(lq)), min(bn, pow2(s)), w, st)
        # 8 warps need 16 query rows each: a 64 x 16 float32 tile on 8 warps faulted (illegal
        # address, H200, Triton 3.6: segformer's 4-key attention), and a fault while timing
        # leaves the process's CUDA context unusable
        if w > max(4, c.xblock // 16):
            continue
        if c not in out and _fits(call, buffers, c):
            out.append(c)
    return out


def attention_kernels(call: L.Extern, buffers, hints: dict[str, int],
                      config: Config | None = None) -> list[TritonKernel]:
    """The kernels the wrapper launches for `call`, in order: the attention kernel, then (the
    decode path split over the keys) `attn_<call>_combine`."""
    config = config or choose_attention_config(call, buffers, hints)
    main = print_attention_kernel(call, buffers, hints, config)
    if is_decode(call) and config.xblock > 1:
        return [main, print_decode_combine(call, buffers, config)]
    return [main]


def print_attention_kernel(call: L.Extern, buffers, hints: dict[str, int],
                           config: Config | None = None) -> TritonKernel:
    config = config or choose_attention_config(call, buffers, hints)
    if is_decode(call):
        return print_decode_kernel(call, buffers, hints, config)
    q, k, v, mask, kind, causal, scale, name, out, dt = operands(call, buffers)
    e, ev = head_dims(call)
    ep, evp = pow2(e), pow2(ev)
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
        st = canon(stride)
        return [] if st == 0 else [var] if st == 1 else [f"{var} * {t(st)}"]

    group = int(call.attr("group", 1))

    def base(a: L.LibArg, head: str = "h") -> str:
        off = [] if canon(a.offset) == 0 else [t(canon(a.offset))]
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
        f"    n_m = ({t(canon(Lq))} + XBLOCK - 1) // XBLOCK",
        # the query blocks of one (batch, head) are neighbours (they share its keys and values
        # in L2); causal: its heaviest block (most keys) starts first
        "    bh = pid // n_m",
        f"    b = bh // {t(canon(H))}",
        f"    h = bh % {t(canon(H))}",
        "    m_blk = n_m - 1 - pid % n_m" if causal else "    m_blk = pid % n_m",
        "    rows = m_blk * XBLOCK + tl.arange(0, XBLOCK)",
        f"    d = tl.arange(0, {ep})",
        f"    dv = tl.arange(0, {evp})",
        f"    row_ok = rows < {t(canon(Lq))}",
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
                out += [f"        mf = {mld}.to(tl.float32)",
                        f"        s = s + {finite_log2('mf')}"]
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

    S_ = t(canon(S))
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
    if mask is not None and canon(Lq).is_Integer and int(canon(Lq)) <= config.xblock:
        # one query block (decode): the keys the mask keeps for some row span [lo_live,
        # hi_live); only those tiles are read (a decode step's mask hides the cache past the
        # current position). A tile left out adds nothing to the online softmax (p = 0).
        pb = max(config.rblock, 2048 // config.xblock)
        ld = (f"tl.load({tile('m_ptr', 'pc[None, :]', mask.strides[3], '', 0)}, "
              "mask=row_ok[:, None] & (pc[None, :] < " + S_ + "), other=0)")
        alive = f"({ld} != 0)" if kind == 1 else \
            f"({ld}.to(tl.float32) > float(\"-inf\"))"
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
        f"    o_ptr = buf_{call.name} + (bh * {t(canon(Lq))} + rows[:, None]) * {ev} + dv[None, :]",
        f"    tl.store(o_ptr, o.to({TL_DTYPE[out.dtype]}), "
        f"mask=row_ok[:, None]{vmask_e})",
    ]
    src = "\n".join(lines) + "\n"
    n_m = _ceil_div(canon(Lq), config.xblock)
    rows = canon(B * H) * n_m * config.xblock
    return TritonKernel(name, src, params, sig, config, rows, call.source)


def _ceil_div(x: sympy.Expr, n: int) -> sympy.Expr:
    if x.is_Integer:
        return sympy.Integer(-(-int(x) // n))
    return FloorDiv(x + n - 1, n)

