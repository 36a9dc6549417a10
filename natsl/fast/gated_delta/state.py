"""The two sequential kernels: the chunk-state recurrence forward and its reverse (dL/dS) pass.

One program owns a BV-wide column slice of the [K, V] state of one (batch, head): every operation
on the state acts on its columns independently, so the V slices never talk. The K rows are held as
up to four BK-row register tiles (K = 192 is three tiles of 64; a tile past K is never generated).

Forward, chunk n (S = S_start(n), stored as h[n] for the output and backward kernels):
    R = U - W S                               (pseudo values, stored)
    S <- a S + write * K_dec^T R              (the route commit; a, K_dec: common.chunk_decay)
Backward, chunk n from last to first (D = dL/dS_start(n+1), stored as dh[n]):
    dR = dR_local + write * K_dec D           (stored)
    D  <- a D + scale (diag(exp(gc)) Q)^T dO - W^T dR
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.devices import sm_count
from natsl.fast.gated_delta.common import (chunk_decay, commit_tile, dim_tile, k_tiles, launch_options, load_tile,
                                          load_tile_t, mm, store_tile)
from natsl.fast.gated_delta.spans import span_commit, span_release, span_start


@triton.jit
def _ws_tile(w_ptr, s, t0, k0, T, H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """W[:, k0:k0+BK] S[k0:k0+BK, :] for one K tile, in W's dtype."""
    w = load_tile(w_ptr, t0, k0, T, H * K, K, C, BK)
    return mm(w, s.to(w.dtype), PREC)


@triton.jit(do_not_specialize=["T", "NB"])  # one compile for every sequence length
def _state_fwd_kernel(
    w_ptr, u_ptr, k_ptr, gc_ptr, write_ptr, h0_ptr, h_ptr, r_ptr, ht_ptr, e_ptr,
    T, H, NB,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DECAY_SKIPPED: tl.constexpr, PREC: tl.constexpr,
    M: tl.constexpr = 1,
):
    iv = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    v0 = iv * BV
    row0 = b.to(tl.int64) * T * H + h
    w_ptr += row0 * K
    k_ptr += row0 * K
    u_ptr += row0 * V
    r_ptr += row0 * V
    gc_ptr += row0
    write_ptr += b.to(tl.int64) * NB * H + h
    wd = w_ptr.dtype.element_ty  # the intermediates' dtype: operands of both products

    s0 = tl.zeros([BK, BV], dtype=tl.float32)
    s1 = tl.zeros([BK, BV], dtype=tl.float32)
    s2 = tl.zeros([BK, BV], dtype=tl.float32)
    s3 = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        h0_ptr += bh.to(tl.int64) * K * V
        s0 = load_tile(h0_ptr, 0, v0, K, V, V, BK, BV).to(tl.float32)
        if NK > 1:
            s1 = load_tile(h0_ptr, BK, v0, K, V, V, BK, BV).to(tl.float32)
        if NK > 2:
            s2 = load_tile(h0_ptr, 2 * BK, v0, K, V, V, BK, BV).to(tl.float32)
        if NK > 3:
            s3 = load_tile(h0_ptr, 3 * BK, v0, K, V, V, BK, BV).to(tl.float32)

    if M > 1:  # routing blocks of M chunks (spans.py): the block's start state beside the running one
        e_ptr += b.to(tl.int64) * NB * H + h
        b0, b1, b2, b3 = s0, s1, s2, s3
    for n in range(NB):
        t0 = n * C
        if M > 1:
            first = n % M == 0
            b0, b1, b2, b3 = span_start(first, b0, b1, b2, b3, s0, s1, s2, s3, NK)
        hb = h_ptr + ((b * NB + n) * H + h).to(tl.int64) * K * V
        store_tile(hb, s0, 0, v0, K, V, V, BK, BV)
        if NK > 1:
            store_tile(hb, s1, BK, v0, K, V, V, BK, BV)
        if NK > 2:
            store_tile(hb, s2, 2 * BK, v0, K, V, V, BK, BV)
        if NK > 3:
            store_tile(hb, s3, 3 * BK, v0, K, V, V, BK, BV)

        # R = U - W S (R is a small difference: the delta rule's prediction error).
        ws = _ws_tile(w_ptr, s0, t0, 0, T, H, K, C, BK, PREC)
        if NK > 1:
            ws += _ws_tile(w_ptr, s1, t0, BK, T, H, K, C, BK, PREC)
        if NK > 2:
            ws += _ws_tile(w_ptr, s2, t0, 2 * BK, T, H, K, C, BK, PREC)
        if NK > 3:
            ws += _ws_tile(w_ptr, s3, t0, 3 * BK, T, H, K, C, BK, PREC)
        r = load_tile(u_ptr, t0, v0, T, H * V, V, C, BV).to(tl.float32) - ws
        store_tile(r_ptr, r, t0, v0, T, H * V, V, C, BV)

        # Commit: S <- a S + K^T (write * exp(G_last - gc) * R); the decay scales R's C rows, not K.
        gc, dec, wt, a = chunk_decay(gc_ptr, write_ptr, t0, n, T, H, C, DECAY_SKIPPED)
        if M > 1:  # S <- write Gamma S + K^T (write K_dec R) + e S_block (write: this chunk's, spans.py)
            a = wt * a
        rd = ((wt * dec)[:, None] * r).to(wd)
        s0 = commit_tile(s0, a, k_ptr, rd, t0, 0, T, H, K, C, BK, PREC)
        if NK > 1:
            s1 = commit_tile(s1, a, k_ptr, rd, t0, BK, T, H, K, C, BK, PREC)
        if NK > 2:
            s2 = commit_tile(s2, a, k_ptr, rd, t0, 2 * BK, T, H, K, C, BK, PREC)
        if NK > 3:
            s3 = commit_tile(s3, a, k_ptr, rd, t0, 3 * BK, T, H, K, C, BK, PREC)
        if M > 1:
            s0, s1, s2, s3 = span_commit(tl.load(e_ptr + n * H), s0, s1, s2, s3, b0, b1, b2, b3, NK)

    if STORE_HT:
        ht_ptr += bh.to(tl.int64) * K * V
        store_tile(ht_ptr, s0, 0, v0, K, V, V, BK, BV)
        if NK > 1:
            store_tile(ht_ptr, s1, BK, v0, K, V, V, BK, BV)
        if NK > 2:
            store_tile(ht_ptr, s2, 2 * BK, v0, K, V, V, BK, BV)
        if NK > 3:
            store_tile(ht_ptr, s3, 3 * BK, v0, K, V, V, BK, BV)


@triton.jit
def _kd_tile(k_ptr, d, t0, k0, T, H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
             wd: tl.constexpr):
    """K[:, k0:k0+BK] D[k0:k0+BK, :] for one K tile."""
    k = load_tile(k_ptr, t0, k0, T, H * K, K, C, BK).to(wd)
    return mm(k, d.to(wd), PREC)


@triton.jit
def _state_bwd_tile(d, a, q_ptr, w_ptr, dos, drw, t0, k0, T, H, K: tl.constexpr, C: tl.constexpr,
                    BK: tl.constexpr, PREC: tl.constexpr):
    """a D + Q^T dos - W^T dR for one K tile; Q^T and W^T are read transposed from memory."""
    qt = load_tile_t(q_ptr, t0, k0, T, H * K, K, C, BK).to(dos.dtype)
    wt = load_tile_t(w_ptr, t0, k0, T, H * K, K, C, BK).to(dos.dtype)
    return a * d + mm(qt, dos, PREC) - mm(wt, drw, PREC)


@triton.jit(do_not_specialize=["T", "NB"])
def _state_bwd_kernel(
    q_ptr, k_ptr, w_ptr, gc_ptr, write_ptr, do_ptr, drl_ptr, dht_ptr, dh_ptr, dr_ptr, dh0_ptr, e_ptr,
    scale, T, H, NB,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DECAY_SKIPPED: tl.constexpr, PREC: tl.constexpr,
    M: tl.constexpr = 1,
):
    iv = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    v0 = iv * BV
    row0 = b.to(tl.int64) * T * H + h
    q_ptr += row0 * K
    k_ptr += row0 * K
    w_ptr += row0 * K
    do_ptr += row0 * V
    drl_ptr += row0 * V
    dr_ptr += row0 * V
    gc_ptr += row0
    write_ptr += b.to(tl.int64) * NB * H + h
    wd: tl.constexpr = w_ptr.dtype.element_ty

    d0 = tl.zeros([BK, BV], dtype=tl.float32)
    d1 = tl.zeros([BK, BV], dtype=tl.float32)
    d2 = tl.zeros([BK, BV], dtype=tl.float32)
    d3 = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dht_ptr += bh.to(tl.int64) * K * V
        d0 = load_tile(dht_ptr, 0, v0, K, V, V, BK, BV).to(tl.float32)
        if NK > 1:
            d1 = load_tile(dht_ptr, BK, v0, K, V, V, BK, BV).to(tl.float32)
        if NK > 2:
            d2 = load_tile(dht_ptr, 2 * BK, v0, K, V, V, BK, BV).to(tl.float32)
        if NK > 3:
            d3 = load_tile(dht_ptr, 3 * BK, v0, K, V, V, BK, BV).to(tl.float32)

    if M > 1:  # the block start state's gradient, gathered from the block's chunks (spans.py)
        e_ptr += b.to(tl.int64) * NB * H + h
        p0 = tl.zeros([BK, BV], dtype=tl.float32)
        p1, p2, p3 = p0, p0, p0
    for m in range(NB):
        n = NB - 1 - m
        t0 = n * C
        hb = dh_ptr + ((b * NB + n) * H + h).to(tl.int64) * K * V
        store_tile(hb, d0, 0, v0, K, V, V, BK, BV)
        if NK > 1:
            store_tile(hb, d1, BK, v0, K, V, V, BK, BV)
        if NK > 2:
            store_tile(hb, d2, 2 * BK, v0, K, V, V, BK, BV)
        if NK > 3:
            store_tile(hb, d3, 3 * BK, v0, K, V, V, BK, BV)

        # dR = dR_local + write * diag(exp(G_last - gc)) K D
        gc, dec, wt, a = chunk_decay(gc_ptr, write_ptr, t0, n, T, H, C, DECAY_SKIPPED)
        if M > 1:
            a = wt * a
            p0, p1, p2, p3 = span_commit(tl.load(e_ptr + n * H), p0, p1, p2, p3, d0, d1, d2, d3, NK)
        kd = _kd_tile(k_ptr, d0, t0, 0, T, H, K, C, BK, PREC, wd)
        if NK > 1:
            kd += _kd_tile(k_ptr, d1, t0, BK, T, H, K, C, BK, PREC, wd)
        if NK > 2:
            kd += _kd_tile(k_ptr, d2, t0, 2 * BK, T, H, K, C, BK, PREC, wd)
        if NK > 3:
            kd += _kd_tile(k_ptr, d3, t0, 3 * BK, T, H, K, C, BK, PREC, wd)
        dr = load_tile(drl_ptr, t0, v0, T, H * V, V, C, BV).to(tl.float32) + (wt * dec)[:, None] * kd
        store_tile(dr_ptr, dr, t0, v0, T, H * V, V, C, BV)

        # D <- a D + Q^T (scale exp(gc) dO) - W^T dR; the decay scales dO's C rows, not Q.
        dos = (load_tile(do_ptr, t0, v0, T, H * V, V, C, BV).to(tl.float32) * (scale * tl.exp(gc))[:, None]).to(wd)
        drw = dr.to(wd)
        d0 = _state_bwd_tile(d0, a, q_ptr, w_ptr, dos, drw, t0, 0, T, H, K, C, BK, PREC)
        if NK > 1:
            d1 = _state_bwd_tile(d1, a, q_ptr, w_ptr, dos, drw, t0, BK, T, H, K, C, BK, PREC)
        if NK > 2:
            d2 = _state_bwd_tile(d2, a, q_ptr, w_ptr, dos, drw, t0, 2 * BK, T, H, K, C, BK, PREC)
        if NK > 3:
            d3 = _state_bwd_tile(d3, a, q_ptr, w_ptr, dos, drw, t0, 3 * BK, T, H, K, C, BK, PREC)
        if M > 1:
            d0, d1, d2, d3, p0, p1, p2, p3 = span_release(n % M == 0, d0, d1, d2, d3, p0, p1, p2, p3, NK)

    if STORE_DH0:
        dh0_ptr += bh.to(tl.int64) * K * V
        store_tile(dh0_ptr, d0, 0, v0, K, V, V, BK, BV)
        if NK > 1:
            store_tile(dh0_ptr, d1, BK, v0, K, V, V, BK, BV)
        if NK > 2:
            store_tile(dh0_ptr, d2, 2 * BK, v0, K, V, V, BK, BV)
        if NK > 3:
            store_tile(dh0_ptr, d3, 3 * BK, v0, K, V, V, BK, BV)


def state_slice(V: int, cfg: dict, batch_heads: int, sms: int, work_dtype=None) -> int:
    """The V slice BV of one program of a sequential kernel (B * H * V / BV programs). cfg["BV"], or the
    wider cfg["BV_WIDE"] where that still gives every SM a program and the intermediates are 16-bit
    (the case the sweeps covered): fewer, longer programs beat a second, mostly empty wave (config.STATE_FWD, STATE_BWD)."""
    bv = min(cfg["BV"], dim_tile(V))
    wide = cfg.get("BV_WIDE")
    if wide and work_dtype is not None and work_dtype.itemsize == 2:
        wide = min(wide, dim_tile(V))
        if batch_heads * triton.cdiv(V, wide) >= sms:
            bv = max(bv, wide)
    return bv


def batch_launches(B: int, H: int, V: int, cfg: dict, sms: int, work_dtype=None) -> list[tuple[int, int, int]]:
    """The launches of a sequential kernel as (first batch row, end row, BV): normally one over every row.
    With cfg["SPLIT_LAST_ROUND"], where the programs of the wide slices overfill whole rounds of
    cfg["PROGRAMS_PER_SM"] programs per SM by a part of a round, the rows that fill whole rounds run
    wide and the rest run in a second launch at the narrow cfg["BV"] (more, shorter programs for the
    last round: docs/kernels/gated_delta.md)."""
    bv = state_slice(V, cfg, B * H, sms, work_dtype)
    narrow = min(cfg["BV"], dim_tile(V))
    per_row = H * triton.cdiv(V, bv)
    slots = cfg.get("PROGRAMS_PER_SM", 2) * sms
    if not cfg.get("SPLIT_LAST_ROUND") or bv == narrow or B * per_row <= slots:
        return [(0, B, bv)]
    full_rows = (B * per_row // slots) * slots // per_row
    if full_rows in (0, B) or (B - full_rows) * H * triton.cdiv(V, narrow) > slots:
        return [(0, B, bv)]
    return [(0, full_rows, bv), (full_rows, B, narrow)]


def narrow(cfg: dict) -> dict:
    """A sequential kernel's launch settings for blocks of several chunks: the narrow V slice only (the
    block's start state, or its gradient, is a second set of state tiles in registers)."""
    return {**cfg, "BV_WIDE": None}


def _rows(t, b0: int, b1: int):
    """Batch rows b0:b1 of a [B, ...] tensor (a contiguous view), or None."""
    return None if t is None else t[b0:b1]


def state_forward(w, u, k, gc, write, initial_state, output_final_state: bool, block_size: int,
                  decay_skipped_blocks: bool, precision: str, cfg: dict, span=None):
    """(h [B,NB,H,K,V] in k's dtype, R [B,T,H,V] in u's dtype, final state [B,H,K,V] fp32 or None).
    `block_size` is the chunk; `span` = (M, e) where a routing block spans M > 1 chunks (spans.py), then
    `write` holds each chunk's write."""
    M, e = span or (1, None)
    if M > 1:
        cfg = narrow(cfg)
    B, T, H, K = k.shape
    V = u.shape[-1]
    NB = triton.cdiv(T, block_size)
    BK, NK = k_tiles(K)
    h = torch.empty(B, NB, H, K, V, device=k.device, dtype=k.dtype)
    r = torch.empty(B, T, H, V, device=k.device, dtype=u.dtype)
    final = torch.empty(B, H, K, V, device=k.device, dtype=torch.float32) if output_final_state else None
    for b0, b1, BV in batch_launches(B, H, V, cfg, sm_count(k.device), u.dtype):
        _state_fwd_kernel[(triton.cdiv(V, BV), (b1 - b0) * H)](
            *(_rows(t, b0, b1) for t in (w, u, k, gc, write, initial_state, h, r, final, e)), T, H, NB,
            K=K, V=V, C=block_size, BK=BK, BV=BV, NK=NK,
            HAS_H0=initial_state is not None, STORE_HT=output_final_state, DECAY_SKIPPED=decay_skipped_blocks or M > 1,
            PREC=precision, **launch_options(cfg, block_size, u.dtype), **({"M": M} if M > 1 else {}),
        )
    return h, r, final


def state_backward(q, k, w, gc, write, do, dr_local, d_final, want_dh0: bool, scale: float, block_size: int,
                   decay_skipped_blocks: bool, precision: str, cfg: dict, span=None):
    """(dh [B,NB,H,K,V] = dL/dS_start(n+1) per chunk, dR [B,T,H,V], dL/dS_start(0) fp32 or None);
    `block_size` and `span` as in state_forward."""
    M, e = span or (1, None)
    if M > 1:
        cfg = narrow(cfg)
    B, T, H, K = k.shape
    V = do.shape[-1]
    NB = triton.cdiv(T, block_size)
    BK, NK = k_tiles(K)
    dh = torch.empty(B, NB, H, K, V, device=k.device, dtype=k.dtype)
    dr = torch.empty(B, T, H, V, device=k.device, dtype=dr_local.dtype)
    dh0 = torch.empty(B, H, K, V, device=k.device, dtype=torch.float32) if want_dh0 else None
    for b0, b1, BV in batch_launches(B, H, V, cfg, sm_count(k.device), dr_local.dtype):
        _state_bwd_kernel[(triton.cdiv(V, BV), (b1 - b0) * H)](
            *(_rows(t, b0, b1) for t in (q, k, w, gc, write, do, dr_local, d_final, dh, dr, dh0, e)), scale, T, H,
            NB, K=K, V=V, C=block_size, BK=BK, BV=BV, NK=NK,
            HAS_DHT=d_final is not None, STORE_DH0=want_dh0, DECAY_SKIPPED=decay_skipped_blocks or M > 1,
            PREC=precision, **launch_options(cfg, block_size, dr_local.dtype), **({"M": M} if M > 1 else {}),
        )
    return dh, dr, dh0
