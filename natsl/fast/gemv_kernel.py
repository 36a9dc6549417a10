"""The Triton kernel of `natsl.fast.gemv` (a module of its own so that its helper is a
module-level jit function; importing it imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def _summed(x_ptr, u_ptr, m, stride_xm, stride_um, k, k_ok, HAS_RES: tl.constexpr):
    """Row m of x at columns k; HAS_RES: x + u rounded to x's dtype (as the plain sum `x + r` is)."""
    x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(u_ptr + m * stride_um + k, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _gated(x_ptr, u_ptr, m, stride_xm, stride_um, k, k_ok):
    """Row m of x at columns k and x * silu(u) there in fp32 (Mamba2's gate before its norm)."""
    x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
    u = tl.load(u_ptr + m * stride_um + k, mask=k_ok, other=0.0).to(tl.float32)
    return x, x.to(tl.float32) * (u / (1.0 + tl.exp(-u)))


@triton.jit
def _row_rstd(x_ptr, u_ptr, s_ptr, m, stride_xm, stride_um, stride_sm, K, eps, store_to, offs_k,
              HAS_RES: tl.constexpr, GATE_FIRST: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(h^2) + eps) of row m over all K columns (fp32), h = x + u (HAS_RES), x * silu(u)
    (GATE_FIRST) or x; with HAS_RES the sum's columns below `store_to` are also written to s_ptr's row m
    (K in one program, 0 in the others)."""
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        if GATE_FIRST:
            x, xf = _gated(x_ptr, u_ptr, m, stride_xm, stride_um, k, k_ok)
        else:
            x = _summed(x_ptr, u_ptr, m, stride_xm, stride_um, k, k_ok, HAS_RES)
            if HAS_RES:
                tl.store(s_ptr + m * stride_sm + k, x, mask=k < store_to)
            xf = x.to(tl.float32)
        ss += xf * xf
    return 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def _row(x_ptr, u_ptr, nw_ptr, eps, rstd, m, stride_xm, stride_um, k, k_ok, GATED: tl.constexpr,
         NORM_HEAD: tl.constexpr, ROW_NORM: tl.constexpr, HAS_RES: tl.constexpr, GATE_FIRST: tl.constexpr,
         BLOCK_K: tl.constexpr):
    """Input row m at columns k in fp32; GATED: silu(x) * u, rounded to the input dtype once (as
    the compiled SwiGLU stores it) before the product. NORM_HEAD > 0: RMSNorm(x) over each head of
    NORM_HEAD columns (whole heads in a tile: BLOCK_K a multiple of it), times the norm weight and
    silu(u), in fp32 rounded once (as the fast rms_norm with a gate stores it). ROW_NORM: (x + u
    where HAS_RES, rounded; x * silu(u) in fp32 where GATE_FIRST) times the row's `rstd` and the norm
    weight, rounded once (as add_rms_norm, or gated_input_rms_norm)."""
    if ROW_NORM:
        if GATE_FIRST:
            x, xf = _gated(x_ptr, u_ptr, m, stride_xm, stride_um, k, k_ok)
        else:
            x = _summed(x_ptr, u_ptr, m, stride_xm, stride_um, k, k_ok, HAS_RES)
            xf = x.to(tl.float32)
        y = xf * rstd * tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        return y.to(x.dtype).to(tl.float32)
    x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
    if NORM_HEAD > 0:
        xf = tl.reshape(x.to(tl.float32), [BLOCK_K // NORM_HEAD, NORM_HEAD])
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / NORM_HEAD + eps)
        y = tl.reshape(xf * rstd[:, None], [BLOCK_K])
        y = y * tl.load(nw_ptr + k % NORM_HEAD, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(u_ptr + m * stride_um + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (y * (g / (1.0 + tl.exp(-g)))).to(x.dtype)
    elif GATED:
        g = x.to(tl.float32)
        u = tl.load(u_ptr + m * stride_um + k, mask=k_ok, other=0.0).to(tl.float32)
        x = (g / (1.0 + tl.exp(-g)) * u).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _accumulate(acc0, acc1, acc2, acc3, w, x_ptr, u_ptr, nw_ptr, eps, rs0, rs1, rs2, rs3, stride_xm, stride_um,
                k, k_ok, M: tl.constexpr, GATED: tl.constexpr, NORM_HEAD: tl.constexpr, ROW_NORM: tl.constexpr,
                HAS_RES: tl.constexpr, GATE_FIRST: tl.constexpr, BLOCK_K: tl.constexpr):
    """Add one [BLOCK_N, BLOCK_K] weight tile times each input row's columns k to its accumulator
    (rs0-rs3: the rows' norm scales where ROW_NORM)."""
    w = w.to(tl.float32)
    acc0 += w * _row(x_ptr, u_ptr, nw_ptr, eps, rs0, 0, stride_xm, stride_um, k, k_ok, GATED, NORM_HEAD,
                     ROW_NORM, HAS_RES, GATE_FIRST, BLOCK_K)[None, :]
    if M > 1:
        acc1 += w * _row(x_ptr, u_ptr, nw_ptr, eps, rs1, 1, stride_xm, stride_um, k, k_ok, GATED, NORM_HEAD,
                         ROW_NORM, HAS_RES, GATE_FIRST, BLOCK_K)[None, :]
    if M > 2:
        acc2 += w * _row(x_ptr, u_ptr, nw_ptr, eps, rs2, 2, stride_xm, stride_um, k, k_ok, GATED, NORM_HEAD,
                         ROW_NORM, HAS_RES, GATE_FIRST, BLOCK_K)[None, :]
    if M > 3:
        acc3 += w * _row(x_ptr, u_ptr, nw_ptr, eps, rs3, 3, stride_xm, stride_um, k, k_ok, GATED, NORM_HEAD,
                         ROW_NORM, HAS_RES, GATE_FIRST, BLOCK_K)[None, :]
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_row(y_ptr, total, m, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2, tb0, tb1,
               tb2, tw0, tw1, tw2, CONV: tl.constexpr, CONV_W: tl.constexpr):
    """Store row m of the product (`total`, fp32) rounded to y's dtype. CONV: the output columns
    c0 .. c0 + C0 + C1 + C2 are up to three short convs' inputs (a GDN layer's q, k, v; Mamba2's xBC): each
    such column takes its conv step as natsl.fast.cached's conv step kernel does, from the rounded product
    (its weights cw [C, CONV_W + 1], its tail ct [B, CONV_W, C] with strides tb, tw, shifted in place: a
    column's tail is this program's alone) and stores SiLU of the fp32 sum, rounded once."""
    out_ty = y_ptr.dtype.element_ty
    y = total.to(out_ty)
    if CONV:
        c = offs_n - c0
        in0 = (c >= 0) & (c < C0)
        in1 = (c >= C0) & (c < C0 + C1)
        on = (in0 | in1 | ((c >= C0 + C1) & (c < C0 + C1 + C2))) & n_ok
        col = tl.where(on, tl.where(in0, c, tl.where(in1, c - C0, c - C0 - C1)), 0)
        w = tl.where(in0, cw0, tl.where(in1, cw1, cw2)) + col * (CONV_W + 1)
        t = tl.where(in0, ct0 + m * tb0, tl.where(in1, ct1 + m * tb1, ct2 + m * tb2)) + col
        tw = tl.where(in0, tw0, tl.where(in1, tw1, tw2))
        acc = y.to(tl.float32) * tl.load(w + CONV_W, mask=on, other=0.0).to(tl.float32)
        prev = tl.load(t, mask=on, other=0.0)
        acc += prev.to(tl.float32) * tl.load(w, mask=on, other=0.0).to(tl.float32)
        for j in tl.static_range(1, CONV_W):
            cur = tl.load(t + j * tw, mask=on, other=0.0)
            acc += cur.to(tl.float32) * tl.load(w + j, mask=on, other=0.0).to(tl.float32)
            tl.store(t + (j - 1) * tw, cur, mask=on)
        tl.store(t + (CONV_W - 1) * tw, y.to(ct0.dtype.element_ty), mask=on)
        y = tl.where(on, (acc / (1.0 + tl.exp(-acc))).to(out_ty), y)
    tl.store(y_ptr + m * stride_ym + offs_n, y, mask=n_ok)


@triton.jit
def gemv_kernel(x_ptr, u_ptr, w_ptr, y_ptr, nw_ptr, s_ptr, eps, N, K, stride_xm, stride_um, stride_wn, stride_ym,
                stride_sm, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                NORM_HEAD: tl.constexpr, ROW_NORM: tl.constexpr, HAS_RES: tl.constexpr, GATE_FIRST: tl.constexpr,
                PDL: tl.constexpr, c0=0, C0=0, C1=0, C2=0, cw0=None, cw1=None, cw2=None, ct0=None, ct1=None, ct2=None,
                tb0=0, tb1=0, tb2=0, tw0=0, tw1=0, tw2=0, CONV: tl.constexpr = False, CONV_W: tl.constexpr = 1):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    # One [BLOCK_N, BLOCK_K] fp32 accumulator per input row, reduced once after the loop.
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = 0
    if PDL:
        # The weights are never written by earlier kernels: the first tile (all of it for one-pass
        # tiles) loads while the previous kernel finishes; the input is read after the wait.
        k_ok = offs_k < K
        w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rs0 = 1.0
    rs1 = 1.0
    rs2 = 1.0
    rs3 = 1.0
    if ROW_NORM:
        # every program takes each row's norm in a pass over it (a few KB, from L2); the first writes the sum
        store = tl.where(tl.program_id(0) == 0, K, 0)
        rs0 = _row_rstd(x_ptr, u_ptr, s_ptr, 0, stride_xm, stride_um, stride_sm, K, eps, store, offs_k, HAS_RES,
                        GATE_FIRST, BLOCK_K)
        if M > 1:
            rs1 = _row_rstd(x_ptr, u_ptr, s_ptr, 1, stride_xm, stride_um, stride_sm, K, eps, store, offs_k,
                            HAS_RES, GATE_FIRST, BLOCK_K)
        if M > 2:
            rs2 = _row_rstd(x_ptr, u_ptr, s_ptr, 2, stride_xm, stride_um, stride_sm, K, eps, store, offs_k,
                            HAS_RES, GATE_FIRST, BLOCK_K)
        if M > 3:
            rs3 = _row_rstd(x_ptr, u_ptr, s_ptr, 3, stride_xm, stride_um, stride_sm, K, eps, store, offs_k,
                            HAS_RES, GATE_FIRST, BLOCK_K)
    if PDL:
        acc0, acc1, acc2, acc3 = _accumulate(acc0, acc1, acc2, acc3, w, x_ptr, u_ptr, nw_ptr, eps, rs0, rs1, rs2,
                                             rs3, stride_xm, stride_um, offs_k, k_ok, M, GATED, NORM_HEAD,
                                             ROW_NORM, HAS_RES, GATE_FIRST, BLOCK_K)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc0, acc1, acc2, acc3 = _accumulate(acc0, acc1, acc2, acc3, w, x_ptr, u_ptr, nw_ptr, eps, rs0, rs1, rs2,
                                             rs3, stride_xm, stride_um, k, k_ok, M, GATED, NORM_HEAD, ROW_NORM,
                                             HAS_RES, GATE_FIRST, BLOCK_K)
    _store_row(y_ptr, tl.sum(acc0, 1), 0, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2,
               tb0, tb1, tb2, tw0, tw1, tw2, CONV, CONV_W)
    if M > 1:
        _store_row(y_ptr, tl.sum(acc1, 1), 1, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2,
                   tb0, tb1, tb2, tw0, tw1, tw2, CONV, CONV_W)
    if M > 2:
        _store_row(y_ptr, tl.sum(acc2, 1), 2, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2,
                   tb0, tb1, tb2, tw0, tw1, tw2, CONV, CONV_W)
    if M > 3:
        _store_row(y_ptr, tl.sum(acc3, 1), 3, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2,
                   tb0, tb1, tb2, tw0, tw1, tw2, CONV, CONV_W)
