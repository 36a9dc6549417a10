"""Where the short conv's backward time goes (GPU): lab variants of natsl.fast.short_conv's "scratch"
kernel, timed beside the op at the 800M widths, bf16, [4, 4096, C].

    PYTHONPATH=. python3 benchmarks/device_conv_lab.py

Every backward form reached only ~0.8 TB/s (2026-11-30, eighth session), while the forward, which
shares the shifted input reads but has no weight-gradient reduction, reaches 2.4-2.7 TB/s. The lab
variants test that: "no dw" drops the weight gradient (a diagnostic, wrong result), "walk" has each
program walk a span of time tiles of one channel tile and accumulate the weight-gradient products
elementwise, reducing across rows once per span instead of four times per tile.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from natsl.fast import short_conv as sc  # noqa: E402
from natsl.fast.short_conv import _conv_input, _dsilu  # noqa: E402


@triton.jit
def _lab_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_part_ptr, scratch_ptr, T, C, n_spans, n_ctiles,
                stride_xb, stride_xt, stride_dyb, stride_dyt, stride_dxb, stride_dxt,
                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SPAN: tl.constexpr, DW: tl.constexpr):
    # grid: one program per (batch row, span of SPAN time tiles, channel tile), channel tile fastest
    pid = tl.program_id(0)
    ctile = pid % n_ctiles
    span = (pid // n_ctiles) % n_spans
    b = (pid // (n_ctiles * n_spans)).to(tl.int64)
    lc = tl.arange(0, BLOCK_C)
    rows = tl.arange(0, BLOCK_T)
    halo = tl.arange(0, 4)
    slot = scratch_ptr + pid.to(tl.int64) * ((BLOCK_T + 4) * BLOCK_C)
    main_ptrs = slot + rows[:, None] * BLOCK_C + lc[None, :]
    halo_ptrs = slot + (BLOCK_T + halo)[:, None] * BLOCK_C + lc[None, :]
    cols = ctile * BLOCK_C + lc
    cmask = cols < C
    x_base = x_ptr + b * stride_xb
    dy_base = dy_ptr + b * stride_dyb
    w0 = tl.load(w_ptr + cols * 4 + 0, mask=cmask, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(w_ptr + cols * 4 + 1, mask=cmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + cols * 4 + 2, mask=cmask, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(w_ptr + cols * 4 + 3, mask=cmask, other=0.0).to(tl.float32)[None, :]
    a0 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for i in range(SPAN):
        tt = span * SPAN + i
        t = tt * BLOCK_T + rows
        x_m3 = _conv_input(x_base, x_base, t - 3, cols, cmask, T, stride_xt, 0, 4, False)
        x_m2 = _conv_input(x_base, x_base, t - 2, cols, cmask, T, stride_xt, 0, 4, False)
        x_m1 = _conv_input(x_base, x_base, t - 1, cols, cmask, T, stride_xt, 0, 4, False)
        x_0 = _conv_input(x_base, x_base, t, cols, cmask, T, stride_xt, 0, 4, False)
        dy = tl.load(dy_base + t.to(tl.int64)[:, None] * stride_dyt + cols[None, :],
                     mask=(t < T)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        g = _dsilu(dy, w0 * x_m3 + w1 * x_m2 + w2 * x_m1 + w3 * x_0)
        if DW == 1:  # elementwise, reduced once after the span
            a0 += g * x_m3
            a1 += g * x_m2
            a2 += g * x_m1
            a3 += g * x_0
        th = tt * BLOCK_T + BLOCK_T + halo
        h_m3 = _conv_input(x_base, x_base, th - 3, cols, cmask, T, stride_xt, 0, 4, False)
        h_m2 = _conv_input(x_base, x_base, th - 2, cols, cmask, T, stride_xt, 0, 4, False)
        h_m1 = _conv_input(x_base, x_base, th - 1, cols, cmask, T, stride_xt, 0, 4, False)
        h_0 = _conv_input(x_base, x_base, th, cols, cmask, T, stride_xt, 0, 4, False)
        dy_h = tl.load(dy_base + th.to(tl.int64)[:, None] * stride_dyt + cols[None, :],
                       mask=(th < T)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        g_h = _dsilu(dy_h, w0 * h_m3 + w1 * h_m2 + w2 * h_m1 + w3 * h_0)
        tl.debug_barrier()
        tl.store(main_ptrs, g)
        tl.store(halo_ptrs, g_h)
        tl.debug_barrier()
        g1 = tl.load(main_ptrs + BLOCK_C, cache_modifier=".cg")
        g2 = tl.load(main_ptrs + 2 * BLOCK_C, cache_modifier=".cg")
        g3 = tl.load(main_ptrs + 3 * BLOCK_C, cache_modifier=".cg")
        dx = w3 * g + w2 * g1 + w1 * g2 + w0 * g3
        tl.store(dx_ptr + b * stride_dxb + t.to(tl.int64)[:, None] * stride_dxt + cols[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])
    if DW == 1:
        taps = tl.arange(0, 4)[:, None]
        dw = tl.where(taps == 0, tl.sum(a0, axis=0)[None, :], 0.0)
        dw = tl.where(taps == 1, tl.sum(a1, axis=0)[None, :], dw)
        dw = tl.where(taps == 2, tl.sum(a2, axis=0)[None, :], dw)
        dw = tl.where(taps == 3, tl.sum(a3, axis=0)[None, :], dw)
        tl.store(dw_part_ptr + ((b * n_spans + span) * 4 + taps) * C + cols[None, :], dw, mask=cmask[None, :])


def lab_backward(x, weight, dy, block_t, block_c, warps, span, dw_mode):
    B, T, C = x.shape
    w = weight.reshape(C, 4).contiguous()
    dx = torch.empty_like(x)
    n_tiles, n_ctiles = -(-T // block_t), -(-C // block_c)
    span = min(span, n_tiles)
    n_spans = -(-n_tiles // span)
    programs = B * n_spans * n_ctiles
    parts = torch.empty(B * n_spans, 4, C, dtype=torch.float32, device=x.device)
    scratch = torch.empty(programs, block_t + 4, block_c, dtype=torch.float32, device=x.device)
    _lab_kernel[(programs,)](x, w, dy, dx, parts, scratch, T, C, n_spans, n_ctiles, x.stride(0), x.stride(1),
                             dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1), BLOCK_T=block_t,
                             BLOCK_C=block_c, SPAN=span, DW=dw_mode, num_warps=warps, num_stages=1)
    dw = torch.empty(C, 4, dtype=weight.dtype, device=x.device)
    if dw_mode:
        sc._dw_sum_kernel[(-(-4 * C // 128),)](parts, dw, parts.shape[0], C, W=4, BLOCK_P=32, BLOCK_F=128, num_warps=4)
    return dx, dw.view(C, 1, 4)


def main() -> None:
    from triton.testing import do_bench

    B, T = 4, 4096
    for C in (1152, 2304):
        gen = torch.Generator().manual_seed(C)
        x = torch.randn(B, T, C, generator=gen).cuda().bfloat16()
        weight = (0.5 * torch.randn(C, 1, 4, generator=gen)).cuda()
        dy = torch.randn(B, T, C, generator=gen).cuda().bfloat16()
        nbytes = 3 * x.numel() * 2
        sc.BACKWARD_FORM = "scratch"
        sc.BACKWARD_TILES["scratch"], sc.SCRATCH_PROGRAMS_PER_SM = (128, 32, 4), 4
        dx_ref, dw_ref = sc.backward(x, weight, None, dy)
        ms = do_bench(lambda: sc.backward(x, weight, None, dy))
        print(f"C={C:5d} op scratch (128, 32, 4) 4/SM          {ms:7.3f} ms {nbytes / ms / 1e6:6.0f} GB/s", flush=True)
        for bt, bc, warps in ((128, 32, 4), (64, 32, 4), (64, 64, 4), (32, 64, 4), (64, 32, 2), (32, 32, 2)):
            for span, dw_mode in ((1, 0), (4, 1), (16, 1), (64, 1)):
                try:
                    dx, dw = lab_backward(x, weight, dy, bt, bc, warps, span, dw_mode)
                    err = ((dx.float() - dx_ref.float()).norm() / dx_ref.float().norm()).item()
                    derr = ((dw - dw_ref).norm() / dw_ref.norm()).item() if dw_mode else float("nan")
                    ms = do_bench(lambda: lab_backward(x, weight, dy, bt, bc, warps, span, dw_mode))
                except Exception as exc:  # a setting that does not compile is reported, not fatal
                    print(f"C={C:5d} lab {(bt, bc, warps)} span {span} dw {dw_mode}: {type(exc).__name__}", flush=True)
                    continue
                label = "no dw (diagnostic)" if dw_mode == 0 else f"walk span {span}"
                print(f"C={C:5d} lab {(bt, bc, warps)} {label:20s} {ms:7.3f} ms {nbytes / ms / 1e6:6.0f} GB/s "
                      f"dx err {err:.1e} dw err {derr:.1e}", flush=True)


if __name__ == "__main__":
    main()
