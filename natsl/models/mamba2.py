"""The Mamba2 layer (Dao and Gu, "Transformers are SSMs"; as mamba_ssm's and flash-linear-attention's
`Mamba2`), and the Mamba2 state that a NAtS-L layer can carry instead of the GDN state.

    x --in_proj--> z [d_in], xBC [d_in + 2 G N], a [H]           d_in = expand * d, H = d_in / P
    x, B, C = SiLU(short causal conv(xBC) [+ b])                   one depthwise conv over x|B|C (b: mamba2_conv_bias)
    dt = softplus(a + dt_bias), A = -exp(A_log)                   per head, fp32
    y = SSD(q=C, k=B, v=x dt, g=A dt, scale 1) + D x               natsl.ops.gated_linear_rule on G groups of B, C
    out = out_proj(RMSNorm(y * silu(z)))                           the gate before the norm, over all of d_in

The SSD is gated linear attention with one scalar decay per head: S_t = exp(g_t) S_{t-1} + k_t v_t^T,
o_t = S_t^T q_t, with the state [N, P] per head. Init as Mamba2: A ~ U(1, 16), dt log-uniform in
[1e-3, 0.1] (dt_bias its inverse softplus), D = 1. The cache (prefill + decode) is a GDNCache: the
conv tail of x|B|C and the state [B, H, N, P].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from natsl import ops
from natsl.models.cache import drop_pad_gates
from natsl.models.conv import ShortConv
from natsl.models.gated_deltanet import GatedDeltaProjections, init_decay
from natsl.models.linear import Linear
from natsl.models.norms import RMSNorm
from natsl.models.pointwise import mamba2_gates
from natsl.ops import gemv, kernel_set
from natsl.ops.cached import gla_token_step
from natsl.reference.gates import add_skip, step_values

if TYPE_CHECKING:
    from natsl.config import ModelConfig

MAMBA2_A_MIN = 1.0  # A ~ U(1, 16) (mamba_ssm's A_init_range)
SSD_SCALE = 1.0  # Mamba2 reads its state unscaled: y = C^T S


class Mamba2(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        self.backend = config.backend
        d = config.hidden_size
        self.inner = config.mamba2_expand * d
        self.head_dim, self.state_size, self.groups = config.mamba2_head_dim, config.mamba2_state_size, config.mamba2_groups
        self.num_heads = self.inner // self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        # No projection biases: mamba_ssm's and FLA's Mamba2 default (use_bias=False). The conv bias, their
        # default (use_conv_bias=True), only with mamba2_conv_bias (natsl's recipes have none; 0.02% of the
        # 800M model): a biased conv runs the PyTorch formula (natsl.ops.short_conv), not the Triton kernels.
        self.in_proj = Linear(d, self.inner + self.conv_dim + self.num_heads, bias=False, device=device)
        self.conv = ShortConv(self.conv_dim, config.conv_size, device=device, backend=config.backend,
                              bias=config.mamba2_conv_bias)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, device=device))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, device=device))
        self.D = nn.Parameter(torch.empty(self.num_heads, device=device))
        for p in (self.A_log, self.dt_bias, self.D):
            p._no_weight_decay = True
        self.norm = RMSNorm(self.inner, config.norm_eps, device=device)
        self.out_proj = Linear(self.inner, d, bias=False, device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_decay(self.A_log, self.dt_bias, MAMBA2_A_MIN)
        with torch.no_grad():
            self.D.fill_(1.0)

    def forward(self, x: torch.Tensor, cache=None, rope=None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]; with `cache` (a GDNCache) the tokens follow those in it. The
        elementwise steps run on the call's kernel set (natsl.ops.kernel_set: one kernel each on the fused
        set; without a cache `pick_full_forward`'s: fused only where nothing is differentiated).
        `rope` is accepted like every mixer's and unused."""
        b, t, _ = x.shape
        z, xbc, a = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        if cache is None:
            kernels = kernel_set.pick_full_forward(self.backend, x.device)
            xbc, _ = self.conv(xbc)
        else:
            kernels = kernel_set.pick(self.backend, x.device, cache.state.dtype)
            if t == 1:
                return self.decode(z, xbc, a, cache, kernels)
            # a padded prefill call (natsl.inference.prefill_graph): the tail ends at the prompt
            xbc, tail = self.conv(xbc, cache.conv[0], valid=cache.positions.valid, kernels=kernels)
            cache.store_conv([tail])
        xs, B, C = xbc.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        # B, C stay [b, t, G, N]: the op reads group j for heads j H/G .. (j+1) H/G - 1 and saves them as
        # they are for its backward (not H/G-fold expanded copies of the same bytes).
        B = B.view(b, t, self.groups, self.state_size)
        C = C.view(b, t, self.groups, self.state_size)
        g, dt = mamba2_gates(a, self.A_log, self.dt_bias)
        if cache is not None:  # the pads of a padded prefill call: g = 0, dt = 0 leave the state as it was
            g, dt = drop_pad_gates(g, dt, cache.positions)
        v = kernels.step_values(xs.view(b, t, self.num_heads, self.head_dim), dt)
        if cache is None:
            y, _ = ops.gated_linear_rule(C, B, v, g, scale=SSD_SCALE, backend=self.backend)
        else:
            y, state = ops.gated_linear_rule(C, B, v, g, scale=SSD_SCALE, initial_state=cache.state,
                                             output_final_state=True, backend=self.backend)
            cache.state.copy_(state)
        y = kernels.gated_input_norm(y.reshape(b, t, self.inner), self.norm, z, skip=xs, skip_scale=self.D)
        return self.out_proj(y)

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm, cache, kernels):
        """A block's cached call: (x + residual, self(norm(x + residual), cache)). On a decode step where
        natsl.ops.gemv.add_norm_conv_linear runs (the switch fused_add_norm), the add and the norm are formed
        inside the in_proj GEMV (and with fused_conv the xBC conv); else `kernels.add_norm`
        (natsl.ops.kernel_set), then this layer."""
        if x.shape[1] == 1:
            # with the switch fused_conv, the xBC conv in the GEMV's epilogue (the kernel's conv has no bias)
            conv = (self.inner, [self.conv.weight], [cache.conv[0]]) if self.conv.bias is None else None
            fused = gemv.add_norm_conv_linear(x, residual, norm.weight, norm.eps, self.in_proj.weight, conv)
            if fused is not None:
                x, projected, convolved = fused
                z, xbc, a = projected.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
                return x, self.decode(z, xbc, a, cache, kernel_set.pick(self.backend, x.device, cache.state.dtype),
                                      convolved)
        x, normed = kernels.add_norm(x, residual, norm)
        return x, self(normed, cache=cache)

    def conv_step(self, xbc: torch.Tensor, cache, kernels) -> torch.Tensor:
        """One token's xBC [B, 1, conv_dim] through the conv + SiLU, the cached tail shifted in place (a
        biased conv runs its formula: the fused step has no bias)."""
        if self.conv.bias is None:
            return kernels.conv_steps([xbc], [cache.conv[0]], [self.conv.weight])[0]
        xbc, tail = self.conv(xbc, cache.conv[0], kernels=kernels)
        cache.store_conv([tail])
        return xbc

    def decode(self, z: torch.Tensor, xbc: torch.Tensor, a: torch.Tensor, cache, kernels,
               convolved: bool = False) -> torch.Tensor:
        """One token [B, 1, ...] of the in_proj's z, xBC and a on the kernel set `kernels`
        (natsl.ops.kernel_set): the conv step (`conv_step`), then dt, g, the SSD step on the cached state (in
        place), the read and + D x (one kernel on the fused set, which reads each B/C group for the heads that
        share it); then the gated norm and out_proj. No host reads. `convolved`: xbc is the conv's output
        already (in_proj's kernel ran the step)."""
        b = xbc.shape[0]
        if not convolved:
            xbc = self.conv_step(xbc, cache, kernels)
        width = self.groups * self.state_size
        xs, B, C = xbc.split([self.inner, width, width], dim=-1)
        y, _ = kernels.gla_decode_step(C, B, xs, a, self.A_log, self.dt_bias, cache.state, D=self.D,
                                       scale=SSD_SCALE)
        y = y.reshape(b, 1, self.inner)
        # the gated norm inside out_proj's GEMV (natsl.ops.gemv), where it runs
        fused = gemv.gated_input_norm_linear(y, z, self.norm.weight, self.norm.eps, self.out_proj.weight,
                                             self.out_proj.bias)
        return fused if fused is not None else self.out_proj(kernels.gated_input_norm(y, self.norm, z))


class Mamba2StateProjections(GatedDeltaProjections):
    """A NAtS-L layer's projections with a Mamba2 (SSD) state in place of the GDN state: the same q, k,
    v (conv + SiLU, H heads of K and V, cut into the softmax heads as before) read as Mamba2's C, B and
    x; one H-wide projection a gives dt = softplus(a + dt_bias) and the decay g = -exp(A_log) dt (no
    beta); the state is written with v dt and read unscaled. As the authors' natsl_attn_mamba2 (the
    default), q and k are L2-normalised per head (the GDN state's `split_heads`) and nothing is added to
    the read; `mamba2_state_l2: false` reads them unnormalised, as Mamba2's C and B, and
    `mamba2_state_skip: true` adds D v. The block write mask and commit are gated_delta_rule's
    (natsl.ops.gated_linear_rule). A ~ U(0, 16) as the authors' layer (GDN's range, not Mamba2's)."""

    gate_names = ("a_proj",)
    merge_groups = {"qkvab": ("q_proj", "k_proj", "v_proj", "a_proj")}  # see natsl.models.merged
    scale = SSD_SCALE

    def __init__(self, config: ModelConfig, device=None):
        super().__init__(config, device=device)
        self.l2_heads = config.mamba2_state_l2
        self.D = None
        if config.mamba2_state_skip:
            self.D = nn.Parameter(torch.ones(self.num_heads, device=device))
            self.D._no_weight_decay = True

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "D", None) is not None:  # the base class's __init__ resets before D exists
            with torch.no_grad():
                self.D.fill_(1.0)

    def gates(self, a: torch.Tensor):
        """The a projection -> (log decay g, step dt), both [B, T, H] fp32."""
        return mamba2_gates(a, self.A_log, self.dt_bias)

    def rule(self, q, k, v, g, dt, write=None, **options):
        return ops.gated_linear_rule(q, k, step_values(v, dt), g, write, scale=self.scale, **options)

    def token_step(self, state, q, k, v, g, dt):
        return gla_token_step(state, q, k, step_values(v, dt), g, scale=self.scale)

    def decode_step(self, q, k, v, raw_gates, state, kernels):
        """`token_step` from the raw projections q, k, v [B, 1, H*D] and the gate input [B, 1, H] on the
        kernel set's gla_decode_step (natsl.ops.kernel_set; one kernel on the fused set): the L2 norms
        (`l2_heads`), dt, g and the step, state [B, H, K, V] in place; the skip stays `skip`'s."""
        (a,) = raw_gates
        return kernels.gla_decode_step(q, k, v, a, self.A_log, self.dt_bias, state, scale=self.scale,
                                       l2=self.l2_heads)

    def skip(self, o: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return o if self.D is None else add_skip(o, v, self.D)
