"""The int4 GEMV on tensor cores (issue 17 item 4): y[N] = x[K] @ W^T for W [N, K] stored in
int4 groups (kiln/gemm/quant_gemv.py's values and scales), M = 1, bf16 x.

Why: the CUDA-core GEMV (kiln/targets/cuda/gemv_template.py) spends 8.3-10.2 SASS
instructions a weight byte (a mask, a convert FMA and a product FMA a weight), about what an
H100 issues a byte at its copy bandwidth. Here the products and the sums go to the tensor
cores (`mma.sync.m16n8k16` bf16 -> float32), and a weight costs about half a LOP3 and half a
shift (about 4 instructions a byte in the K loop, loads and scales included).

**Packing** (`pack_tc`, at compile time; the same bytes, another order): in each 16 bytes of
a row (four little-endian 32-bit words, 32 values of K), nibble i of word j holds
k = 32 * chunk + 4 * i + j (i < 8, j < 4), as `q + 8`. One LOP3 with 0x000F000F and the bits
of the bf16 128.0 (0x4300) turns nibbles i and i + 4 of a word into the bf16 pair
(128 + q_i + 8, 128 + q_{i+4} + 8), exact; nibbles 1-3 after a shift by 4 i.

**Mapping onto the mma** (m16n8k16: A 16 x 16 row-major in registers, B 16 x 8, C float32).
A warp's lane l = 4 * g + t (g < 8, t < 4) holds, in the layout Triton gives the weight tile
[H, T, 4] (16-byte loads: 4 words along the last dim, 4 lanes along T, 8 along the rows),
the 4 words of 32-value chunk t of one row r (tile half "a") and of row r + H (half "b").
Each of the thread's words is one `mma` pair: A row g is that word of row r, A row g + 8 the
word of row r + H; A's k slots (2t, 2t + 1, 2t + 8, 2t + 9) are nibbles (0, 4, 1, 5) of
the word (then 2, 6, 3, 7 for the second mma), and B's entries at those slots in column g
are the x values of lane group g's k. The mma sums over its 16 slots, the four lanes t of a
quad: 4 chunks, 128 values, one group when G >= 128 (so the group's scale can multiply the
sum). C[g, g] and C[g + 8, g] pair rows r and r + H with their own chunks' x (other columns
take another lane group's x where a step spans several groups): lane (g, t = g / 2) holds
them (d0 / d2 for even g, d1 / d3 for odd) and returns them; the other lanes return 0.
The values are 128 + 8 + q: two more mmas with A = -136 (0xC308) take 136 * x off, exactly
(float32 accumulation of exact bf16 products).

The mapping relies on Triton's blocked layout of the [H, T, 4] tile: lanes fastest along T
with 4 lanes a quad (T = 4 * groups a step). The GPU tests compare against float64 math; the
Triton interpreter (no inline PTX) runs the same addressing with `USE_MMA=False`, where each
element's products are summed by Triton instead."""

from __future__ import annotations

import torch

try:  # the kernels need Triton (kiln[cuda]); a CPU-only install imports this module without
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

#: smallest int4 group the tensor-core GEMV takes: a quad of lanes sums 128 values of K
MIN_GROUP = 128

#: one word pair (rows r and r + H of one 32-value chunk) through two data mmas and two
#: offset mmas; $0 / $1: C[g, g] / C[g + 8, g] in lane (g, g / 2), else 0 (float32);
#: $2 / $3: the words; $4-$7: x at nibbles 0-3 (k = 4i + j), $8-$11: at nibbles 4-7 (bf16)
def _mma(a: str) -> str:
    """D += A (the registers `a`) x B (b0, b1): bf16 operands, float32 accumulators d0-d3."""
    return ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0, d1, d2, d3}, "
            f"{{{a}}}, {{b0, b1}}, {{d0, d1, d2, d3}};")


def _pairs(w: str, dst: str) -> str:
    """Nibbles 0 and 4 of the word in `w` as the bf16 pair (128 + nibble, 128 + nibble)."""
    return f"lop3.b32 {dst}, {w}, 0x000F000F, 0x43004300, 0xEA;"


MMA_PTX = "\n".join([
    "{",
    ".reg .b32 a0, a1, a2, a3, b0, b1, s, t, m0, m1, m2, m3, l, g;",
    ".reg .f32 d0, d1, d2, d3;",
    ".reg .pred pd, po;",
    *(f"mov.b32 m{i}, 0xC308C308;" for i in range(4)),  # bf16 -136, -136
    *(f"mov.f32 d{i}, 0f00000000;" for i in range(4)),
    # nibbles 0, 4 (A rows g, g + 8: slots 2t, 2t + 1) and 1, 5 (slots 2t + 8, 2t + 9)
    "mov.b32 b0, {$4, $8};",
    "mov.b32 b1, {$5, $9};",
    _pairs("$2", "a0"), _pairs("$3", "a1"),
    "shr.u32 s, $2, 4;", "shr.u32 t, $3, 4;",
    _pairs("s", "a2"), _pairs("t", "a3"),
    _mma("m0, m1, m2, m3"), _mma("a0, a1, a2, a3"),
    # nibbles 2, 6 and 3, 7
    "mov.b32 b0, {$6, $10};",
    "mov.b32 b1, {$7, $11};",
    "shr.u32 s, $2, 8;", "shr.u32 t, $3, 8;",
    _pairs("s", "a0"), _pairs("t", "a1"),
    "shr.u32 s, $2, 12;", "shr.u32 t, $3, 12;",
    _pairs("s", "a2"), _pairs("t", "a3"),
    _mma("m0, m1, m2, m3"), _mma("a0, a1, a2, a3"),
    # C[g, g] (d0 / d1 for even / odd g) and C[g + 8, g] (d2 / d3) in lane (g, g / 2)
    "mov.u32 l, %laneid;",
    "shr.u32 g, l, 3;",
    "and.b32 t, l, 3;",
    "setp.eq.u32 pd, g, t;",
    "and.b32 s, l, 4;",
    "setp.ne.u32 po, s, 0;",
    "selp.f32 d0, d1, d0, po;",
    "selp.f32 d2, d3, d2, po;",
    "selp.f32 $0, d0, 0f00000000, pd;",
    "selp.f32 $1, d2, 0f00000000, pd;",
    "}"])

#: the constraint string of MMA_PTX
MMA_CONSTRAINTS = "=f,=f,r,r,h,h,h,h,h,h,h,h"


def pack_tc(p: torch.Tensor) -> torch.Tensor:
    """quant_gemv.py's int4 rows (uint8 [N, K / 2], two values a byte in K order, k even: the
    low nibble) in the tensor-core order (module docstring). K a multiple of 32."""
    n = p.shape[0]
    if p.shape[1] % 16:
        raise ValueError(f"pack_tc: expected rows of a multiple of 16 bytes (K a multiple of "
                         f"32), got {tuple(p.shape)}")
    p16 = p.to(torch.int16)
    q = torch.stack([p16 & 15, p16 >> 4], dim=2).reshape(n, -1)  # K order
    q = q.reshape(n, -1, 8, 4).transpose(2, 3).reshape(n, -1)  # position 8j + i: k = 4i + j
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


def unpack_tc(p: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_tc`."""
    n = p.shape[0]
    p16 = p.to(torch.int16)
    q = torch.stack([p16 & 15, p16 >> 4], dim=2).reshape(n, -1)  # position 8j + i
    q = q.reshape(n, -1, 4, 8).transpose(2, 3).reshape(n, -1)  # K order
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


def check(n: int, k: int, group: int, xblock: int, rblock: int) -> None:
    """Raises ValueError unless the tensor-core GEMV takes this problem and tile."""
    why = []
    if group < MIN_GROUP or group & (group - 1):
        why.append(f"the group a power of two >= {MIN_GROUP} (got {group})")
    if k % group:
        why.append(f"K a multiple of the group (got K {k}, group {group})")
    if xblock < 2 or xblock & (xblock - 1):
        why.append(f"XBLOCK a power of two >= 2 (got {xblock})")
    if rblock % group or rblock < group:
        why.append(f"RBLOCK a multiple of the group (got {rblock}, group {group})")
    if k % rblock:
        why.append(f"K a multiple of RBLOCK (got K {k}, RBLOCK {rblock})")
    if why:
        raise ValueError("int4 tensor-core GEMV: expected " + "; ".join(why))


if triton is not None:
    _PTX = tl.constexpr(MMA_PTX)
    _CONSTRAINTS = tl.constexpr(MMA_CONSTRAINTS)

    @triton.jit
    def _nib(w, i: tl.constexpr):
        """Nibble i of each word as the float32 q (the stored value less 8)."""
        return (((w >> (4 * i)) & 15) - 8).to(tl.float32)

    @triton.jit
    def mma_pair(wa, wb, x0, x1, x2, x3, x4, x5, x6, x7, USE_MMA: tl.constexpr):
        """(rows a, rows b) of one word pair: the quad's sums through the tensor cores in one
        lane of the quad, 0 in the others (USE_MMA), or this element's own products (the
        interpreter's stand-in); either way the tile's sum is the GEMV's."""
        if USE_MMA:
            return tl.inline_asm_elementwise(
                _PTX, _CONSTRAINTS, [wa, wb, x0, x1, x2, x3, x4, x5, x6, x7],
                dtype=(tl.float32, tl.float32), is_pure=False, pack=1)
        else:
            ra = _nib(wa, 0) * x0 + _nib(wa, 1) * x1 + _nib(wa, 2) * x2 + _nib(wa, 3) * x3 + \
                _nib(wa, 4) * x4 + _nib(wa, 5) * x5 + _nib(wa, 6) * x6 + _nib(wa, 7) * x7
            rb = _nib(wb, 0) * x0 + _nib(wb, 1) * x1 + _nib(wb, 2) * x2 + _nib(wb, 3) * x3 + \
                _nib(wb, 4) * x4 + _nib(wb, 5) * x5 + _nib(wb, 6) * x6 + _nib(wb, 7) * x7
            return ra, rb

    @triton.jit
    def _step_loads(pwa, pwb, psa, psb, k0, G: tl.constexpr):
        """A step's words (both halves) and their scales at K offset k0."""
        return (tl.load(pwa + k0 // 8), tl.load(pwb + k0 // 8), tl.load(psa + k0 // G),
                tl.load(psb + k0 // G))

    @triton.jit
    def _step(acc_a, acc_b, wa, wb, sa, sb, pk, USE_MMA: tl.constexpr):
        """The accumulators after one step: x at the 8 nibble places (pk + 4 i), the words'
        group sums times their scales."""
        da, db = mma_pair(wa, wb, tl.load(pk), tl.load(pk + 4), tl.load(pk + 8),
                          tl.load(pk + 12), tl.load(pk + 16), tl.load(pk + 20),
                          tl.load(pk + 24), tl.load(pk + 28), USE_MMA)
        return acc_a + da * sa, acc_b + db * sb

    @triton.jit
    def gemv_int4_tc_kernel(x_ptr, p_ptr, s_ptr, out_ptr, N, K: tl.constexpr,
                            G: tl.constexpr, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr,
                            USE_MMA: tl.constexpr, SPLIT: tl.constexpr = 1,
                            PREFETCH: tl.constexpr = 1):
        """y = x @ W^T, W `pack_tc`-packed int4 [N, K / 2] bytes, scales float32 [N, K / G];
        XBLOCK rows a program (two halves of H), RBLOCK values of K a step. SPLIT > 1: program
        (i, j) sums part j of SPLIT of K and adds it to the float32 `out` (zeroed first)
        atomically (split-K). PREFETCH: steps of words in flight ahead of the one multiplied (0:
        each step waits for its own loads; 2 needs K / SPLIT >= 2 RBLOCK), for A/B runs."""
        KS: tl.constexpr = K // SPLIT
        base = tl.program_id(1) * KS
        H: tl.constexpr = XBLOCK // 2
        T: tl.constexpr = RBLOCK // 32  # 32-value chunks a step (lanes along the tile)
        # the tile is [T, H, 4]: chunks before rows, so that Triton's layout (the order of
        # the pointers' contiguity, ties by dimension) puts a quad of lanes along T
        r0 = tl.program_id(0) * XBLOCK + tl.arange(0, H)[None, :, None]
        ra = tl.minimum(r0, N - 1)  # rows past N read the last row; their sums are not stored
        rb = tl.minimum(r0 + H, N - 1)
        rt = tl.arange(0, T)[:, None, None]
        rj = tl.arange(0, 4)[None, None, :]
        rw = rt * 4 + rj  # the step's words
        pw = p_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        pwa = pw + ra * (K // 8) + base // 8 + rw
        pwb = pw + rb * (K // 8) + base // 8 + rw
        psa = s_ptr + ra * (K // G) + base // G + rt * 32 // G
        psb = s_ptr + rb * (K // G) + base // G + rt * 32 // G
        # x at nibble 0 of word j (+ 4 i: nibble i), in the weight tile's shape: the same
        # layout as the words (a [T, 1, 4] load would get fewer values a thread)
        px = x_ptr + base + rt * 32 + rj + r0 * 0
        acc_a = tl.zeros((T, H, 4), dtype=tl.float32)
        acc_b = tl.zeros((T, H, 4), dtype=tl.float32)
        # software-pipelined by hand: the next step's words and scales are loaded before this
        # step's products (x, a few KB read by every program, is loaded where it is used)
        if PREFETCH == 0:  # each step waits for its own loads
            for k0 in range(0, KS, RBLOCK):
                wa, wb, sa, sb = _step_loads(pwa, pwb, psa, psb, k0, G)
                acc_a, acc_b = _step(acc_a, acc_b, wa, wb, sa, sb, px + k0, USE_MMA)
        elif PREFETCH == 2:  # two steps in flight (K / SPLIT spans at least two steps)
            wa, wb, sa, sb = _step_loads(pwa, pwb, psa, psb, 0, G)
            na, nb, nsa, nsb = _step_loads(pwa, pwb, psa, psb, RBLOCK, G)
            for k0 in range(2 * RBLOCK, KS, RBLOCK):
                ca, cb, csa, csb = wa, wb, sa, sb
                wa, wb, sa, sb = na, nb, nsa, nsb
                na, nb, nsa, nsb = _step_loads(pwa, pwb, psa, psb, k0, G)
                acc_a, acc_b = _step(acc_a, acc_b, ca, cb, csa, csb, px + k0 - 2 * RBLOCK,
                                     USE_MMA)
            acc_a, acc_b = _step(acc_a, acc_b, wa, wb, sa, sb, px + KS - 2 * RBLOCK, USE_MMA)
            acc_a, acc_b = _step(acc_a, acc_b, na, nb, nsa, nsb, px + KS - RBLOCK, USE_MMA)
        else:  # 1 (the default)
            wa, wb, sa, sb = _step_loads(pwa, pwb, psa, psb, 0, G)
            for k0 in range(RBLOCK, KS, RBLOCK):
                ca, cb, csa, csb = wa, wb, sa, sb
                wa, wb, sa, sb = _step_loads(pwa, pwb, psa, psb, k0, G)
                acc_a, acc_b = _step(acc_a, acc_b, ca, cb, csa, csb, px + k0 - RBLOCK,
                                     USE_MMA)
            acc_a, acc_b = _step(acc_a, acc_b, wa, wb, sa, sb, px + KS - RBLOCK, USE_MMA)
        ya = tl.sum(tl.sum(acc_a, 2), 0)
        yb = tl.sum(tl.sum(acc_b, 2), 0)
        rn = tl.program_id(0) * XBLOCK + tl.arange(0, H)
        if SPLIT == 1:
            tl.store(out_ptr + rn, ya.to(out_ptr.dtype.element_ty), mask=rn < N)
            tl.store(out_ptr + rn + H, yb.to(out_ptr.dtype.element_ty), mask=rn + H < N)
        else:
            tl.atomic_add(out_ptr + rn, ya, mask=rn < N, sem="relaxed")
            tl.atomic_add(out_ptr + rn + H, yb, mask=rn + H < N, sem="relaxed")


def gemv_int4_tc(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
                 xblock: int = 32, rblock: int = 256, num_warps: int = 1,
                 use_mma: bool | None = None, split: int = 1,
                 prefetch: int = 1) -> torch.Tensor:
    """y [N] = x [K] @ W^T with W `pack_tc(quantize_int4(W)["q"])`; x bf16 (float16 / float32
    too in the interpreter's stand-in). `use_mma` None: the tensor cores on a GPU. `split` > 1:
    split-K into a float32 result (returned in x's dtype). `prefetch`: steps of words in
    flight, 0-2 (2 needs K / split >= 2 rblock)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if x.shape != (k,):
        raise ValueError(f"gemv_int4_tc: x: expected shape ({k},) for packed weights "
                         f"{tuple(packed.shape)}, got {tuple(x.shape)}")
    if scales.shape != (n, k // group):
        raise ValueError(f"gemv_int4_tc: scales: expected shape ({n}, {k // group}), got "
                         f"{tuple(scales.shape)}")
    check(n, k // split, group, xblock, rblock)
    if split < 1 or k % split:
        raise ValueError(f"gemv_int4_tc: split: expected a divisor of K {k}, got {split}")
    if prefetch not in (0, 1, 2) or (prefetch == 2 and k // split < 2 * rblock):
        raise ValueError(f"gemv_int4_tc: prefetch: expected 0, 1 or 2 (2: K / split >= 2 "
                         f"RBLOCK, here {k // split} and {rblock}), got {prefetch}")
    if use_mma is None:
        use_mma = x.is_cuda
    if use_mma and x.dtype != torch.bfloat16:
        raise ValueError(f"gemv_int4_tc: x: expected bfloat16 on the tensor cores, got {x.dtype}")
    if split > 1:
        out = torch.zeros(n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(n, device=x.device, dtype=x.dtype)
    gemv_int4_tc_kernel[(triton.cdiv(n, xblock), split)](
        x, packed, scales, out, n, k, G=group, XBLOCK=xblock, RBLOCK=rblock,
        USE_MMA=use_mma, SPLIT=split, PREFETCH=prefetch, num_warps=num_warps)
    return out.to(x.dtype)
