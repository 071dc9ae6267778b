@triton.jit
def attn_scaled_dot_product_attention(buf_scaled_dot_product_attention, buf_q, buf_k, buf_v, buf_mask_0, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    # attn_scaled_dot_product_attention: flash attention (online softmax) -> scaled_dot_product_attention
    #   from graph nodes: scaled_dot_product_attention
    #   float16, head dims 80 / 80 (padded to 128 / 128), causal, mask bool (keep where true), scale 0.11180339887498948
    #   XBLOCK queries per program, keys in RBLOCK-wide tiles
    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    n_m = (20 + XBLOCK - 1) // XBLOCK
    bh = pid // n_m
    b = bh // 3
    h = bh % 3
    m_blk = n_m - 1 - pid % n_m
    rows = m_blk * XBLOCK + tl.arange(0, XBLOCK)
    d = tl.arange(0, 128)
    dv = tl.arange(0, 128)
    row_ok = rows < 20
    q = tl.load(buf_q + b * 4800 + h * 80 + rows[:, None] * 240 + d[None, :], mask=row_ok[:, None] & (d[None, :] < 80), other=0.0)
    m_i = tl.full([XBLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([XBLOCK], tl.float32)
    acc = tl.zeros([XBLOCK, 128], tl.float32)
    k_ptr = buf_k + b * 7920 + h * 80
    v_ptr = buf_v + b * 7920 + h * 80
    m_ptr = buf_mask_0 + rows[:, None] * 33
    # base-2 softmax: scores scaled by scale * log2(e), exp2 instead of exp
    qk_scale = 0.16129820911147805
    first = m_blk * XBLOCK
    # keys below the block's first query are kept for every row: no causal mask
    lo = tl.minimum(33 // RBLOCK * RBLOCK, first // RBLOCK * RBLOCK)
    hi = tl.minimum(33, first + XBLOCK)
    lo_live = 33
    hi_live = 0
    for pi in range(0, (33 + 63) // 64):
        pc = pi * 64 + tl.arange(0, 64)
        alive = tl.max((row_ok[:, None] & (pc[None, :] < 33) & (tl.load(m_ptr + pc[None, :], mask=row_ok[:, None] & (pc[None, :] < 33), other=0) != 0)).to(tl.int32), 0) > 0
        lo_live = tl.minimum(lo_live, tl.min(tl.where(alive, pc, 33)))
        hi_live = tl.maximum(hi_live, tl.max(tl.where(alive, pc + 1, 0)))
    first_t = lo_live // RBLOCK * RBLOCK
    end_t = (hi_live + RBLOCK - 1) // RBLOCK * RBLOCK
    whole_lo = first_t
    whole_hi = tl.minimum(lo, end_t)
    for start in range(whole_lo, whole_hi, RBLOCK):
        cols = start + tl.arange(0, RBLOCK)
        kt = tl.load(k_ptr + cols[None, :] * 240 + d[:, None], mask=(d[:, None] < 80), other=0.0)
        s = tl.dot(q, kt) * qk_scale
        s = tl.where((tl.load(m_ptr + cols[None, :], mask=row_ok[:, None], other=0) != 0), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_ptr + cols[:, None] * 240 + dv[None, :], mask=(dv[None, :] < 80), other=0.0)
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
        m_i = m_new
    tail_lo = tl.maximum(lo, first_t)
    tail_hi = tl.minimum(hi, end_t)
    for start in range(tail_lo, tail_hi, RBLOCK):  # the tail: bounds (and causal) masks
        cols = start + tl.arange(0, RBLOCK)
        col_ok = cols < 33
        kt = tl.load(k_ptr + cols[None, :] * 240 + d[:, None], mask=col_ok[None, :] & (d[:, None] < 80), other=0.0)
        s = tl.dot(q, kt) * qk_scale
        s = tl.where(col_ok[None, :] & (cols[None, :] <= rows[:, None]) & (tl.load(m_ptr + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0) != 0), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_ptr + cols[:, None] * 240 + dv[None, :], mask=col_ok[:, None] & (dv[None, :] < 80), other=0.0)
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
        m_i = m_new
    # rows whose keys were all masked: zeros (l_i == 0), as eager gives
    o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    o_ptr = buf_scaled_dot_product_attention + (bh * 20 + rows[:, None]) * 80 + dv[None, :]
    tl.store(o_ptr, o.to(tl.float16), mask=row_ok[:, None] & (dv[None, :] < 80))
