"""The layers' norms compiled on CUDA (natsl.ops.compiled): the reference twins of `natsl.fast.norms`
(natsl.ops.TWINS) as every full-sequence forward runs them, and as the cached paths run them where
the fused kernels do not (`natsl.ops.kernel_set.Reference`). `natsl.models.pointwise` and the
`RMSNorm` module name these very objects; the choice of the fused kernels is made in
`natsl.ops.kernel_set`, never in the models."""

from __future__ import annotations

import torch

from natsl.ops.compiled import pointwise
from natsl.reference import norms as reference


@pointwise
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None):
    """RMSNorm over the last dim in fp32, times `weight` when given, in `out_dtype` (default x's dtype)."""
    return reference.normed(x, weight, eps).to(out_dtype or x.dtype)


@pointwise
def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate), all in fp32, one rounding to x's dtype (gate broadcasts as x)."""
    return reference.rms_norm(x, weight, eps, gate)


l2_normalize = pointwise(reference.l2_normalize)
gated_input_rms_norm = pointwise(reference.gated_input_rms_norm)
