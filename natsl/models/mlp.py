"""SwiGLU feed-forward: W_down(silu(W_gate x) * W_up x)."""

from __future__ import annotations

import torch
from torch import nn

from natsl.ops import gemv
from natsl.models.linear import Linear
from natsl.models.merged import shared_linear


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, device=None):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, device=device)

    merge_groups = {"gate_up": ("gate_proj", "up_proj")}  # run as one product by natsl.models.merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = shared_linear(self, "gate_up", x)
        # a decode step's down product forms silu(gate) * up as it reads the weight (natsl.ops.gemv)
        return gemv.swiglu_linear(gate, up, self.down_proj.weight, self.down_proj.bias)
