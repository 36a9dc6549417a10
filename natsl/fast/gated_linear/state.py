"""The two sequential kernels of the gated linear rule: the chunk-state recurrence and its reverse pass.

As in the gated-delta package (natsl/fast/gated_delta/state.py), one program owns a BV-wide column
slice of the [K, V] state of one (batch, head), its K rows held as up to four BK-row register tiles.
Without the delta erase the chunk's pseudo values are V itself, so no W S product is needed, and the
forward recurrence is independent per K row: its programs may also split the K rows between them
(K_SPLIT in config.STATE_FWD; k_split_tiles), which gives small batches more programs than SMs.

Forward, chunk n (S = S_start(n), stored as h[n] for the output and backward kernels):
    S <- a S + write * K_dec^T V              (the route commit; a, K_dec: common.chunk_decay)
Backward, chunk n from last to first (D = dL/dS_start(n+1), stored as dh[n]):
    D  <- a D + scale (diag(exp(gc)) Q)^T dO
(dV, which reads D but feeds nothing back into the chain, is chunk-parallel: gated_delta.output.local_dr's commit term.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.devices import sm_count
from natsl.fast.gated_delta.common import (MIN_TILE, chunk_decay, commit_tile, dim_tile, group_row0, k_tiles,
                                           launch_options, load_tile, load_tile_t, mm, store_tile)
from natsl.fast.gated_delta.spans import span_commit, span_release, span_start


@triton.jit
def _store_state(ptr, s0, s1, s2, s3, k0, v0, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 NK: tl.constexpr):
    """NK BK-row tiles, from row k0 on, of a [K, V] state slice to `ptr` (a [K, V] matrix)."""
    store_tile(ptr, s0, k0, v0, K, V, V, BK, BV)
    if NK > 1:
        store_tile(ptr, s1, k0 + BK, v0, K, V, V, BK, BV)
    if NK > 2:
        store_tile(ptr, s2, k0 + 2 * BK, v0, K, V, V, BK, BV)
    if NK > 3:
        store_tile(ptr, s3, k0 + 3 * BK, v0, K, V, V, BK, BV)


@triton.jit
def _load_state(ptr, k0, v0, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr):
    """NK BK-row tiles (fp32), from row k0 on, of a [K, V] state slice; tiles past NK are zeros."""
    s0 = load_tile(ptr, k0, v0, K, V, V, BK, BV).to(tl.float32)
    s1 = tl.zeros([BK, BV], dtype=tl.float32)
    s2 = tl.zeros([BK, BV], dtype=tl.float32)
    s3 = tl.zeros([BK, BV], dtype=tl.float32)
    if NK > 1:
        s1 = load_tile(ptr, k0 + BK, v0, K, V, V, BK, BV).to(tl.float32)
    if NK > 2:
        s2 = load_tile(ptr, k0 + 2 * BK, v0, K, V, V, BK, BV).to(tl.float32)
    if NK > 3:
        s3 = load_tile(ptr, k0 + 3 * BK, v0, K, V, V, BK, BV).to(tl.float32)
    return s0, s1, s2, s3


@triton.jit(do_not_specialize=["T", "NB"])  # one compile for every sequence length
def _state_fwd_kernel(
    k_ptr, v_ptr, gc_ptr, write_ptr, h0_ptr, h_ptr, ht_ptr, e_ptr,
    T, H, HK, NB,
    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NK_LOCAL: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DECAY_SKIPPED: tl.constexpr, PREC: tl.constexpr,
    M: tl.constexpr = 1,
):
    iv = tl.program_id(0)
    bh = tl.program_id(1)
    # The K split: program ik owns the NK_LOCAL tiles of BK rows from row k0 on. Each row of S evolves on
    # its own (a S + K^T rd mixes no rows), so the programs of one V slice need no reduction; each
    # re-reads the chunk's V and decay, the price of more programs at small B * H (k_split_tiles).
    ik = tl.program_id(2)
    k0 = ik * (NK_LOCAL * BK)
    b = bh // H
    h = bh % H
    v0 = iv * BV
    row0 = b.to(tl.int64) * T * H + h
    k_ptr += group_row0(b, h, T, H, HK) * K  # k of HK heads: head h reads its group's
    v_ptr += row0 * V
    gc_ptr += row0
    write_ptr += b.to(tl.int64) * NB * H + h
    vd = v_ptr.dtype.element_ty  # the inputs' dtype: operands of the commit product

    if HAS_H0:
        s0, s1, s2, s3 = _load_state(h0_ptr + bh.to(tl.int64) * K * V, k0, v0, K, V, BK, BV, NK_LOCAL)
    else:
        s0 = tl.zeros([BK, BV], dtype=tl.float32)
        s1 = tl.zeros([BK, BV], dtype=tl.float32)
        s2 = tl.zeros([BK, BV], dtype=tl.float32)
        s3 = tl.zeros([BK, BV], dtype=tl.float32)

    if M > 1:  # routing blocks of M chunks (gated_delta/spans.py): the block's start state beside S
        e_ptr += b.to(tl.int64) * NB * H + h
        b0, b1, b2, b3 = s0, s1, s2, s3
    for n in range(NB):
        t0 = n * C
        if M > 1:
            b0, b1, b2, b3 = span_start(n % M == 0, b0, b1, b2, b3, s0, s1, s2, s3, NK_LOCAL)
        _store_state(h_ptr + ((b * NB + n) * H + h).to(tl.int64) * K * V, s0, s1, s2, s3, k0, v0, K, V, BK, BV,
                     NK_LOCAL)
        # Commit: S <- a S + K^T (write * exp(G_last - gc) * V); the decay scales V's C rows, not K.
        gc, dec, wt, a = chunk_decay(gc_ptr, write_ptr, t0, n, T, H, C, DECAY_SKIPPED)
        if M > 1:  # S <- write Gamma S + K^T (write K_dec V) + e S_block (write: this chunk's)
            a = wt * a
        vv = load_tile(v_ptr, t0, v0, T, H * V, V, C, BV).to(tl.float32)
        rd = ((wt * dec)[:, None] * vv).to(vd)
        s0 = commit_tile(s0, a, k_ptr, rd, t0, k0, T, HK, K, C, BK, PREC)
        if NK_LOCAL > 1:
            s1 = commit_tile(s1, a, k_ptr, rd, t0, k0 + BK, T, HK, K, C, BK, PREC)
        if NK_LOCAL > 2:
            s2 = commit_tile(s2, a, k_ptr, rd, t0, k0 + 2 * BK, T, HK, K, C, BK, PREC)
        if NK_LOCAL > 3:
            s3 = commit_tile(s3, a, k_ptr, rd, t0, k0 + 3 * BK, T, HK, K, C, BK, PREC)
        if M > 1:
            s0, s1, s2, s3 = span_commit(tl.load(e_ptr + n * H), s0, s1, s2, s3, b0, b1, b2, b3, NK_LOCAL)

    if STORE_HT:
        _store_state(ht_ptr + bh.to(tl.int64) * K * V, s0, s1, s2, s3, k0, v0, K, V, BK, BV, NK_LOCAL)


@triton.jit
def _reverse_tile(d, a, q_ptr, dos, t0, k0, T, H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                  PREC: tl.constexpr):
    """a D + Q^T dos for one K tile; Q^T is read transposed from memory."""
    qt = load_tile_t(q_ptr, t0, k0, T, H * K, K, C, BK).to(dos.dtype)
    return a * d + mm(qt, dos, PREC)


@triton.jit(do_not_specialize=["T", "NB"])
def _state_bwd_kernel(
    q_ptr, gc_ptr, write_ptr, do_ptr, dht_ptr, dh_ptr, dh0_ptr, e_ptr,
    scale, T, H, HK, NB,
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
    q_ptr += group_row0(b, h, T, H, HK) * K
    do_ptr += row0 * V
    gc_ptr += row0
    write_ptr += b.to(tl.int64) * NB * H + h
    wd: tl.constexpr = q_ptr.dtype.element_ty

    if HAS_DHT:
        d0, d1, d2, d3 = _load_state(dht_ptr + bh.to(tl.int64) * K * V, 0, v0, K, V, BK, BV, NK)
    else:
        d0 = tl.zeros([BK, BV], dtype=tl.float32)
        d1 = tl.zeros([BK, BV], dtype=tl.float32)
        d2 = tl.zeros([BK, BV], dtype=tl.float32)
        d3 = tl.zeros([BK, BV], dtype=tl.float32)

    if M > 1:  # the block start state's gradient, gathered from the block's chunks
        e_ptr += b.to(tl.int64) * NB * H + h
        p0 = tl.zeros([BK, BV], dtype=tl.float32)
        p1, p2, p3 = p0, p0, p0
    for m in range(NB):
        n = NB - 1 - m
        t0 = n * C
        _store_state(dh_ptr + ((b * NB + n) * H + h).to(tl.int64) * K * V, d0, d1, d2, d3, 0, v0, K, V, BK, BV, NK)

        gc, _, wt, a = chunk_decay(gc_ptr, write_ptr, t0, n, T, H, C, DECAY_SKIPPED)
        if M > 1:
            a = wt * a
            p0, p1, p2, p3 = span_commit(tl.load(e_ptr + n * H), p0, p1, p2, p3, d0, d1, d2, d3, NK)
        # D <- a D + Q^T (scale exp(gc) dO); the decay scales dO's C rows, not Q.
        dos = (load_tile(do_ptr, t0, v0, T, H * V, V, C, BV).to(tl.float32) * (scale * tl.exp(gc))[:, None]).to(wd)
        d0 = _reverse_tile(d0, a, q_ptr, dos, t0, 0, T, HK, K, C, BK, PREC)
        if NK > 1:
            d1 = _reverse_tile(d1, a, q_ptr, dos, t0, BK, T, HK, K, C, BK, PREC)
        if NK > 2:
            d2 = _reverse_tile(d2, a, q_ptr, dos, t0, 2 * BK, T, HK, K, C, BK, PREC)
        if NK > 3:
            d3 = _reverse_tile(d3, a, q_ptr, dos, t0, 3 * BK, T, HK, K, C, BK, PREC)
        if M > 1:
            d0, d1, d2, d3, p0, p1, p2, p3 = span_release(n % M == 0, d0, d1, d2, d3, p0, p1, p2, p3, NK)

    if STORE_DH0:
        _store_state(dh0_ptr + bh.to(tl.int64) * K * V, d0, d1, d2, d3, 0, v0, K, V, BK, BV, NK)


AUTO_K_SPLIT_MAX = 4  # the automatic split stops here: the largest that the benchmark sweep times


def k_split_tiles(K: int, split: int) -> tuple[int, int] | None:
    """The register tiles (BK, NK_LOCAL) of each of `split` forward programs that share a state's K rows
    (program ik owns rows ik * NK_LOCAL * BK on), or None where that split does not fit K.

    k_tiles' NK tiles of BK rows are dealt out whole where `split` divides NK. A split past NK (K = 64 is
    one 64-row tile, K = 128 two) narrows the tile instead, to BK * NK / split rows, which must stay a
    power of two (a tl.arange length) of at least MIN_TILE (tl.dot), and then the last program must
    still own a real row (K = 48 over four 16-row tiles would leave the fourth only masked rows)."""
    BK, NK = k_tiles(K)
    if split < 1:
        return None
    if NK % split == 0:
        return BK, NK // split
    rows = BK * NK // split
    if split % NK or rows < MIN_TILE or rows & (rows - 1) or (split - 1) * rows >= K:
        return None
    return rows, 1


def choose_k_split(K: int, requested: int, programs: int, sms: int, auto_max: int = AUTO_K_SPLIT_MAX) -> int:
    """The K split of the forward state kernel (config.STATE_FWD["K_SPLIT"] = `requested`).

    A fixed split (requested >= 1) falls back to the largest split below it that fits K (k_split_tiles;
    1 always does). 0 is automatic: `programs` (B * H * cdiv(V, BV), one per V slice) leaves SMs idle at
    small batches (48 of the H200's 132 at the 800M Mamba2 shape, batch 1, BV 64), so the split doubles
    while the doubled count still fits in one wave of `sms` programs and the doubled split fits K, up to
    auto_max (past one wave, a second, mostly empty wave cost more than the split gained: docs/performance.md)."""
    if requested >= 1:
        return next(s for s in range(requested, 0, -1) if k_split_tiles(K, s) is not None)
    split = 1
    while programs * 2 * split <= sms and 2 * split <= auto_max and k_split_tiles(K, 2 * split) is not None:
        split *= 2
    return split


def state_forward(k, v, gc, write, initial_state, output_final_state: bool, block_size: int,
                  decay_skipped_blocks: bool, precision: str, cfg: dict, span=None):
    """(h [B,NB,H,K,V] in k's dtype, final state [B,H,K,V] fp32 or None); k contiguous [B,T,HK,K] with
    H % HK == 0 (Mamba2's groups: head h reads k head h // (H // HK) in place). `block_size` is the chunk;
    `span` = (M, e) for routing blocks of M > 1 chunks, as gated_delta.state.state_forward's."""
    M, e = span or (1, None)
    B, T, HK, K = k.shape
    H, V = v.shape[2], v.shape[-1]
    NB = triton.cdiv(T, block_size)
    BV = min(cfg["BV"], dim_tile(V))
    # A dict without K_SPLIT (e.g. one built by hand) keeps one program per V slice, as before the split.
    split = choose_k_split(K, cfg.get("K_SPLIT", 1), B * H * triton.cdiv(V, BV), sm_count(k.device))
    BK, NK_LOCAL = k_split_tiles(K, split)
    h = torch.empty(B, NB, H, K, V, device=k.device, dtype=k.dtype)
    final = torch.empty(B, H, K, V, device=k.device, dtype=torch.float32) if output_final_state else None
    _state_fwd_kernel[(triton.cdiv(V, BV), B * H, split)](
        k, v, gc, write, initial_state, h, final, e, T, H, HK, NB,
        K=K, V=V, C=block_size, BK=BK, BV=BV, NK_LOCAL=NK_LOCAL,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, DECAY_SKIPPED=decay_skipped_blocks or M > 1,
        PREC=precision, **launch_options(split_launch(cfg, split), block_size, v.dtype), **({"M": M} if M > 1 else {}),
    )
    return h, final


def split_launch(cfg: dict, split: int) -> dict:
    """The forward's launch settings for a split: with the K rows split (small batches, few programs) its
    `num_stages_split` pipeline depth and `num_warps_split` warps where the dict has them, else
    `num_stages` and `num_warps` (docs/performance.md: a deeper prefetch of the next chunk's K and V paid
    at batch 1 and cost at 8 x 4K)."""
    if split <= 1:
        return cfg
    return {**cfg, "num_stages": cfg.get("num_stages_split", cfg["num_stages"]),
            "num_warps": cfg.get("num_warps_split", cfg["num_warps"])}


def state_backward(q, gc, write, do, d_final, want_dh0: bool, scale: float, block_size: int,
                   decay_skipped_blocks: bool, precision: str, cfg: dict, span=None):
    """(dh [B,NB,H,K,V] = dL/dS_start(n+1) per chunk in q's dtype, dL/dS_start(0) fp32 or None); q on HK heads
    as state_forward's k; `block_size` and `span` as there."""
    M, e = span or (1, None)
    B, T, HK, K = q.shape
    H, V = do.shape[2], do.shape[-1]
    NB = triton.cdiv(T, block_size)
    BK, NK = k_tiles(K)
    BV = min(cfg["BV"], dim_tile(V))
    dh = torch.empty(B, NB, H, K, V, device=q.device, dtype=q.dtype)
    dh0 = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32) if want_dh0 else None
    _state_bwd_kernel[(triton.cdiv(V, BV), B * H)](
        q, gc, write, do, d_final, dh, dh0, e, scale, T, H, HK, NB,
        K=K, V=V, C=block_size, BK=BK, BV=BV, NK=NK,
        HAS_DHT=d_final is not None, STORE_DH0=want_dh0, DECAY_SKIPPED=decay_skipped_blocks or M > 1,
        PREC=precision, **launch_options(cfg, block_size, q.dtype), **({"M": M} if M > 1 else {}),
    )
    return dh, dh0
