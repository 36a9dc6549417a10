"""Plain causal softmax attention (Transformer and GDN Hybrid layers), RoPE optional."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from natsl.config import ModelConfig
from natsl.ops import fused as kernels
from natsl.ops.cached import attend_cached, write_kv
from natsl.models.linear import Linear
from natsl.models.merged import shared_linear
from natsl.models.rope import RopeTable, apply_rope


class SoftmaxAttention(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        d, nh, hd = config.hidden_size, config.attn_num_heads, config.attn_head_dim
        self.num_heads, self.head_dim = nh, hd
        self.backend = config.backend  # picks the decode-attention kernel (set_backend changes it)
        self.q_proj = Linear(d, nh * hd, bias=False, device=device)
        self.k_proj = Linear(d, nh * hd, bias=False, device=device)
        self.v_proj = Linear(d, nh * hd, bias=False, device=device)
        self.o_proj = Linear(nh * hd, d, bias=False, device=device)

    merge_groups = {"qkv": ("q_proj", "k_proj", "v_proj")}  # run as one product by natsl.models.merged

    def project(self, x: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None,
                rope: RopeTable | None = None):
        """x [B,T,d] -> q, k, v [B,T,heads,head_dim], RoPE applied at positions start..start+T-1
        (or at `positions` [B, T], one row per sequence; or from `rope`, positions 0..T-1)."""
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.num_heads, self.head_dim)
                   for y in shared_linear(self, "qkv", x, label="attn_qkv"))
        if self.config.attn_rope:
            if positions is None and rope is None:
                positions = torch.arange(start, start + t, device=x.device)
            q = apply_rope(q, positions, self.config.rope_theta, rope)
            k = apply_rope(k, positions, self.config.rope_theta, rope)
        return q, k, v

    def forward(self, x: torch.Tensor, cache=None, rope: RopeTable | None = None) -> torch.Tensor:
        """`rope`: the forward's shared angle table (natsl.models.rope.RopeTable), full sequences only."""
        if cache is not None:
            return self.forward_cached(x, cache)
        b, t, _ = x.shape
        q, k, v = self.project(x, rope=rope)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward_cached(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Tokens that follow those in `cache` (an AttentionCache, K/V stored at absolute positions)."""
        b, t, _ = x.shape
        start = cache.positions.start
        if start is None:  # decode: one token per sequence, each at its own position
            pos = cache.positions.pos
            q, k, v = self.project(x, positions=pos[:, None])
            slots = pos[:, None].expand(b, self.num_heads)
            write_kv(cache.k, cache.v, slots, k[:, 0], v[:, 0], fused=kernels.enabled(self.backend, x.device))
            n = cache.positions.attn_read
            o = attend_cached(q, cache.k[:, :, :n], cache.v[:, :, :n], slots + 1, backend=self.backend)
        else:  # prefill: every sequence starts at `start`
            q, k, v = self.project(x, start)
            cache.k[:, :, start:start + t].copy_(k.transpose(1, 2))
            cache.v[:, :, start:start + t].copy_(v.transpose(1, 2))
            if start == 0:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True).transpose(1, 2)
            else:
                keys, values = cache.k[:, :, :start + t], cache.v[:, :, :start + t]
                key_pos = torch.arange(start + t, device=x.device)
                causal = key_pos[None, :] <= key_pos[start:, None]  # query i at start + i
                o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=causal).transpose(1, 2)
        return self.o_proj(o.reshape(b, t, -1))
