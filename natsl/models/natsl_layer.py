"""The NAtS-L layer (docs/spec.md section 2): one set of projections read by two memories.

    x --W_q,W_k,W_v + conv + SiLU--> q, k, v
      GDN branch:      L2(q), L2(k), v, decay g, beta  --gated_delta_rule(write)--> O_la
      softmax branch:  RMSNorm(q), RMSNorm(k), v cut into R heads per GDN head (+RoPE)
                                                       --routed_attention(keep)--> O_nla
      router:          block mean of x -> W_r -> hard argmax (straight-through) -> keep, write
      mixing:          w = softmax(W_m q) per softmax head
    o = W_o((w_la * RMSNorm_1(O_la) + w_nla * RMSNorm_2(O_nla)) * silu(W_g x))

Table 4 ablations are switches of the config: intra_block_output, decay_skipped_blocks,
branch_norm, mix_input, mix_weights, block_size.

`natsl_state: mamba2` puts a Mamba2 (SSD) state in the GDN branch's place (the authors'
`natsl_attn_mamba2`): the projections (natsl.models.mamba2.Mamba2StateProjections) bring the op
(gated_linear_rule on L2-normalised q, k and v dt with decay A dt and the same write mask; optionally
unnormalised q, k and a D skip); the router, the softmax branch and the mixing are the same.

Incremental inference (docs/spec.md section 4: prefill and decode from a NAtSLCache) is
`forward(x, cache=...)`, in natsl/models/natsl_cached.py beside the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from natsl import ops
from natsl.models.gated_deltanet import with_projections
from natsl.models.linear import Linear, aligned_linear
from natsl.models.merged import product_and_last
from natsl.models.natsl_cached import CachedNAtSL
from natsl.models.norms import RMSNorm
from natsl.models.rope import RopeTable, apply_rope
from natsl.ops import kernel_set
from natsl.ops import mix as mix_door
from natsl.reference.router import route_blocks, route_means

if TYPE_CHECKING:
    from natsl.config import ModelConfig


class NAtSL(CachedNAtSL, nn.Module):
    """The NAtS-L layer: the parameters and the full-sequence forward; the cached prefill and decode
    (`forward(x, cache=...)`) come from `CachedNAtSL` (natsl/models/natsl_cached.py)."""

    def __init__(self, config: ModelConfig, device=None, projections: type | None = None):
        """`projections`: the class of the linear memory's projections and op (GatedDeltaProjections or a
        subclass); None: the one config.natsl_state names in the layer registry (natsl.models.registry)."""
        super().__init__()
        self.config = config
        self.backend = config.backend
        d, h, r = config.hidden_size, config.num_heads, config.softmax_heads_per_group
        self.num_heads, self.groups = h, r
        self.softmax_heads = h * r
        if projections is None:
            from natsl.models.registry import kind_of

            projections = kind_of(config, "natsl").projections()
        self.proj = projections(config, device=device)
        self.router = Linear(d, 2 * h, bias=False, device=device)
        if config.mix_weights != "none":
            mix_in = h * config.head_k_dim if config.mix_input == "q" else d
            self.mix_proj = Linear(mix_in, self.softmax_heads * 2, bias=False, device=device)
        self.q_norm = RMSNorm(config.softmax_k_dim, config.norm_eps, device=device)
        self.k_norm = RMSNorm(config.softmax_k_dim, config.norm_eps, device=device)
        if config.branch_norm == "separate":
            self.la_norm = RMSNorm(config.softmax_v_dim, config.norm_eps, device=device)
            self.nla_norm = RMSNorm(config.softmax_v_dim, config.norm_eps, device=device)
        else:
            width = config.head_v_dim if config.branch_norm == "after_sum_state_head" else config.softmax_v_dim
            self.out_norm = RMSNorm(width, config.norm_eps, device=device)
        self.g_proj = Linear(d, h * config.head_v_dim, bias=False, device=device)
        self.o_proj = Linear(h * config.head_v_dim, d, bias=False, device=device)
        # the products of the layer's input as one (natsl.models.merged), as a GDN layer's
        self.merge_groups = {"qkvabg": with_projections(self.proj, "g_proj")}
        # Routes of the last forward ([B, NB, H], detached): read by training logs and inspect-routing.
        self.last_keep: torch.Tensor | None = None
        # The router's balance loss of the last training forward (config.router_balance > 0), else None.
        self.aux_loss: torch.Tensor | None = None
        # `(block_index [B, N], groups) -> keep [B, N, groups]` replacing the router in the full-sequence
        # forward and incremental inference alike (natsl.models.routing.force_keep_fraction); None =
        # the router decides.
        self.route_override = None
        # The balancing controller's keep bias (config.router_keep_target; docs/recall.md), float32 [H]:
        # part of the trained model (a persistent buffer, in checkpoints), read by every route of the
        # layer, moved in place after each training forward (`_update_keep_bias`). None: the paper's
        # router, and no buffer (checkpoints of the plain layer are unchanged).
        if config.router_keep_target is not None:
            self.register_buffer("router_keep_bias", torch.zeros(h, dtype=torch.float32, device=device))
        else:
            self.router_keep_bias: torch.Tensor | None = None

    def _apply(self, fn, recurse: bool = True):
        """`model.to(torch.bfloat16)` casts every floating tensor; the keep bias goes to the new device
        but stays float32, with its values (its steps of router_bias_rate would round away in bf16)."""
        bias = self.router_keep_bias
        super()._apply(fn, recurse)
        moved = self.router_keep_bias
        if bias is not None and moved.dtype != torch.float32:
            self.router_keep_bias = bias.to(device=moved.device, dtype=torch.float32)
        return self

    # -- the layer, in the order of its equations (docs/spec.md section 2) -----------------------
    # route, the softmax branch's views and mix are shared with incremental inference (natsl_cached).

    def route(self, x: torch.Tensor):
        """x [B,T,d] -> keep, write [B, NB, H] (0/1 values, straight-through gradients), by
        `natsl.reference.router.route_means` on the block means, the rule of every path of the layer.
        With a `route_override` (a forced keep fraction) every block takes the override's route for its
        absolute block index, as the incremental path does, so both paths agree (no gradient, no bias
        step); the override wins over `router_keep_budget` too. With the budget the hard route is
        `budget_keep` on the keep gaps. In training, the options of docs/recall.md: Gumbel noise on the
        scores (the keep bias, if any, is in the scores before the noise; the budget ranks the noisy
        gaps), the balance loss towards router_target_keep, left in `self.aux_loss` for the trainer,
        and the keep bias's step."""
        c = self.config
        if self.route_override is not None:
            b, nb = x.shape[0], -(-x.shape[1] // c.block_size)
            index = torch.arange(nb, device=x.device)[None].expand(b, nb)
            keep, write, _ = route_means(None, self.router.weight, self.num_heads, override=self.route_override,
                                         block_index=index)
            return keep.to(x.dtype), write.to(x.dtype)
        keep, write, probs = route_blocks(x, self.router.weight, self.num_heads, c.block_size, self.router_keep_bias,
                                          c.router_keep_budget, c.router_keep_budget_sink,
                                          c.router_noise if self.training else 0.0)
        if self.training and c.router_balance > 0:
            keep_prob = probs[..., 0].mean(dim=(0, 1))  # [H]: mean keep probability per routing group
            self.aux_loss = c.router_balance * ((keep_prob - c.router_target_keep) ** 2).sum()
        if self.training and self.router_keep_bias is not None:
            self._update_keep_bias(keep)
        return keep, write

    @torch.no_grad()
    def _update_keep_bias(self, keep: torch.Tensor) -> None:
        """The balancing controller's step, after the routes of a training forward (as BatchNorm's
        running statistics: in place, no gradient, no host read, so compiled steps and CUDA graphs
        keep it): bias += router_bias_rate * sign(router_keep_target - kept fraction per group), the
        fraction being the hard keep's mean over the batch and the blocks (the trainer's keep_groups).
        Every rank moves its own copy (no all-reduce; docs/recall.md)."""
        c = self.config
        observed = keep.detach().float().mean(dim=(0, 1))  # [H]
        self.router_keep_bias.add_(torch.sign(c.router_keep_target - observed), alpha=c.router_bias_rate)

    def softmax_heads_of(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Flat post-conv q, k, v -> the softmax branch's heads [B, T, H*R, K/R or V/R], as views (no norm,
        no RoPE)."""
        b, t = q.shape[:2]
        c = self.config
        return (q.view(b, t, self.softmax_heads, c.softmax_k_dim), k.view(b, t, self.softmax_heads, c.softmax_k_dim),
                v.view(b, t, self.softmax_heads, c.softmax_v_dim))

    def softmax_views(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
                      positions: torch.Tensor | None = None, kernels=kernel_set.REFERENCE,
                      rope: RopeTable | None = None):
        """Flat post-conv q, k, v -> softmax-branch heads [B, T, H*R, K/R or V/R] (normed on `kernels`,
        natsl.ops.kernel_set; RoPE at positions start..start+T-1, or at `positions` [B, T], one row per
        sequence; or from the shared table `rope`, positions 0..T-1)."""
        c = self.config
        qv, kv, vs = self.softmax_heads_of(q, k, v)
        qs, ks = kernels.norm(qv, self.q_norm), kernels.norm(kv, self.k_norm)
        if c.natsl_rope:
            if positions is None and rope is None:
                positions = torch.arange(start, start + q.shape[1], device=q.device)
            qs = apply_rope(qs, positions, c.rope_theta, rope)
            ks = apply_rope(ks, positions, c.rope_theta, rope)
        return qs, ks, vs

    def forward(self, x: torch.Tensor, cache=None, rope: RopeTable | None = None) -> torch.Tensor:
        """`rope`: the forward's shared angle table (natsl.models.rope.RopeTable), full sequences only."""
        if cache is not None:
            return self.forward_cached(x, cache)
        c = self.config
        self.aux_loss = None
        projected, gate = product_and_last(self, "qkvabg", x)
        q, k, v, g, beta, _ = self.proj(x, projected=projected)
        keep, write = self.route(x)
        self.last_keep = keep.detach()
        ql, kl, vl = self.proj.split_heads(q, k, v)
        o_la, _ = self.proj.rule(
            ql, kl, vl, g, beta, write, block_size=c.block_size,
            decay_skipped_blocks=c.decay_skipped_blocks, route_grad=c.route_grad, backend=self.backend,
            intra_block=c.intra_block_output != "softmax")
        o_la = self.proj.skip(o_la, vl)
        qs, ks, vs = self.softmax_views(q, k, v, rope=rope)
        o_nla = ops.routed_attention(
            qs, ks, vs, keep, block_size=c.block_size, route_grad=c.route_grad, backend=self.backend,
            intra_block=c.intra_block_output != "gdn")
        return self.mix(o_la, o_nla, q, x, gate)

    def mix(self, o_la: torch.Tensor, o_nla: torch.Tensor, q: torch.Tensor, x: torch.Tensor,
            gate: torch.Tensor | None = None) -> torch.Tensor:
        """Both branch outputs (per softmax head) -> W_o(mixed * silu(W_g x)) [B, T, d]; `gate`: W_g x where
        the caller has it (the merged product)."""
        c = self.config
        b, t = x.shape[:2]
        o_la = o_la.reshape(b, t, self.softmax_heads, c.softmax_v_dim)
        logits = None
        if c.mix_weights != "none":
            logits = aligned_linear(q if c.mix_input == "q" else x, self.mix_proj).view(b, t, self.softmax_heads, 2)
        if c.branch_norm == "separate":
            norms = (self.la_norm.weight, self.nla_norm.weight, None, self.la_norm.eps)
        else:
            norms = (None, None, self.out_norm.weight, self.out_norm.eps)
        gate = self.g_proj(x) if gate is None else gate
        # on the Triton kernels (natsl.fast.mix) for the paper's layer on the fast backend, else the
        # compiled formula: natsl.ops.mix decides
        return self.o_proj(mix_door.mix_read(o_la, o_nla, logits, c.mix_weights, gate, *norms, backend=self.backend))
