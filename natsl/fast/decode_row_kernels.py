"""The Triton kernels of `natsl.fast.cached`'s per-head row writes of a decode token (`write_kv`,
`rope_write_kv`): a module of their own so that the parts they share are module-level jit functions,
which Triton's interpreter finds (as natsl.fast.decode_step_kernels); importing it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def _head_program(HEADS, PDL: tl.constexpr):
    """One program per (sequence, head): (bh, the sequence b as int64, the head h)."""
    if PDL:  # kernels.pdl: wait for the earlier kernels' writes, then let the next kernel start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0)
    return bh, (bh // HEADS).to(tl.int64), bh % HEADS


@triton.jit
def _copy_row(src_ptr, dest_ptr, N, BLOCK: tl.constexpr):
    """N values from src to dest, cast to dest's dtype."""
    c = tl.arange(0, BLOCK)
    row = tl.load(src_ptr + c, mask=c < N)
    tl.store(dest_ptr + c, row.to(dest_ptr.dtype.element_ty), mask=c < N)


@triton.jit
def write_kv_kernel(kb_ptr, vb_ptr, slots_ptr, k_ptr, v_ptr, HEADS, DK, DV,
                    kb_b, kb_h, kb_l, vb_b, vb_h, vb_l, sl_b, sl_h, k_b, k_h, v_b, v_h,
                    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    # Its K row and V row into the slot the (sequence, head) was given.
    bh, b, h = _head_program(HEADS, PDL)
    slot = tl.load(slots_ptr + b * sl_b + h * sl_h)
    _copy_row(k_ptr + b * k_b + h * k_h, kb_ptr + b * kb_b + h * kb_h + slot * kb_l, DK, BLOCK_K)
    _copy_row(v_ptr + b * v_b + h * v_h, vb_ptr + b * vb_b + h * vb_h + slot * vb_l, DV, BLOCK_V)


@triton.jit
def _normed_halves(ptr, w_ptr, i, lo_ok, hi_ok, HALF, DK, eps, NORM: tl.constexpr):
    """A row read as two halves, [0, HALF) and [HALF, DK), in fp32; with NORM RMS-normed over both and
    times the weight, rounded to the row's dtype (as the layer's norm module)."""
    lo = tl.load(ptr + i, mask=lo_ok, other=0.0).to(tl.float32)
    hi = tl.load(ptr + HALF + i, mask=hi_ok, other=0.0).to(tl.float32)
    if NORM:
        r = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / DK + eps)
        lo = (lo * r * tl.load(w_ptr + i, mask=lo_ok, other=0.0).to(tl.float32))
        hi = (hi * r * tl.load(w_ptr + HALF + i, mask=hi_ok, other=0.0).to(tl.float32))
        lo = lo.to(ptr.dtype.element_ty).to(tl.float32)
        hi = hi.to(ptr.dtype.element_ty).to(tl.float32)
    return lo, hi


@triton.jit
def rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, freq_ptr, qw_ptr, kw_ptr, qo_ptr, kb_ptr, vb_ptr,
                         slots_ptr, HEADS, DK, DV, HALF, eps, q_b, q_h, k_b, k_h, v_b, v_h, pos_b,
                         kb_b, kb_h, kb_l, vb_b, vb_h, vb_l, sl_b, sl_h, BLOCK_H: tl.constexpr,
                         BLOCK_V: tl.constexpr, ROPE: tl.constexpr, Q_NORM: tl.constexpr,
                         K_NORM: tl.constexpr, PDL: tl.constexpr):
    # RoPE (rotate-half) pairs element i with HALF + i, so q and k are read as their two halves.
    bh, b, h = _head_program(HEADS, PDL)
    i = tl.arange(0, BLOCK_H)
    lo_ok, hi_ok = i < HALF, i < DK - HALF
    q_lo, q_hi = _normed_halves(q_ptr + b * q_b + h * q_h, qw_ptr, i, lo_ok, hi_ok, HALF, DK, eps, Q_NORM)
    k_lo, k_hi = _normed_halves(k_ptr + b * k_b + h * k_h, kw_ptr, i, lo_ok, hi_ok, HALF, DK, eps, K_NORM)
    if ROPE:  # the angle of pair i: position x inv_freq[i], in fp32 (as natsl.reference.rope.angles)
        angle = tl.load(pos_ptr + b * pos_b).to(tl.float32) * tl.load(freq_ptr + i, mask=lo_ok, other=0.0)
        c, s = tl.cos(angle), tl.sin(angle)
        q_lo, q_hi = q_lo * c - q_hi * s, q_hi * c + q_lo * s
        k_lo, k_hi = k_lo * c - k_hi * s, k_hi * c + k_lo * s
    q_out = qo_ptr + bh.to(tl.int64) * DK
    tl.store(q_out + i, q_lo.to(qo_ptr.dtype.element_ty), mask=lo_ok)
    tl.store(q_out + HALF + i, q_hi.to(qo_ptr.dtype.element_ty), mask=hi_ok)
    slot = tl.load(slots_ptr + b * sl_b + h * sl_h)
    # K rounded to its own dtype first, then to the cache's (as the reference's rotation, then write)
    k_dest = kb_ptr + b * kb_b + h * kb_h + slot * kb_l
    tl.store(k_dest + i, k_lo.to(k_ptr.dtype.element_ty).to(kb_ptr.dtype.element_ty), mask=lo_ok)
    tl.store(k_dest + HALF + i, k_hi.to(k_ptr.dtype.element_ty).to(kb_ptr.dtype.element_ty), mask=hi_ok)
    _copy_row(v_ptr + b * v_b + h * v_h, vb_ptr + b * vb_b + h * vb_h + slot * vb_l, DV, BLOCK_V)
