"""The fused norm kernels of the cached paths (prefill and decode): the fast twins of
`natsl.reference.norms` (`rms_norm`, `l2_normalize`, `add_rms_norm`, same signatures).

- `rms_norm(x, weight, eps, gate=None)`: RMSNorm in fp32 (optionally times silu(gate)), one kernel;
  `l2_normalize(x, eps)` the same kernel without weight and with the sum instead of the mean;
  `add_rms_norm(x, r, weight, eps)` the residual add and the next norm in one pass;
  `gated_input_rms_norm(x, weight, eps, gate, skip, skip_scale)` Mamba2's output norm (the gate
  before the norm, optionally after its + D x) in one pass over x, gate and skip read in place.

Why one kernel: see `natsl.fast.cached` (an fp32 RMSNorm is nine eager kernels in bf16). They compute
the reference's formulas (fp32 math, one rounding at the end) with a different reduction order, so
results agree to rounding, not bitwise. Triton is imported only when a kernel launches; whether the
cached paths use them is decided in `natsl.ops.kernel_set`.
"""

from __future__ import annotations

import functools

import torch

from natsl.fast.cached import launch_options, next_pow2, pdl


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_kernel(x_ptr, w_ptr, gate_ptr, y_ptr, res_ptr, sum_ptr, N, D, eps,
                   HAS_W: tl.constexpr, HAS_GATE: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr,
                   ROWS: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
        # ROWS rows per program: per-head L2 norms have rows of 64-256 values, too little work for
        # a program each (a 128K prefill has 786K such rows per projection).
        if PDL:  # kernels.pdl: wait for the earlier kernels' writes, then let the next kernel start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows < N)[:, None] & (cols < D)[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_RES:
            # the residual add first, rounded to the activation dtype as `x + r` is, and kept
            x = (x.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + offs, x, mask=mask)
        x = x.to(tl.float32)
        ss = tl.sum(x * x, 1)
        if MEAN:
            ss = ss / D
        y = x * (1.0 / tl.sqrt(ss + eps))[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        if HAS_GATE:
            # as natsl.reference.norms.rms_norm with a gate: all in fp32, one rounding at the store
            gt = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = y * (gt / (1.0 + tl.exp(-gt)))
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    return rms_kernel


@functools.lru_cache(maxsize=None)
def _gated_input_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gated_input_kernel(x_ptr, gate_ptr, skip_ptr, scale_ptr, w_ptr, y_ptr, N, D, stride_x, stride_gate,
                           stride_skip, eps, HEAD: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr,
                           ROWS: tl.constexpr, PDL: tl.constexpr):
        # Mamba2's x, gate and skip are column slices of wider rows (the in_proj's z, the conv's x):
        # read through their row strides, not copied first.
        if PDL:  # kernels.pdl: wait for the earlier kernels' writes, then let the next kernel start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        col_mask = cols < D
        mask = (rows < N)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_SKIP:
            # + D skip per head in fp32, rounded to x's dtype as add_skip rounds it
            skip = tl.load(skip_ptr + rows[:, None] * stride_skip + cols[None, :], mask=mask, other=0.0)
            scale = tl.load(scale_ptr + cols // HEAD, mask=col_mask, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) + scale[None, :] * skip.to(tl.float32)).to(x.dtype)
        gate = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = x.to(tl.float32) * (gate / (1.0 + tl.exp(-gate)))
        mean_square = tl.sum(h * h, 1) / D
        y = h * (1.0 / tl.sqrt(mean_square + eps))[:, None]
        y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    return gated_input_kernel


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, gate: torch.Tensor | None = None,
             *, mean: bool = True) -> torch.Tensor:
    """RMSNorm of the last dim in fp32 (as its reference twin `natsl.reference.norms.rms_norm`), optionally times silu(gate)
    (gate: same shape as x); one kernel. `mean=False` divides by the sum (L2 normalisation)."""
    xr = _rows(x)
    y = torch.empty_like(xr)
    g = _rows(gate.reshape(x.shape)) if gate is not None else xr
    _launch_rms(xr, weight, g, y, None, None, eps, gate is not None, mean)
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, RMSNorm(x + residual) * weight) in one kernel: the sum rounded to x's dtype as
    the plain `x + residual` is, and normalised from that rounded value (so both outputs equal the
    unfused add then `rms_norm`)."""
    assert residual.shape == x.shape and residual.dtype == x.dtype
    xr, rr = _rows(x), _rows(residual)
    total, y = torch.empty_like(xr), torch.empty_like(xr)
    _launch_rms(xr, weight, xr, y, rr, total, eps, False, True)
    return total.view(x.shape), y.view(x.shape)


# Benchmarks set this to {"rows": R, "warps": W, "pdl": bool} to time other launches of rms_kernel.
RMS_LAUNCH: dict = {}


def _launch_rms(xr, weight, g, y, rr, total, eps, has_gate: bool, mean: bool) -> None:
    n, D = xr.shape
    if n == 0:
        return
    on = RMS_LAUNCH.get("pdl", pdl(xr.device))
    block = max(16, next_pow2(D))
    rows_per_program = RMS_LAUNCH.get("rows", max(1, min(16, 2048 // block)))  # tiles of about 2048 values
    warps = RMS_LAUNCH.get("warps", 4 if block <= 2048 else 8)
    if weight is not None:  # the kernel reads it at cols: a strided view (a slice) would give wrong values
        weight = weight.contiguous()
    _kernel()[(-(-n // rows_per_program),)](
        xr, weight if weight is not None else xr, g, y, rr if rr is not None else xr,
        total if total is not None else y, n, D, float(eps), HAS_W=weight is not None,
        HAS_GATE=has_gate, MEAN=mean, BLOCK=block, ROWS=rows_per_program, HAS_RES=rr is not None,
        num_warps=warps, PDL=on, **launch_options(on))


def strided_rows(x: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """x as rows [n, width] (default: its last dim) of unit column stride, a view where x's dims merge
    (a column slice of a contiguous tensor does), else a copy: the kernels take the row stride."""
    rows = x.reshape(-1, x.shape[-1] if width is None else width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def gated_input_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor,
                         skip: torch.Tensor | None = None, skip_scale: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm(x * silu(gate)) * weight in fp32 (as its reference twin
    `natsl.reference.norms.gated_input_rms_norm`), first x + skip_scale skip per head when `skip` is
    given; x, gate, skip [..., D] (column slices read in place), skip_scale [H]; one kernel."""
    D = x.shape[-1]
    xr, gr = strided_rows(x), strided_rows(gate)
    n = xr.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    has_skip = skip is not None
    sr = strided_rows(skip) if has_skip else xr
    scale = skip_scale.contiguous() if has_skip else weight
    head = D // skip_scale.shape[0] if has_skip else 1
    on = pdl(x.device)
    block = max(16, next_pow2(D))
    rows_per_program = max(1, min(16, 2048 // block))
    _gated_input_kernel()[(-(-n // rows_per_program),)](
        xr, gr, sr, scale, weight.contiguous(), y, n, D, xr.stride(0), gr.stride(0), sr.stride(0), float(eps),
        HEAD=head, HAS_SKIP=has_skip, BLOCK=block, ROWS=rows_per_program, PDL=on,
        num_warps=4 if block <= 2048 else 8, **launch_options(on))
    return y


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim in fp32, in x's dtype; one kernel."""
    return rms_norm(x, None, eps, mean=False)
