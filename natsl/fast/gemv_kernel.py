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
def _add(acc, part, AXIS: tl.constexpr, ACC_K: tl.constexpr):
    """acc + part. ACC_K == 1 (one tile holds the whole row): part is summed over its columns (AXIS) first, so
    the accumulator is [..., 1] rather than a tile's width, which frees the registers a one-pass tile needs."""
    if ACC_K == 1:
        part = tl.sum(part, AXIS, keep_dims=True)
    return acc + part


@triton.jit
def _normed_step(acc, ss, w, x_ptr, u_ptr, nw_ptr, s_ptr, m, stride_xm, stride_um, stride_sm, k, k_ok, store_to,
                 HAS_RES: tl.constexpr, GATE_FIRST: tl.constexpr, ACC_K: tl.constexpr):
    """Row m of a row-norm product at columns k: adds the fp32 weight tile w times h * the norm weight to acc
    [BLOCK_N, ACC_K] and h * h to ss [ACC_K] (`_add`), h = x + u rounded to x's dtype (HAS_RES: the sum's columns
    below `store_to` are written to s_ptr's row m, K in one program and 0 in the others), x * silu(u)
    (GATE_FIRST) or x. The norm scale 1 / sqrt(mean(h^2) + eps) is one number per row, so it multiplies the
    finished fp32 product instead: one pass over the row, in step with the weights."""
    if GATE_FIRST:
        x, hf = _gated(x_ptr, u_ptr, m, stride_xm, stride_um, k, k_ok)
    else:
        x = _summed(x_ptr, u_ptr, m, stride_xm, stride_um, k, k_ok, HAS_RES)
        if HAS_RES:
            tl.store(s_ptr + m * stride_sm + k, x, mask=k < store_to)
        hf = x.to(tl.float32)
    h = hf * tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    return _add(acc, w * h[None, :], 1, ACC_K), _add(ss, hf * hf, 0, ACC_K)


@triton.jit
def _accumulate_normed(acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, w, x_ptr, u_ptr, nw_ptr, s_ptr, stride_xm,
                       stride_um, stride_sm, k, k_ok, store_to, M: tl.constexpr, HAS_RES: tl.constexpr,
                       GATE_FIRST: tl.constexpr, ACC_K: tl.constexpr):
    """`_normed_step` for each of the M rows with one [BLOCK_N, BLOCK_K] weight tile."""
    w = w.to(tl.float32)
    acc0, ss0 = _normed_step(acc0, ss0, w, x_ptr, u_ptr, nw_ptr, s_ptr, 0, stride_xm, stride_um, stride_sm, k, k_ok,
                             store_to, HAS_RES, GATE_FIRST, ACC_K)
    if M > 1:
        acc1, ss1 = _normed_step(acc1, ss1, w, x_ptr, u_ptr, nw_ptr, s_ptr, 1, stride_xm, stride_um, stride_sm, k,
                                 k_ok, store_to, HAS_RES, GATE_FIRST, ACC_K)
    if M > 2:
        acc2, ss2 = _normed_step(acc2, ss2, w, x_ptr, u_ptr, nw_ptr, s_ptr, 2, stride_xm, stride_um, stride_sm, k,
                                 k_ok, store_to, HAS_RES, GATE_FIRST, ACC_K)
    if M > 3:
        acc3, ss3 = _normed_step(acc3, ss3, w, x_ptr, u_ptr, nw_ptr, s_ptr, 3, stride_xm, stride_um, stride_sm, k,
                                 k_ok, store_to, HAS_RES, GATE_FIRST, ACC_K)
    return acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3


@triton.jit
def _columns(kp, K, NORM_HEAD: tl.constexpr, HEAD_P2: tl.constexpr):
    """The input columns of tile positions kp, and which are real. Heads whose width NORM_HEAD is not a power
    of two take HEAD_P2 (the next one) positions each, the last HEAD_P2 - NORM_HEAD masked, so that a tile
    still holds whole heads and reshapes to [heads, HEAD_P2] (a GDN head of 384 at the 800M widths)."""
    col = kp
    ok = kp < K
    if HEAD_P2 != NORM_HEAD:  # both 0 without a head norm
        j = kp % HEAD_P2
        col = (kp // HEAD_P2) * NORM_HEAD + j
        ok = (j < NORM_HEAD) & (col < K)
    return col, ok


@triton.jit
def _row(x_ptr, u_ptr, nw_ptr, eps, m, stride_xm, stride_um, k, k_ok, GATED: tl.constexpr,
         NORM_HEAD: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_K: tl.constexpr):
    """Input row m at columns k in fp32; GATED: silu(x) * u, rounded to the input dtype once (as
    the compiled SwiGLU stores it) before the product. NORM_HEAD > 0: RMSNorm(x) over each head of
    NORM_HEAD columns (whole heads in a tile, each on HEAD_P2 positions: `_columns`), times the norm weight
    and silu(u), in fp32 rounded once (as the fast rms_norm with a gate stores it)."""
    x = tl.load(x_ptr + m * stride_xm + k, mask=k_ok, other=0.0)
    if NORM_HEAD > 0:
        xf = tl.reshape(x.to(tl.float32), [BLOCK_K // HEAD_P2, HEAD_P2])
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
def _accumulate(acc0, acc1, acc2, acc3, w, x_ptr, u_ptr, nw_ptr, eps, stride_xm, stride_um, k, k_ok,
                M: tl.constexpr, GATED: tl.constexpr, NORM_HEAD: tl.constexpr, HEAD_P2: tl.constexpr,
                BLOCK_K: tl.constexpr, ACC_K: tl.constexpr):
    """Add one [BLOCK_N, BLOCK_K] weight tile times each input row's columns k to its accumulator."""
    w = w.to(tl.float32)
    acc0 = _add(acc0, w * _row(x_ptr, u_ptr, nw_ptr, eps, 0, stride_xm, stride_um, k, k_ok, GATED, NORM_HEAD,
                             HEAD_P2, BLOCK_K)[None, :], 1, ACC_K)
    if M > 1:
        acc1 = _add(acc1, w * _row(x_ptr, u_ptr, nw_ptr, eps, 1, stride_xm, stride_um, k, k_ok, GATED, NORM_HEAD,
                                 HEAD_P2, BLOCK_K)[None, :], 1, ACC_K)
    if M > 2:
        acc2 = _add(acc2, w * _row(x_ptr, u_ptr, nw_ptr, eps, 2, stride_xm, stride_um, k, k_ok, GATED, NORM_HEAD,
                                 HEAD_P2, BLOCK_K)[None, :], 1, ACC_K)
    if M > 3:
        acc3 = _add(acc3, w * _row(x_ptr, u_ptr, nw_ptr, eps, 3, stride_xm, stride_um, k, k_ok, GATED, NORM_HEAD,
                                 HEAD_P2, BLOCK_K)[None, :], 1, ACC_K)
    return acc0, acc1, acc2, acc3


@triton.jit
def _tile(acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, w, x_ptr, u_ptr, nw_ptr, s_ptr, eps, stride_xm, stride_um,
          stride_sm, k, k_ok, store_to, M: tl.constexpr, GATED: tl.constexpr, NORM_HEAD: tl.constexpr,
          HEAD_P2: tl.constexpr, ROW_NORM: tl.constexpr, HAS_RES: tl.constexpr, GATE_FIRST: tl.constexpr,
          BLOCK_K: tl.constexpr, ACC_K: tl.constexpr):
    """One weight tile into the accumulators: `_accumulate_normed` (ROW_NORM, with the sums of squares) or
    `_accumulate`."""
    if ROW_NORM:
        acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = _accumulate_normed(
            acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, w, x_ptr, u_ptr, nw_ptr, s_ptr, stride_xm, stride_um,
            stride_sm, k, k_ok, store_to, M, HAS_RES, GATE_FIRST, ACC_K)
    else:
        acc0, acc1, acc2, acc3 = _accumulate(acc0, acc1, acc2, acc3, w, x_ptr, u_ptr, nw_ptr, eps, stride_xm,
                                             stride_um, k, k_ok, M, GATED, NORM_HEAD, HEAD_P2, BLOCK_K, ACC_K)
    return acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3


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
                PDL: tl.constexpr, ACC_K: tl.constexpr, HEAD_P2: tl.constexpr = 0, c0=0, C0=0, C1=0, C2=0, cw0=None,
                cw1=None, cw2=None, ct0=None, ct1=None, ct2=None,
                tb0=0, tb1=0, tb2=0, tw0=0, tw1=0, tw2=0, CONV: tl.constexpr = False, CONV_W: tl.constexpr = 1):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    # One [BLOCK_N, ACC_K] fp32 accumulator per input row, reduced once after the loop (ACC_K = BLOCK_K; 1 where
    # one tile holds the whole row, whose product is reduced as it forms: `_add`).
    acc0 = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    k_start = 0
    k_end = K  # in tile positions: padded heads (`_columns`) take HEAD_P2 positions each
    if HEAD_P2 != NORM_HEAD:
        k_end = (K // NORM_HEAD) * HEAD_P2
    # ROW_NORM: each row's sum of squares, gathered in the same pass as the product (the first program writes
    # the residual sum); the row's norm scale multiplies the product after the loop.
    ss0 = tl.zeros([ACC_K], dtype=tl.float32)
    ss1 = tl.zeros([ACC_K], dtype=tl.float32)
    ss2 = tl.zeros([ACC_K], dtype=tl.float32)
    ss3 = tl.zeros([ACC_K], dtype=tl.float32)
    store_to = tl.where(tl.program_id(0) == 0, K, 0)
    if PDL:
        # The weights are never written by earlier kernels: the first tile (all of it for one-pass
        # tiles) loads while the previous kernel finishes; the input is read after the wait.
        k, k_ok = _columns(offs_k, K, NORM_HEAD, HEAD_P2)
        w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = _tile(
            acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, w, x_ptr, u_ptr, nw_ptr, s_ptr, eps, stride_xm, stride_um,
            stride_sm, k, k_ok, store_to, M, GATED, NORM_HEAD, HEAD_P2, ROW_NORM, HAS_RES, GATE_FIRST, BLOCK_K,
            ACC_K)
        k_start = BLOCK_K
    for k0 in range(k_start, k_end, BLOCK_K):
        k, k_ok = _columns(k0 + offs_k, K, NORM_HEAD, HEAD_P2)
        w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3 = _tile(
            acc0, acc1, acc2, acc3, ss0, ss1, ss2, ss3, w, x_ptr, u_ptr, nw_ptr, s_ptr, eps, stride_xm, stride_um,
            stride_sm, k, k_ok, store_to, M, GATED, NORM_HEAD, HEAD_P2, ROW_NORM, HAS_RES, GATE_FIRST, BLOCK_K,
            ACC_K)
    rs0 = 1.0
    rs1 = 1.0
    rs2 = 1.0
    rs3 = 1.0
    if ROW_NORM:
        rs0 = 1.0 / tl.sqrt(tl.sum(ss0, 0) / K + eps)
        rs1 = 1.0 / tl.sqrt(tl.sum(ss1, 0) / K + eps)
        rs2 = 1.0 / tl.sqrt(tl.sum(ss2, 0) / K + eps)
        rs3 = 1.0 / tl.sqrt(tl.sum(ss3, 0) / K + eps)
    _store_row(y_ptr, tl.sum(acc0, 1) * rs0, 0, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2,
               tb0, tb1, tb2, tw0, tw1, tw2, CONV, CONV_W)
    if M > 1:
        _store_row(y_ptr, tl.sum(acc1, 1) * rs1, 1, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2,
                   tb0, tb1, tb2, tw0, tw1, tw2, CONV, CONV_W)
    if M > 2:
        _store_row(y_ptr, tl.sum(acc2, 1) * rs2, 2, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2,
                   tb0, tb1, tb2, tw0, tw1, tw2, CONV, CONV_W)
    if M > 3:
        _store_row(y_ptr, tl.sum(acc3, 1) * rs3, 3, stride_ym, offs_n, n_ok, c0, C0, C1, C2, cw0, cw1, cw2, ct0, ct1, ct2,
                   tb0, tb1, tb2, tw0, tw1, tw2, CONV, CONV_W)
