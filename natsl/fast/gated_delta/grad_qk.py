"""Backward, chunk-parallel part 1: dq, the output and commit parts of dk, dW, and dg terms.

One program per (K tile, chunk, batch * head); it walks the V tiles. q and k may hold fewer heads (HK,
H % HK == 0: Mamba2's groups), read in place by each of their group's heads. With S = h[n], D = dh[n]
(dL/dS_start(n+1)), the forward's R and the state pass's dR:
    dQ  = scale diag(exp(gc)) dO S^T + P K,   P = scale (dO R^T) * exp(gc_i - gc_j) * [j <= i]
    dK  = P^T Q + write diag(exp(G_last - gc)) R D^T    (+ the W and A parts, in grad_wy)
    dW  = -dR S^T     (STORE_DW; the gated linear rule, R = V, has no W and skips it)
and the log-decay gradient terms of these products, already summed back onto g (reverse cumsum
inside the chunk, plus the chunk total for terms that move with G_last). P^T is P read back
transposed from a per-program scratch tile: a dot result is never transposed in registers
(flash-linear-attention issue 640: Triton 3.4-3.7 miscompiles that on Hopper).
Per chunk it also returns the two Frobenius products the route gradient needs:
    p1 = <D, K_dec^T R>,  p2 = <D, S>.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.fast.gated_delta.common import (
    chunk_decay,
    dim_tile,
    group_row0,
    launch_options,
    load_tile,
    mm,
    reverse_cumsum,
    store_tile,
    store_vec,
    transpose_through_memory,
)


@triton.jit(do_not_specialize=["B", "T", "NB"])  # one compile for every sequence length
def _grad_qk_kernel(
    q_ptr, k_ptr, gc_ptr, write_ptr, h_ptr, dh_ptr, r_ptr, dr_ptr, do_ptr,
    dq_ptr, dkp_ptr, dw_ptr, dgp_ptr, p1_ptr, p2_ptr, scratch_ptr,
    scale, B, T, H, HK, NB,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, STORE_DW: tl.constexpr,
):
    ik = tl.program_id(0)
    n = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    k0 = ik * BK
    t0 = n * C
    row0 = b.to(tl.int64) * T * H + h
    qk_row0 = group_row0(b, h, T, H, HK)  # q, k of HK heads; dq, dk per head of H
    q_ptr += qk_row0 * K
    k_ptr += qk_row0 * K
    dq_ptr += row0 * K
    dkp_ptr += row0 * K
    dw_ptr += row0 * K
    r_ptr += row0 * V
    dr_ptr += row0 * V
    do_ptr += row0 * V
    gc_ptr += row0
    write_ptr += b.to(tl.int64) * NB * H + h
    state = ((b * NB + n) * H + h).to(tl.int64) * K * V
    h_ptr += state
    dh_ptr += state

    q = load_tile(q_ptr, t0, k0, T, HK * K, K, C, BK)
    k = load_tile(k_ptr, t0, k0, T, HK * K, K, C, BK)
    dos = tl.zeros([C, BK], dtype=tl.float32)  # dO S^T
    drs = tl.zeros([C, BK], dtype=tl.float32)  # dR S^T
    rds = tl.zeros([C, BK], dtype=tl.float32)  # R D^T
    dor = tl.zeros([C, C], dtype=tl.float32)  # dO R^T
    sd = tl.zeros([BK], dtype=tl.float32)  # row sums of S * D
    for v0 in range(0, V, BV):
        do = load_tile(do_ptr, t0, v0, T, H * V, V, C, BV)
        r = load_tile(r_ptr, t0, v0, T, H * V, V, C, BV)  # in config.INTERMEDIATE's dtype
        s = load_tile(h_ptr, k0, v0, K, V, V, BK, BV)
        d = load_tile(dh_ptr, k0, v0, K, V, V, BK, BV)
        dos += mm(do, tl.trans(s), PREC)
        sd += tl.sum(s.to(tl.float32) * d.to(tl.float32), 1)
        s = s.to(r.dtype)
        d = d.to(r.dtype)
        do = do.to(r.dtype)
        if STORE_DW:
            dr = load_tile(dr_ptr, t0, v0, T, H * V, V, C, BV)
            drs += mm(dr, tl.trans(s), PREC)
        rds += mm(r, tl.trans(d), PREC)
        dor += mm(do, tl.trans(r), PREC)

    gc, dec, wt, a = chunk_decay(gc_ptr, write_ptr, t0, n, T, H, C, True)
    rows = tl.arange(0, C)
    p = tl.where(rows[:, None] >= rows[None, :], scale * dor * tl.exp(gc[:, None] - gc[None, :]), 0.0)
    wd = r_ptr.dtype.element_ty
    # P^T through this program's scratch tile (in wd, the dtype the product reads)
    scratch_ptr += ((bh.to(tl.int64) * NB + n) * tl.num_programs(0) + ik) * C * C
    pt = transpose_through_memory(scratch_ptr, p, C)
    qf = q.to(tl.float32)
    kf = k.to(tl.float32)
    dq = scale * tl.exp(gc)[:, None] * dos + mm(p.to(wd), k.to(wd), PREC)
    dk_intra = mm(pt, q.to(wd), PREC)
    dk_commit = (wt * dec)[:, None] * rds
    store_tile(dq_ptr, dq, t0, k0, T, H * K, K, C, BK)
    store_tile(dkp_ptr, dk_intra + dk_commit, t0, k0, T, H * K, K, C, BK)
    if STORE_DW:
        store_tile(dw_ptr, -drs, t0, k0, T, H * K, K, C, BK)

    # d/dgc: q . dq counts every exp(gc_i) on the query side, k . dk_intra every exp(-gc_j) on the
    # key side; the commit term moves with G_last - gc_t, so it is -y_t plus sum(y) on G_last.
    y = tl.sum(kf * dk_commit, 1)
    dgc = tl.sum(qf * dq, 1) - tl.sum(kf * dk_intra, 1) - y
    dg = reverse_cumsum(dgc) + tl.sum(y, 0)
    store_vec(dgp_ptr + ik.to(tl.int64) * B * T * H + row0, dg, t0, T, H, C)

    route = ((ik * B + b) * NB + n) * H + h
    tl.store(p1_ptr + route, tl.sum(tl.sum(kf * dec[:, None] * rds, 1), 0))
    tl.store(p2_ptr + route, tl.sum(sd, 0))


def grad_qk(q, k, gc, write, h, dh, r, dr, do, scale: float, block_size: int, precision: str, cfg: dict,
            store_dw: bool = True, dk_dtype=torch.float32):
    """(dq [B,T,H,K] in q's dtype, dk part in dk_dtype (fp32: grad_wy adds to it; the gated linear rule's is
    its whole dk), dW in the intermediates' dtype (None without store_dw: the
    gated linear rule has no W), dg parts [NK,B,T,H], p1 and p2 parts [NK,B,NB,H]). q, k may hold HK of
    the H heads (as chunk_output's); dq, dk are per head of H (the caller sums each group's)."""
    B, T, HK, K = q.shape
    H, V = do.shape[2], do.shape[-1]
    NB = triton.cdiv(T, block_size)
    BK = dim_tile(K)
    NK = triton.cdiv(K, BK)
    f32 = dict(device=q.device, dtype=torch.float32)
    dq = torch.empty(B, T, H, K, device=q.device, dtype=q.dtype)
    dkp = torch.empty(B, T, H, K, device=q.device, dtype=dk_dtype)
    # grad_wy multiplies dW in this dtype; without it the kernel never touches the pointer
    dw = torch.empty(B, T, H, K, device=q.device, dtype=r.dtype) if store_dw else dkp
    dgp = torch.empty(NK, B, T, H, **f32)
    p1 = torch.empty(NK, B, NB, H, **f32)
    p2 = torch.empty(NK, B, NB, H, **f32)
    scratch = torch.empty(B * H, NB, NK, block_size, block_size, device=q.device, dtype=r.dtype)  # P per program
    grid = (NK, NB, B * H)
    _grad_qk_kernel[grid](
        q, k, gc, write, h, dh, r, dr, do, dq, dkp, dw, dgp, p1, p2, scratch, scale, B, T, H, HK, NB,
        K=K, V=V, C=block_size, BK=BK, BV=min(cfg["BV"], dim_tile(V)), PREC=precision, STORE_DW=store_dw,
        **launch_options(cfg, block_size, dr.dtype),
    )
    return dq, dkp, dw if store_dw else None, dgp, p1, p2
