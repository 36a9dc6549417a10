"""The Gated DeltaNet layer (Yang et al.), and the projections it shares with the NAtS-L layer.

x -> q, k, v = SiLU(short causal conv(W x)); decay g = -exp(A_log) * softplus(W_a x + dt_bias)
(fp32, log space), beta = sigmoid(W_b x); o = W_o(RMSNorm_V(GDN(q_l2, k_l2, v, g, beta)) * silu(W_g x)).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from natsl import ops
from natsl.config import ModelConfig
from natsl.models.cache import drop_pad_gates
from natsl.models.conv import ShortConv, joined_conv_fits, joined_conv_silu
from natsl.models.linear import Linear
from natsl.models.merged import buffer_product, group_product, joined_product
from natsl.models.norms import RMSNorm
from natsl.models.pointwise import gated_rms_norm, gdn_gates, l2_normalize
from natsl.ops import fused as kernels
from natsl.ops.cached import gdn_token_step, use_fast


class GatedDeltaProjections(nn.Module):
    """Input projections of a GDN head set: q, k, v after conv+SiLU, log-decay g and write strength beta."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        d, h = config.hidden_size, config.num_heads
        self.num_heads, self.k_dim, self.v_dim = h, config.head_k_dim, config.head_v_dim
        self.q_proj = Linear(d, h * self.k_dim, bias=False, device=device)
        self.k_proj = Linear(d, h * self.k_dim, bias=False, device=device)
        self.v_proj = Linear(d, h * self.v_dim, bias=False, device=device)
        self.a_proj = Linear(d, h, bias=False, device=device)
        self.b_proj = Linear(d, h, bias=False, device=device)
        self.q_conv = ShortConv(h * self.k_dim, config.conv_size, device=device, backend=config.backend)
        self.k_conv = ShortConv(h * self.k_dim, config.conv_size, device=device, backend=config.backend)
        self.v_conv = ShortConv(h * self.v_dim, config.conv_size, device=device, backend=config.backend)
        self.A_log = nn.Parameter(torch.empty(h, device=device))
        self.dt_bias = nn.Parameter(torch.empty(h, device=device))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Gated DeltaNet's init: A ~ U(0, 16); dt log-uniform in [1e-3, 0.1] floored at 1e-4, and
        # dt_bias the inverse softplus of dt so that softplus(dt_bias) = dt at zero input.
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).clamp_(min=1e-6).log())
            log_dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1))
            dt = log_dt.exp().clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor, conv_tails=None, fused: bool = False, positions=None):
        """x [B, T, d] -> (q [B,T,H*K], k [B,T,H*K], v [B,T,H*V] post-conv, g [B,T,H] fp32, beta [B,T,H], tails).
        `fused`: the cached path's convs run on the fused inference kernel. `positions` (cached paths):
        in a padded prefill call the tails end at the prompt and the pads' gates are zero
        (natsl.models.cache.drop_pad_gates)."""
        convs = [self.q_conv, self.k_conv, self.v_conv]
        if conv_tails is None and joined_conv_fits(convs, x.device):
            qkv = joined_product("gdn_qkv", [self.q_proj, self.k_proj, self.v_proj], x)
            if qkv is not None:  # the q|k|v product is one tensor: its three convs run as one op
                q, k, v = joined_conv_silu(convs, qkv)
                g, beta = self.gates(*self.gate_inputs(x))
                return q, k, v, g, beta, (None, None, None)
        tails = conv_tails or (None, None, None)
        valid = None if positions is None else positions.valid
        q, k, v, a, b = self.linear(x)
        q, q_tail = self.q_conv(q, tails[0], fused=fused, valid=valid)
        k, k_tail = self.k_conv(k, tails[1], fused=fused, valid=valid)
        v, v_tail = self.v_conv(v, tails[2], fused=fused, valid=valid)
        g, beta = self.gates(a, b)
        if valid is not None:
            g, beta = drop_pad_gates(g, beta, positions)
        return q, k, v, g, beta, (q_tail, k_tail, v_tail)

    merge_groups = {"qkvab": ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj")}  # see natsl.models.merged

    def linear(self, x: torch.Tensor):
        """x [B, T, d] -> the raw projections q, k, v (before the conv), a and b."""
        merged = buffer_product(self, "qkvab", x)
        if merged is not None:
            return merged
        q, k, v = group_product("gdn_qkv", [self.q_proj, self.k_proj, self.v_proj], x)
        return (q, k, v, *self.gate_inputs(x))

    def gate_inputs(self, x: torch.Tensor):
        """x [B, T, d] -> the raw H-wide projections a (decay) and b (write strength)."""
        return group_product("gdn_ab", [self.a_proj, self.b_proj], x)

    def gates(self, a: torch.Tensor, b: torch.Tensor):
        """The a, b projections -> log decay g [B,T,H] (fp32) and write strength beta [B,T,H] (b's dtype)."""
        return gdn_gates(a, b, self.A_log, self.dt_bias)

    def decode_conv(self, x: torch.Tensor, conv_tails):
        """One token [B, 1, d] -> q, k, v (projection + conv + SiLU with the fused kernel; the cached
        tails are shifted in place) and the raw a, b projections (cached paths only, see
        natsl.fast.cached)."""
        q, k, v, a, b = self.linear(x)
        q, k, v = kernels.conv_steps([q, k, v], conv_tails, [self.q_conv.weight, self.k_conv.weight,
                                                             self.v_conv.weight])
        return q, k, v, a, b

    def split_heads(self, q, k, v, fused: bool = False):
        """Flat projections -> per-head q, k (L2-normalised) [B,T,H,K] and v [B,T,H,V]."""
        b, t = q.shape[:2]
        h = self.num_heads
        norm = kernels.l2_normalize if fused else l2_normalize
        return (norm(q.view(b, t, h, self.k_dim)), norm(k.view(b, t, h, self.k_dim)), v.view(b, t, h, self.v_dim))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        self.backend = config.backend
        d, h, vd = config.hidden_size, config.num_heads, config.head_v_dim
        self.proj = GatedDeltaProjections(config, device=device)
        self.g_proj = Linear(d, h * vd, bias=False, device=device)
        self.o_norm = RMSNorm(vd, config.norm_eps, device=device)
        self.o_proj = Linear(h * vd, d, bias=False, device=device)

    def forward(self, x: torch.Tensor, cache=None, rope=None) -> torch.Tensor:
        """`rope` (the model's shared RoPE table) is accepted like every mixer's and unused."""
        if cache is not None:
            return self.forward_cached(x, cache)
        b, t, _ = x.shape
        q, k, v, g, beta, _ = self.proj(x)
        q, k, v = self.proj.split_heads(q, k, v)
        o, _ = ops.gated_delta_rule(q, k, v, g, beta, backend=self.backend)
        return self.output(o, x)

    def forward_cached(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Tokens that follow those in `cache` (a GDNCache): one token steps the state, many run the op from it."""
        fused = kernels.enabled(self.backend, x.device) and cache.state.dtype == torch.float32
        if fused and x.shape[1] == 1:
            # One kernel each for the three convs (tails shifted in place) and for L2 norms + g + beta
            # + the delta-rule step (state updated in place); then norm * gate in one kernel.
            p = self.proj
            q, k, v, a, b = p.decode_conv(x, cache.conv)
            o, _ = kernels.gdn_decode_step(q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0],
                                           p.A_log, p.dt_bias, cache.state)
            return self.output(o[:, None], x, fused=True)
        q, k, v, g, beta, tails = self.proj(x, cache.conv, fused=fused, positions=cache.positions)
        cache.store_conv(tails)
        q, k, v = self.proj.split_heads(q, k, v, fused=fused)
        if x.shape[1] == 1:
            o, state = gdn_token_step(cache.state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                      fast=use_fast(self.backend, x.device))
            o = o[:, None]
        else:
            o, state = ops.gated_delta_rule(q, k, v, g, beta, initial_state=cache.state, output_final_state=True,
                                            backend=self.backend)
        cache.state.copy_(state)
        return self.output(o, x, fused=fused)

    def output(self, o: torch.Tensor, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """o [B,T,H,V] -> W_o(RMSNorm(o) * silu(W_g x)) (`fused`: norm and gate in one kernel)."""
        b, t = x.shape[:2]
        if fused:
            gate = self.g_proj(x).view(b, t, self.config.num_heads, self.config.head_v_dim)
            o = kernels.rms_norm(o, self.o_norm.weight, self.o_norm.eps, gate=gate)
            return self.o_proj(o.reshape(b, t, -1))
        gate = self.g_proj(x).view(b, t, self.config.num_heads, self.config.head_v_dim)
        # Inductor's fusion of this formula with its neighbours was as fast in a compiled training step
        # as Triton kernels of its own, so it stays a compiled piece.
        o = gated_rms_norm(o, self.o_norm.weight, self.o_norm.eps, gate)
        return self.o_proj(o.reshape(b, t, -1))
