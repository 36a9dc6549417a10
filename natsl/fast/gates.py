"""`step_values(v, dt)`: Mamba2's write x dt in one pass, the fast twin of
`natsl.reference.gates.step_values` (same signature, the same product and rounding, so the results
are equal, not only close). Eagerly the product is two passes over a prefill's [T, H, P] values (an
fp32 product, then its rounding); v is the conv output's x columns, read in place through its row
stride. Used by the cached paths (`natsl.ops.kernel_set`); training's forward keeps the formula,
which torch.compile fuses with its neighbours."""

from __future__ import annotations

import functools

import torch

from natsl.fast.cached import launch_options, next_pow2, pdl
from natsl.fast.norms import strided_rows

BLOCK_COLUMNS = 1024  # columns per program: a few rows of 3072 values (800M Mamba2) per program


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def step_values_kernel(v_ptr, dt_ptr, out_ptr, N, W, stride_v, stride_dt, HEAD: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # kernels.pdl: wait for the earlier kernels' writes, then let the next kernel start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = (rows < N)[:, None] & (cols < W)[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_v + cols[None, :], mask=mask, other=0.0)
        dt = tl.load(dt_ptr + rows[:, None] * stride_dt + (cols // HEAD)[None, :], mask=mask, other=0.0)
        # v promotes to dt's dtype in the product, as in PyTorch; one rounding to v's dtype
        tl.store(out_ptr + rows[:, None] * W + cols[None, :], (v * dt).to(out_ptr.dtype.element_ty), mask=mask)

    return step_values_kernel


def step_values(v: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """v [..., H, P] scaled by the step dt [..., H] (fp32): the SSD's write x dt, in v's dtype
    (contiguous); one kernel."""
    H, P = v.shape[-2:]
    width = H * P
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    vr, dtr = strided_rows(v, width), strided_rows(dt, H)
    n = vr.shape[0]
    if n == 0:
        return out
    block = min(BLOCK_COLUMNS, max(16, next_pow2(width)))
    rows_per_program = max(1, min(8, 4096 // block))
    on = pdl(v.device)
    _kernel()[(-(-n // rows_per_program), -(-width // block))](
        vr, dtr, out, n, width, vr.stride(0), dtr.stride(0), HEAD=P, ROWS=rows_per_program, BLOCK=block,
        PDL=on, num_warps=4, **launch_options(on))
    return out
