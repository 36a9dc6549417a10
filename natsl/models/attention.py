"""Plain causal softmax attention (Transformer and GDN Hybrid layers), RoPE optional."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from natsl.config import ModelConfig
from natsl.models.rope import apply_rope


class SoftmaxAttention(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        d, nh, hd = config.hidden_size, config.attn_num_heads, config.attn_head_dim
        self.num_heads, self.head_dim = nh, hd
        self.q_proj = nn.Linear(d, nh * hd, bias=False, device=device)
        self.k_proj = nn.Linear(d, nh * hd, bias=False, device=device)
        self.v_proj = nn.Linear(d, nh * hd, bias=False, device=device)
        self.o_proj = nn.Linear(nh * hd, d, bias=False, device=device)

    def project(self, x: torch.Tensor, start: int = 0):
        """x [B,T,d] -> q, k, v [B,T,heads,head_dim], RoPE applied at positions start..start+T-1."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_heads, self.head_dim)
        if self.config.attn_rope:
            positions = torch.arange(start, start + t, device=x.device)
            q = apply_rope(q, positions, self.config.rope_theta)
            k = apply_rope(k, positions, self.config.rope_theta)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
