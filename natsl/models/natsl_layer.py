"""The NAtS-L layer (contract section 2): one set of projections read by two memories.

    x --W_q,W_k,W_v + conv + SiLU--> q, k, v
      GDN branch:      L2(q), L2(k), v, decay g, beta  --gated_delta_rule(write)--> O_la
      softmax branch:  RMSNorm(q), RMSNorm(k), v cut into R heads per GDN head (+RoPE)
                                                       --routed_attention(keep)--> O_nla
      router:          block mean of x -> W_r -> hard argmax (straight-through) -> keep, write
      mixing:          w = softmax(W_m q) per softmax head
    o = W_o((w_la * RMSNorm_1(O_la) + w_nla * RMSNorm_2(O_nla)) * silu(W_g x))

Table 4 ablations are switches of the config: intra_block_output, decay_skipped_blocks,
branch_norm, mix_input, mix_weights, block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from natsl import ops
from natsl.config import ModelConfig
from natsl.models.gated_deltanet import GatedDeltaProjections
from natsl.models.norms import RMSNorm
from natsl.models.rope import apply_rope
from natsl.reference.router import route_blocks


def mixing_weights(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """logits [..., 2] (index 0: softmax memory, 1: GDN state) -> the two read weights."""
    if kind == "softmax":
        return torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    if kind == "linear":
        return logits
    raise ValueError(f"no mixing weights for kind {kind!r}")


class NAtSL(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        self.backend = config.backend
        d, h, r = config.hidden_size, config.num_heads, config.softmax_heads_per_group
        self.num_heads, self.groups = h, r
        self.softmax_heads = h * r
        self.proj = GatedDeltaProjections(config, device=device)
        self.router = nn.Linear(d, 2 * h, bias=False, device=device)
        if config.mix_weights != "none":
            mix_in = h * config.head_k_dim if config.mix_input == "q" else d
            self.mix_proj = nn.Linear(mix_in, self.softmax_heads * 2, bias=False, device=device)
        self.q_norm = RMSNorm(config.softmax_k_dim, config.norm_eps, device=device)
        self.k_norm = RMSNorm(config.softmax_k_dim, config.norm_eps, device=device)
        if config.branch_norm == "separate":
            self.la_norm = RMSNorm(config.softmax_v_dim, config.norm_eps, device=device)
            self.nla_norm = RMSNorm(config.softmax_v_dim, config.norm_eps, device=device)
        else:
            self.out_norm = RMSNorm(config.softmax_v_dim, config.norm_eps, device=device)
        self.g_proj = nn.Linear(d, h * config.head_v_dim, bias=False, device=device)
        self.o_proj = nn.Linear(h * config.head_v_dim, d, bias=False, device=device)
        # Routes of the last forward ([B, NB, H], detached): read by training logs and inspect-routing.
        self.last_keep: torch.Tensor | None = None

    # -- pieces shared by the full-sequence forward and incremental inference ------------------

    def softmax_views(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0):
        """Flat post-conv q, k, v -> softmax-branch heads [B, T, H*R, K/R or V/R] (normed, RoPE)."""
        b, t = q.shape[:2]
        c = self.config
        qs = self.q_norm(q.view(b, t, self.softmax_heads, c.softmax_k_dim))
        ks = self.k_norm(k.view(b, t, self.softmax_heads, c.softmax_k_dim))
        vs = v.view(b, t, self.softmax_heads, c.softmax_v_dim)
        if c.natsl_rope:
            positions = torch.arange(start, start + t, device=q.device)
            qs = apply_rope(qs, positions, c.rope_theta)
            ks = apply_rope(ks, positions, c.rope_theta)
        return qs, ks, vs

    def mix(self, o_la: torch.Tensor, o_nla: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Both branch outputs (per softmax head) -> W_o(mixed * silu(W_g x)) [B, T, d]."""
        c = self.config
        b, t = x.shape[:2]
        o_la = o_la.reshape(b, t, self.softmax_heads, c.softmax_v_dim)
        if c.mix_weights == "none":
            w_nla = w_la = 1.0
        else:
            logits = self.mix_proj(q if c.mix_input == "q" else x).view(b, t, self.softmax_heads, 2)
            w = mixing_weights(logits, c.mix_weights)
            w_nla, w_la = w[..., 0:1], w[..., 1:2]
        if c.branch_norm == "separate":
            o = w_la * self.la_norm(o_la) + w_nla * self.nla_norm(o_nla)
        else:
            o = self.out_norm(w_la * o_la + w_nla * o_nla)
        o = o.reshape(b, t, -1) * F.silu(self.g_proj(x))
        return self.o_proj(o)

    def route(self, x: torch.Tensor):
        """x [B,T,d] -> keep, write [B, NB, H] (0/1 values, straight-through gradients)."""
        keep, write, _ = route_blocks(x, self.router.weight, self.num_heads, self.config.block_size)
        return keep, write

    # -- full-sequence forward -----------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        q, k, v, g, beta, _ = self.proj(x)
        keep, write = self.route(x)
        self.last_keep = keep.detach()
        ql, kl, vl = self.proj.split_heads(q, k, v)
        o_la, _ = ops.gated_delta_rule(
            ql, kl, vl, g, beta, write, block_size=c.block_size,
            decay_skipped_blocks=c.decay_skipped_blocks, route_grad=c.route_grad, backend=self.backend,
            intra_block=c.intra_block_output != "softmax")
        qs, ks, vs = self.softmax_views(q, k, v)
        o_nla = ops.routed_attention(
            qs, ks, vs, keep, block_size=c.block_size, route_grad=c.route_grad, backend=self.backend,
            intra_block=c.intra_block_output != "gdn")
        return self.mix(o_la, o_nla, q, x)
