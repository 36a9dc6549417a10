"""`Linear`: nn.Linear whose grad-free products of a few rows (decode steps) run on a GEMV kernel.

Same parameters, names and checkpoint layout as nn.Linear (it is one); only the kernel behind a
decode-sized, grad-free call changes (`natsl.inference.gemv`, where that says it is enabled).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from natsl.inference import gemv


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on the GEMV kernel for grad-free inputs of at most gemv.MAX_ROWS rows without bias."""
    if (bias is None and not torch.is_grad_enabled() and x.numel() <= gemv.MAX_ROWS * x.shape[-1]
            and x.numel() > 0 and gemv.enabled(x) and x.dtype == weight.dtype):
        return gemv.linear(x, weight)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
