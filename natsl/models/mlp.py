"""SwiGLU feed-forward: W_down(silu(W_gate x) * W_up x)."""

from __future__ import annotations

import torch
from torch import nn

from natsl.ops import gemv
from natsl.models.linear import Linear, decode_sized
from natsl.models.merged import shared_linear
from natsl.models.pointwise import swiglu


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, device=None):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, device=device)

    merge_groups = {"gate_up": ("gate_proj", "up_proj")}  # run as one product by natsl.models.merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = shared_linear(self, "gate_up", x)
        if decode_sized(gate, self.down_proj):
            # a decode step: the down product computes silu(gate) * up as it reads (no SwiGLU kernel)
            return gemv.linear(gate, self.down_proj.weight, up=up)
        return self.down_proj(swiglu(gate, up))
