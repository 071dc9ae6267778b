@triton.jit
def k0_out0_add(buf_mul, buf_out0_add, buf_x, buf_p_ln_bias, buf_p_ln_weight, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    # k0_out0_add: layer_norm_sum, layer_norm_sqsum, mul, softmax_max, softmax_sum, amax, out0_add
    #   from graph nodes: layer_norm, softmax, amax, add
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    xidx = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xidx < 6
    i0 = xidx
    # layer_norm_sum <- layer_norm
    acc_layer_norm_sum = tl.full([XBLOCK, RBLOCK], 0, tl.float32)
    r_m0 = tl.arange(0, RBLOCK)[None, :]
    mask_m0 = xmask & (r_m0 < 40)
    r0_m0 = r_m0
    t1 = tl.load(buf_x + ((40 * i0) + r0_m0), mask=mask_m0, other=0)
    acc_layer_norm_sum = acc_layer_norm_sum + tl.where(mask_m0, t1, 0)
    res_layer_norm_sum = tl.sum(acc_layer_norm_sum, 1, keep_dims=True)
    v_layer_norm_sum = res_layer_norm_sum
    # layer_norm_sqsum <- layer_norm
    acc_layer_norm_sqsum = tl.full([XBLOCK, RBLOCK], 0, tl.float32)
    r_m1 = tl.arange(0, RBLOCK)[None, :]
    mask_m1 = xmask & (r_m1 < 40)
    r0_m1 = r_m1
    t2 = tl.load(buf_x + ((40 * i0) + r0_m1), mask=mask_m1, other=0)
    t3 = (v_layer_norm_sum / tl.full([], 40.0, tl.float32))
    t4 = (t2 - t3)
    t5 = (t4 * t4)
    acc_layer_norm_sqsum = acc_layer_norm_sqsum + tl.where(mask_m1, t5, 0)
    res_layer_norm_sqsum = tl.sum(acc_layer_norm_sqsum, 1, keep_dims=True)
    v_layer_norm_sqsum = res_layer_norm_sqsum
    # mul <- softmax
    r_m2 = tl.arange(0, RBLOCK)[None, :]
    mask_m2 = xmask & (r_m2 < 40)
    i1_m2 = r_m2
    t6 = tl.load(buf_x + ((40 * i0) + i1_m2), mask=mask_m2, other=0)
    t7 = (v_layer_norm_sum / tl.full([], 40.0, tl.float32))
    t8 = (t6 - t7)
    t9 = (v_layer_norm_sqsum / tl.full([], 40.0, tl.float32))
    t10 = (t9 + tl.full([], 1e-05, tl.float32))
    t11 = tl.rsqrt(t10)
    t12 = (t8 * t11)
    t13 = tl.load(buf_p_ln_weight + i1_m2, mask=mask_m2, other=0)
    t14 = (t12 * t13)
    t15 = tl.load(buf_p_ln_bias + i1_m2, mask=mask_m2, other=0)
    t16 = (t14 + t15)
    t17 = (t16 * tl.full([], 2.0, tl.float32))
    tl.store(buf_mul + ((40 * i0) + i1_m2), t17, mask=mask_m2)
    tl.debug_barrier()  # later members read what this one stored
    # softmax_max <- softmax
    acc_softmax_max = tl.full([XBLOCK, RBLOCK], float('-inf'), tl.float32)
    r_m3 = tl.arange(0, RBLOCK)[None, :]
    mask_m3 = xmask & (r_m3 < 40)
    r0_m3 = r_m3
    t18 = tl.load(buf_mul + ((40 * i0) + r0_m3), mask=mask_m3, other=0)
    acc_softmax_max = tl.maximum(acc_softmax_max, tl.where(mask_m3, t18, float('-inf')), propagate_nan=tl.PropagateNan.ALL)
    res_softmax_max = tl.reduce(acc_softmax_max, 1, _kl_max, keep_dims=True)
    v_softmax_max = res_softmax_max
    # softmax_sum <- softmax
    acc_softmax_sum = tl.full([XBLOCK, RBLOCK], 0, tl.float32)
    r_m4 = tl.arange(0, RBLOCK)[None, :]
    mask_m4 = xmask & (r_m4 < 40)
    r0_m4 = r_m4
    t19 = tl.load(buf_mul + ((40 * i0) + r0_m4), mask=mask_m4, other=0)
    t20 = (t19 - v_softmax_max)
    t21 = tl.exp(t20)
    acc_softmax_sum = acc_softmax_sum + tl.where(mask_m4, t21, 0)
    res_softmax_sum = tl.sum(acc_softmax_sum, 1, keep_dims=True)
    v_softmax_sum = res_softmax_sum
    # amax <- amax
    acc_amax = tl.full([XBLOCK, RBLOCK], float('-inf'), tl.float32)
    r_m5 = tl.arange(0, RBLOCK)[None, :]
    mask_m5 = xmask & (r_m5 < 40)
    r0_m5 = r_m5
    t22 = tl.load(buf_x + ((40 * i0) + r0_m5), mask=mask_m5, other=0)
    acc_amax = tl.maximum(acc_amax, tl.where(mask_m5, t22, float('-inf')), propagate_nan=tl.PropagateNan.ALL)
    res_amax = tl.reduce(acc_amax, 1, _kl_max, keep_dims=True)
    v_amax = res_amax
    # out0_add <- add
    r_m6 = tl.arange(0, RBLOCK)[None, :]
    mask_m6 = xmask & (r_m6 < 40)
    i1_m6 = r_m6
    t23 = tl.load(buf_mul + ((40 * i0) + i1_m6), mask=mask_m6, other=0)
    t24 = (t23 - v_softmax_max)
    t25 = tl.exp(t24)
    t26 = (t25 / v_softmax_sum)
    t27 = (t26 + v_amax)
    tl.store(buf_out0_add + ((40 * i0) + i1_m6), t27, mask=mask_m6)
