"""Causal depthwise short convolution + SiLU (Gated DeltaNet's q/k/v conv) in Triton, forward and backward.

    y[t] = silu(sum_j w[j] * x[t - (W-1) + j]),   x[s] = tail[s + W-1] for s < 0 (zeros without a tail)

The reference twin is `natsl.reference.short_conv` (same signatures; the same sum, fp32 inside, one
rounding to x's dtype). Why a kernel: compiled by Inductor from that formula, the conv and its backward took
several times their memory traffic in the 800M hybrid's training step; the weight gradient in particular is a column reduction over all
B x T rows.

Forward: one pass over [time, channel] tiles; the W shifted reads of x hit the cache. Backward
(`backward_form_setting()`): dL/d(pre-activation) needs the pre-activation, which is recomputed from x rather
than saved (a second [B, T, C] tensor per conv); dx[t] needs it at the W output rows t .. t+W-1,
that is shifted by up to W-1 rows, which a register tile cannot be. "walk" (W = 4, the default on GPUs) has
each program walk its rows one at a time from the last, so that the shifted rows are whole rows held
in registers; "two_pass" (any width) stores it as a [B, T, C] fp32 tensor and a second kernel sums
dx. Both accumulate dx in fp32 and round it once, and write a partial weight gradient per program
(or time tile); one kernel sums the partials in a fixed order (deterministic, no atomics) into the
weight's layout and dtype. The tail is read-only (no gradient): training passes none, the cached
prefill passes the conv state and wants no gradient.

`short_conv_silu_split` runs the convs of consecutive channel groups of one input (a GDN projection's
q, k and v on their joined product) as one launch each way: each group's output is its own tensor,
and the input's gradient comes back whole.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from natsl import switches
from natsl.devices import triton_interpreted
from natsl.errors import NatslError
from natsl.fast import eager

FORWARD_TILE = (32, 128)  # (time, channels)
FORWARD_WARPS = 4
# Backward settings per form, the fastest of each at the 800M widths on the H200: "two_pass" (time,
# channels, warps) of its first kernel; "walk" (rows per program, channels, warps): 128 rows for the
# joined q|k|v op at micro-batch 8 (fewer weight partials; dx bitwise equal to 64 rows,
# `python -m benchmarks.ops --op short_conv`). The forward's tile settings all ran alike there, so they stay.
BACKWARD_TILES = {"two_pass": (64, 64, 4), "walk": (128, 128, 1)}
# How the backward forms dx (each input row feeds the W output rows after it):
#   "walk":     one kernel for W = 4 whose programs walk their rows one by one from the last, holding
#               the shifted input rows and dL/d(pre-activation) rows in registers (other widths fall
#               back to "two_pass");
#   "two_pass": the first kernel stores dL/d(pre-activation) in fp32, a second kernel sums dx from it.
# Dropped, all slower than "walk" on the H200 (docs/kernels/short_conv.md): "scratch", whole tiles with
# g written to a per-program scratch slot and read back shifted (register-bound occupancy); recompute
# at the W rows in one kernel; "held", all 2W-1 shifted input tiles in registers.
# The switch short_conv_backward (NATSL_SHORT_CONV_BACKWARD, natsl.switches) picks one for a whole run
# (benchmarks compare them end to end).
# Under Triton's CPU interpreter (tests only) the walk's row-by-row loop is far slower than two passes
# (the interpreter runs each row step in Python), and every fast-backend backward in the model tests ran
# it, so there the default is two passes; both forms keep their own tests (tests/test_fast_short_conv.py
# names the form), and on a GPU the walk is the default.
def backward_form_setting() -> str:
    """The backward form in force: the switch, else two passes under the interpreter, else the walk."""
    return switches.current().short_conv_backward or ("two_pass" if triton_interpreted() else "walk")


@triton.jit
def _conv_input(x_base, tail_base, s, cols, cmask, T, stride_xt, stride_tw, W: tl.constexpr, HAS_TAIL: tl.constexpr):
    """The conv's input at rows s in fp32: x where 0 <= s < T, the tail's slot s + W-1 where s < 0
    (with a tail), else zero."""
    xv = tl.load(x_base + s.to(tl.int64)[:, None] * stride_xt + cols[None, :],
                 mask=((s >= 0) & (s < T))[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if HAS_TAIL:
        slot = s + (W - 1)
        xv += tl.load(tail_base + slot[:, None] * stride_tw + cols[None, :],
                      mask=((s < 0) & (slot >= 0))[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    return xv


@triton.jit
def _pre_activation(x_base, tail_base, w_ptr, rows, cols, cmask, T, stride_xt, stride_tw,
                    W: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """sum_j w[j] * x[rows - (W-1) + j] in fp32 for a [rows, cols] tile (rows past T give garbage
    that the callers mask out)."""
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w_ptr + cols * W + j, mask=cmask, other=0.0).to(tl.float32)
        xv = _conv_input(x_base, tail_base, rows - (W - 1 - j), cols, cmask, T, stride_xt, stride_tw, W, HAS_TAIL)
        acc += xv * wj[None, :]
    return acc


@triton.jit
def _group_base(p0, p1, p2, c_start, c1, c2, C, b, T):
    """Outputs (and their gradients) come as up to three contiguous [B, T, width] tensors, one per
    channel group [0, c1), [c1, c2), [c2, C) (one group: c1 = c2 = C). For the channel tile starting at
    c_start (never across a group's edge): the batch row b's base, offset so that global channel
    numbers index it, and the group's width (its row stride)."""
    base = p0
    start = 0
    width = c1
    if c_start >= c1:
        base = p1
        start = c1
        width = c2 - c1
    if c_start >= c2:
        base = p2
        start = c2
        width = C - c2
    return base + b * T * width - start, width


@triton.jit
def _conv_fwd_kernel(x_ptr, tail_ptr, w_ptr, y0_ptr, y1_ptr, y2_ptr, c1, c2, T, C, stride_xb, stride_xt,
                     stride_tb, stride_tw, W: tl.constexpr, HAS_TAIL: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c_start = tl.program_id(2) * BLOCK_C
    cols = c_start + tl.arange(0, BLOCK_C)
    cmask = cols < C
    pre = _pre_activation(x_ptr + b * stride_xb, tail_ptr + b * stride_tb, w_ptr, t, cols, cmask, T,
                          stride_xt, stride_tw, W, HAS_TAIL, BLOCK_T, BLOCK_C)
    y = pre / (1.0 + tl.exp(-pre))
    y_base, stride_yt = _group_base(y0_ptr, y1_ptr, y2_ptr, c_start, c1, c2, C, b, T)
    tl.store(y_base + t.to(tl.int64)[:, None] * stride_yt + cols[None, :],
             y.to(y0_ptr.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])


@triton.jit
def _silu_grad(x_base, tail_base, w_ptr, dy_base, rows, cols, cmask, T, stride_xt, stride_tw, stride_dyt,
               W: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dL/d(pre-activation) at `rows` (zero past T): dy * silu'(pre)."""
    pre = _pre_activation(x_base, tail_base, w_ptr, rows, cols, cmask, T, stride_xt, stride_tw, W, HAS_TAIL,
                          BLOCK_T, BLOCK_C)
    dy = tl.load(dy_base + rows.to(tl.int64)[:, None] * stride_dyt + cols[None, :],
                 mask=(rows < T)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    return _dsilu(dy, pre)


@triton.jit
def _dsilu(dy, pre):
    """dy * silu'(pre)."""
    sig = 1.0 / (1.0 + tl.exp(-pre))
    return dy * sig * (1.0 + pre * (1.0 - sig))


@triton.jit
def _backward_program(x_ptr, tail_ptr, dy0_ptr, dy1_ptr, dy2_ptr, c1, c2, T, C, stride_xb, stride_tb,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """A backward program's (batch row, time tile, rows, columns, column mask, its batch row's x and
    tail bases, and its output gradient's base and row stride, see _group_base)."""
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    c_start = tl.program_id(2) * BLOCK_C
    cols = c_start + tl.arange(0, BLOCK_C)
    dy_base, stride_dyt = _group_base(dy0_ptr, dy1_ptr, dy2_ptr, c_start, c1, c2, C, b, T)
    return b, tile, t, cols, cols < C, x_ptr + b * stride_xb, tail_ptr + b * stride_tb, dy_base, stride_dyt


@triton.jit
def _conv_bwd_kernel(x_ptr, tail_ptr, w_ptr, dy0_ptr, dy1_ptr, dy2_ptr, c1, c2, dw_part_ptr, dpre_ptr, T, C,
                     n_tiles, stride_xb, stride_xt, stride_tb, stride_tw,
                     W: tl.constexpr, W_POW2: tl.constexpr, HAS_TAIL: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # "two_pass", first pass: dL/d pre-activation at output rows t, stored for _conv_dx_kernel, and
    # this tile's share of dw.
    b, tile, t, cols, cmask, x_base, tail_base, dy_base, stride_dyt = _backward_program(
        x_ptr, tail_ptr, dy0_ptr, dy1_ptr, dy2_ptr, c1, c2, T, C, stride_xb, stride_tb, BLOCK_T, BLOCK_C)
    dpre = _silu_grad(x_base, tail_base, w_ptr, dy_base, t, cols, cmask, T, stride_xt, stride_tw, stride_dyt,
                      W, HAS_TAIL, BLOCK_T, BLOCK_C)
    # This tile's dw partial as one [W, C] tile (taps padded to a power of two), stored once.
    taps = tl.arange(0, W_POW2)
    dw = tl.zeros([W_POW2, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        xv = _conv_input(x_base, tail_base, t - (W - 1 - j), cols, cmask, T, stride_xt, stride_tw, W, HAS_TAIL)
        dw = tl.where(taps[:, None] == j, tl.sum(dpre * xv, axis=0)[None, :], dw)
    tl.store(dw_part_ptr + ((b * n_tiles + tile) * W + taps)[:, None] * C + cols[None, :], dw,
             mask=(taps < W)[:, None] & cmask[None, :])
    tl.store(dpre_ptr + (b * T + t.to(tl.int64))[:, None] * C + cols[None, :], dpre,
             mask=(t < T)[:, None] & cmask[None, :])


@triton.jit
def _conv_dx_kernel(dpre_ptr, w_ptr, dx_ptr, T, C, stride_dxb, stride_dxt, W: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # dx[t] = sum_k w[W-1-k] dpre[t+k]: input row t feeds output rows t .. t+W-1.
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(W):
        r = t + k
        dpre = tl.load(dpre_ptr + (b * T + r.to(tl.int64))[:, None] * C + cols[None, :],
                       mask=(r < T)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        wk = tl.load(w_ptr + cols * W + (W - 1 - k), mask=cmask, other=0.0).to(tl.float32)
        dx += dpre * wk[None, :]
    tl.store(dx_ptr + b * stride_dxb + t.to(tl.int64)[:, None] * stride_dxt + cols[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=(t < T)[:, None] & cmask[None, :])


@triton.jit
def _rows_mask(cmask, ok):
    """cmask where the scalar row condition `ok` holds, spelled as a block (Triton's interpreter
    rejects a block & scalar mask)."""
    return cmask & (tl.zeros_like(cmask) | ok)


@triton.jit
def _row_input(x_base, tail_base, s, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL: tl.constexpr):
    """Row s of the conv's input (W = 4): x where 0 <= s < T, the tail's slot s + 3 where -3 <= s < 0
    (with a tail), else zero. In x's dtype without a tail (converted where used, so that a prefetched
    row's load is not waited for at once), fp32 with one."""
    v = tl.load(x_base + s.to(tl.int64) * stride_xt + cols, mask=_rows_mask(cmask, (s >= 0) & (s < T)), other=0.0)
    if HAS_TAIL:
        v = v.to(tl.float32) + tl.load(tail_base + (s + 3) * stride_tw + cols,
                                       mask=_rows_mask(cmask, (s < 0) & (s >= -3)), other=0.0).to(tl.float32)
    return v


@triton.jit
def _row_dy(dy_base, r, t0, cols, cmask, T, stride_dyt):
    """dy at row r in its dtype, zero outside [t0, T) (rows below the program's chunk are not its own)."""
    return tl.load(dy_base + r.to(tl.int64) * stride_dyt + cols, mask=_rows_mask(cmask, (r >= t0) & (r < T)),
                   other=0.0)


@triton.jit
def _walk_row(r, dy, x_below, xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, t0, t_end,
              cols, cmask, dx_base, stride_dxt):
    """One row r of the "walk" backward. In: x[r-3..r] (xa..xd), g[r+1..r+3] (g1..g3), x[r-4]
    (x_below). Forms g[r], stores dx[r] and adds to dw if r is the program's own; returns the window
    and g moved one row down."""
    g = _dsilu(dy.to(tl.float32), w0 * xa + w1 * xb + w2 * xc + w3 * xd)
    own = _rows_mask(cmask, (r >= t0) & (r < t_end))
    dx = w3 * g + w2 * g1 + w1 * g2 + w0 * g3
    tl.store(dx_base + r.to(tl.int64) * stride_dxt + cols, dx.to(dx_base.dtype.element_ty), mask=own)
    g_own = tl.where(own, g, 0.0)  # g of the 3 rows past the chunk feeds dx only
    dw0 += g_own * xa
    dw1 += g_own * xb
    dw2 += g_own * xc
    dw3 += g_own * xd
    return x_below.to(tl.float32), xa, xb, xc, g, g1, g2, dw0, dw1, dw2, dw3


@triton.jit
def _conv_bwd_walk_kernel(x_ptr, tail_ptr, w_ptr, dy0_ptr, dy1_ptr, dy2_ptr, c1, c2, dx_ptr, dw_part_ptr, T, C,
                          n_chunks, n_ctiles, stride_xb, stride_xt, stride_tb, stride_tw, stride_dxb,
                          stride_dxt, HAS_TAIL: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # W = 4. A program owns CHUNK_T rows x BLOCK_C channels and walks its rows one at a time from the
    # last to the first, so that everything shifted lives in registers as whole rows: the input rows
    # x[r-3..r] of the pre-activation at r, and dL/d pre-activation g[r+1..r+3] that dx[r] needs
    # (dx[r] = w3 g[r] + w2 g[r+1] + w1 g[r+2] + w0 g[r+3]). The walk starts 3 rows past the chunk
    # (their g only). No scratch, no barrier, no cross-thread reduction: the weight gradient is four
    # [BLOCK_C] sums. Rows go 4 per step, and the next step's 8 rows (x, dy) are loaded before this
    # step's arithmetic so that their latency overlaps it.
    pid = tl.program_id(0)
    ctile = pid % n_ctiles  # channel tile fastest: neighbouring programs share the halo rows' lines
    chunk = (pid // n_ctiles) % n_chunks
    b = (pid // (n_ctiles * n_chunks)).to(tl.int64)
    c_start = ctile * BLOCK_C
    cols = c_start + tl.arange(0, BLOCK_C)
    cmask = cols < C
    x_base = x_ptr + b * stride_xb
    tail_base = tail_ptr + b * stride_tb
    dy_base, stride_dyt = _group_base(dy0_ptr, dy1_ptr, dy2_ptr, c_start, c1, c2, C, b, T)
    dx_base = dx_ptr + b * stride_dxb
    w0 = tl.load(w_ptr + cols * 4 + 0, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + cols * 4 + 1, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + cols * 4 + 2, mask=cmask, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + cols * 4 + 3, mask=cmask, other=0.0).to(tl.float32)
    t0 = chunk * CHUNK_T
    t_end = tl.minimum(t0 + CHUNK_T, T)
    top = t_end + 2  # the first row walked
    xa = _row_input(x_base, tail_base, top - 3, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL).to(tl.float32)
    xb = _row_input(x_base, tail_base, top - 2, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL).to(tl.float32)
    xc = _row_input(x_base, tail_base, top - 1, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL).to(tl.float32)
    xd = _row_input(x_base, tail_base, top, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL).to(tl.float32)
    zero = tl.zeros([BLOCK_C], dtype=tl.float32)
    g1, g2, g3 = zero, zero, zero
    dw0, dw1, dw2, dw3 = zero, zero, zero, zero
    # step 0's rows: x[r-4] and dy[r] for r = top .. top-3
    px0 = _row_input(x_base, tail_base, top - 4, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL)
    px1 = _row_input(x_base, tail_base, top - 5, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL)
    px2 = _row_input(x_base, tail_base, top - 6, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL)
    px3 = _row_input(x_base, tail_base, top - 7, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL)
    pd0 = _row_dy(dy_base, top, t0, cols, cmask, T, stride_dyt)
    pd1 = _row_dy(dy_base, top - 1, t0, cols, cmask, T, stride_dyt)
    pd2 = _row_dy(dy_base, top - 2, t0, cols, cmask, T, stride_dyt)
    pd3 = _row_dy(dy_base, top - 3, t0, cols, cmask, T, stride_dyt)
    n_steps = (top + 1 - t0 + 3) // 4
    for step in range(n_steps):
        r = top - 4 * step
        # the next step's rows first (masked past the ends), then this step's arithmetic
        nx0 = _row_input(x_base, tail_base, r - 8, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL)
        nx1 = _row_input(x_base, tail_base, r - 9, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL)
        nx2 = _row_input(x_base, tail_base, r - 10, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL)
        nx3 = _row_input(x_base, tail_base, r - 11, cols, cmask, T, stride_xt, stride_tw, HAS_TAIL)
        nd0 = _row_dy(dy_base, r - 4, t0, cols, cmask, T, stride_dyt)
        nd1 = _row_dy(dy_base, r - 5, t0, cols, cmask, T, stride_dyt)
        nd2 = _row_dy(dy_base, r - 6, t0, cols, cmask, T, stride_dyt)
        nd3 = _row_dy(dy_base, r - 7, t0, cols, cmask, T, stride_dyt)
        xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3 = _walk_row(
            r, pd0, px0, xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, t0, t_end, cols, cmask,
            dx_base, stride_dxt)
        xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3 = _walk_row(
            r - 1, pd1, px1, xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, t0, t_end, cols, cmask,
            dx_base, stride_dxt)
        xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3 = _walk_row(
            r - 2, pd2, px2, xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, t0, t_end, cols, cmask,
            dx_base, stride_dxt)
        xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3 = _walk_row(
            r - 3, pd3, px3, xa, xb, xc, xd, g1, g2, g3, dw0, dw1, dw2, dw3, w0, w1, w2, w3, t0, t_end, cols, cmask,
            dx_base, stride_dxt)
        px0, px1, px2, px3, pd0, pd1, pd2, pd3 = nx0, nx1, nx2, nx3, nd0, nd1, nd2, nd3
    part = dw_part_ptr + (b * n_chunks + chunk) * 4 * C + cols
    tl.store(part, dw0, mask=cmask)
    tl.store(part + C, dw1, mask=cmask)
    tl.store(part + 2 * C, dw2, mask=cmask)
    tl.store(part + 3 * C, dw3, mask=cmask)


@triton.jit
def _dw_sum_kernel(part_ptr, dw_ptr, n_parts, C, W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_F: tl.constexpr):
    # dw[c, j] = sum_p part[p, j, c] in a fixed order (deterministic), stored [C, W] in the weight's
    # dtype: one launch in place of sum + transpose + copy + cast. A program sums BLOCK_F of the
    # W * C flat (tap, channel) entries over all partials, BLOCK_P partials per step.
    f = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = f < W * C
    p = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_F], dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        acc += tl.load(part_ptr + (p0 + p).to(tl.int64)[:, None] * (W * C) + f[None, :],
                       mask=(p0 + p < n_parts)[:, None] & fmask[None, :], other=0.0)
    tap, chan = f // C, f % C
    tl.store(dw_ptr + chan * W + tap, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty), mask=fmask)


def _tail_args(x: torch.Tensor, tail: Optional[torch.Tensor]):
    if tail is None:
        return x, 0, 0, False  # never read
    return tail, tail.stride(0), tail.stride(1), True


def _group_edges(C: int, sizes: Sequence[int]) -> tuple[int, int]:
    """(c1, c2), the starts of the second and third channel group (C where there is none)."""
    edges = list(itertools.accumulate(sizes))[:-1] + [C, C]
    return edges[0], edges[1]


def _check_edges(edges: Sequence[int], C: int, block_c: int, where: str) -> None:
    """A channel tile must not straddle two groups (it reads one group's tensor): refuse edges that are
    not multiples of the tile, which split_fits keeps the public entry point from passing."""
    bad = [edge for edge in edges if edge < C and edge % block_c]
    if bad:
        raise NatslError(f"short conv: group edges {bad} are not multiples of {where}'s {block_c}-channel tiles; "
                         "call short_conv_silu_split, which falls back to one conv per group")


def _three(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The kernels' three group tensors: a missing group repeats the first (never indexed)."""
    return (list(tensors) + [tensors[0]] * 2)[:3]


def _forward_groups(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor],
                    sizes: Sequence[int]) -> list[torch.Tensor]:
    """SiLU(conv) of x [B, T, C] as one contiguous [B, T, size] tensor per channel group (1 to 3 groups
    whose edges the forward tile does not cross, see split_fits)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    ys = [torch.empty(B, T, size, dtype=x.dtype, device=x.device) for size in sizes]
    if B * T * C == 0:
        return ys
    w = weight.reshape(C, W).contiguous()
    tail_t, stride_tb, stride_tw, has_tail = _tail_args(x, tail)
    block_t, block_c = FORWARD_TILE
    edges = _group_edges(C, sizes)
    _check_edges(edges, C, block_c, "the forward")
    y0, y1, y2 = _three(ys)
    grid = (B, -(-T // block_t), -(-C // block_c))
    _conv_fwd_kernel[grid](x, tail_t, w, y0, y1, y2, *edges, T, C, x.stride(0), x.stride(1),
                           stride_tb, stride_tw, W=W, HAS_TAIL=has_tail, BLOCK_T=block_t, BLOCK_C=block_c,
                           num_warps=FORWARD_WARPS)
    return ys


def _backward_form(W: int) -> str:
    return "walk" if backward_form_setting() == "walk" and W == 4 else "two_pass"


def _backward_groups(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor],
                     dys: Sequence[torch.Tensor]):
    """(dx [B, T, C] in x's dtype, dw [C, 1, W] in weight's dtype) of _forward_groups, given the
    gradient of each of its outputs (contiguous)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    dx = torch.empty_like(x)
    if B * T * C == 0:
        return dx, torch.zeros_like(weight)
    w = weight.reshape(C, W).contiguous()
    tail_t, stride_tb, stride_tw, has_tail = _tail_args(x, tail)
    form = _backward_form(W)
    block_t, block_c, warps = BACKWARD_TILES[form]
    n_tiles, n_ctiles = -(-T // block_t), -(-C // block_c)
    dy0, dy1, dy2 = _three(dys)
    c1, c2 = _group_edges(C, [dy.shape[-1] for dy in dys])
    _check_edges((c1, c2), C, block_c, f"the {form} backward")
    parts = torch.empty(B * n_tiles, W, C, dtype=torch.float32, device=x.device)
    if form == "walk":
        _conv_bwd_walk_kernel[(B * n_tiles * n_ctiles,)](
            x, tail_t, w, dy0, dy1, dy2, c1, c2, dx, parts, T, C, n_tiles, n_ctiles, x.stride(0), x.stride(1),
            stride_tb, stride_tw, dx.stride(0), dx.stride(1), HAS_TAIL=has_tail, CHUNK_T=block_t,
            BLOCK_C=block_c, num_warps=warps)
    else:
        dpre = torch.empty(B, T, C, dtype=torch.float32, device=x.device)
        _conv_bwd_kernel[(B, n_tiles, n_ctiles)](
            x, tail_t, w, dy0, dy1, dy2, c1, c2, parts, dpre, T, C, n_tiles, x.stride(0), x.stride(1), stride_tb,
            stride_tw, W=W, W_POW2=triton.next_power_of_2(W), HAS_TAIL=has_tail,
            BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps)
        bt, bc = FORWARD_TILE
        _conv_dx_kernel[(B, -(-T // bt), -(-C // bc))](dpre, w, dx, T, C, dx.stride(0), dx.stride(1), W=W,
                                                        BLOCK_T=bt, BLOCK_C=bc, num_warps=4)
    dw = torch.empty(C, W, dtype=weight.dtype, device=x.device)
    _dw_sum_kernel[(-(-W * C // 128),)](parts, dw, parts.shape[0], C, W=W, BLOCK_P=32, BLOCK_F=128, num_warps=4)
    return dx, dw.view(C, 1, W)


def forward(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SiLU(conv) [B, T, C] in x's dtype; x [B, T, C] with contiguous channels, weight [C, 1, W],
    tail [B, W-1, C] (x's dtype, channels contiguous) or None. No autograd (see short_conv_silu)."""
    return _forward_groups(x, weight, tail, [x.shape[2]])[0]


def backward(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor], dy: torch.Tensor):
    """(dx [B, T, C] in x's dtype, dw [C, 1, W] in weight's dtype) of the forward above."""
    return _backward_groups(x, weight, tail, [dy.contiguous()])


def split_fits(sizes: Sequence[int], W: int = 4) -> bool:
    """Whether three channel groups of these sizes can come out of one launch: every group edge a
    multiple of the channel tiles of the forward and of the backward form in use."""
    if len(sizes) != 3:
        return False
    tiles = (FORWARD_TILE[1], BACKWARD_TILES[_backward_form(W)][1])
    return all(edge % tile == 0 for edge in _group_edges(sum(sizes), sizes) for tile in tiles)


# The custom-op pair (opaque to torch.compile) and its eager twin, as the other fast ops (eager.py).
@torch.library.custom_op("natsl::short_conv_forward", mutates_args=())
def short_conv_forward(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor]) -> torch.Tensor:
    return forward(x, weight, tail)


@short_conv_forward.register_fake
def _(x, weight, tail):
    return torch.empty_like(x)


@torch.library.custom_op("natsl::short_conv_backward", mutates_args=())
def short_conv_backward(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor],
                        dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(x, weight, tail, dy)


@short_conv_backward.register_fake
def _(x, weight, tail, dy):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, tail = inputs
    ctx.save_for_backward(x, weight, tail)


def _backward(ctx, dy, backward_op=short_conv_backward):
    x, weight, tail = ctx.saved_tensors
    dx, dw = backward_op(x, weight, tail, dy.contiguous())
    return dx, dw, None


short_conv_forward.register_autograd(_backward, setup_context=_setup_context)
_EagerShortConv = eager.twin(forward, _setup_context, _backward, backward)


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SiLU(causal depthwise conv(x)) [B, T, C] in x's dtype, differentiable in x and weight.

    x [B, T, C]; weight [C, 1, W] (any float dtype; the math is fp32); tail [B, W-1, C], the inputs
    before x (None: zeros), read-only. Same formula as natsl.reference.short_conv.short_conv_silu."""
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[0] != x.shape[2] or weight.shape[1] != 1:
        raise NatslError(f"short_conv_silu wants x [B, T, C] and weight [C, 1, W], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    W = weight.shape[-1]
    if tail is not None:
        if tail.shape != (x.shape[0], W - 1, x.shape[2]):
            raise NatslError(f"short_conv_silu: tail {tuple(tail.shape)} should be [B, W-1, C] = "
                             f"{[x.shape[0], W - 1, x.shape[2]]}")
        if tail.requires_grad and torch.is_grad_enabled():
            raise NatslError("short_conv_silu gives no gradient for tail; detach it or use "
                             "natsl.reference.short_conv.short_conv_silu")
        tail = tail.to(x.dtype).contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return eager.run(short_conv_forward, _EagerShortConv, forward, x, weight, tail)


# The q, k and v convs of a GDN layer in one launch each way (training: no tail). Separate convs of a
# concatenated projection's column slices hand back three input gradients that autograd then copies
# into the projection's [B, T, q+k+v] gradient; here the backward writes that gradient itself.
def _sizes(C: int, c1: int, c2: int) -> list[int]:
    return [c1, c2 - c1, C - c2]


def _split_forward(x: torch.Tensor, weight: torch.Tensor, c1: int, c2: int):
    return tuple(_forward_groups(x, weight, None, _sizes(x.shape[2], c1, c2)))


@torch.library.custom_op("natsl::short_conv_split_forward", mutates_args=())
def short_conv_split_forward(x: torch.Tensor, weight: torch.Tensor, c1: int,
                             c2: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _split_forward(x, weight, c1, c2)


@short_conv_split_forward.register_fake
def _(x, weight, c1, c2):
    B, T, C = x.shape
    return tuple(x.new_empty(B, T, size) for size in _sizes(C, c1, c2))


@torch.library.custom_op("natsl::short_conv_split_backward", mutates_args=())
def short_conv_split_backward(x: torch.Tensor, weight: torch.Tensor, dy0: torch.Tensor, dy1: torch.Tensor,
                              dy2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_groups(x, weight, None, [dy0, dy1, dy2])


@short_conv_split_backward.register_fake
def _(x, weight, dy0, dy1, dy2):
    return torch.empty_like(x), torch.empty_like(weight)


def _split_setup_context(ctx, inputs, output):
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.y_shapes = [tuple(y.shape) for y in output]


def _split_grads(ctx, *dys, backward_op=short_conv_split_backward):
    x, weight = ctx.saved_tensors
    # an output that nothing used comes without a gradient: zeros of its shape
    dys = [x.new_zeros(y_shape) if dy is None else dy.contiguous() for dy, y_shape in zip(dys, ctx.y_shapes)]
    dx, dw = backward_op(x, weight, *dys)
    return dx, dw, None, None


short_conv_split_forward.register_autograd(_split_grads, setup_context=_split_setup_context)
_EagerSplitConv = eager.twin(_split_forward, _split_setup_context, _split_grads,
                             lambda x, weight, *dys: _backward_groups(x, weight, None, dys))


def short_conv_silu_split(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """short_conv_silu of x's consecutive channel groups (one per weight [C_i, 1, W]), no tail: the
    outputs [B, T, C_i], each contiguous, and the gradient of x [B, T, sum C_i] as one tensor. One
    launch each way where the groups fit the channel tiles (split_fits), else one conv per group."""
    sizes = [w.shape[0] for w in weights]
    if x.dim() != 3 or x.shape[2] != sum(sizes) or any(w.dim() != 3 or w.shape[1] != 1 for w in weights) \
            or len({w.shape[-1] for w in weights}) != 1:
        raise NatslError(f"short_conv_silu_split wants x [B, T, C] and weights [C_i, 1, W] with sum C_i = C, got "
                         f"{tuple(x.shape)} and {[tuple(w.shape) for w in weights]}")
    if not split_fits(sizes, weights[0].shape[-1]):
        edges = [0] + list(itertools.accumulate(sizes))
        return tuple(short_conv_silu(x[..., a:b], w) for a, b, w in zip(edges, edges[1:], weights))
    if x.stride(-1) != 1:
        x = x.contiguous()
    c1, c2 = _group_edges(x.shape[2], sizes)
    return eager.run(short_conv_split_forward, _EagerSplitConv, _split_forward, x, torch.cat(list(weights)), c1, c2)
