"""The Gated DeltaNet layer (Yang et al.), and the projections it shares with the NAtS-L layer.

x -> q, k, v = SiLU(short causal conv(W x)); decay g = -exp(A_log) * softplus(W_a x + dt_bias)
(fp32, log space), beta = sigmoid(W_b x); o = W_o(RMSNorm_V(GDN(q_l2, k_l2, v, g, beta)) * silu(W_g x)).

`GatedDeltaProjections` also owns its linear memory's op (`rule`, `token_step`, `skip`), so that the
NAtS-L layer runs on whichever state its projections bring: the GDN state here, the Mamba2 (SSD) state
in natsl.models.mamba2.Mamba2StateProjections.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from natsl import ops
from natsl.models.cache import drop_pad_gates
from natsl.models.conv import ShortConv, joined_conv_fits, joined_conv_silu
from natsl.models.linear import Linear
from natsl.models.merged import (buffer_product, group_product, group_sizes, joined_product, merged_weight,
                                  product_and_last)
from natsl.models.norms import RMSNorm
from natsl.models.pointwise import gdn_gates
from natsl.ops import gemv, kernel_set
from natsl.ops.cached import gdn_token_step

if TYPE_CHECKING:
    from natsl.config import ModelConfig


def init_decay(A_log: torch.Tensor, dt_bias: torch.Tensor, a_min: float) -> None:
    """A ~ U(a_min, 16) (floored at 1e-6 before the log); dt log-uniform in [1e-3, 0.1] floored at 1e-4,
    and dt_bias the inverse softplus of dt so that softplus(dt_bias) = dt at zero input. Gated
    DeltaNet draws A from U(0, 16), Mamba2 from U(1, 16).
    The draws are in the parameters' dtype (the random stream as ever); the log, exp and expm1 run in
    fp64, rounded once: the CPU's vectorised fp32 transcendentals differ by an ulp between instruction sets
    (AVX2 and AVX-512 gave different parameters for the same seed), the fp64 ones rounded to fp32 do not."""
    with torch.no_grad():
        A = torch.empty_like(A_log).uniform_(a_min, 16).clamp_(min=1e-6)
        A_log.copy_(A.double().log())
        log_dt = torch.empty_like(dt_bias).uniform_(math.log(1e-3), math.log(0.1)).double()
        dt = log_dt.exp().clamp(min=1e-4)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class GatedDeltaProjections(nn.Module):
    """Input projections of a GDN head set: q, k, v after conv+SiLU, log-decay g and write strength beta.

    The class attributes below are what a linear memory of another kind changes (mamba2.py)."""

    gate_names = ("a_proj", "b_proj")  # the H-wide gate inputs: decay, write strength
    a_min = 0.0  # A ~ U(a_min, 16) at init
    scale = None  # the op's output scale (None: K^-0.5)
    l2_heads = True  # q and k are L2-normalised per head
    fused_decode = True  # `decode_step` runs the memory's token step on the kernel set (one kernel on the fused one)
    decays = True  # the state decays: A_log and dt_bias (a DeltaNet state has neither; natsl.models.deltanet)

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        d, h = config.hidden_size, config.num_heads
        self.num_heads, self.k_dim, self.v_dim = h, config.head_k_dim, config.head_v_dim
        self.q_proj = Linear(d, h * self.k_dim, bias=False, device=device)
        self.k_proj = Linear(d, h * self.k_dim, bias=False, device=device)
        self.v_proj = Linear(d, h * self.v_dim, bias=False, device=device)
        for name in self.gate_names:
            setattr(self, name, Linear(d, h, bias=False, device=device))
        self.q_conv = ShortConv(h * self.k_dim, config.conv_size, device=device, backend=config.backend)
        self.k_conv = ShortConv(h * self.k_dim, config.conv_size, device=device, backend=config.backend)
        self.v_conv = ShortConv(h * self.v_dim, config.conv_size, device=device, backend=config.backend)
        if self.decays:
            self.A_log = nn.Parameter(torch.empty(h, device=device))
            self.dt_bias = nn.Parameter(torch.empty(h, device=device))
            self.A_log._no_weight_decay = True
            self.dt_bias._no_weight_decay = True
        self.backend = config.backend  # the token step's (set_backend changes it with the layers')
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.decays:
            init_decay(self.A_log, self.dt_bias, self.a_min)

    def forward(self, x: torch.Tensor, conv_tails=None, kernels=None, positions=None, projected=None):
        """x [B, T, d] -> (q [B,T,H*K], k [B,T,H*K], v [B,T,H*V] post-conv, g [B,T,H] fp32, beta [B,T,H], tails).
        (A Mamba2 state returns its step dt [B,T,H] fp32 in beta's place.)
        `kernels`: a cached path's kernel set (natsl.ops.kernel_set), which runs its convs. `positions` (cached paths):
        in a padded prefill call the tails end at the prompt and the pads' gates are zero
        (natsl.models.cache.drop_pad_gates). `projected`: `linear(x)` where the caller has it already (a GDN
        layer's merged product)."""
        convs = [self.q_conv, self.k_conv, self.v_conv]
        if projected is None and conv_tails is None and joined_conv_fits(convs, x.device):
            qkv = joined_product("gdn_qkv", [self.q_proj, self.k_proj, self.v_proj], x)
            if qkv is not None:  # the q|k|v product is one tensor: its three convs run as one op
                q, k, v = joined_conv_silu(convs, qkv)
                g, beta = self.gates(*self.gate_inputs(x))
                return q, k, v, g, beta, (None, None, None)
        tails = conv_tails or (None, None, None)
        valid = None if positions is None else positions.valid
        q, k, v, *raw_gates = self.linear(x) if projected is None else projected
        q, q_tail = self.q_conv(q, tails[0], valid=valid, kernels=kernels)
        k, k_tail = self.k_conv(k, tails[1], valid=valid, kernels=kernels)
        v, v_tail = self.v_conv(v, tails[2], valid=valid, kernels=kernels)
        g, beta = self.gates(*raw_gates)
        if valid is not None:
            g, beta = drop_pad_gates(g, beta, positions)
        return q, k, v, g, beta, (q_tail, k_tail, v_tail)

    merge_groups = {"qkvab": ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj")}  # see natsl.models.merged

    def linear(self, x: torch.Tensor):
        """x [B, T, d] -> the raw projections q, k, v (before the conv) and the gate inputs (a, b)."""
        merged = buffer_product(self, "qkvab", x)
        if merged is not None:
            return merged
        q, k, v = group_product("gdn_qkv", [self.q_proj, self.k_proj, self.v_proj], x)
        return (q, k, v, *self.gate_inputs(x))

    def gate_inputs(self, x: torch.Tensor):
        """x [B, T, d] -> the raw H-wide projections of `gate_names`: a (decay) and b (write strength)."""
        return group_product("gdn_ab", [getattr(self, name) for name in self.gate_names], x)

    def gates(self, a: torch.Tensor, b: torch.Tensor):
        """The a, b projections -> log decay g [B,T,H] (fp32) and write strength beta [B,T,H] (b's dtype)."""
        return gdn_gates(a, b, self.A_log, self.dt_bias)

    def decode_conv(self, x: torch.Tensor, conv_tails, kernels, projected=None, convolved: bool = False):
        """One token [B, 1, d] -> q, k, v (projection + conv + SiLU on the kernel set's `conv_steps`; the
        cached tails are shifted in place) and the raw gate inputs (a, b) (cached paths only). `projected`:
        `linear(x)` where the caller has it already (x then unused); `convolved`: its q, k, v are the convs'
        outputs already (the product's kernel ran them: `conv_inputs`)."""
        q, k, v, *raw_gates = self.linear(x) if projected is None else projected
        if convolved:
            return (q, k, v, *raw_gates)
        q, k, v = kernels.conv_steps([q, k, v], conv_tails, [self.q_conv.weight, self.k_conv.weight,
                                                             self.v_conv.weight])
        return (q, k, v, *raw_gates)

    def conv_inputs(self, start: int, conv_tails) -> tuple:
        """(start, the q, k, v convs' weights, their cached tails): the `conv` of natsl.ops.gemv's products for
        a product whose columns from `start` are q, k, v."""
        return start, [self.q_conv.weight, self.k_conv.weight, self.v_conv.weight], list(conv_tails)

    def split_heads(self, q, k, v, kernels=kernel_set.REFERENCE):
        """Flat projections -> per-head q, k (L2-normalised by `kernels`, natsl.ops.kernel_set) [B,T,H,K]
        and v [B,T,H,V]."""
        b, t = q.shape[:2]
        h = self.num_heads
        q, k = q.view(b, t, h, self.k_dim), k.view(b, t, h, self.k_dim)
        if self.l2_heads:
            q, k = kernels.l2_normalize(q), kernels.l2_normalize(k)
        return q, k, v.view(b, t, h, self.v_dim)

    # -- the linear memory: the op of the full sequence, one decode token, the output's skip term --

    def rule(self, q, k, v, g, beta, write=None, **options):
        """`natsl.ops.gated_delta_rule` on per-head q, k, v and the gates; `options` as there."""
        return ops.gated_delta_rule(q, k, v, g, beta, write, scale=self.scale, **options)

    def token_step(self, state, q, k, v, g, beta):
        """One decode token of `rule` ([B, H, D] tensors): (o [B,H,V], the new state); natsl.ops.cached
        picks the step's kernel by the backend."""
        return gdn_token_step(state, q, k, v, g, beta, scale=self.scale, backend=self.backend)

    def decode_step(self, q, k, v, raw_gates, state, kernels):
        """One decode token from the flat post-conv q, k, v [B, 1, H*D] and the raw gate inputs [B, 1, H]
        on the kernel set's gdn_decode_step (natsl.ops.kernel_set; one kernel on the fused set): L2 norms,
        g, beta and the step, the state [B, H, K, V] updated in place. Returns (o [B, H, V], g [B, H] fp32)."""
        a, b = raw_gates
        return kernels.gdn_decode_step(q, k, v, a, b, self.A_log, self.dt_bias, state)

    def skip(self, o: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The memory's read o [B,T,H,V] plus any direct term of the token's own value (GDN: none)."""
        return o


def with_projections(proj: GatedDeltaProjections, *names: str) -> tuple[str, ...]:
    """The merge group (natsl.models.merged) of a layer that owns `proj` as .proj: the projections' q, k, v
    and gate inputs, then the layer's own linears `names`."""
    return (*(f"proj.{name}" for name in proj.merge_groups["qkvab"]), *names)


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
        # every product of the layer's input as one (natsl.models.merged): the projections' q, k, v and gate
        # inputs, then the output gate's; merged, it takes the place of the projections' own group
        self.merge_groups = {"qkvabg": with_projections(self.proj, "g_proj")}

    def forward(self, x: torch.Tensor, cache=None, rope=None) -> torch.Tensor:
        """`rope` (the model's shared RoPE table) is accepted like every mixer's and unused."""
        if cache is not None:
            return self.forward_cached(x, cache)
        projected, gate = product_and_last(self, "qkvabg", x)
        q, k, v, g, beta, _ = self.proj(x, projected=projected)
        q, k, v = self.proj.split_heads(q, k, v)
        o, _ = self.proj.rule(q, k, v, g, beta, backend=self.backend)
        return self.output(o, x, gate=gate)

    def forward_cached(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Tokens that follow those in `cache` (a GDNCache): one token steps the state, many run the op
        from it; every step on the call's kernel set (natsl.ops.kernel_set)."""
        kernels = kernel_set.pick(self.backend, x.device, cache.state.dtype)
        projected, gate = product_and_last(self, "qkvabg", x)
        if x.shape[1] == 1:
            return self.decode(x, projected, gate, cache, kernels)
        q, k, v, g, beta, tails = self.proj(x, cache.conv, kernels, positions=cache.positions, projected=projected)
        cache.store_conv(tails)
        q, k, v = self.proj.split_heads(q, k, v, kernels)
        o, state = ops.gated_delta_rule(q, k, v, g, beta, initial_state=cache.state, output_final_state=True,
                                        backend=self.backend)
        cache.state.copy_(state)
        return self.output(o, x, kernels, gate)

    def decode(self, x: torch.Tensor, projected, gate, cache, kernels, convolved: bool = False) -> torch.Tensor:
        """One token [B, 1, d]: the three convs (tails shifted in place), then L2 norms + g + beta + the
        delta-rule step (state updated in place), one kernel each on the fused set, then the output.
        `projected`, `gate`: the merged product's pieces (None: the layer's products of x); `convolved`: the
        product's kernel ran the convs already."""
        q, k, v, *raw_gates = self.proj.decode_conv(x, cache.conv, kernels, projected, convolved)
        o, _ = self.proj.decode_step(q, k, v, raw_gates, cache.state, kernels)
        return self.output(o[:, None], x, kernels, gate)

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm, cache, kernels):
        """A block's cached call: (x + residual, self(norm(x + residual), cache)). On a decode step where
        natsl.ops.gemv.add_norm_conv_linear runs (the switch fused_add_norm, merged weights), the add and norm
        are formed inside the merged q/k/v/a/b/g GEMV; else `kernels.add_norm` (natsl.ops.kernel_set), then
        this layer. With the switch fused_conv the q, k, v convs run in that GEMV's epilogue too."""
        if x.shape[1] == 1:
            fused = gemv.add_norm_conv_linear(x, residual, norm.weight, norm.eps, merged_weight(self, "qkvabg", x),
                                              self.proj.conv_inputs(0, cache.conv))
            if fused is not None:
                x, product, convolved = fused
                *projected, gate = product.split(group_sizes(self, "qkvabg"), dim=-1)
                kernels = kernel_set.pick(self.backend, x.device, cache.state.dtype)
                return x, self.decode(None, projected, gate, cache, kernels, convolved)
        x, normed = kernels.add_norm(x, residual, norm)
        return x, self(normed, cache=cache)

    def output(self, o: torch.Tensor, x: torch.Tensor | None, kernels=kernel_set.REFERENCE,
               gate: torch.Tensor | None = None) -> torch.Tensor:
        """o [B,T,H,V] -> W_o(RMSNorm(o) * silu(W_g x)), the norm and gate on `kernels`
        (natsl.ops.kernel_set: one kernel on the fused set, the compiled formula on the reference set).
        `gate`: W_g x where the caller has it (x then unused).
        Inductor's fusion of the formula with its neighbours was as fast in a compiled training step as
        Triton kernels of its own, so the full-sequence forward keeps the compiled piece."""
        b, t = o.shape[:2]
        gate = self.g_proj(x) if gate is None else gate
        # a decode step: the norm and gate inside the output product's GEMV (natsl.ops.gemv), where it runs
        fused = gemv.gated_norm_linear(o.reshape(b, t, -1), gate, self.o_norm.weight, self.o_norm.eps,
                                       self.o_proj.weight, self.o_proj.bias)
        if fused is not None:
            return fused
        gate = gate.view(b, t, self.config.num_heads, self.config.head_v_dim)
        o = kernels.norm(o, self.o_norm, gate)
        return self.o_proj(o.reshape(b, t, -1))
