"""SwiGLU feed-forward: W_down(silu(W_gate x) * W_up x)."""

from __future__ import annotations

import torch
from torch import nn

from natsl.ops import gemv
from natsl.models.linear import Linear
from natsl.models.merged import merged_weight, shared_linear


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

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm, kernels):
        """A cached call's (x + residual, self(norm(x + residual))): the add and the norm inside the merged
        gate/up product's GEMV kernel where natsl.ops.gemv.add_norm_linear runs (a decode step, the switch
        fused_add_norm), else `kernels.add_norm` (natsl.ops.kernel_set) then this MLP."""
        fused = gemv.add_norm_linear(x, residual, norm.weight, norm.eps, merged_weight(self, "gate_up", x))
        if fused is None:
            x, normed = kernels.add_norm(x, residual, norm)
            return x, self(normed)
        x, gate_up = fused
        gate, up = gate_up.split(self.gate_proj.out_features, dim=-1)
        return x, gemv.swiglu_linear(gate, up, self.down_proj.weight, self.down_proj.bias)
