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
    t3 = (v_layer_norm_sum / tl.full([], 40.0, tl.float32))
    t4 = (t1 - t3)
    t5 = (t4 * t4)
    acc_layer_norm_sqsum = acc_layer_norm_sqsum + tl.where(mask_m0, t5, 0)
    res_layer_norm_sqsum = tl.sum(acc_layer_norm_sqsum, 1, keep_dims=True)
    v_layer_norm_sqsum = res_layer_norm_sqsum
    # mul <- softmax
    t9 = (v_layer_norm_sqsum / tl.full([], 40.0, tl.float32))
    t10 = (t9 + tl.full([], 1e-05, tl.float32))
    t11 = tl.rsqrt(t10)
    t12 = (t4 * t11)
    t13 = tl.load(buf_p_ln_weight + r0_m0, mask=mask_m0, other=0)
    t14 = (t12 * t13)
    t15 = tl.load(buf_p_ln_bias + r0_m0, mask=mask_m0, other=0)
    t16 = (t14 + t15)
    t17 = (t16 * tl.full([], 2.0, tl.float32))
    tl.store(buf_mul + ((40 * i0) + r0_m0), t17, mask=mask_m0)
    tl.debug_barrier()  # later members read what this one stored
    # softmax_max <- softmax
    acc_softmax_max = tl.full([XBLOCK, RBLOCK], float('-inf'), tl.float32)
    t18 = tl.load(buf_mul + ((40 * i0) + r0_m0), mask=mask_m0, other=0)
    acc_softmax_max = tl.maximum(acc_softmax_max, tl.where(mask_m0, t18, float('-inf')), propagate_nan=tl.PropagateNan.ALL)
    res_softmax_max = tl.reduce(acc_softmax_max, 1, _kl_max, keep_dims=True)
    v_softmax_max = res_softmax_max
    # softmax_sum <- softmax
    acc_softmax_sum = tl.full([XBLOCK, RBLOCK], 0, tl.float32)
    t20 = (t18 - v_softmax_max)
    t21 = tl.exp(t20)
    acc_softmax_sum = acc_softmax_sum + tl.where(mask_m0, t21, 0)
    res_softmax_sum = tl.sum(acc_softmax_sum, 1, keep_dims=True)
    v_softmax_sum = res_softmax_sum
    # amax <- amax
    acc_amax = tl.full([XBLOCK, RBLOCK], float('-inf'), tl.float32)
    acc_amax = tl.maximum(acc_amax, tl.where(mask_m0, t1, float('-inf')), propagate_nan=tl.PropagateNan.ALL)
    res_amax = tl.reduce(acc_amax, 1, _kl_max, keep_dims=True)
    v_amax = res_amax
    # out0_add <- add
    t26 = (t21 / v_softmax_sum)
    t27 = (t26 + v_amax)
    tl.store(buf_out0_add + ((40 * i0) + r0_m0), t27, mask=mask_m0)
