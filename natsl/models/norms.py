"""RMSNorm over the last dimension, computed in fp32 (the formula: natsl.reference.norms, compiled by natsl.ops.norms.rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

from natsl.models.pointwise import rms_norm


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast gives x's device (None when autocast is off or would not lower x).

    Under bf16 autocast the residual stream stays fp32 and every Linear casts its input to bf16: a
    norm that feeds six projections would be cast six times, forward and backward. Rounding the
    norm's output once gives those Linears the very same bf16 values for one cast. (Not for the
    final norm: the chunked LM loss keeps its input's gradient in fp32.)"""
    device = x.device.type
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):  # ("meta": shape runs)
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype.itemsize < x.dtype.itemsize else None


class RMSNorm(nn.Module):
    """`autocast_output`: under autocast return the autocast dtype (for the pre-norms, whose output
    only feeds Linears; see autocast_dtype)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, autocast_output: bool = False):
        super().__init__()
        self.eps = eps
        self.autocast_output = autocast_output
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.weight._no_weight_decay = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, autocast_dtype(x) if self.autocast_output else None)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
