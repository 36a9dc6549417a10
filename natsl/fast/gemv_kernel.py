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
def gemv_kernel(x_ptr, u_ptr, w_ptr, y_ptr, nw_ptr, s_ptr, eps, N, K, stride_xm, stride_um, stride_wn, stride_ym,
                stride_sm, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                NORM_HEAD: tl.constexpr, ROW_NORM: tl.constexpr, HAS_RES: tl.constexpr, GATE_FIRST: tl.constexpr,
                PDL: tl.constexpr):
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
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, tl.sum(acc0, 1).to(out_ty), mask=n_ok)
    if M > 1:
        tl.store(y_ptr + stride_ym + offs_n, tl.sum(acc1, 1).to(out_ty), mask=n_ok)
    if M > 2:
        tl.store(y_ptr + 2 * stride_ym + offs_n, tl.sum(acc2, 1).to(out_ty), mask=n_ok)
    if M > 3:
        tl.store(y_ptr + 3 * stride_ym + offs_n, tl.sum(acc3, 1).to(out_ty), mask=n_ok)
