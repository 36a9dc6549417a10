"""Backward kernels: dq; dk, dv and the route gradient dkeep; and the row term D = <dO, O>.

With P_ij = exp(A_ij - lse_i) and dS_ij = P_ij (<dO_i, v_j> - D_i):
  dv_j = sum_i P_ij dO_i,  dk_j = scale sum_i dS_ij q_i,  dq_i = scale sum_j dS_ij k_j,
  dkeep_c (per head) = sum over queries i in blocks after c and keys j in c of dS_ij,
which is docs/spec.md section 3's sum of P_ij <dO_i, v_j - O_i>. The dk/dv program of key block c already
forms every dS_ij of later queries when c is kept, so it sums them on the way ("active" policy:
no extra visits). Under "full" it also walks the later queries of a dropped block, computing
only P and dP for that sum (two matmuls instead of four; dk, dv stay zero there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.fast.block_sparse import config
from natsl.fast.block_sparse.forward import (LOG2E, cast_to, ceil_div, dot_precision, head_and_tile, kept_key_rows,
                                             mm, mma)


@triton.jit
def _row_delta_kernel(o_ptr, do_ptr, delta_ptr, so_b, so_t, so_h, sd_b, sd_t, sd_h, T, H,
                      BLOCK: tl.constexpr, DV: tl.constexpr):
    """D_i = <dO_i, O_i> in fp32, stored [B, H, T] like lse."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DV)
    ok = offs_t < T
    o = tl.load(o_ptr + b * so_b + h * so_h + offs_t[:, None] * so_t + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(do_ptr + b * sd_b + h * sd_h + offs_t[:, None] * sd_t + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(delta_ptr + bh * T + offs_t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _dq_step(dq, q, do, lse, delta, k, v, qk_scale, visible, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Add one key tile's dS @ K to dq (unscaled)."""
    s = mm(q, tl.trans(k), PREC)
    p = tl.math.exp2(s * qk_scale - lse[:, None])
    if MASKED:
        p = tl.where(visible, p, 0.0)
    dp = mm(do, tl.trans(v), PREC)
    ds = p * (dp - delta[:, None])
    return mma(cast_to(ds, k.dtype), k, dq, PREC)


@triton.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, flags_ptr, before_ptr, blocks_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sd_b, sd_t, sd_h, sdq_b, sdq_t, sdq_h,
    T, NB, H, R, qk_scale, scale,
    C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    """Mirror of the forward: a query tile walks the kept blocks before it, then its own blocks."""
    # Latest (heaviest) tiles first; HEADS_FIRST: heads on grid axis 0 (config.heads_first).
    bh, tile, n_tiles = head_and_tile(HEADS_FIRST)
    tile = n_tiles - 1 - tile
    b = bh // H
    h = bh % H
    row = (b * (H // R) + h // R) * NB
    b64 = b.to(tl.int64)
    q_ptr += b64 * sq_b + h * sq_h
    dq_ptr += b64 * sdq_b + h * sdq_h
    k_ptr += b64 * sk_b + h * sk_h
    v_ptr += b64 * sv_b + h * sv_h
    do_ptr += b64 * sd_b + h * sd_h

    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    row_ok = offs_m < T
    q = tl.load(q_ptr + offs_m[:, None] * sq_t + offs_dk[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + offs_m[:, None] * sd_t + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
    # Padding rows: lse = +inf makes their P zero.
    lse = tl.load(lse_ptr + bh * T + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + bh * T + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, DK], dtype=tl.float32)

    a0 = m0 // C
    n_rows = tl.load(before_ptr + row + a0) * C
    for it in range(0, n_rows // BLOCK_N):
        keys = kept_key_rows(blocks_ptr, row, it * BLOCK_N, offs_n, n_rows, C, BLOCK_N, False)
        k = tl.load(k_ptr + keys[:, None] * sk_t + offs_dk[None, :])
        v = tl.load(v_ptr + keys[:, None] * sv_t + offs_dv[None, :])
        dq = _dq_step(dq, q, do, lse, delta, k, v, qk_scale, None, False, PREC)
    if BLOCK_N > C:
        tail = n_rows % BLOCK_N
        if tail > 0:
            col_ok = (n_rows - tail) + offs_n < n_rows
            keys = kept_key_rows(blocks_ptr, row, n_rows - tail, offs_n, n_rows, C, BLOCK_N, True)
            k = tl.load(k_ptr + keys[:, None] * sk_t + offs_dk[None, :])
            v = tl.load(v_ptr + keys[:, None] * sv_t + offs_dv[None, :])
            dq = _dq_step(dq, q, do, lse, delta, k, v, qk_scale, col_ok[None, :], True, PREC)

    blk_m = offs_m // C
    for start in range(a0 * C, tl.minimum(m0 + BLOCK_M, T), BLOCK_N):
        keys = start + offs_n
        key_ok = keys < T
        k = tl.load(k_ptr + keys[:, None] * sk_t + offs_dk[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + keys[:, None] * sv_t + offs_dv[None, :], mask=key_ok[:, None], other=0.0)
        blk_n = keys // C
        kept_n = tl.load(flags_ptr + row + blk_n, mask=key_ok, other=0) != 0
        visible = (keys[None, :] <= offs_m[:, None]) & ((blk_n[None, :] == blk_m[:, None]) | kept_n[None, :])
        dq = _dq_step(dq, q, do, lse, delta, k, v, qk_scale, visible, True, PREC)

    dq = dq * scale
    dq_ptrs = dq_ptr + offs_m[:, None] * sdq_t + offs_dk[None, :]
    tl.store(dq_ptrs, cast_to(dq, dq_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _load_query_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, offs_m, sq_t, sd_t, T, bh,
                     DK: tl.constexpr, DV: tl.constexpr):
    """q^T [DK, BM], dO [BM, DV], lse and D of a query tile; padding rows give P = 0, dO = 0."""
    ok = offs_m < T
    qT = tl.load(q_ptr + offs_m[None, :] * sq_t + tl.arange(0, DK)[:, None], mask=ok[None, :], other=0.0)
    do = tl.load(do_ptr + offs_m[:, None] * sd_t + tl.arange(0, DV)[None, :], mask=ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * T + offs_m, mask=ok, other=float("inf"))
    delta = tl.load(delta_ptr + bh * T + offs_m, mask=ok, other=0.0)
    return qT, do, lse, delta


@triton.jit
def _dkdv_step(dk, dv, k, v, qT, do, lse, delta, qk_scale, visible, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Add one query tile to dk, dv (transposed: key rows first); also return the tile's sum of dS."""
    sT = mm(k, qT, PREC)  # [BLOCK_N, BLOCK_M]
    pT = tl.math.exp2(sT * qk_scale - lse[None, :])
    if MASKED:
        pT = tl.where(visible, pT, 0.0)
    dv = mma(cast_to(pT, do.dtype), do, dv, PREC)
    dpT = mm(v, tl.trans(do), PREC)
    dsT = pT * (dpT - delta[None, :])
    dk = mma(cast_to(dsT, qT.dtype), tl.trans(qT), dk, PREC)
    return dk, dv, tl.sum(tl.sum(dsT, 1), 0)


@triton.jit
def _dkeep_only_step(k, v, qT, do, lse, delta, qk_scale, PREC: tl.constexpr):
    """Sum of dS over a query tile for a dropped key block: P and dP only."""
    sT = mm(k, qT, PREC)
    pT = tl.math.exp2(sT * qk_scale - lse[None, :])
    dpT = mm(v, tl.trans(do), PREC)
    return tl.sum(tl.sum(pT * (dpT - delta[None, :]), 1), 0)


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, dkeep_ptr, lse_ptr, delta_ptr, flags_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sd_b, sd_t, sd_h,
    sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
    T, NB, H, R, qk_scale, scale,
    C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    FULL: tl.constexpr, PREC: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    """One program per (key tile inside block c, head): its dk, dv and its share of dkeep_c."""
    # earliest keys (most later queries) are scheduled first; HEADS_FIRST: heads on grid axis 0
    bh, pid_n, n_tiles = head_and_tile(HEADS_FIRST)
    b = bh // H
    h = bh % H
    row = (b * (H // R) + h // R) * NB
    b64 = b.to(tl.int64)
    q_ptr += b64 * sq_b + h * sq_h
    k_ptr += b64 * sk_b + h * sk_h
    v_ptr += b64 * sv_b + h * sv_h
    do_ptr += b64 * sd_b + h * sd_h
    dk_ptr += b64 * sdk_b + h * sdk_h
    dv_ptr += b64 * sdv_b + h * sdv_h

    n0 = pid_n * BLOCK_N
    c = n0 // C  # BLOCK_N <= C: the whole tile lies in block c
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    k = tl.load(k_ptr + offs_n[:, None] * sk_t + offs_dk[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(v_ptr + offs_n[:, None] * sv_t + offs_dv[None, :], mask=key_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DV], dtype=tl.float32)
    offs_bm = tl.arange(0, BLOCK_M)

    # Queries of block c from the tile's first key on: causal. They add nothing to dkeep_c.
    for start in range(n0, tl.minimum(c * C + C, T), BLOCK_M):
        offs_m = start + offs_bm
        qT, do, lse, delta = _load_query_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, offs_m, sq_t, sd_t, T, bh, DK, DV)
        visible = offs_m[None, :] >= offs_n[:, None]
        dk, dv, _ = _dkdv_step(dk, dv, k, v, qT, do, lse, delta, qk_scale, visible, True, PREC)

    # Later queries see all of block c when it is kept, none of it when it is dropped.
    dkeep = tl.zeros([], dtype=tl.float32)
    kept = tl.load(flags_ptr + row + c) != 0
    if kept:
        for start in range(c * C + C, T, BLOCK_M):
            offs_m = start + offs_bm
            qT, do, lse, delta = _load_query_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, offs_m, sq_t, sd_t, T, bh, DK, DV)
            dk, dv, ds_sum = _dkdv_step(dk, dv, k, v, qT, do, lse, delta, qk_scale, None, False, PREC)
            dkeep += ds_sum
    elif FULL:
        for start in range(c * C + C, T, BLOCK_M):
            offs_m = start + offs_bm
            qT, do, lse, delta = _load_query_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, offs_m, sq_t, sd_t, T, bh, DK, DV)
            dkeep += _dkeep_only_step(k, v, qT, do, lse, delta, qk_scale, PREC)

    dk = dk * scale
    dk_ptrs = dk_ptr + offs_n[:, None] * sdk_t + offs_dk[None, :]
    dv_ptrs = dv_ptr + offs_n[:, None] * sdv_t + offs_dv[None, :]
    tl.store(dk_ptrs, cast_to(dk, dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptrs, cast_to(dv, dv_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dkeep_ptr + bh * n_tiles + pid_n, dkeep)


def attention_backward(q, k, v, o, lse, do, lists, scale: float, block_size: int, n_groups: int, full: bool):
    """dq, dk, dv (the inputs' dtypes and layouts) and the per-head dkeep [B, H, NB] in fp32."""
    B, T, H, DK = q.shape
    DV = v.shape[-1]
    NB = lists.flags.shape[1]
    R = H // n_groups
    prec = dot_precision(q.dtype)
    if do.stride(-1) != 1:
        do = do.contiguous()

    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    rows = 64
    _row_delta_kernel[(ceil_div(T, rows), B * H)](
        o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        T, H, BLOCK=rows, DV=DV,
    )

    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    strides = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
    )

    cfg = config.dkdv_config(q.element_size(), DK, DV)
    block_n, block_m = config.dkdv_tiles(cfg, block_size)
    tiles_per_block = block_size // block_n
    dkeep = torch.empty(B, H, NB, tiles_per_block, dtype=torch.float32, device=q.device)
    grid, heads_first = config.program_grid(B * H, NB * tiles_per_block, q.device)
    _dkdv_kernel[grid](
        q, k, v, do, dk, dv, dkeep, lse, delta, lists.flags, *strides,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        T, NB, H, R, scale * LOG2E, scale,
        C=block_size, BLOCK_N=block_n, BLOCK_M=block_m, DK=DK, DV=DV, FULL=full, PREC=prec,
        HEADS_FIRST=heads_first, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )

    cfg = config.dq_config(q.element_size(), DK, DV)
    grid, heads_first = config.program_grid(B * H, ceil_div(T, cfg["BLOCK_M"]), q.device)
    _dq_kernel[grid](
        q, k, v, do, dq, lse, delta, lists.flags, lists.before, lists.blocks, *strides,
        dq.stride(0), dq.stride(1), dq.stride(2),
        T, NB, H, R, scale * LOG2E, scale,
        C=block_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], DK=DK, DV=DV, PREC=prec,
        HEADS_FIRST=heads_first, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dq, dk, dv, dkeep.sum(-1)
