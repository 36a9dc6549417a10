"""Chunk-parallel output kernel and its transpose (the intra-chunk part of dL/dR).

With S = S_start(n), R the chunk's pseudo values and gc its cumulative log decay:
    O = scale * ( diag(exp(gc)) Q S + (Q K^T * exp(gc_i - gc_j) * [j <= i]) R )
The transposed intra-chunk product dR_local = scale * (...)^T dO is built from K Q^T directly, so
no dot result is transposed in registers. With COMMIT (the gated linear rule, whose R is V itself) the same
kernel adds the commit's term from the reverse pass's D = dh[n]: dV = dR_local + write diag(exp(G_last - gc)) K D,
the whole of dL/dV, chunk-parallel, so that the sequential pass carries only the D recurrence (as
flash-linear-attention splits chunk_bwd_dh from chunk_bwd_dv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.fast.gated_delta.common import (chunk_decay, dim_tile, group_row0, launch_options, load_tile, load_vec, mm,
                                           store_tile)


@triton.jit(do_not_specialize=["T", "NB"])  # one compile for every sequence length
def _output_kernel(
    q_ptr, k_ptr, gc_ptr, h_ptr, r_ptr, o_ptr,
    scale, T, H, HK, NB,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    iv = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    v0 = iv * BV
    t0 = n * C
    row0 = b.to(tl.int64) * T * H + h
    qk_row0 = group_row0(b, h, T, H, HK)  # q, k of HK heads: head h reads its group's
    q_ptr += qk_row0 * K
    k_ptr += qk_row0 * K
    r_ptr += row0 * V
    o_ptr += row0 * V
    gc_ptr += row0
    h_ptr += ((b * NB + n) * H + h).to(tl.int64) * K * V

    qs = tl.zeros([C, BV], dtype=tl.float32)
    qk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, BK):
        q = load_tile(q_ptr, t0, k0, T, HK * K, K, C, BK)
        k = load_tile(k_ptr, t0, k0, T, HK * K, K, C, BK)
        s = load_tile(h_ptr, k0, v0, K, V, V, BK, BV)
        qs += mm(q, s, PREC)
        qk += mm(q, tl.trans(k), PREC)
    gc = load_vec(gc_ptr, t0, T, H, C)
    rows = tl.arange(0, C)
    p = tl.where(rows[:, None] >= rows[None, :], qk * tl.exp(gc[:, None] - gc[None, :]), 0.0)
    r = load_tile(r_ptr, t0, v0, T, H * V, V, C, BV)
    o = scale * (tl.exp(gc)[:, None] * qs + mm(p.to(r.dtype), r, PREC))
    store_tile(o_ptr, o, t0, v0, T, H * V, V, C, BV)


@triton.jit(do_not_specialize=["T", "NB"])
def _local_dr_kernel(
    q_ptr, k_ptr, gc_ptr, do_ptr, drl_ptr, write_ptr, dh_ptr,
    scale, T, H, HK, NB,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, COMMIT: tl.constexpr, DECAY_SKIPPED: tl.constexpr,
):
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t0 = n * C
    row0 = b.to(tl.int64) * T * H + h
    qk_row0 = group_row0(b, h, T, H, HK)
    q_ptr += qk_row0 * K
    k_ptr += qk_row0 * K
    do_ptr += row0 * V
    drl_ptr += row0 * V
    gc_ptr += row0

    kq = tl.zeros([C, C], dtype=tl.float32)  # kq[j, i] = k_j . q_i
    for k0 in range(0, K, BK):
        q = load_tile(q_ptr, t0, k0, T, HK * K, K, C, BK)
        k = load_tile(k_ptr, t0, k0, T, HK * K, K, C, BK)
        kq += mm(k, tl.trans(q), PREC)
    if COMMIT:
        gc, dec, wt, _ = chunk_decay(gc_ptr, write_ptr + b.to(tl.int64) * NB * H + h, t0, n, T, H, C, DECAY_SKIPPED)
        commit = wt * dec  # the commit's weight of each row's value
        dh_ptr += ((b * NB + n) * H + h).to(tl.int64) * K * V
    else:
        gc = load_vec(gc_ptr, t0, T, H, C)
    rows = tl.arange(0, C)
    pt = tl.where(rows[:, None] <= rows[None, :], scale * kq * tl.exp(gc[None, :] - gc[:, None]), 0.0)
    wd = drl_ptr.dtype.element_ty
    pt = pt.to(wd)
    for v0 in range(0, V, BV):
        do = load_tile(do_ptr, t0, v0, T, H * V, V, C, BV).to(wd)
        dr = mm(pt, do, PREC)
        if COMMIT:
            kd = tl.zeros([C, BV], dtype=tl.float32)
            for k0 in range(0, K, BK):
                k = load_tile(k_ptr, t0, k0, T, HK * K, K, C, BK).to(wd)
                kd += mm(k, load_tile(dh_ptr, k0, v0, K, V, V, BK, BV).to(wd), PREC)
            dr += commit[:, None] * kd
        store_tile(drl_ptr, dr, t0, v0, T, H * V, V, C, BV)


def chunk_output(q, k, gc, h, r, scale: float, block_size: int, precision: str, cfg: dict) -> torch.Tensor:
    """O [B,T,H,V] in q's dtype; q, k contiguous [B,T,HK,K] with H % HK == 0 (head h reads q, k head
    h // (H // HK): Mamba2's groups, read in place rather than expanded)."""
    B, T, HK, K = q.shape
    H, V = r.shape[2], r.shape[-1]
    NB = triton.cdiv(T, block_size)
    BV = min(cfg["BV"], dim_tile(V))
    o = torch.empty(B, T, H, V, device=q.device, dtype=q.dtype)
    grid = (triton.cdiv(V, BV), NB, B * H)
    _output_kernel[grid](
        q, k, gc, h, r, o, scale, T, H, HK, NB,
        K=K, V=V, C=block_size, BK=dim_tile(K), BV=BV, PREC=precision,
        **launch_options(cfg, block_size, r.dtype),
    )
    return o


def local_dr(q, k, gc, do, scale: float, block_size: int, precision: str, cfg: dict, work_dtype, write=None, dh=None,
             decay_skipped_blocks: bool = True) -> torch.Tensor:
    """dR_local [B,T,H,V] in work_dtype: the intra-chunk part of dL/dR (q, k on HK heads as chunk_output's).
    With `write` (fp32 [B,NB,H]) and `dh` ([B,NB,H,K,V], the reverse pass's dL/dS_start(n+1)) also the
    commit's term: the gated linear rule's whole dL/dV."""
    B, T, HK, K = q.shape
    H, V = do.shape[2], do.shape[-1]
    NB = triton.cdiv(T, block_size)
    drl = torch.empty(B, T, H, V, device=q.device, dtype=work_dtype)
    grid = (NB, B * H)
    _local_dr_kernel[grid](
        q, k, gc, do, drl, write, dh, scale, T, H, HK, NB,
        K=K, V=V, C=block_size, BK=dim_tile(K), BV=min(cfg["BV"], dim_tile(V)), PREC=precision,
        COMMIT=dh is not None, DECAY_SKIPPED=decay_skipped_blocks, **launch_options(cfg, block_size, work_dtype),
    )
    return drl
