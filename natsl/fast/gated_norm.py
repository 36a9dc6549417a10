"""A GDN layer's output norm and gate as one Triton kernel each way (the fast twin of
natsl.models.pointwise.gated_rms_norm):

    out = RMSNorm(o) * weight * silu(gate)        per row of D = head_v_dim channels

Rows are (token, head) pairs. Compiled, Inductor runs the backward as a row kernel plus a second
pass for the weight's gradient (about 0.46 ms per GDN layer at 8 x 4096 tokens on the H200, the
2026-12-01 step profile); here the backward reads o, gate and dout once, writes d o and d gate once,
and sums the weight's gradient per program into an fp32 [programs, D] buffer that torch reduces
(deterministic, no atomics). D need not be a power of two (384 in the 800M recipes): the row tile is
padded to the next one and masked. Alone at 8 x 4096 tokens on the H200 (benchmarks/bench_gated_norm.py,
2026-12-01): forward 0.137 -> 0.127 ms, forward + backward 0.622 -> 0.512 ms against the compiled
formula. Off by default (NATSL_FUSED_GATED_NORM=1 turns it on) until a training step side by side
shows that losing Inductor's fusion around the formula does not eat that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.devices import sm_count
from natsl.errors import NatslError
from natsl.fast import eager
from natsl.fast.block_sparse.forward import cast_to  # rounds to nearest even also in the interpreter
from natsl.fast.mix import rms_norm_backward

NUM_WARPS = 4
# Rows per program: about 4K fp32 values per tensor in flight (D = 384 pads to 512).
ROW_VALUES = 4096
# Backward programs per SM: a grid-stride loop over row tiles keeps the weight-gradient buffer small;
# three blocks of 4 warps fit an SM at the kernel's 163 registers (Triton 3.6, sm_90, offline).
PROGRAMS_PER_SM = 3


def _rows_per_tile(d_pad: int) -> int:
    return max(1, ROW_VALUES // d_pad)


@triton.jit
def _load_rows(x_ptr, gate_ptr, rows, cols, n_rows, D: tl.constexpr, eps):
    """The fp32 pieces of a tile of rows: normalised x, its reciprocal RMS, the gate, the offsets, the mask."""
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    return x * r[:, None], r, gate, offs, mask


@triton.jit
def _gated_norm_fwd_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, n_rows, eps,
                           D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D_PAD)
    y, r, gate, offs, mask = _load_rows(x_ptr, gate_ptr, rows, cols, n_rows, D, eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = y * w[None, :] * (gate * tl.sigmoid(gate))
    tl.store(out_ptr + offs, cast_to(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_norm_bwd_kernel(x_ptr, gate_ptr, w_ptr, dout_ptr, dx_ptr, dgate_ptr, dw_part_ptr, n_rows, n_tiles, eps,
                           D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, D_PAD)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    dw = tl.zeros([D_PAD], dtype=tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        y, r, gate, offs, mask = _load_rows(x_ptr, gate_ptr, rows, cols, n_rows, D, eps)
        dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_yw = dout * gate * sig  # d(y * w)
        dgate = dout * y * w[None, :] * sig * (1.0 + gate * (1.0 - sig))
        dw += tl.sum(d_yw * y, axis=0)
        dx = rms_norm_backward(d_yw * w[None, :], y, r, D)
        tl.store(dx_ptr + offs, cast_to(dx, dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dgate_ptr + offs, cast_to(dgate, dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + pid * D + cols, dw, mask=cols < D)


def forward(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """out in x's shape and dtype (x, gate contiguous, same shape; weight [D])."""
    d = x.shape[-1]
    n = x.numel() // d if d else 0
    out = torch.empty_like(x)
    if n:
        d_pad = triton.next_power_of_2(d)
        block_r = _rows_per_tile(d_pad)
        _gated_norm_fwd_kernel[(triton.cdiv(n, block_r),)](
            x, gate, weight, out, n, eps, D=d, D_PAD=d_pad, BLOCK_R=block_r, num_warps=NUM_WARPS)
    return out


def backward(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, dout: torch.Tensor):
    """(d x, d weight, d gate), each in its input's dtype."""
    d = x.shape[-1]
    n = x.numel() // d if d else 0
    d_pad = triton.next_power_of_2(max(d, 1))
    block_r = _rows_per_tile(d_pad)
    n_tiles = triton.cdiv(n, block_r)
    programs = max(1, min(n_tiles, PROGRAMS_PER_SM * sm_count(x.device)))
    dx, dgate = torch.empty_like(x), torch.empty_like(gate)
    parts = torch.empty(programs, d, dtype=torch.float32, device=x.device)
    if n:  # every program owns at least one tile and writes its row of partials
        _gated_norm_bwd_kernel[(programs,)](
            x, gate, weight, dout, dx, dgate, parts, n, n_tiles, eps, D=d, D_PAD=d_pad, BLOCK_R=block_r,
            num_warps=NUM_WARPS)
    else:
        parts.zero_()
    return dx, parts.sum(0).to(weight.dtype), dgate


# The custom-op pair (opaque to torch.compile) and its eager twin, as the other fast ops (eager.py).
@torch.library.custom_op("natsl::gated_norm_forward", mutates_args=())
def gated_norm_forward(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    return forward(x, weight, gate, eps)


@gated_norm_forward.register_fake
def _(x, weight, gate, eps):
    return torch.empty_like(x)


@torch.library.custom_op("natsl::gated_norm_backward", mutates_args=())
def gated_norm_backward(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, dout: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(x, weight, gate, eps, dout)


@gated_norm_backward.register_fake
def _(x, weight, gate, eps, dout):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(gate)


def _setup_context(ctx, inputs, output):
    x, weight, gate, eps = inputs
    ctx.save_for_backward(x, weight, gate)
    ctx.eps = eps


def _backward(ctx, dout, backward_op=gated_norm_backward):
    x, weight, gate = ctx.saved_tensors
    dx, dweight, dgate = backward_op(x, weight, gate, ctx.eps, dout.contiguous())
    return dx, dweight, dgate, None


gated_norm_forward.register_autograd(_backward, setup_context=_setup_context)
_EagerGatedNorm = eager.twin(forward, _setup_context, _backward, backward)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """natsl.models.pointwise.gated_rms_norm(x, weight, eps, gate) on the kernels: x [..., D], gate of
    x's shape, weight [D] -> x's shape and dtype. Differentiable in x, weight and gate."""
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise NatslError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit [..., D] / [..., D] / [D]")
    return eager.run(gated_norm_forward, _EagerGatedNorm, forward, x.contiguous(), weight, gate.contiguous(),
                     float(eps))
