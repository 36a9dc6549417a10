"""The norms of the layers, in fp32 with one rounding at the end: the reference twins of the fused
kernels in `natsl.fast.norms` (`rms_norm`, `l2_normalize`, `add_rms_norm`, `gated_input_rms_norm`,
same signatures) and the single definition of the formulas that `natsl.models.pointwise` compiles for
the model's forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.reference.gates import add_head_skip
from natsl.reference.precision import up


def normalize(xf: torch.Tensor, eps: float, mean: bool) -> torch.Tensor:
    """xf / sqrt(mean (or sum) of xf^2 over the last dim + eps), in xf's dtype."""
    square = xf.pow(2)
    total = square.mean(dim=-1, keepdim=True) if mean else square.sum(dim=-1, keepdim=True)
    return xf * torch.rsqrt(total + eps)


def normed(x: torch.Tensor, weight: torch.Tensor | None, eps: float, gate: torch.Tensor | None = None,
           *, mean: bool = True) -> torch.Tensor:
    """`rms_norm` before its final rounding (fp32, or fp64 for fp64 inputs)."""
    y = normalize(up(x), eps, mean)
    if weight is not None:
        y = y * up(weight)
    if gate is not None:
        y = y * F.silu(up(gate))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, gate: torch.Tensor | None = None,
             *, mean: bool = True) -> torch.Tensor:
    """RMSNorm of the last dim in fp32, times `weight` when given, times silu(gate) when given (gate
    broadcasts as x), rounded once to x's dtype. `mean=False` divides by the sum (L2 normalisation)."""
    return normed(x, weight, eps, gate, mean=mean).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (flash-linear-attention's l2norm), in x's dtype."""
    return rms_norm(x, None, eps, mean=False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, rms_norm(x + residual, weight, eps)): the sum rounded to x's dtype, normalised
    from that rounded value."""
    total = x + residual
    return total, rms_norm(total, weight, eps)


def gated_input_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor,
                         skip: torch.Tensor | None = None, skip_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Mamba2's output norm, RMSNorm(x * silu(gate)) * weight over the last dim (the gate before the
    norm, mamba_ssm's norm_before_gate=False; `rms_norm` gates after it), fp32 inside, rounded once to
    x's dtype. With `skip` (x's shape) x is first x + skip_scale skip per head (skip_scale [H], the
    last dim cut into H heads), rounded to x's dtype: Mamba2's + D x (natsl.reference.gates.add_skip)."""
    if skip is not None:
        x = add_head_skip(x, skip, skip_scale)
    y = normalize(up(x) * F.silu(up(gate)), eps, mean=True) * up(weight)
    return y.to(x.dtype)
