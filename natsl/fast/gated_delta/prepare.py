"""Intra-chunk WY / UT-transform preparation (forward), one program per (chunk, batch * head).

For a chunk of C tokens with in-chunk cumulative log decay gc (gc_t = sum_{s<=t} g_s):
    A = strictly-lower( diag(beta) (K K^T) * exp(gc_i - gc_j) ),  T = (I + A)^-1,
    W = T diag(beta exp(gc)) K,   U = T diag(beta) V.
Then the delta-rule "pseudo values" of the chunk are R = U - W S_start, which the state kernel uses.

T is built from four diagonal sub-blocks of C/4 rows, each inverted by forward substitution in
registers, and six off-diagonal sub-blocks from T_ij = -T_ii sum_{j<=m<i} A_im T_mj. All products
then run on sub-block tiles, so no computed tile is ever transposed in registers (Triton 3.4-3.7
miscompiles some transposed accumulators on Hopper: flash-linear-attention issue 640).

A sub-block has at least 16 rows (tl.dot's least size): a 32-token chunk is two real sub-blocks and
two past the chunk's end, whose rows read as padding (g = 0, beta = 0, k = v = 0) and are never
stored, as the rows past T of a partial last chunk are. 64- and 128-token chunks compile as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.fast.gated_delta.common import (
    dim_tile,
    fp32_precision,
    launch_options,
    load_tile,
    load_vec,
    mm,
    store_tile,
    store_vec,
)


@triton.jit
def _decayed(acc, beta_i, gc_i, gc_j):
    """beta_i * exp(gc_i - gc_j) * acc for an off-diagonal sub-block (rows later than columns)."""
    return beta_i[:, None] * tl.exp(gc_i[:, None] - gc_j[None, :]) * acc


@triton.jit
def _decayed_diag(acc, beta_i, gc_i, rows):
    """As _decayed for a diagonal sub-block, kept strictly below the diagonal."""
    strict = rows[:, None] > rows[None, :]
    return tl.where(strict, beta_i[:, None] * tl.exp(gc_i[:, None] - gc_i[None, :]) * acc, 0.0)


@triton.jit
def _substitute_row(a, inv, eye, rows, i):
    """Row i of (I + a)^-1 from its rows < i (a strictly lower): e_i - sum_j a[i, j] inv[j, :]."""
    a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)
    new = tl.sum(a_row[:, None] * inv, 0)
    return tl.where(rows[:, None] == i, eye - new[None, :], inv)


@triton.jit(do_not_specialize=["T"])  # one compile for every sequence length
def _prepare_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, gc_ptr, ai_ptr, w_ptr, u_ptr,
    T, H,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    S: tl.constexpr = C // 4 if C >= 64 else 16
    row0 = b.to(tl.int64) * T * H + h  # (b, t=0, h) in a [B, T, H] tensor
    k_ptr += row0 * K
    w_ptr += row0 * K
    v_ptr += row0 * V
    u_ptr += row0 * V
    ai_ptr += row0 * C
    g_ptr += row0
    beta_ptr += row0
    gc_ptr += row0
    t0 = n * C
    if C < 4 * S:  # the sub-blocks reach past the chunk: read and write only its own rows
        T = tl.minimum(T, t0 + C)
    t1 = t0 + S
    t2 = t0 + 2 * S
    t3 = t0 + 3 * S

    # In-chunk cumulative log decay, one sub-block at a time (padding rows read g = 0, beta = 0).
    g0 = load_vec(g_ptr, t0, T, H, S)
    g1 = load_vec(g_ptr, t1, T, H, S)
    g2 = load_vec(g_ptr, t2, T, H, S)
    g3 = load_vec(g_ptr, t3, T, H, S)
    c0 = tl.cumsum(g0, 0)
    c1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    c2 = tl.cumsum(g2, 0) + (tl.sum(g0, 0) + tl.sum(g1, 0))
    c3 = tl.cumsum(g3, 0) + (tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0))
    store_vec(gc_ptr, c0, t0, T, H, S)
    store_vec(gc_ptr, c1, t1, T, H, S)
    store_vec(gc_ptr, c2, t2, T, H, S)
    store_vec(gc_ptr, c3, t3, T, H, S)
    b0 = load_vec(beta_ptr, t0, T, H, S)
    b1 = load_vec(beta_ptr, t1, T, H, S)
    b2 = load_vec(beta_ptr, t2, T, H, S)
    b3 = load_vec(beta_ptr, t3, T, H, S)

    # K K^T, lower sub-blocks only.
    z = tl.zeros([S, S], dtype=tl.float32)
    a00, a10, a11, a20, a21, a22, a30, a31, a32, a33 = z, z, z, z, z, z, z, z, z, z
    for k0 in range(0, K, BK):
        x0 = load_tile(k_ptr, t0, k0, T, H * K, K, S, BK)
        x1 = load_tile(k_ptr, t1, k0, T, H * K, K, S, BK)
        x2 = load_tile(k_ptr, t2, k0, T, H * K, K, S, BK)
        x3 = load_tile(k_ptr, t3, k0, T, H * K, K, S, BK)
        a00 += mm(x0, tl.trans(x0), PREC)
        a10 += mm(x1, tl.trans(x0), PREC)
        a11 += mm(x1, tl.trans(x1), PREC)
        a20 += mm(x2, tl.trans(x0), PREC)
        a21 += mm(x2, tl.trans(x1), PREC)
        a22 += mm(x2, tl.trans(x2), PREC)
        a30 += mm(x3, tl.trans(x0), PREC)
        a31 += mm(x3, tl.trans(x1), PREC)
        a32 += mm(x3, tl.trans(x2), PREC)
        a33 += mm(x3, tl.trans(x3), PREC)
    rows = tl.arange(0, S)
    a00 = _decayed_diag(a00, b0, c0, rows)
    a11 = _decayed_diag(a11, b1, c1, rows)
    a22 = _decayed_diag(a22, b2, c2, rows)
    a33 = _decayed_diag(a33, b3, c3, rows)
    a10 = _decayed(a10, b1, c1, c0)
    a20 = _decayed(a20, b2, c2, c0)
    a21 = _decayed(a21, b2, c2, c1)
    a30 = _decayed(a30, b3, c3, c0)
    a31 = _decayed(a31, b3, c3, c1)
    a32 = _decayed(a32, b3, c3, c2)

    # Diagonal sub-blocks of T: four independent forward substitutions, interleaved.
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    i00, i11, i22, i33 = eye, eye, eye, eye
    for i in range(1, S):
        i00 = _substitute_row(a00, i00, eye, rows, i)
        i11 = _substitute_row(a11, i11, eye, rows, i)
        i22 = _substitute_row(a22, i22, eye, rows, i)
        i33 = _substitute_row(a33, i33, eye, rows, i)
    # Off-diagonal sub-blocks, nearest the diagonal first. Exact fp32: these tiles are small.
    i10 = -mm(i11, mm(a10, i00, "ieee"), "ieee")
    i21 = -mm(i22, mm(a21, i11, "ieee"), "ieee")
    i32 = -mm(i33, mm(a32, i22, "ieee"), "ieee")
    i20 = -mm(i22, mm(a20, i00, "ieee") + mm(a21, i10, "ieee"), "ieee")
    i31 = -mm(i33, mm(a31, i11, "ieee") + mm(a32, i21, "ieee"), "ieee")
    i30 = -mm(i33, mm(a30, i00, "ieee") + mm(a31, i10, "ieee") + mm(a32, i20, "ieee"), "ieee")

    # T for the backward, zeros above the diagonal blocks included.
    AS = H * C
    store_tile(ai_ptr, i00, t0, 0, T, AS, C, S, S)
    store_tile(ai_ptr, z, t0, S, T, AS, C, S, S)
    store_tile(ai_ptr, z, t0, 2 * S, T, AS, C, S, S)
    store_tile(ai_ptr, z, t0, 3 * S, T, AS, C, S, S)
    store_tile(ai_ptr, i10, t1, 0, T, AS, C, S, S)
    store_tile(ai_ptr, i11, t1, S, T, AS, C, S, S)
    store_tile(ai_ptr, z, t1, 2 * S, T, AS, C, S, S)
    store_tile(ai_ptr, z, t1, 3 * S, T, AS, C, S, S)
    store_tile(ai_ptr, i20, t2, 0, T, AS, C, S, S)
    store_tile(ai_ptr, i21, t2, S, T, AS, C, S, S)
    store_tile(ai_ptr, i22, t2, 2 * S, T, AS, C, S, S)
    store_tile(ai_ptr, z, t2, 3 * S, T, AS, C, S, S)
    store_tile(ai_ptr, i30, t3, 0, T, AS, C, S, S)
    store_tile(ai_ptr, i31, t3, S, T, AS, C, S, S)
    store_tile(ai_ptr, i32, t3, 2 * S, T, AS, C, S, S)
    store_tile(ai_ptr, i33, t3, 3 * S, T, AS, C, S, S)

    # W = T diag(beta exp(gc)) K and U = T diag(beta) V, sub-block rows at a time.
    s0 = b0 * tl.exp(c0)
    s1 = b1 * tl.exp(c1)
    s2 = b2 * tl.exp(c2)
    s3 = b3 * tl.exp(c3)
    for k0 in range(0, K, BK):
        y0 = s0[:, None] * load_tile(k_ptr, t0, k0, T, H * K, K, S, BK).to(tl.float32)
        y1 = s1[:, None] * load_tile(k_ptr, t1, k0, T, H * K, K, S, BK).to(tl.float32)
        y2 = s2[:, None] * load_tile(k_ptr, t2, k0, T, H * K, K, S, BK).to(tl.float32)
        y3 = s3[:, None] * load_tile(k_ptr, t3, k0, T, H * K, K, S, BK).to(tl.float32)
        store_tile(w_ptr, mm(i00, y0, PREC), t0, k0, T, H * K, K, S, BK)
        store_tile(w_ptr, mm(i10, y0, PREC) + mm(i11, y1, PREC), t1, k0, T, H * K, K, S, BK)
        store_tile(w_ptr, mm(i20, y0, PREC) + mm(i21, y1, PREC) + mm(i22, y2, PREC), t2, k0, T, H * K, K, S, BK)
        w3 = mm(i30, y0, PREC) + mm(i31, y1, PREC) + mm(i32, y2, PREC) + mm(i33, y3, PREC)
        store_tile(w_ptr, w3, t3, k0, T, H * K, K, S, BK)
    for v0 in range(0, V, BV):
        y0 = b0[:, None] * load_tile(v_ptr, t0, v0, T, H * V, V, S, BV).to(tl.float32)
        y1 = b1[:, None] * load_tile(v_ptr, t1, v0, T, H * V, V, S, BV).to(tl.float32)
        y2 = b2[:, None] * load_tile(v_ptr, t2, v0, T, H * V, V, S, BV).to(tl.float32)
        y3 = b3[:, None] * load_tile(v_ptr, t3, v0, T, H * V, V, S, BV).to(tl.float32)
        store_tile(u_ptr, mm(i00, y0, PREC), t0, v0, T, H * V, V, S, BV)
        store_tile(u_ptr, mm(i10, y0, PREC) + mm(i11, y1, PREC), t1, v0, T, H * V, V, S, BV)
        store_tile(u_ptr, mm(i20, y0, PREC) + mm(i21, y1, PREC) + mm(i22, y2, PREC), t2, v0, T, H * V, V, S, BV)
        u3 = mm(i30, y0, PREC) + mm(i31, y1, PREC) + mm(i32, y2, PREC) + mm(i33, y3, PREC)
        store_tile(u_ptr, u3, t3, v0, T, H * V, V, S, BV)


def prepare_chunks(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, block_size: int, cfg: dict,
                   work_dtype=torch.float32):
    """(gc [B,T,H] fp32, T-matrix rows [B,T,H,C] fp32, W [B,T,H,K] and U [B,T,H,V] in work_dtype)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = block_size
    gc = torch.empty(B, T, H, device=k.device, dtype=torch.float32)
    ai = torch.empty(B, T, H, C, device=k.device, dtype=torch.float32)
    w = torch.empty(B, T, H, K, device=k.device, dtype=work_dtype)
    u = torch.empty(B, T, H, V, device=k.device, dtype=work_dtype)
    grid = (triton.cdiv(T, C), B * H)
    _prepare_kernel[grid](
        k, v, g, beta, gc, ai, w, u, T, H,
        K=K, V=V, C=C, BK=dim_tile(K), BV=dim_tile(V), PREC=fp32_precision(k.dtype),
        **launch_options(cfg, block_size, work_dtype),
    )
    return gc, ai, w, u
