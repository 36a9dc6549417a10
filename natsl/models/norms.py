"""RMSNorm over the last dimension, computed in fp32 (the formula: natsl.models.pointwise.rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

from natsl.models.pointwise import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.weight._no_weight_decay = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
