"""`conv2d_nhwc` Extern steps (lowering/conv_nhwc.py, passes/conv_nhwc.py) -> Triton kernels for
CUDA builds: an implicit-GEMM convolution (dense and grouped) and a direct depthwise
convolution, both channels-last, with the fused epilogue act(acc * scale + shift
[+ residual]) in their store (scale: batch norm's, 1 without one; shift: bias and batch norm).

Input: the Extern (args x [N, H, W, C], packed weight, float32 [scale; shift] [2 * OC],
optional residual [N, OH, OW, OC], as strided operands; attrs kh, kw, sh, sw, ph, pw, dh,
dw, groups, depthwise, act, lo, hi, split), the Loop IR buffers, size hints and a `Config`.
Output: a `TritonKernel` named `conv_<output buffer>` that the CUDA wrapper launches like the
attention kernel (a 1-D grid of ceil(rows / XBLOCK) programs; XBLOCK and RBLOCK are its constexprs).

Implicit GEMM (dense / grouped): out[m, g * OCg + n] = sum_k A[m, k] * B[g][k, n] with
m = (n_, oh, ow) an output pixel, k = (kh, kw, c) and A[m, k] = x[n_, oh * sh - ph + kh * dh,
ow * sw - pw + kw * dw, g * Cg + c] (0 outside the image): the im2col matrix is never stored;
its tiles are gathered as the K loop loads them. XBLOCK = BLOCK_M output pixels, RBLOCK =
BLOCK_N output channels per program (grouped order over the M tiles, for L2 reuse of the
input), BLOCK_K printed into the source. Two K loops:
  "taps"  (Cg a multiple of 16): one loop over KH * KW * ceil(Cg / BLOCK_K) steps, each a
          kernel tap and a run of BLOCK_K contiguous channels (the pixel's bounds test is
          per row, the channels are contiguous: coalesced loads); one flat loop, so Triton
          pipelines it whatever Cg is;
  "flat"  (other Cg, e.g. a stem's 3 channels): K = KH * KW * Cg in BLOCK_K steps, each
          element's (tap, channel) unravelled (no padding of Cg up to BLOCK_K).
The packed weight is [G, KH * KW * Cg, OCg] (output channels contiguous).

Depthwise (groups == C == OC): a direct kernel, no GEMM: XBLOCK output pixels x RBLOCK
channels per program, a float32 accumulator, the KH x KW taps unrolled, each a load of
RBLOCK contiguous channels per pixel times the tap's weights [KH, KW, C].

Precision: float32 accumulation; 16-bit operands on tensor cores; float32 operands as 3xTF32
products (float32-level error, kiln's attention kernel does the same); the epilogue in float32,
rounded once at the store (eager rounds after the convolution, the bias, the batch norm and
the residual add: kiln's result is at least as close to a float64 reference)."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import FloorDiv, evaluate
from kiln.targets.cuda.kernel import Config, TritonKernel
from kiln.targets.cuda.ops import SIG_PTR, TL_DTYPE, canon, to_tl

ROUTINE = "conv2d_nhwc"
DOT_PRECISION = {"float32": "tf32x3"}
SMS = 132  # H100 SXM; only the heuristic's tile count target
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): largest first
DENSE_SPACE = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
               (64, 64, 64, 4, 4), (64, 32, 64, 4, 4), (32, 64, 64, 4, 4),
               (32, 32, 64, 4, 4), (16, 32, 128, 4, 4), (16, 64, 64, 4, 4)]
DW_SPACE = [(32, 64, 0, 4, 1), (16, 64, 0, 4, 1), (64, 64, 0, 4, 1), (32, 128, 0, 4, 1),
            (16, 128, 0, 4, 1), (8, 128, 0, 4, 1), (64, 32, 0, 4, 1)]
GROUP_M = 8


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def geometry(call: L.Extern) -> dict:
    """Sizes of the call: batch, image, output image (expressions), channels, kernel."""
    x, w = call.args[0], call.args[1]
    a = dict(call.attrs)
    n, h, wd, c = x.shape
    out = call.args[3].shape if len(call.args) > 3 else None
    g = a["groups"]
    oc = int(w.shape[2]) if a["depthwise"] else int(w.shape[0]) * int(w.shape[2])
    return {"n": n, "h": h, "w": wd, "c": int(c), "g": g, "oc": oc, "cg": int(c) // g,
            "ocg": oc // g, "kh": a["kh"], "kw": a["kw"], "res": out}


def _out_hw(call: L.Extern, buffers) -> tuple[sympy.Expr, sympy.Expr]:
    shape = buffers[call.name].shape  # [N, OH, OW, OC], split-K: [S, N, OH, OW, OC]
    return shape[-3], shape[-2]


def _split(call: L.Extern) -> int:
    return int(dict(call.attrs).get("split", 1))


def _taps(gm: dict) -> bool:
    return gm["cg"] % 16 == 0


def choose_conv_config(call: L.Extern, buffers, hints: dict[str, int]) -> Config:
    """Dense: the largest tile of `DENSE_SPACE` that gives at least one program per SM at the
    example sizes (else the one with the most programs): small images at batch 1 need small
    tiles to fill the GPU. BLOCK_N at most the padded channels of a group, BLOCK_K 32 for
    float32 (twice the bytes per element). Depthwise: 32 pixels x 64 channels."""
    return conv_candidates(call, buffers, hints)[0]


def _m(call: L.Extern, buffers, hints) -> int:
    oh, ow = _out_hw(call, buffers)
    try:
        return max(1, evaluate(canon(buffers[call.name].shape[-4] * oh * ow), hints))
    except Exception:  # noqa: BLE001 - no hints (a printer called without sizes)
        return 4096


def _block_k(cfg, call, buffers) -> int:
    """BLOCK_K of a dense config: its own, 32 for float32 operands, at most the padded K."""
    gm = geometry(call)
    bk = cfg[2]
    if buffers[call.args[0].buf].dtype.itemsize == 4:
        bk = min(bk, 32)
    k = gm["cg"] if _taps(gm) else gm["cg"] * gm["kh"] * gm["kw"]
    return max(16, min(bk, _pow2(k)))


def conv_candidates(call: L.Extern, buffers, hints: dict[str, int]) -> list[Config]:
    """The heuristic config first, then the rest of the space (distinct after clipping to the
    problem): what a local GPU times (launch_autotune; targets/cuda/tune_plan.py prunes it)."""
    gm = geometry(call)
    m = _m(call, buffers, hints)
    out: list[Config] = []
    if dict(call.attrs)["depthwise"]:
        for bm, bn, _, w, s in DW_SPACE:
            c = Config(min(bm, _pow2(m, 8)), min(bn, _pow2(gm["c"], 16)), w, s)
            if c not in out:
                out.append(c)
        return out
    scored = []
    for bm, bn, bk, w, s in DENSE_SPACE:
        bm2, bn2 = min(bm, _pow2(m)), min(bn, _pow2(gm["ocg"]))
        c = Config(bm2, bn2, w, s)
        if c in [x for x, _ in scored]:
            continue
        tiles = -(-m // bm2) * -(-gm["ocg"] // bn2) * gm["g"] * _split(call)
        scored.append((c, tiles))
    first = next((c for c, t in scored if t >= SMS), max(scored, key=lambda ct: ct[1])[0])
    return [first] + [c for c, _ in scored if c != first]


def print_conv_kernel(call: L.Extern, buffers, hints: dict[str, int],
                      config: Config | None = None) -> TritonKernel:
    config = config or choose_conv_config(call, buffers, hints)
    if dict(call.attrs)["depthwise"]:
        return _print(call, buffers, config, _depthwise_body)
    return _print(call, buffers, config, _dense_body)


def _print(call: L.Extern, buffers, cfg: Config, body) -> TritonKernel:
    a = dict(call.attrs)
    gm = geometry(call)
    oh, ow = _out_hw(call, buffers)
    name = f"conv_{call.name}"
    bufs: list[str] = [call.name]
    for arg in call.args:
        if arg.buf not in bufs:
            bufs.append(arg.buf)
    exprs = [gm["n"], gm["h"], gm["w"], oh, ow] + [
        x for arg in call.args for x in (arg.offset, *arg.strides)]
    syms = sorted({str(s) for x in exprs for s in sympy.sympify(x).free_symbols})
    params = (("out", call.name), *(("in", b) for b in bufs[1:]), *(("size", s) for s in syms))
    sig = {f"buf_{b}": SIG_PTR[buffers[b].dtype] for b in bufs}
    sig.update({s: "i64" for s in syms})
    sig["XBLOCK"] = sig["RBLOCK"] = "constexpr"
    dt = buffers[call.name].dtype
    xdt = buffers[call.args[0].buf].dtype
    big = any(not sympy.sympify(buffers[b].numel).is_Integer or
              int(buffers[b].numel) >= 2**31 - 2**20 for b in bufs)
    kind = "depthwise" if a["depthwise"] else (
        f"implicit GEMM, {'taps' if _taps(gm) else 'flat'} K loop")
    lines = [
        "@triton.jit",
        f"def {name}({', '.join(x for x in sig if sig[x] != 'constexpr')}, "
        "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {name}: {call.name} = conv2d({call.args[0].buf}, {call.args[1].buf}) NHWC, "
        f"{kind}",
        f"    #   from graph nodes: {', '.join(call.source)}",
        f"    #   kernel {a['kh']}x{a['kw']}, stride {a['sh']}x{a['sw']}, padding "
        f"{a['ph']}x{a['pw']}, dilation {a['dh']}x{a['dw']}, groups {a['groups']}, "
        f"{xdt.name}; " + (
            f"split-K {_split(call)}: float32 partial sums, the epilogue in the reduction"
            if _split(call) > 1 else "epilogue: scale, shift" + (
                f" + residual {call.args[3].buf}" if len(call.args) > 3 else "")
            + {0: "", 1: ", relu", 2: f", clamp({a['lo']:g}, {a['hi']:g})", 3: ", silu"}[
                a["act"]]),
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        f"    H = {to_tl(canon(gm['h']))}",
        f"    W = {to_tl(canon(gm['w']))}",
        f"    OH = {to_tl(canon(oh))}",
        f"    OW = {to_tl(canon(ow))}",
        f"    M = {to_tl(canon(gm['n']))} * OH * OW",
    ]
    blines, rows = body(call, buffers, cfg, gm, big)
    lines += blines
    if _split(call) > 1:
        lines += ["    # a partial sum over this split's K steps: the reduction over splits adds "
                  "them and",
                  "    # applies the epilogue",
                  "    mask = m_ok[:, None] & n_ok[None, :]",
                  f"    tl.store(buf_{call.name} + (ks_split * M + rm)[:, None] * {gm['oc']} + "
                  "oc[None, :], acc, mask=mask)"]
    else:
        lines += _epilogue(call, dt, gm)
    return TritonKernel(name, "\n".join(lines) + "\n", params, sig, cfg, rows, call.source)


def _ptr(arg: L.LibArg, idx: list[str]) -> str:
    """buf + offset + sum(idx_d * stride_d) (zero strides left out)."""
    parts = [f"buf_{arg.buf}"]
    if canon(arg.offset) != 0:
        parts.append(to_tl(canon(arg.offset)))
    for var, st in zip(idx, arg.strides):
        st = canon(st)
        if st != 0 and var != "0":
            parts.append(var if st == 1 else f"{var} * {to_tl(st)}")
    return " + ".join(parts)


def _pixel_lines(gm, big: bool, var: str = "rm") -> list[str]:
    cast = ".to(tl.int64)" if big else ""
    return [f"    ow_ = {var} % OW",
            "    t_ = " + var + " // OW",
            "    oh_ = t_ % OH",
            f"    n_ = (t_ // OH){cast}",
            f"    m_ok = {var} < M"]


def _dense_body(call: L.Extern, buffers, cfg: Config, gm: dict, big: bool):
    a = dict(call.attrs)
    x, w = call.args[0], call.args[1]
    dt = buffers[x.buf].dtype.name  # the operands' (a split-K output is float32)
    prec = f', input_precision="{DOT_PRECISION[dt]}"' if dt in DOT_PRECISION else ""
    bk = _block_k((cfg.xblock, cfg.rblock, 64), call, buffers)
    cg, ocg, g = gm["cg"], gm["ocg"], gm["g"]
    ktot = a["kh"] * a["kw"] * cg
    lines = [
        f"    BLOCK_K: tl.constexpr = {bk}",
        "    num_m = tl.cdiv(M, XBLOCK)",
        f"    num_n = {-(-ocg // cfg.rblock)}",
        "    per_group = num_m * num_n",
        *([f"    ks_split = pid // (per_group * {g})  # split-K: this program's share of K",
           f"    pid = pid % (per_group * {g})"] if _split(call) > 1 else []),
        "    grp = pid // per_group  # the convolution's group",
        "    t = pid % per_group",
        f"    per_band = {GROUP_M} * num_n  # grouped order: programs side by side share rows",
        f"    first_m = (t // per_band) * {GROUP_M}",
        f"    size_m = tl.minimum(num_m - first_m, {GROUP_M})",
        "    pid_m = first_m + (t % per_band) % size_m",
        "    pid_n = (t % per_band) // size_m",
        "    rm = (pid_m * XBLOCK + tl.arange(0, XBLOCK))" + (".to(tl.int64)" if big else ""),
        "    rn = pid_n * RBLOCK + tl.arange(0, RBLOCK)",
        *_pixel_lines(gm, big),
        f"    ih0 = oh_ * {a['sh']} - {a['ph']}",
        f"    iw0 = ow_ * {a['sw']} - {a['pw']}",
        f"    n_ok = rn < {ocg}",
        "    rk = tl.arange(0, BLOCK_K)",
        f"    xb = {_ptr(x, ['n_', '0', '0', f'grp * {cg}'])}",
        f"    wb = buf_{w.buf} + {to_tl(canon(w.offset))} + grp * {ktot * ocg}",
        "    acc = tl.zeros((XBLOCK, RBLOCK), dtype=tl.float32)",
    ]
    sxh, sxw, sxc = (canon(s) for s in x.strides[1:])

    def off(var, st):
        return var if st == 1 else f"{var} * {to_tl(st)}"
    pad = a["ph"] or a["pw"]
    if _taps(gm):
        nc = -(-cg // bk)
        cmask = cg % bk != 0
        steps = a["kh"] * a["kw"] * nc
        split = _split(call)
        per = -(-steps // split)
        tail = split > 1 and per * split != steps  # the last split has fewer steps
        if split > 1:  # static bounds: Triton pipelines the loop
            lines += [f"    for kq in range(0, {per}):  # K steps [ks_split * {per}, +{per})",
                      f"        ks = ks_split * {per} + kq"]
            if tail:
                lines.append(f"        k_ok = ks < {steps}")
        else:
            lines.append(f"    for ks in range(0, {steps}):")
        lines += [
            f"        tap = ks // {nc}",
            f"        cc = (ks % {nc}) * BLOCK_K + rk",
            f"        ih = ih0 + (tap // {a['kw']}) * {a['dh']}",
            f"        iw = iw0 + (tap % {a['kw']}) * {a['dw']}",
        ]
        ok = "m_ok" + (" & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)" if pad else "") + (
            " & k_ok" if tail else "")
        amask = f"({ok})[:, None]" + (f" & (cc[None, :] < {cg})" if cmask else "")
        bmask = "n_ok[None, :]" + (f" & (cc[:, None] < {cg})" if cmask else "") + (
            " & k_ok" if tail else "")
        lines += [
            f"        a = tl.load((xb + {off('ih', sxh)} + {off('iw', sxw)})[:, None] + "
            f"({off('cc', sxc)})[None, :], mask={amask}, other=0.0)",
            f"        b = tl.load(wb + (tap * {cg} + cc)[:, None] * {ocg} + rn[None, :], "
            f"mask={bmask}, other=0.0)",
            f"        acc = tl.dot(a, b, acc{prec})",
        ]
    else:
        kw_cg = a["kw"] * cg
        lines += [
            f"    for k0 in range(0, {ktot}, BLOCK_K):",
            "        kk = k0 + rk",
            f"        k_ok = kk < {ktot}",
            f"        cc = kk % {cg}",
            f"        ky = kk // {kw_cg}",
            f"        kx = (kk % {kw_cg}) // {cg}",
            f"        ih = ih0[:, None] + ky[None, :] * {a['dh']}",
            f"        iw = iw0[:, None] + kx[None, :] * {a['dw']}",
        ]
        ok = "m_ok[:, None] & k_ok[None, :]" + (
            " & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)" if pad else "")
        lines += [
            f"        a = tl.load(xb[:, None] + {off('ih', sxh)} + {off('iw', sxw)} + "
            f"({off('cc', sxc)})[None, :], mask={ok}, other=0.0)",
            f"        b = tl.load(wb + kk[:, None] * {ocg} + rn[None, :], "
            "mask=k_ok[:, None] & n_ok[None, :], other=0.0)",
            f"        acc = tl.dot(a, b, acc{prec})",
        ]
    lines.append(f"    oc = grp * {ocg} + rn")
    m_pad = FloorDiv(canon(gm["n"] * _out_hw(call, buffers)[0] * _out_hw(call, buffers)[1])
                     + cfg.xblock - 1, cfg.xblock) * cfg.xblock
    rows = sympy.expand(m_pad * (-(-ocg // cfg.rblock)) * g * _split(call))
    return lines, rows


def _depthwise_body(call: L.Extern, buffers, cfg: Config, gm: dict, big: bool):
    a = dict(call.attrs)
    x, w = call.args[0], call.args[1]
    c = gm["c"]
    sxh, sxw, sxc = (canon(s) for s in x.strides[1:])
    nb = -(-c // cfg.rblock)
    lines = [
        f"    pid_m = pid // {nb}",
        f"    pid_n = pid % {nb}",
        "    rm = (pid_m * XBLOCK + tl.arange(0, XBLOCK))" + (".to(tl.int64)" if big else ""),
        "    rn = pid_n * RBLOCK + tl.arange(0, RBLOCK)",
        *_pixel_lines(gm, big),
        f"    ih0 = oh_ * {a['sh']} - {a['ph']}",
        f"    iw0 = ow_ * {a['sw']} - {a['pw']}",
        f"    n_ok = rn < {c}",
        f"    xb = {_ptr(x, ['n_', '0', '0', '0'])}",
        "    acc = tl.zeros((XBLOCK, RBLOCK), dtype=tl.float32)",
        f"    for ky in tl.static_range({a['kh']}):",
        f"        ih = ih0 + ky * {a['dh']}",
        f"        for kx in tl.static_range({a['kw']}):",
        f"            iw = iw0 + kx * {a['dw']}",
        "            ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)",
        f"            v = tl.load((xb + {'ih' if sxh == 1 else f'ih * {to_tl(sxh)}'} + "
        f"{'iw' if sxw == 1 else f'iw * {to_tl(sxw)}'})[:, None] + "
        f"{'rn' if sxc == 1 else f'(rn * {to_tl(sxc)})'}[None, :], "
        "mask=ok[:, None] & n_ok[None, :], other=0.0)",
        f"            wv = tl.load(buf_{w.buf} + {to_tl(canon(w.offset))} + "
        f"(ky * {a['kw']} + kx) * {c} + rn, mask=n_ok, other=0.0)",
        "            acc += v.to(tl.float32) * wv.to(tl.float32)[None, :]",
        "    oc = rn",
    ]
    oh, ow = _out_hw(call, buffers)
    m_pad = FloorDiv(canon(gm["n"] * oh * ow) + cfg.xblock - 1, cfg.xblock) * cfg.xblock
    return lines, sympy.expand(m_pad * nb)


def _epilogue(call: L.Extern, dt, gm: dict) -> list[str]:
    """act(acc * scale + shift [+ residual]) in float32, rounded once, stored at [m, oc] of the
    contiguous NHWC output."""
    a = dict(call.attrs)
    b = call.args[2]
    sb = f"buf_{b.buf}" + (f" + {to_tl(canon(b.offset))}" if canon(b.offset) != 0 else "")
    lines = [
        "    mask = m_ok[:, None] & n_ok[None, :]",
        "    # batch norm's scale (1 without one) and the shift (bias, batch norm), float32",
        f"    scale = tl.load({sb} + oc, mask=n_ok, other=0.0)",
        f"    shift = tl.load({sb} + {gm['oc']} + oc, mask=n_ok, other=0.0)",
        "    acc = acc * scale[None, :] + shift[None, :]",
    ]
    if len(call.args) > 3:
        r = call.args[3]
        sn, sh, sw, sc = (canon(s) for s in r.strides)

        def term(var, st):
            return [] if st == 0 else [var if st == 1 else f"{var} * {to_tl(st)}"]
        rows = " + ".join(term("n_", sn) + term("oh_", sh) + term("ow_", sw)) or "0"
        base = f"buf_{r.buf}" + (f" + {to_tl(canon(r.offset))}" if canon(r.offset) != 0 else "")
        cols = "oc" if sc == 1 else f"(oc * {to_tl(sc)})"
        lines.append(f"    acc = acc + tl.load({base} + ({rows})[:, None] + {cols}[None, :], "
                     "mask=mask, other=0.0).to(tl.float32)  # the residual")
    if a["act"] == 1:
        lines.append("    acc = tl.maximum(acc, 0.0)")
    elif a["act"] == 2:
        if a["lo"] != float("-inf"):
            lines.append(f"    acc = tl.maximum(acc, {a['lo']!r})")
        if a["hi"] != float("inf"):
            lines.append(f"    acc = tl.minimum(acc, {a['hi']!r})")
    elif a["act"] == 3:
        lines.append("    acc = acc / (1.0 + tl.exp(-acc))")
    lines.append(f"    tl.store(buf_{call.name} + (rm * {gm['oc']})[:, None] + oc[None, :], "
                 f"acc.to({TL_DTYPE[dt]}), mask=mask)")
    return lines
