"""The decode path of the CUDA attention (`attention` Extern steps with L static, at most
DECODE_MAX_L query rows; dispatched by targets/cuda/attention.py): `print_decode_kernel`, the
split-K combine `print_decode_combine`, their configs (`decode_config`, `decode_candidates`)
and the decode step's KV-cache writes fused into the attention's launch (`fuse_decode_puts`,
`FusedLaunch`, `fused_puts_attention_kernels`). The comment below says how the kernel maps
programs to rows and key splits; targets/cuda/attention.py's docstring, the precision and
masking rules both paths follow."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import sympy

from kiln.errors import CompileError
from kiln.schedule import Kernel
from kiln.schedule.steps import CutlassGemm, GemmKernel, PutKernel
from kiln.targets.cuda.attention_parts import (DOT_PRECISION, LOG2E, SHARED_LIMIT, finite_log2,
                                               head_dims, itemsize, operands, pow2, shared_estimate)
from kiln.targets.cuda.cse import render, text
from kiln.targets.cuda.kernel import Config, TritonKernel, _Scope
from kiln.targets.cuda.ops import COMPUTE, SIG_PTR, TL_DTYPE, canon, to_tl
from kiln.targets.cuda.put import STATUS_COUNTER_BASE, STATUS_COUNTERS
from kiln.ir import loop as L
from kiln.ir.sym import contiguous_strides, evaluate, free_size_symbols, product, unravel
from kiln.ir.sym import FloorDiv
from kiln.lowering.attention import DECODE_MAX_L


# -- the decode path: few query rows (L static, at most DECODE_MAX_L) ------------------------
#
# One program handles all G x L query rows of one (batch, kv head) (G = group, the query heads
# that read one kv head: row r is query head hk * G + r // L, query r % L), padded to MB >= 16
# rows (tl.dot's minimum), so a K / V tile is read once per kv head, not once per query head.
# XBLOCK is the number of key splits (flash-decoding): program (b, hk, split) walks keys
# [split * span, (split + 1) * span), span = ceil(S / XBLOCK) rounded up to RBLOCK, in
# RBLOCK-wide tiles. With a bool mask (or causal), the mask tile is read first; a tile whose
# keys no row keeps is skipped, and in the others K and V are loaded only at the keys some row
# keeps (masked loads: no memory traffic for the rest): a step over a static cache reads its
# filled part and nothing past it, whatever the model; causal (top-left: key j <= query i)
# stops at key L. A float mask's -inf entries are kept out alike; elsewhere it is added to
# the scores as on the other path (-inf gives p = 0, a NaN score stays NaN).
#
# The split (decode_config, fourteenth session): as many splits as the scratch allows
# (DECODE_KEYS_PER_SPLIT 64 keys of the cache a split, up to DECODE_TARGET_PROGRAMS 512
# programs), tiles of at most DECODE_TILE_BYTES. Where one mask row serves all of a
# program's query rows (L = 1, the mask broadcast over the group: a decoder's step,
# `_live_range`), each program first reads that row (one load of up to DECODE_SCAN keys) and
# finds the range [lo_live, hi_live) of kept keys; the splits divide that range, not the
# cache: 4096 filled keys of an 8192-key cache are 64 keys a program over 512 programs, 32
# filled keys 16 a program over 2 splits a head, the other programs store an empty state.
# Before, 256 keys a split and 264 programs over the whole cache left a Llama-3-8B step (8 kv
# heads, cache 256-512) with 8-16 programs walking 2 tiles each (8.5 us a layer on an H100
# for 0.5 MB of K / V). Other masks (per-head rows, several query rows) split the cache.
#
# XBLOCK == 1: the program normalises and stores its rows. XBLOCK > 1: each program stores
# its partial state (running maximum m in base 2, running sum l, the unnormalised [Ev]
# accumulator) in the call's float32 scratch (`<call>_part`, [B * H * L, splits, Ev + 2],
# declared by lowering/attention.py and planned in the arena like any temp), and a second small
# kernel, `attn_<call>_combine` (one program per output row), merges the splits: M = max m,
# o = sum(2^(m - M) acc) / sum(2^(m - M) l). A second launch rather than an in-kernel
# "last program reduces" step: the latter needs a per-row arrival counter that is zero before
# every call (the arena's bytes are not, and a memset is a launch as well), and its atomics
# and fences serialise the splits' tails; the combine reads B * H * L * splits * (Ev + 2)
# floats (tens of KB), a microsecond-scale launch that a CUDA graph queues back to back.
# (Fifteenth session: where the attention absorbed the step's KV-cache writes, such counters
# exist: words of the status buffer, zeroed at load, each reset by the split that merges;
# `KILN_DECODE_COMBINE=last`. Measured no faster than the combine launch: see `FusedLaunch`.)
# A row that no split kept (fully masked) gets zeros, as on the other path.

#: key splits: the heuristic wants at least this many keys a split ...
DECODE_KEYS_PER_SPLIT = 64
#: ... and no more programs than this (about four of an H100's 132 SMs each: a program
#: whose keys are past the filled part reads one mask tile and stores an empty state)
DECODE_TARGET_PROGRAMS = 512
#: the twelfth session's figures (256 keys, 264 programs): `KILN_DECODE_SPLIT=legacy` at
#: compile time, for A/B runs (scripts/prof_decode.py); `KILN_DECODE_SPLIT=KEYS,PROGRAMS[,TILE
#: BYTES]` sets the three
_LEGACY = "256,264"


def _split_limits() -> tuple[int, int, int]:
    """(DECODE_KEYS_PER_SPLIT, DECODE_TARGET_PROGRAMS, DECODE_TILE_BYTES), or what the
    environment's KILN_DECODE_SPLIT says (A/B runs)."""
    env = os.environ.get("KILN_DECODE_SPLIT", "")
    env = _LEGACY if env == "legacy" else env
    out = [DECODE_KEYS_PER_SPLIT, DECODE_TARGET_PROGRAMS, DECODE_TILE_BYTES]
    for i, x in enumerate(env.split(",")[:3] if env else ()):
        out[i] = int(x)
    return out[0], out[1], out[2]


def is_decode(call: L.Extern) -> bool:
    """Whether `call` takes the decode path: L static, at most DECODE_MAX_L."""
    lq = canon(call.args[0].shape[2])
    return lq.is_Integer and int(lq) <= DECODE_MAX_L


def _decode_rows(call: L.Extern) -> tuple[int, int, int]:
    """(G, L, MB): the group, the query rows per head and the padded rows of one program."""
    g = int(call.attr("group", 1))
    lq = int(canon(call.args[0].shape[2]))
    return g, lq, pow2(g * lq)


#: the decode path's tiles: MB x RBLOCK float32 scores at most (registers), RBLOCK x (E + Ev)
#: key / value elements of a step at most DECODE_TILE_BYTES (shared memory: 32 KiB of keys
#: and values take 36 KiB of an sm_90 block, so 6 programs fit an SM and 512 programs run in
#: one wave on 132 SMs; 64 KiB took 68 KiB, 3 an SM: 2 waves. H200, Llama-3-8B attention,
#: 8192-key cache, 4096 filled: 12.7 against 17.3 us; fourteenth session)
DECODE_SCORES = 8192
DECODE_TILE_BYTES = 32768


def _decode_fits(call: L.Extern, buffers, cfg: Config, limit: int = SHARED_LIMIT) -> bool:
    e, ev = head_dims(call)
    _, _, mb = _decode_rows(call)
    return (shared_estimate(Config(mb, cfg.rblock, cfg.num_warps, cfg.num_stages), pow2(e),
                             pow2(ev), itemsize(call, buffers)) <= limit)


def _decode_warps(mb: int, bn: int, width: int) -> int:
    return 4 if mb * max(bn, width) <= DECODE_SCORES else 8


def decode_config(call: L.Extern, buffers, hints: dict[str, int]) -> Config:
    """XBLOCK key splits: as many as keep DECODE_KEYS_PER_SPLIT keys a split and B * Hkv *
    splits within DECODE_TARGET_PROGRAMS (at most the call's `splits`, the scratch it has);
    RBLOCK the widest power of two up to 256 that covers no more than a split's keys, keeps
    MB x RBLOCK scores within DECODE_SCORES and a step's keys and values within
    DECODE_TILE_BYTES: a decode step's program walks one or two tiles, whose loads are all in
    flight at once (a walk over many narrow tiles pays a memory latency per tile); 4 warps (8
    for tiles above DECODE_SCORES elements), 2 stages. `KILN_DECODE_SPLIT` (compile time)
    overrides the three limits for A/B runs (`_split_limits`)."""
    e, ev = head_dims(call)
    ep, evp = pow2(e), pow2(ev)
    size = itemsize(call, buffers)
    g, _, mb = _decode_rows(call)
    s = max(1, evaluate(call.args[1].shape[2], hints))
    programs = max(1, evaluate(call.args[0].shape[0], hints) *
                   evaluate(call.args[0].shape[1], hints) // g)
    keys, target, tile_bytes = _split_limits()
    split = max(1, min(int(call.attr("splits", 1)), -(-s // keys), target // programs))
    span = pow2(-(-s // split))
    bn = 256
    while bn > 16 and (bn > span or mb * bn > DECODE_SCORES or
                       bn * (ep + evp) * size > tile_bytes):
        bn //= 2
    return Config(split, bn, _decode_warps(mb, bn, max(ep, evp)), 2)


def decode_candidates(call: L.Extern, buffers, hints: dict[str, int]) -> list[Config]:
    """The heuristic first, then splits in {1, half, the heuristic's, twice, the scratch's
    most} x RBLOCK in {32 .. 256} (at most the keys' power of two, MB x RBLOCK within twice
    DECODE_SCORES), kept where shared memory fits."""
    base = decode_config(call, buffers, hints)
    e, ev = head_dims(call)
    _, _, mb = _decode_rows(call)
    most = int(call.attr("splits", 1))
    s = max(1, evaluate(call.args[1].shape[2], hints))
    splits = sorted({x for x in (1, base.xblock // 2, base.xblock, base.xblock * 2, most)
                     if 1 <= x <= most})
    bns = sorted({min(b, pow2(s)) for b in (32, 64, 128, 256)
                  if mb * b <= 2 * DECODE_SCORES})
    out = [base]
    for sp in splits:
        for bn in bns:
            c = Config(sp, bn, _decode_warps(mb, bn, max(pow2(e), pow2(ev))), 2)
            if c not in out and _decode_fits(call, buffers, c):
                out.append(c)
    return out


#: the splits of a live key range start at multiples of this many keys
DECODE_SPAN_ALIGN = 16
#: the mask row is read in chunks of at most this many keys (one chunk up to 8192 keys)
DECODE_SCAN = 8192


def _live_range(call: L.Extern) -> bool:
    """Whether the decode kernel splits the mask's live key range rather than the cache: a
    bool or float mask, one query row (L = 1) and one mask row for the group's heads (G = 1,
    or the mask broadcast over heads). `KILN_DECODE_SPLIT` with a fourth field 0 turns it
    off (A/B runs)."""
    env = os.environ.get("KILN_DECODE_SPLIT", "")
    if env == "legacy" or env.count(",") >= 3 and env.split(",")[3] == "0":
        return False
    if len(call.args) < 4 or int(canon(call.args[0].shape[2])) != 1:
        return False
    return int(call.attr("group", 1)) == 1 or canon(call.args[3].strides[1]) == 0


def _scan_width(call: L.Extern, hints: dict[str, int]) -> int:
    s = max(1, evaluate(call.args[1].shape[2], hints))
    return min(DECODE_SCAN, pow2(s))


def _term(var: str, stride) -> list[str]:
    st = canon(stride)
    return [] if st == 0 else [var] if st == 1 else [f"{var} * {to_tl(st)}"]


def _signature(call: L.Extern, buffers, exprs, bufs: list[tuple[str, str]]):
    syms = sorted({str(x) for e in exprs for x in sympy.sympify(e).free_symbols})
    params = (*bufs, *(("size", x) for x in syms))
    sig = {f"buf_{b}": SIG_PTR[buffers[b].dtype] for _, b in bufs}
    sig.update({x: "i64" for x in syms})
    sig["XBLOCK"] = sig["RBLOCK"] = "constexpr"
    return params, sig


def _scratch(call: L.Extern) -> str | None:
    return call.outs[1] if len(call.outs) > 1 else None


def print_decode_kernel(call: L.Extern, buffers, hints: dict[str, int],
                        config: Config, fused: PutKernel | None = None,
                        counter: int | None = None) -> TritonKernel:
    """The decode path's attention kernel (see the comment above); with `fused` (a
    `PutKernel` whose attention is `call`: `fuse_decode_puts`), also that step's kernel
    members where the attention reads them and its cache writes."""
    t = to_tl
    members = {m.name: m for m in fused.kernel.members} \
        if fused is not None and fused.kernel is not None else {}
    counter_ = [0]
    q, k, v, mask, kind, causal, scale, name, out, dt = operands(call, buffers)
    e, ev = head_dims(call)
    ep, evp = pow2(e), pow2(ev)
    g, lq, mb = _decode_rows(call)
    B, H, S = q.shape[0], q.shape[1], k.shape[2]
    split = config.xblock
    part = _scratch(call) if split > 1 else None
    if split > 1 and (part is None or split > int(call.attr("splits", 1))):
        raise CompileError(f"{name}: a launch config of {split} key splits (XBLOCK), but the "
                           f"call's scratch {part or '(none)'} holds {call.attr('splits', 1)}")
    bufs = [("out", call.name)] + ([("out", part)] if part else [])
    if fused is not None:
        bufs += [("out", p.name) for p in fused.puts]
    for a in call.args:
        if a.buf not in [b for _, b in bufs] and a.buf not in members:
            bufs.append(("in", a.buf))
    exprs = [B, H, S] + [x for a in call.args for x in (a.offset, *a.strides)]
    if fused is not None:
        used = [members[b] for b in [call.args[0].buf, *(a.buf for a in call.args[3:]),
                                     *(p.args[1].buf for p in fused.puts)] if b in members]
        extra = [ld.buf for m in used for ld in L.loads(m.body)]
        extra += [a.buf for p in fused.puts for a in p.args[1:] if a.buf not in members]
        for b in extra:
            if b not in [x for _, x in bufs]:
                bufs.append(("in", b))
        exprs += [x for p in fused.puts for a in p.args for x in (a.offset, *a.strides)]
    params, sig = _signature(call, buffers, exprs, bufs)
    if fused is not None:  # the cache writes' index checks
        params = (*params, ("status", "kiln_status"))
        sig = {k: v for k, v in sig.items() if k not in ("XBLOCK", "RBLOCK")}
        sig.update({"kiln_status": "*i32", "XBLOCK": "constexpr", "RBLOCK": "constexpr"})
    prec = f', input_precision="{DOT_PRECISION[dt]}"' if dt in DOT_PRECISION else ""
    S_, H_ = t(canon(S)), t(canon(H))
    hkv = H_ if g == 1 else f"({H_} // {g})"

    def ptr(a: L.LibArg, *idx: tuple[str, object]) -> str:
        off = [] if canon(a.offset) == 0 else [t(canon(a.offset))]
        terms = [x for var, st in (("b", a.strides[0]), *idx) for x in _term(var, st)]
        return " + ".join([f"buf_{a.buf}", *off, *terms])

    qs, ks, vs = q.strides, k.strides, v.strides
    dmask = f" & (d[None, :] < {e})" if ep != e else ""
    kmask = f" & (d[:, None] < {e})" if ep != e else ""
    vmask = f" & (dv[None, :] < {ev})" if evp != ev else ""
    hk_k = "hk" if g > 1 else "h_kv"
    q_ptr = ptr(q, ("h[:, None]", qs[1]), ("lq[:, None]", qs[2]), ("d[None, :]", qs[3]))
    lines = [
        "@triton.jit",
        f"def {name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}, "
        "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {name}: attention, decode path (GQA packed, split over the keys) -> "
        f"{call.name}",
        f"    #   from graph nodes: {', '.join(call.source)}",
        f"    #   {dt}, head dims {e} / {ev} (padded to {ep} / {evp}), "
        f"{'causal' if causal else 'not causal'}, "
        f"mask {['none', 'bool (keep where true)', 'float (added)'][kind]}, scale {scale!r}",
        f"    #   one program: the {g} x {lq} query rows (padded to {mb}) of one kv head and "
        "one of XBLOCK key splits, keys in RBLOCK-wide tiles",
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        "    split = pid % XBLOCK",
        "    bhk = pid // XBLOCK",
        f"    b = bhk // {hkv}",
        f"    {hk_k} = bhk % {hkv}",
        f"    r = tl.arange(0, {mb})",
        f"    row_ok = r < {g * lq}",
        f"    h = {hk_k} * {g} + r" + (f" // {lq}" if lq > 1 else "") if g > 1 else
        f"    h = {hk_k} + r * 0",
        f"    lq = r % {lq}" if lq > 1 else "    lq = r * 0",
        f"    d = tl.arange(0, {ep})",
        f"    dv = tl.arange(0, {evp})",
    ]
    if q.buf in members:  # the absorbed kernel's member, computed here (not stored)
        m = members[q.buf]
        lines.append(f"    # q: {m.name} <- {', '.join(m.source)}, computed here")
        lines.append(f"    qmask = row_ok[:, None]{dmask}")
        more, val = _member_value(m, buffers, _flat(q, ("b", qs[0]), ("h[:, None]", qs[1]),
                                                    ("lq[:, None]", qs[2]), ("d[None, :]", qs[3])),
                                  "qmask", counter_, "q_", "    ")
        lines += more
        lines.append(f"    q = tl.where(qmask, {val}, 0.0).to({TL_DTYPE[buffers[q.buf].dtype]})")
    else:
        lines.append(f"    q = tl.load({q_ptr}, mask=row_ok[:, None]{dmask}, other=0.0)")
    lines += [
        f"    k_ptr = {ptr(k, (hk_k, ks[1]))}",
        f"    v_ptr = {ptr(v, (hk_k, vs[1]))}",
    ]
    new_rows = {}  # "k" / "v" -> the put writing that cache
    if fused is not None:
        for p in fused.puts:
            role = "k" if p.name == k.buf else "v"
            new_rows[role] = p
            lines += _new_row_lines(p, role, "d" if role == "k" else "dv", e if role == "k"
                                    else ev, hk_k, buffers, members, counter_)
    if mask is not None and mask.buf not in members:
        ms = mask.strides
        lines.append(f"    m_ptr = {ptr(mask, ('h[:, None]', ms[1]), ('lq[:, None]', ms[2]))}")
    lines += [
        f"    m_i = tl.full([{mb}], float(\"-inf\"), tl.float32)",
        f"    l_i = tl.zeros([{mb}], tl.float32)",
        f"    acc = tl.zeros([{mb}, {evp}], tl.float32)",
        "    # base-2 softmax: scores scaled by scale * log2(e), exp2 instead of exp",
        f"    qk_scale = {scale * LOG2E!r}",
    ]
    if _live_range(call):
        # one mask row serves every query row of the program (L = 1, the mask broadcast over
        # the group's heads): the keys it keeps span [lo_live, hi_live), found by one read of
        # the row, and the splits share that range, not the whole cache: a step over a
        # static cache spreads its filled part over every program
        sc = _scan_width(call, hints)
        ms = mask.strides
        alive = "(mr != 0)" if kind == 1 else "(mr.to(tl.float32) > float(\"-inf\"))"
        lines += [
            f"    lo_live = {S_}",
            "    hi_live = 0",
            f"    for ci in range(0, ({S_} + {sc - 1}) // {sc}):",
            f"        pc = ci * {sc} + tl.arange(0, {sc})",
        ]
        if mask.buf in members:
            m = members[mask.buf]
            lines += [f"        # the mask row: {m.name} <- {', '.join(m.source)}, computed here",
                      f"        pc_ok = pc < {S_}"]
            more, val = _member_value(m, buffers, _flat(mask, ("b", ms[0]), (hk_k, ms[1]),
                                                        ("pc", ms[3])),
                                      "pc_ok", counter_, "mr_", "        ")
            lines += more + [f"        mr = tl.where(pc_ok, {val}, 0)"]
        else:
            row = " + ".join(["m_row", *(_term("pc", ms[3]) or ["pc * 0"])])
            lines += [
                f"        m_row = {ptr(mask, (hk_k, ms[1]))}",
                f"        mr = tl.load({row}, mask=pc < {S_}, other=0)",
            ]
        lines += [
            f"        alive = {alive} & (pc < {S_})",
            f"        lo_live = tl.minimum(lo_live, tl.min(tl.where(alive, pc, {S_})))",
            "        hi_live = tl.maximum(hi_live, tl.max(tl.where(alive, pc + 1, 0)))",
            "    span = (tl.maximum(hi_live - lo_live, 0) + XBLOCK - 1) // XBLOCK",
            f"    span = (span + {DECODE_SPAN_ALIGN - 1}) // {DECODE_SPAN_ALIGN} * "
            f"{DECODE_SPAN_ALIGN}",
            "    lo = lo_live + split * span",
            "    hi = tl.minimum(hi_live, lo + span)",
        ]
    else:
        lines += [
            f"    span = ({S_} + XBLOCK - 1) // XBLOCK",
            "    span = (span + RBLOCK - 1) // RBLOCK * RBLOCK",
            "    lo = split * span",
            f"    hi = tl.minimum({S_}, lo + span)",
        ]
    if causal:
        lines.append(f"    hi = tl.minimum(hi, {lq})  # causal (top-left): key j <= query i")
    lines += [
        "    for start in range(lo, hi, RBLOCK):",
        "        cols = start + tl.arange(0, RBLOCK)",
        "        col_ok = cols < hi",
        "        keep = row_ok[:, None] & col_ok[None, :]",
    ]
    if causal:
        lines.append("        keep = keep & (cols[None, :] <= lq[:, None])")
    ind = "        "
    if mask is not None and mask.buf in members:
        m, ms = members[mask.buf], mask.strides
        more, val = _member_value(m, buffers, _flat(mask, ("b", ms[0]), ("h[:, None]", ms[1]),
                                                    ("lq[:, None]", ms[2]),
                                                    ("cols[None, :]", ms[3])),
                                  "keep", counter_, "mt_", "        ")
        lines += more + [f"        mt = tl.where(keep, {val}, 0)"]
    elif mask is not None:
        lines.append(f"        mt = tl.load({_tile_cols('m_ptr', mask.strides[3])}, mask=keep, "
                     "other=0)")
        if kind == 1:
            lines.append("        keep = keep & (mt != 0)")
        else:  # added to the scores as on the other path (a NaN score stays NaN)
            lines += ["        mf = mt.to(tl.float32)",
                      f"        madd = {finite_log2('mf')}",
                      "        live = keep & (madd > float(\"-inf\"))"]
    cols_read = "col_ok"
    if mask is not None or causal:
        live = "live" if kind == 2 else "keep"
        lines += [
            "        # the keys some row keeps: only their keys and values are read (a static",
            "        # cache's filled part; a tile no row keeps is skipped, its p would be 0)",
            f"        col_live = tl.max({live}.to(tl.int32), 0) > 0",
            "        if tl.max(col_live.to(tl.int32)) > 0:",
        ]
        ind = "            "
        cols_read = "col_live"
    body = [
        f"kt = tl.load(k_ptr + {_cols_expr('cols[None, :]', ks[2], 'd[:, None]', ks[3])}, "
        f"mask={cols_read}[None, :]{kmask}, other=0.0)",
        f"vt = tl.load(v_ptr + {_cols_expr('cols[:, None]', vs[2], 'dv[None, :]', vs[3])}, "
        f"mask={cols_read}[:, None]{vmask}, other=0.0)",
    ]
    if "k" in new_rows:  # the new token's key / value: this call's, not the cache's old row
        body.append("kt = tl.where(cols[None, :] == pos_k, k_new[:, None], kt)")
    if "v" in new_rows:
        body.append("vt = tl.where(cols[:, None] == pos_v, v_new[None, :], vt)")
    body += [
        f"s = tl.dot(q, kt{prec}) * qk_scale",
    ]
    if mask is not None and kind == 2:
        body.append("s = s + madd")
    body += [
        "s = tl.where(keep, s, float(\"-inf\"))",
        "m_new = tl.maximum(m_i, tl.max(s, 1))",
        "m_use = tl.where(m_new == float(\"-inf\"), 0.0, m_new)  # all masked so far",
        "p = tl.exp2(s - m_use[:, None])",
        "alpha = tl.exp2(m_i - m_use)",
        "l_i = l_i * alpha + tl.sum(p, 1)",
        f"acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None]{prec})",
        "m_i = m_new",
    ]
    lines += [ind + x for x in body]
    orow = f"bhk * {g * lq} + r"
    if part is None:
        lines += [
            "    # rows whose keys were all masked: zeros (l_i == 0), as eager gives",
            "    o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)",
            f"    tl.store(buf_{call.name} + ({orow})[:, None] * {ev} + dv[None, :], "
            f"o.to({TL_DTYPE[out.dtype]}), mask=row_ok[:, None]{vmask})",
        ]
    else:
        most = int(call.attr("splits"))
        lines += [
            f"    # this split's partial state -> {part}[row, split, :]: m, l, acc "
            + ("(the last split to arrive merges them)" if counter is not None else
               f"(attn_{call.name}_combine merges the splits)"),
            f"    p_ptr = buf_{part} + (({orow}) * {most} + split) * {ev + 2}",
            "    tl.store(p_ptr, m_i, mask=row_ok)",
            "    tl.store(p_ptr + 1, l_i, mask=row_ok)",
            f"    tl.store(p_ptr[:, None] + 2 + dv[None, :], acc, mask=row_ok[:, None]{vmask})",
        ]
        if counter is not None:  # the last split of the kv head to arrive merges them
            cnt = f"kiln_status + {counter} + bhk"
            ptr_r = f"buf_{part} + ({orow}) * {most * (ev + 2)}"
            lines += [
                "    # the splits' arrival counter (a word of the status buffer, zero at load):",
                "    # the last split of this kv head to arrive merges the partial states, as",
                f"    # attn_{call.name}_combine did, and zeroes the counter for the next call",
                "    tl.debug_barrier()  # every thread's partial state stored",
                f"    arrived = tl.atomic_add({cnt}, 1, sem=\"acq_rel\", scope=\"gpu\")",
                "    if arrived == XBLOCK - 1:",
                f"        tl.store({cnt}, 0)",
                f"        sp = tl.arange(0, {pow2(split, 1)})",
                "        sp_ok = row_ok[:, None] & (sp[None, :] < XBLOCK)",
                f"        c_ptr = {ptr_r}",
                f"        mm = tl.load(c_ptr[:, None] + sp[None, :] * {ev + 2}, mask=sp_ok, "
                "other=float(\"-inf\"), cache_modifier=\".cg\")",
                f"        ll = tl.load(c_ptr[:, None] + sp[None, :] * {ev + 2} + 1, mask=sp_ok, "
                "other=0.0, cache_modifier=\".cg\")",
                "        top = tl.max(mm, 1)",
                "        top = tl.where(top == float(\"-inf\"), 0.0, top)  # no split kept a key",
                "        w = tl.exp2(mm - top[:, None])",
                "        total = tl.sum(w * ll, 1)",
                f"        o = tl.zeros([{mb}, {evp}], tl.float32)",
                "        for j in tl.static_range(XBLOCK):",
                "            wj = tl.sum(tl.where(sp[None, :] == j, w, 0.0), 1)",
                f"            aj = tl.load(c_ptr[:, None] + j * {ev + 2} + 2 + dv[None, :], "
                f"mask=row_ok[:, None]{vmask}, other=0.0, cache_modifier=\".cg\")",
                "            o += wj[:, None] * aj",
                "        # rows whose keys were all masked: zeros (total == 0), as eager gives",
                "        o = tl.where(total[:, None] > 0, o / tl.where(total > 0, total, 1.0)"
                "[:, None], 0.0)",
                f"        tl.store(buf_{call.name} + ({orow})[:, None] * {ev} + dv[None, :], "
                f"o.to({TL_DTYPE[out.dtype]}), mask=row_ok[:, None]{vmask})",
            ]
    src = "\n".join(lines) + "\n"
    heads = canon(H) if g == 1 else sympy.Integer(int(canon(H)) // g) if canon(H).is_Integer else \
        FloorDiv(canon(H), g)
    rows = sympy.expand(canon(B) * heads * split * split)  # programs x XBLOCK
    return TritonKernel(name, src, params, sig, config, rows, call.source)


def _tile_cols(p: str, stride) -> str:
    return " + ".join([p, *(_term("cols[None, :]", stride) or ["cols[None, :] * 0"])])


def _cols_expr(cvar: str, cstride, dvar: str, dstride) -> str:
    parts = []
    for var, st in ((cvar, cstride), (dvar, dstride)):
        parts += _term(var, st) or [f"{var} * 0"]
    return " + ".join(parts)


def print_decode_combine(call: L.Extern, buffers, config: Config) -> TritonKernel:
    """`attn_<call>_combine`: one program per output row merges the XBLOCK splits' partial
    states of `print_decode_kernel` (see the comment above)."""
    part = _scratch(call)
    split, most = config.xblock, int(call.attr("splits", 1))
    ev = head_dims(call)[1]
    evp, sp2 = pow2(ev), pow2(split, 1)
    out = buffers[call.name]
    name = f"attn_{call.name}_combine"
    B, H, Lq = (call.args[0].shape[i] for i in range(3))
    params, sig = _signature(call, buffers, [B, H, Lq], [("out", call.name), ("in", part)])
    vmask = f" & (dv[None, :] < {ev})" if evp != ev else ""
    lines = [
        "@triton.jit",
        f"def {name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}, "
        "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {name}: the {split} key splits of attn_{call.name} merged -> {call.name}",
        f"    #   from graph nodes: {', '.join(call.source)}",
        "    row = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        f"    sp = tl.arange(0, {sp2})",
        f"    sp_ok = sp < {split}",
        f"    dv = tl.arange(0, {evp})",
        f"    p_ptr = buf_{part} + (row * {most} + sp) * {ev + 2}",
        "    m = tl.load(p_ptr, mask=sp_ok, other=float(\"-inf\"))",
        "    l = tl.load(p_ptr + 1, mask=sp_ok, other=0.0)",
        "    top = tl.max(m, 0)",
        "    top = tl.where(top == float(\"-inf\"), 0.0, top)  # no split kept a key",
        "    w = tl.exp2(m - top)",
        "    total = tl.sum(w * l, 0)",
        f"    acc = tl.load(p_ptr[:, None] + 2 + dv[None, :], mask=sp_ok[:, None]{vmask}, "
        "other=0.0)",
        "    o = tl.sum(w[:, None] * acc, 0)",
        "    # rows whose keys were all masked: zeros (total == 0), as eager gives",
        "    o = tl.where(total > 0, o / tl.where(total > 0, total, 1.0), 0.0)",
        f"    tl.store(buf_{call.name} + row * {ev} + dv, o.to({TL_DTYPE[out.dtype]})"
        + (f", mask=dv < {ev})" if evp != ev else ")"),
    ]
    rows = sympy.expand(canon(B * H * Lq))
    return TritonKernel(name, "\n".join(lines) + "\n", params, sig,
                        Config(1, sp2, 4 if split * evp > 4096 else 1, 0), rows, call.source)


# -- KV-cache writes in the decode attention's launch (issue 17.3, fifteenth session) --------
# A decode step writes each layer's new key and value rows into the static caches (two `put`
# calls, index_copy_ at the cache position) right after the one-row kernel that computes the
# rotary queries and keys (and the mask): schedule/puts.py made those one launch of one
# program (`PutKernel`, 3.3-3.7 us a layer on an H100: load -> store -> barrier -> load ->
# store, then the attention's launch). `fuse_decode_puts` folds that whole step into the
# attention call after it when the attention reads the puts' outputs as its keys and values:
#   - the kernel's members are computed where the attention reads them (the query tile, the
#     mask row of the live-range scan and of each key tile, the new key row), never stored;
#   - each program computes the new key and value rows of its kv head (E elements each) and
#     uses them in place of the cache's row at the written position (`tl.where` over the
#     tile: the other programs of the head may not have written it yet); the programs of
#     split 0 store them into the caches (in place, as the puts did);
#   - a position outside the cache stores nothing and sets the run's index status, as the
#     put did.
# Conditions (else the steps stay as they were): the attention is on the decode path with one
# query row (L = 1), static sizes; the step's puts are exactly the two writes whose outputs
# are the attention's key and value operands (whole, contiguous), each writing one position
# (an index tensor of one element) along dim 2 of a [B, Hkv, S, E] cache from values
# [B, Hkv, 1, E]; every member of the step's kernel is pointwise, loads only buffers outside
# the kernel (no indirect loads) and is read by the attention (its query or mask) or a put
# (its values) and nothing else (no later step, no program output). `KILN_DECODE_FUSED_PUTS=0`
# at compile time keeps the old steps (A/B runs).


def _flat(a: L.LibArg, *idx: tuple[str, object]) -> str:
    """Triton text of `a`'s element offset at index variables `idx` ((var, stride) pairs)."""
    off = [] if canon(a.offset) == 0 else [to_tl(canon(a.offset))]
    return " + ".join([*off, *(x for var, st in idx for x in _term(var, st))]) or "0"


def _member_value(m: L.Compute, buffers, flat: str, mask: str, counter: list[int],
                  prefix: str, indent: str) -> tuple[list[str], str]:
    """(lines, value): pointwise member `m` evaluated at the flat positions `flat` (a block)
    of its (contiguous) buffer, its loads masked by `mask`; the value as its buffer holds it."""
    z = f"{prefix}z"
    lines = [f"{indent}{prefix}f = {flat}", f"{indent}{z} = {prefix}f * 0"]
    names: dict[str, str] = {}
    for d, ex in enumerate(unravel(sympy.Symbol("FLAT"), m.shape)):
        if sympy.sympify(m.shape[d]) == 1:
            names[f"i{d}"] = "0"
            continue
        names[f"i{d}"] = f"{prefix}i{d}"
        lines.append(f"{indent}{prefix}i{d} = {to_tl(ex, {'FLAT': f'{prefix}f'})}")
    sc = _Scope(names, mask, {}, counter)
    v = text(sc.value(m.body))
    lines += [re.sub(r"\bxidx\b", z, x) for x in render(sc.lines, indent)]
    v = re.sub(r"\bxidx\b", z, v)
    dt = buffers[m.name].dtype
    if dt.name in COMPUTE:
        v = f"{v}.to({TL_DTYPE[dt]})"
    return lines, v


def _new_row_lines(p: L.Extern, role: str, dvar: str, width: int, hk: str, buffers,
                   members: dict, counter: list[int]) -> list[str]:
    """The new `role` row (k_new / v_new, [width padded] of the cache's dtype) of kv head
    `hk`, its position pos_<role> (-1 when outside the cache), and its store into the cache
    by the programs of split 0."""
    vals, idx = p.args[1], p.args[2]
    out = buffers[p.name]
    st = contiguous_strides(out.shape)
    size = to_tl(canon(out.shape[2]))
    pos, bad, new = f"pos_{role}", f"bad_{role}", f"{role}_new"
    vs, dims = vals.strides, tuple(p.attr("dims"))  # self dim -> iteration dim
    lines = [f"    # {p.name} = index_put({', '.join(a.buf for a in p.args)}) <- "
             f"{', '.join(p.source)}: the new {'key' if role == 'k' else 'value'} row, "
             "written by split 0, used by every split",
             f"    {pos} = tl.load(buf_{idx.buf} + {_flat(idx)}).to(tl.int64)"]
    if p.attr("wrap"):
        lines.append(f"    {pos} = tl.where({pos} < 0, {pos} + {size}, {pos})")
    lines.append(f"    {bad} = ({pos} < 0) | ({pos} >= {size})")
    flat = _flat(vals, ("b", vs[dims[0]]), (hk, vs[dims[1]]), (dvar, vs[dims[3]]))
    dm = f"{dvar} < {width}"
    if vals.buf in members:
        m = members[vals.buf]
        lines.append(f"    {role}_ok = {dm}")
        more, val = _member_value(m, buffers, flat, f"{role}_ok", counter, f"{role}n_", "    ")
        lines += more
    else:
        val = f"tl.load(buf_{vals.buf} + {flat}, mask={dm}, other=0.0)"
    dst = " + ".join([f"buf_{p.name}", *_term("b", st[0]), *_term(hk, st[1]),
                      *_term(pos, st[2]), *_term(dvar, st[3])])
    lines += [
        f"    {new} = tl.where({dm}, {val}, 0.0).to({TL_DTYPE[out.dtype]})",
        f"    tl.store({dst}, {new}, mask=({dm}) & (split == 0) & ~{bad})",
        f"    tl.store(kiln_status + {dvar}.to(tl.int32) * 0, 1, mask=({dvar} == 0) & {bad})",
        f"    {pos} = tl.where({bad}, -1, {pos})",
    ]
    return lines


def _static(*exprs) -> bool:
    return all(canon(e).is_Integer for e in exprs)


def _step_reads(s) -> set[str]:
    if isinstance(s, Kernel):
        return {ld.buf for m in s.members for ld in L.loads(m.body)}
    if isinstance(s, (GemmKernel, CutlassGemm, PutKernel)):
        return set(s.reads())
    if isinstance(s, L.CONTROL):
        return set(s.reads)
    return set(L.node_reads(s))


def _whole(a: L.LibArg, buf: L.Buffer) -> bool:
    """`a` is the whole of `buf`, contiguous, in its shape."""
    return (canon(a.offset) == 0 and len(a.shape) == len(buf.shape) and
            all(canon(x - y) == 0 for x, y in zip(a.shape, buf.shape)) and
            all(canon(x - y) == 0 for x, y in zip(a.strides, contiguous_strides(buf.shape))))


def absorbs(s: PutKernel, a, later: list, buffers, outputs) -> bool:
    """Whether decode attention `a`, the step after `s`, can take over `s` (the conditions
    above)."""
    if not (isinstance(s, PutKernel) and s.attention is None and isinstance(a, L.Extern)
            and a.routine == "attention" and is_decode(a) and int(canon(a.args[0].shape[2])) == 1):
        return False
    q, k, v = a.args[:3]
    if not _static(*q.shape, *k.shape, *v.shape) or len(s.puts) != 2 or \
            {p.name for p in s.puts} != {k.buf, v.buf} or k.buf == v.buf:
        return False
    for p, op in ((next(p for p in s.puts if p.name == k.buf), k),
                  (next(p for p in s.puts if p.name == v.buf), v)):
        out = buffers[p.name]
        dims = tuple(p.attr("dims"))
        if len(p.args) != 3 or len(dims) != 4 or dims[2] != -1 or \
                min(dims[0], dims[1], dims[3]) < 0 or \
                not _whole(op, out) or not _static(*out.shape, *p.args[1].shape):
            return False
        vals, idx = p.args[1], p.args[2]
        want = [1] * len(vals.shape)
        for d in (0, 1, 3):
            want[dims[d]] = int(canon(out.shape[d]))
        if [int(canon(x)) for x in vals.shape] != want:
            return False
        if any(canon(st) != 0 and canon(n) != 1 for st, n in zip(idx.strides, idx.shape)):
            return False  # one position for every row
        if buffers[idx.buf].dtype.is_float or not _static(idx.offset, vals.offset,
                                                           *vals.strides):
            return False
    if any(free_size_symbols(canon(x)) for x in (*a.args[0].strides, *k.strides)):
        return False
    members = {m.name: m for m in s.kernel.members} if s.kernel is not None else {}
    used = {a.args[0].buf, *(x.buf for x in a.args[3:]), *(p.args[1].buf for p in s.puts)}
    if any(p.args[2].buf in members or p.args[0].buf in members for p in s.puts):
        return False
    if s.kernel is not None and (s.kernel.locals or s.kernel.row_locals):
        return False
    for m in members.values():
        if m.reduce is not None or m.name not in used or m.name in outputs:
            return False
        if any(ld.buf in members or ld.indirect for ld in L.loads(m.body)):
            return False
        if int(canon(product(buffers[m.name].shape))) != int(canon(product(m.shape))):
            return False
    read_later = set().union(set(), *(_step_reads(x) for x in later))
    return not (set(members) & read_later)


def fuse_decode_puts(steps: tuple, buffers, hints: dict[str, int],
                     outputs=frozenset()) -> tuple:
    """Each `PutKernel` that the decode attention after it absorbs (`absorbs`) becomes that
    attention's launch (PutKernel.attention, with its heuristic config); the attention step
    goes. Top-level steps only; pure."""
    if os.environ.get("KILN_DECODE_FUSED_PUTS", "1") == "0":
        return steps
    out = list(steps)
    used = 0  # arrival counters handed out
    for i in range(len(out) - 1):
        s, a = out[i], out[i + 1]
        if s is None or a is None or not absorbs(s, a, [x for x in out[i + 2:] if x is not None],
                                                 buffers, outputs):
            continue
        cfg = decode_config(a, buffers, hints)
        slots = int(canon(a.args[0].shape[0])) * int(canon(a.args[0].shape[1])) // \
            int(a.attr("group", 1))
        base = None
        if cfg.xblock > 1 and os.environ.get("KILN_DECODE_COMBINE", "launch") == "last" and \
                used + slots <= STATUS_COUNTERS:
            base, used = STATUS_COUNTER_BASE + used, used + slots
        out[i] = PutKernel(s.kernel, s.puts, a, FusedLaunch(cfg, base))
        out[i + 1] = None
    return tuple(x for x in out if x is not None)


@dataclass(frozen=True)
class FusedLaunch:
    """The launch of a decode attention that absorbed a `PutKernel`: its config and, when
    split with `KILN_DECODE_COMBINE=last` at compile time, where its arrival counters start
    in the status buffer (one a kv head and batch row: the last split to arrive merges the
    partial states in the same launch); else None (split: `attn_<call>_combine` is launched
    after it, as on the unfused path). The combine launch is the default: on the H100 (2
    layers of the 8B widths, cache 256 at position 128, fifteenth session) the in-kernel
    merge made the attention kernel 1.55 us longer (its fence, atomic and the merge's L2
    loads after the last split's own work), the combine kernel costs 1.3 us: the step's
    device time was 666 us against 665."""

    config: Config
    counter: int | None = None

    @property
    def xblock(self) -> int:
        return self.config.xblock

    @property
    def separate_combine(self) -> bool:
        return self.config.xblock > 1 and self.counter is None


def fused_puts_attention_kernels(step: PutKernel, buffers, hints: dict[str, int]
                                 ) -> list[TritonKernel]:
    """The kernels of a `PutKernel` with an attention: the decode kernel (the step's name),
    then its combine when split (the step's `launches`)."""
    call, launch = step.attention, step.config
    cfg = launch.config
    main = print_decode_kernel(call, buffers, hints, cfg, fused=step, counter=launch.counter)
    return [main] + ([print_decode_combine(call, buffers, cfg)] if launch.separate_combine
                     else [])
