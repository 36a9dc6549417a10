"""Backward, chunk-parallel part 2: through W = T diag(beta e) K, U = T diag(beta) V and T = (I+A)^-1.

One program per (chunk, batch * head). With dU = dR and dW from grad_qk (e = exp(gc)):
    dV = diag(beta) T^T dR,   dT = dR (diag(beta) V)^T + dW (diag(beta e) K)^T,
    dA = -T^T dT T^T (strictly lower),   A = diag(beta) (K K^T) * exp(gc_i - gc_j),
    dK = dK_part + diag(beta e) T^T dW + (dB + dB^T) K with dB = dA * beta_i exp(gc_i - gc_j),
and dbeta, dg. Transposes come from memory: T^T is loaded transposed, and dB^T is read back
transposed from a per-program fp32 scratch tile after a barrier. A dot result is never transposed
in registers (flash-linear-attention issue 640: Triton 3.4-3.7 miscompiles that on Hopper).
dg sums this kernel's in-chunk terms (reverse cumsum), grad_qk's parts, and the chunk's G_last term.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.fast.gated_delta.common import (
    dim_tile,
    launch_options,
    load_tile_t,
    load_vec,
    mm,
    read_tile,
    reverse_cumsum,
    store_vec,
    token_descriptors,
    transpose_through_memory,
    write_tile,
)


@triton.jit(do_not_specialize=["B", "T", "NB"])  # one compile for every sequence length
def _grad_wy_kernel(
    k_ptr, v_ptr, beta_ptr, gc_ptr, ai_ptr, dr_ptr, dw_ptr, dkp_ptr, dgp_ptr, dgl_ptr,
    dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, scratch_ptr,
    dr_desc, v_desc, dw_desc, k_desc, dkp_desc, dv_desc, dk_desc,
    B, T, H, NB,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NKP: tl.constexpr,
    PREC: tl.constexpr, DESC: tl.constexpr,
):
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t0 = n * C
    row0 = b.to(tl.int64) * T * H + h
    k_ptr += row0 * K
    dk_ptr += row0 * K
    dkp_ptr += row0 * K
    dw_ptr += row0 * K
    v_ptr += row0 * V
    dv_ptr += row0 * V
    dr_ptr += row0 * V
    ai_ptr += row0 * C
    beta_ptr += row0
    gc_ptr += row0
    dbeta_ptr += row0
    dg_ptr += row0

    beta = load_vec(beta_ptr, t0, T, H, C)
    gc = load_vec(gc_ptr, t0, T, H, C)
    be = beta * tl.exp(gc)

    # Only dT and K K^T are accumulated (dT^T is never formed): at C = 64 and 4 warps every [C, C] fp32
    # accumulator holds 32 of a thread's 255 registers, and each one dropped saves a product per tile.
    dtm = tl.zeros([C, C], dtype=tl.float32)  # dT
    kk = tl.zeros([C, C], dtype=tl.float32)  # K K^T
    dbeta = tl.zeros([C], dtype=tl.float32)
    dgc = tl.zeros([C], dtype=tl.float32)
    # Products run in the intermediates' dtype wd (config.INTERMEDIATE: bf16, or fp32 -> tf32); sums fp32.
    wd = dr_ptr.dtype.element_ty
    tmtw = load_tile_t(ai_ptr, t0, 0, T, H * C, C, C, C).to(wd)  # T^T
    for v0 in range(0, V, BV):
        dr = read_tile(dr_desc, dr_ptr, b, h, t0, v0, T, H * V, V, C, BV, DESC)
        vv = read_tile(v_desc, v_ptr, b, h, t0, v0, T, H * V, V, C, BV, DESC).to(tl.float32)
        du = mm(tmtw, dr, PREC)  # T^T dU
        write_tile(dv_desc, dv_ptr, beta[:, None] * du, b, h, t0, v0, T, H * V, V, C, BV, DESC)
        dbeta += tl.sum(vv * du, 1)
        dtm += mm(dr, tl.trans((beta[:, None] * vv).to(wd)), PREC)
    for k0 in range(0, K, BK):
        dw = read_tile(dw_desc, dw_ptr, b, h, t0, k0, T, H * K, K, C, BK, DESC).to(wd)
        kx = read_tile(k_desc, k_ptr, b, h, t0, k0, T, H * K, K, C, BK, DESC)
        ek = tl.exp(gc)[:, None] * kx.to(tl.float32)
        dx = mm(tmtw, dw, PREC)  # T^T dW
        dtm += mm(dw, tl.trans((beta[:, None] * ek).to(wd)), PREC)  # dW (diag(beta e) K)^T
        edx = tl.sum(ek * dx, 1)
        dbeta += edx
        dgc += beta * edx
        kk += mm(kx, tl.trans(kx), PREC)

    rows = tl.arange(0, C)
    lower = rows[:, None] > rows[None, :]
    tmt = load_tile_t(ai_ptr, t0, 0, T, H * C, C, C, C)  # T^T again, fp32 (not kept live through the loops)
    da = tl.where(lower, -mm(mm(tmt, dtm, PREC), tmt, PREC), 0.0)
    decay = tl.where(lower, tl.exp(gc[:, None] - gc[None, :]), 0.0)
    dak = da * decay * kk
    dbeta += tl.sum(dak, 1)
    daa = beta[:, None] * dak  # dA * A
    dgc += tl.sum(daa, 1) - tl.sum(daa, 0)
    # dB + dB^T, the transpose through this program's fp32 scratch tile
    db = beta[:, None] * da * decay
    scratch_ptr += (bh.to(tl.int64) * NB + n) * C * C
    dbsym = (db + transpose_through_memory(scratch_ptr, db, C)).to(wd)

    for k0 in range(0, K, BK):
        dw = read_tile(dw_desc, dw_ptr, b, h, t0, k0, T, H * K, K, C, BK, DESC).to(wd)
        kw = read_tile(k_desc, k_ptr, b, h, t0, k0, T, H * K, K, C, BK, DESC).to(wd)
        dk = read_tile(dkp_desc, dkp_ptr, b, h, t0, k0, T, H * K, K, C, BK, DESC)
        dk += be[:, None] * mm(tmtw, dw, PREC) + mm(dbsym, kw, PREC)
        write_tile(dk_desc, dk_ptr, dk, b, h, t0, k0, T, H * K, K, C, BK, DESC)

    dg = reverse_cumsum(dgc) + tl.load(dgl_ptr + (b * NB + n) * H + h)
    for i in tl.static_range(NKP):
        dg += load_vec(dgp_ptr + i * B * T * H + row0, t0, T, H, C)
    store_vec(dg_ptr, dg, t0, T, H, C)
    store_vec(dbeta_ptr, dbeta, t0, T, H, C)


def grad_wy(k, v, beta, gc, ai, dr, dw, dkp, dgp, dg_last, block_size: int, precision: str, cfg: dict):
    """(dk in k's dtype, dv in v's dtype, dbeta fp32 [B,T,H], dg fp32 [B,T,H])."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    NB = triton.cdiv(T, block_size)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, H, device=k.device, dtype=torch.float32)
    dg = torch.empty(B, T, H, device=k.device, dtype=torch.float32)
    scratch = torch.empty(B * H, NB, block_size, block_size, device=k.device, dtype=torch.float32)  # dB per chunk
    BK, BV = dim_tile(K), dim_tile(V)
    # The loop tiles through TMA descriptors where config.GRAD_WY["descriptors"] says so (the default: faster
    # on the H200) and the tensors allow; without them each stage of the software pipeline carries [C, 64]
    # pointer and mask tensors.
    on = cfg.get("descriptors", False)
    v_side = token_descriptors((dr, v, dv), block_size, BV, on)
    k_side = token_descriptors((dw, k, dkp, dk), block_size, BK, on)
    use_desc = v_side is not None and k_side is not None
    # None (a constexpr) when off, so the default kernel compiles exactly as it did without descriptors.
    dr_d, v_d, dv_d = v_side if use_desc else (None,) * 3
    dw_d, k_d, dkp_d, dk_d = k_side if use_desc else (None,) * 4
    grid = (NB, B * H)
    _grad_wy_kernel[grid](
        k, v, beta, gc, ai, dr, dw, dkp, dgp, dg_last, dk, dv, dbeta, dg, scratch,
        dr_d, v_d, dw_d, k_d, dkp_d, dv_d, dk_d, B, T, H, NB,
        K=K, V=V, C=block_size, BK=BK, BV=BV, NKP=dgp.shape[0], PREC=precision, DESC=use_desc,
        **launch_options(cfg, block_size, dr.dtype),
    )
    return dk, dv, dbeta, dg
