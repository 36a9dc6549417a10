"""The Triton kernels of `natsl.fast.cached`'s decode steps (`gdn_decode_step`, `gla_decode_step`): a
module of their own so that the parts they share are module-level jit functions, which Triton's
interpreter finds (it runs a kernel in its module's globals, not in the closure that defines it);
importing it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def _step_program(H, PER_GROUP, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  PDL: tl.constexpr):
    """A decode step's program, one per (V tile iv, sequence x head bh): (iv, bh, the sequence b, the
    head h, the q and k row h // PER_GROUP that the head reads, the state's rows rk and columns rv, their
    masks)."""
    if PDL:  # kernels.pdl: wait for the earlier kernels' writes, then let the next kernel start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    iv = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    row = h // PER_GROUP
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    return iv, bh, b, h, row, rk, rv, rk < K, rv < V


@triton.jit
def _step_qk(q_ptr, k_ptr, b, row, stride_qb, stride_kb, rk, mk, K: tl.constexpr, L2: tl.constexpr):
    """Sequence b's q and k at `row` (a head, or the group of heads that shares them) in fp32."""
    q = tl.load(q_ptr + b * stride_qb + row * K + rk, mask=mk, other=0.0)
    k = tl.load(k_ptr + b * stride_kb + row * K + rk, mask=mk, other=0.0)
    qf = q.to(tl.float32)
    kf = k.to(tl.float32)
    if L2:  # l2_normalize: x / sqrt(|x|^2 + 1e-6) in fp32, rounded to the activation dtype
        qf = (qf * (1.0 / tl.sqrt(tl.sum(qf * qf, 0) + 1e-6))).to(q.dtype).to(tl.float32)
        kf = (kf * (1.0 / tl.sqrt(tl.sum(kf * kf, 0) + 1e-6))).to(k.dtype).to(tl.float32)
    return qf, kf


@triton.jit
def _state_tile(s_ptr, b, h, stride_sb, rk, rv, mk, mv, K: tl.constexpr, V: tl.constexpr):
    """The program's [rk, rv] tile of head h's state [K, V]: (its offsets, its mask, its values in fp32)."""
    offs = b * stride_sb + h * K * V + rk[:, None] * V + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    return offs, mask, tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_read(o_ptr, g_ptr, o, g, bh, iv, rv, mv, V: tl.constexpr):
    """The read o at the program's V columns, and the head's log decay g (once: by the first V tile)."""
    tl.store(o_ptr + bh * V + rv, o.to(o_ptr.dtype.element_ty), mask=mv)
    if iv == 0:
        tl.store(g_ptr + bh, g)


@triton.jit
def gdn_step_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, g_ptr,
                    H, stride_qb, stride_kb, stride_vb, stride_ab, stride_bb, stride_sb, scale,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    PDL: tl.constexpr):
    iv, bh, b, h, row, rk, rv, mk, mv = _step_program(H, 1, K, V, BK, BV, PDL)  # a q, k row per head
    qf, kf = _step_qk(q_ptr, k_ptr, b, row, stride_qb, stride_kb, rk, mk, K, True)
    v = tl.load(v_ptr + b * stride_vb + h * V + rv, mask=mv, other=0.0).to(tl.float32)
    # g = -exp(A_log) * softplus(a + dt_bias) (fp32; softplus threshold 20 as torch's)
    a = tl.load(a_ptr + b * stride_ab + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    sp = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * sp
    bt = tl.load(b_ptr + b * stride_bb + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bt))).to(q_ptr.dtype.element_ty).to(tl.float32)
    alpha = tl.exp(g)
    offs, mask, s = _state_tile(s_ptr, b, h, stride_sb, rk, rv, mk, mv, K, V)
    r = beta * (v - alpha * tl.sum(kf[:, None] * s, 0))
    s = alpha * s + kf[:, None] * r[None, :]
    tl.store(s_ptr + offs, s.to(s_ptr.dtype.element_ty), mask=mask)
    _store_read(o_ptr, g_ptr, scale * tl.sum(qf[:, None] * s, 0), g, bh, iv, rv, mv, V)


@triton.jit
def gla_step_kernel(q_ptr, k_ptr, v_ptr, a_ptr, alog_ptr, dtb_ptr, d_ptr, s_ptr, o_ptr, g_ptr,
                    H, PER_GROUP, stride_qb, stride_kb, stride_vb, stride_ab, stride_sb, scale,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    L2: tl.constexpr, HAS_D: tl.constexpr, PDL: tl.constexpr):
    # Head h reads the q, k of its group h // PER_GROUP (Mamba2's B and C are shared by the heads of a
    # group: read in place, never repeated).
    iv, bh, b, h, row, rk, rv, mk, mv = _step_program(H, PER_GROUP, K, V, BK, BV, PDL)
    qf, kf = _step_qk(q_ptr, k_ptr, b, row, stride_qb, stride_kb, rk, mk, K, L2)
    x = tl.load(v_ptr + b * stride_vb + h * V + rv, mask=mv, other=0.0)
    xf = x.to(tl.float32)
    # dt = softplus(a + dt_bias) (threshold 20 as torch's), g = -exp(A_log) dt, both fp32. Mamba2's
    # a + dt_bias sits near -7..-2 (dt ~ 1e-3..0.1), where 1 + e^a rounds off most of e^a's bits:
    # log1p(e) as log(u) e / (u - 1), u = 1 + e (Goldberg), so that dt keeps them as torch's softplus.
    a = tl.load(a_ptr + b * stride_ab + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    e = tl.exp(tl.minimum(a, 20.0))
    u = 1.0 + e
    dt = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    dt = tl.where(a > 20.0, a, dt)
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * dt
    vdt = (xf * dt).to(x.dtype).to(tl.float32)  # the write x dt, rounded as step_values rounds it
    offs, mask, s = _state_tile(s_ptr, b, h, stride_sb, rk, rv, mk, mv, K, V)
    s = tl.exp(g) * s + kf[:, None] * vdt[None, :]
    tl.store(s_ptr + offs, s.to(s_ptr.dtype.element_ty), mask=mask)
    o = scale * tl.sum(qf[:, None] * s, 0)
    if HAS_D:  # + D x: the read rounded first, then the sum in fp32, one more rounding (add_skip)
        o = o.to(o_ptr.dtype.element_ty).to(tl.float32) + tl.load(d_ptr + h).to(tl.float32) * xf
    _store_read(o_ptr, g_ptr, o, g, bh, iv, rv, mv, V)
