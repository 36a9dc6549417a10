"""The gated linear rule's dL/dV, chunk-parallel, after the reverse state pass.

With D = dh[n] = dL/dS_start(n+1) from the state pass, chunk n's values reach the loss through its own
outputs and through the commit into S_start(n+1):
    dV = P^T dO + write diag(exp(G_last - gc)) K D,   P = scale (Q K^T) * exp(gc_i - gc_j) * [j <= i]
One program per (chunk, batch * head) builds K Q^T once and walks the V tiles. Both products are summed
in fp32 and stored once, so the sequential state pass carries only the D recurrence (as
flash-linear-attention splits chunk_bwd_dh from chunk_bwd_dv). q, k may hold HK of the H heads
(Mamba2's groups), read in place by every head of their group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.fast.gated_delta.common import chunk_decay, dim_tile, group_row0, launch_options, load_tile, mm, store_tile


@triton.jit(do_not_specialize=["T", "NB"])  # one compile for every sequence length
def _dv_kernel(
    q_ptr, k_ptr, gc_ptr, write_ptr, do_ptr, dh_ptr, dv_ptr,
    scale, T, H, HK, NB,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY_SKIPPED: tl.constexpr, PREC: tl.constexpr,
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
    dv_ptr += row0 * V
    gc_ptr += row0
    write_ptr += b.to(tl.int64) * NB * H + h
    dh_ptr += ((b * NB + n) * H + h).to(tl.int64) * K * V
    wd = k_ptr.dtype.element_ty  # the inputs' dtype: operands of both products

    kq = tl.zeros([C, C], dtype=tl.float32)  # kq[j, i] = k_j . q_i: P^T without a register transpose
    for k0 in range(0, K, BK):
        q = load_tile(q_ptr, t0, k0, T, HK * K, K, C, BK)
        k = load_tile(k_ptr, t0, k0, T, HK * K, K, C, BK)
        kq += mm(k, tl.trans(q), PREC)
    gc, dec, wt, a = chunk_decay(gc_ptr, write_ptr, t0, n, T, H, C, DECAY_SKIPPED)
    rows = tl.arange(0, C)
    pt = tl.where(rows[:, None] <= rows[None, :], scale * kq * tl.exp(gc[None, :] - gc[:, None]), 0.0).to(wd)
    commit = wt * dec  # the commit's weight of each row's value
    for v0 in range(0, V, BV):
        kd = tl.zeros([C, BV], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = load_tile(k_ptr, t0, k0, T, HK * K, K, C, BK)
            d = load_tile(dh_ptr, k0, v0, K, V, V, BK, BV)
            kd += mm(k.to(wd), d.to(wd), PREC)
        do = load_tile(do_ptr, t0, v0, T, H * V, V, C, BV).to(wd)
        dv = mm(pt, do, PREC) + commit[:, None] * kd
        store_tile(dv_ptr, dv, t0, v0, T, H * V, V, C, BV)


def chunk_dv(q, k, gc, write, do, dh, scale: float, block_size: int, decay_skipped_blocks: bool, precision: str,
             cfg: dict) -> torch.Tensor:
    """dL/dV [B,T,H,V] in q's dtype from dO and the state pass's dh [B,NB,H,K,V]; q, k contiguous
    [B,T,HK,K] with H % HK == 0."""
    B, T, HK, K = q.shape
    H, V = do.shape[2], do.shape[-1]
    NB = triton.cdiv(T, block_size)
    dv = torch.empty(B, T, H, V, device=q.device, dtype=q.dtype)
    _dv_kernel[(NB, B * H)](
        q, k, gc, write, do, dh, dv, scale, T, H, HK, NB,
        K=K, V=V, C=block_size, BK=dim_tile(K), BV=min(cfg["BV"], dim_tile(V)),
        DECAY_SKIPPED=decay_skipped_blocks, PREC=precision, **launch_options(cfg, block_size, q.dtype),
    )
    return dv
