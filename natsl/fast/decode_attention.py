"""Split-K ("flash-decoding") Triton attention for one query token per sequence: the twin of
`natsl.reference.cached.attend_one` for the decode step.

At decode time a row (b, h) has one query and up to L cached keys, so one program per row leaves
most of the GPU idle (24 heads at batch 1 fill 24 of 132 SMs) and serialises the whole key range.
Here each row's visible keys are cut into `num_splits` chunks, one program per (row, chunk):

- kernel 1 runs an online softmax (fp32, exp2 with log2(e) folded into the scale) over its chunk
  and writes the chunk's max, sum and unnormalised accumulator to fp32 scratch;
- kernel 2 merges the chunks of a row with the log-sum-exp rescaling and normalises.

With one split kernel 1 normalises and writes the output itself. The chunks are cut from the row's
`visible` inside the kernel, so the work follows visible, not the static read length L, and no
device value is read on the host: a decode step using this can be captured in a CUDA graph.
Callers keep `attend_one` for the CPU and as the reference.
"""

from __future__ import annotations

import functools
import math

import torch

from natsl.fast import cached as kernels

MIN_SPLIT_KEYS = 256  # the host never cuts L into chunks shorter than this
MAX_SPLITS = 64  # bounds the combine kernel's [splits, Dv] tile
# Launch defaults from `python -m benchmarks.ops --op decode_attention --sweep` on the H200 (128K keys, batch 1): the per-slot
# statistics loop won for both shapes; 24x64 heads were fastest with 128-key tiles and ~16 programs per
# SM, 18x(64,128) with 64-key tiles and 3 programs per SM (docs/kernels/decode_attention.md).
PROGRAMS_PER_SM_NARROW = 16  # head dims <= 64
PROGRAMS_PER_SM = 3  # wider heads


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    # The split count is a runtime value (not specialised): it follows the read length, which grows
    # as a decode goes on, and a constexpr count compiled the kernel again at every new count.
    @triton.jit(do_not_specialize=["num_splits"])
    def split_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, H, L, qk_scale, num_splits,
                     stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                     stride_vb, stride_vh, stride_vl, stride_vd, stride_visb, stride_vish,
                     DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
                     BLOCK_N: tl.constexpr, ONE_SPLIT: tl.constexpr, SLOT_STATS: tl.constexpr,
                     PDL: tl.constexpr):
        if PDL:  # kernels.pdl: wait for the earlier kernels' writes, then let the next kernel start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        b = bh // H
        h = bh % H
        dk = tl.arange(0, DK_P)
        dv = tl.arange(0, DV_P)
        mask_dk = dk < DK
        mask_dv = dv < DV
        vis = tl.load(vis_ptr + b * stride_visb + h * stride_vish)
        vis = tl.minimum(tl.maximum(vis, 0), L)
        # Chunks are cut from this row's visible (not L), so every split gets a share of the real work.
        chunk = tl.cdiv(tl.cdiv(vis, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, vis)

        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + dk * stride_qd, mask=mask_dk, other=0.0)
        q = q.to(tl.float32) * qk_scale  # scores come out in log2 units
        k_row = k_ptr + b * stride_kb + h * stride_kh
        v_row = v_ptr + b * stride_vb + h * stride_vh
        if SLOT_STATS:
            # Running max, sum and accumulator per key slot of the tile: the loop then has no
            # reduction across the tile (the other variant's per-tile max and sum over BLOCK_N
            # synchronise the warps every iteration); the slots are merged once at the end.
            m_n = tl.full([BLOCK_N], -float("inf"), dtype=tl.float32)
            l_n = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_n = tl.zeros([BLOCK_N, DV_P], dtype=tl.float32)
            for start in range(lo, hi, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                mask_n = n < hi
                k = tl.load(k_row + n[:, None] * stride_kl + dk[None, :] * stride_kd,
                            mask=mask_n[:, None] & mask_dk[None, :], other=0.0)
                s = tl.where(mask_n, tl.sum(q[None, :] * k.to(tl.float32), axis=1), -float("inf"))
                m_new = tl.maximum(m_n, s)
                m_ref = tl.where(m_new > -float("inf"), m_new, 0.0)  # a slot that has seen nothing: no nan
                alpha = tl.exp2(m_n - m_ref)
                p = tl.exp2(s - m_ref)
                v = tl.load(v_row + n[:, None] * stride_vl + dv[None, :] * stride_vd,
                            mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
                acc_n = acc_n * alpha[:, None] + p[:, None] * v.to(tl.float32)
                l_n = l_n * alpha + p
                m_n = m_new
            m_i = tl.max(m_n, axis=0)
            weight = tl.exp2(m_n - tl.where(m_i > -float("inf"), m_i, 0.0))
            l_i = tl.sum(l_n * weight, axis=0)
            acc = tl.sum(acc_n * weight[:, None], axis=0)
        else:
            m_i = -float("inf")
            l_i = 0.0
            acc = tl.zeros([DV_P], dtype=tl.float32)
            for start in range(lo, hi, BLOCK_N):  # empty where this split starts past visible
                n = start + tl.arange(0, BLOCK_N)
                mask_n = n < hi
                k = tl.load(k_row + n[:, None] * stride_kl + dk[None, :] * stride_kd,
                            mask=mask_n[:, None] & mask_dk[None, :], other=0.0)
                # one query row: a multiply-sum, as tl.dot needs at least 16 rows
                s = tl.sum(q[None, :] * k.to(tl.float32), axis=1)
                s = tl.where(mask_n, s, -float("inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: the tile has a visible key
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new)
                v = tl.load(v_row + n[:, None] * stride_vl + dv[None, :] * stride_vd,
                            mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
                acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
                l_i = l_i * alpha + tl.sum(p, axis=0)
                m_i = m_new

        if ONE_SPLIT:
            # l_i == 0 only where nothing is visible, and then acc is 0: zeros out
            out = acc / tl.where(l_i > 0, l_i, 1.0)
            tl.store(o_ptr + bh * DV + dv, out.to(o_ptr.dtype.element_ty), mask=mask_dv)
        else:
            part = bh * num_splits + split
            tl.store(m_ptr + part, m_i)
            tl.store(l_ptr + part, l_i)
            tl.store(acc_ptr + part * DV + dv, acc, mask=mask_dv)

    @triton.jit(do_not_specialize=["num_splits"])
    def combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, num_splits, DV: tl.constexpr, DV_P: tl.constexpr,
                       SPLITS_P: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # kernels.pdl: wait for the earlier kernels' writes, then let the next kernel start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0).to(tl.int64)
        sp = tl.arange(0, SPLITS_P)
        dv = tl.arange(0, DV_P)
        mask_s = sp < num_splits
        mask_dv = dv < DV
        part = bh * num_splits + sp
        m = tl.load(m_ptr + part, mask=mask_s, other=-float("inf"))
        sums = tl.load(l_ptr + part, mask=mask_s, other=0.0)
        m_max = tl.max(m, axis=0)
        # empty splits (m = -inf) weigh exp2(-inf) = 0; a row that sees nothing subtracts 0, not -inf (nan)
        w = tl.exp2(m - tl.where(m_max > -float("inf"), m_max, 0.0))
        den = tl.sum(w * sums, axis=0)
        acc = tl.load(acc_ptr + part[:, None] * DV + dv[None, :], mask=mask_s[:, None] & mask_dv[None, :], other=0.0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.where(den > 0, den, 1.0)
        tl.store(o_ptr + bh * DV + dv, out.to(o_ptr.dtype.element_ty), mask=mask_dv)

    return split_kernel, combine_kernel


def choose_splits(L: int, rows: int, sm_count: int, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Chunks per row: enough programs for ~programs_per_sm per SM when B*heads is small, but no
    chunk of L shorter than MIN_SPLIT_KEYS and at most MAX_SPLITS; at least 1."""
    want = -(-programs_per_sm * sm_count // max(rows, 1))
    return max(1, min(want, -(-L // MIN_SPLIT_KEYS), MAX_SPLITS))


def decode_attention(q, keys, values, visible, *, scale=None, num_splits: int | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                     slot_stats: bool = True, programs_per_sm: int | None = None):
    """One query per sequence over cached keys, each row seeing its first `visible` slots.

    q [B,1,heads,Dk]; keys [B,heads,L,Dk]; values [B,heads,L,Dv] (any strides, e.g. views of a larger
    cache); visible [B,heads] (int64, on the device). Returns [B,1,heads,Dv] in q's dtype; a row that
    sees nothing gives zeros. As `attend_one`, in fp32 throughout. `num_splits` overrides the chunk
    count (tests); `block_n`, `num_warps`, `num_stages`, `slot_stats` (per-slot softmax statistics,
    the kernel's second loop variant) and `programs_per_sm` are launch settings for
    `python -m benchmarks.ops --op decode_attention --sweep`, the defaults the fastest it found on the H200.
    """
    B, T, H, Dk = q.shape
    L, Dv = keys.shape[2], values.shape[-1]
    assert T == 1 and keys.shape == (B, H, L, Dk) and values.shape == (B, H, L, Dv), (q.shape, keys.shape, values.shape)
    assert visible.shape == (B, H) and Dk <= 256 and Dv <= 256
    scale = Dk ** -0.5 if scale is None else float(scale)
    out = torch.empty(B, 1, H, Dv, dtype=q.dtype, device=q.device)
    rows = B * H
    if rows == 0:
        return out
    DK_P, DV_P = max(16, kernels.next_pow2(Dk)), max(16, kernels.next_pow2(Dv))
    if programs_per_sm is None:
        programs_per_sm = PROGRAMS_PER_SM_NARROW if max(DK_P, DV_P) <= 64 else PROGRAMS_PER_SM
    splits = (choose_splits(L, rows, kernels.sm_count(q.device), programs_per_sm) if num_splits is None
              else max(1, int(num_splits)))
    if block_n is None:
        block_n = max(16, min(128, 8192 // max(DK_P, DV_P)))  # the [BLOCK_N, D] fp32 tiles stay ~64 registers/thread
    if splits > 1:
        maxes = torch.empty(rows, splits, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
        accs = torch.empty(rows, splits, Dv, dtype=torch.float32, device=q.device)
    else:
        maxes = sums = accs = out  # unused
    split_kernel, combine_kernel = _kernels()
    on = kernels.pdl(q.device)
    split_kernel[(rows, splits)](
        q, keys, values, visible, out, maxes, sums, accs, H, L, scale * math.log2(math.e), splits,
        q.stride(0), q.stride(2), q.stride(3), *keys.stride(), *values.stride(), *visible.stride(),
        DK=Dk, DV=Dv, DK_P=DK_P, DV_P=DV_P, BLOCK_N=block_n, ONE_SPLIT=splits == 1, SLOT_STATS=slot_stats,
        num_warps=num_warps, PDL=on, **kernels.launch_options(on),
        **({} if num_stages is None else {"num_stages": num_stages}))
    if splits > 1:
        combine_kernel[(rows,)](maxes, sums, accs, out, splits, DV=Dv, DV_P=DV_P,
                                SPLITS_P=max(16, kernels.next_pow2(splits)), num_warps=4, PDL=on,
                                **kernels.launch_options(on))
    return out
