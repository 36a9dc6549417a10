"""The kernel set of a layer's cached call (prefill or decode): the door through which the models reach
the fused Triton kernels of their cached paths, and the place where they are chosen.

`pick(backend, device, state_dtype)` returns `Fused` where the fused inference kernels are enabled
for the layer's backend on `device` (natsl.ops.fused.enabled: CUDA with the fast backend, or the
Triton interpreter with the switch force_fused_inference) and the layer's recurrent state, if it has
one, is fp32 (the kernels' state); else `Reference`. A layer picks once per call and runs every
step below on the set it got, with no choice of its own:

| step | `Fused` | `Reference` |
|---|---|---|
| `norm` (RMSNorm, optionally x silu(gate)) | `natsl.fast.norms.rms_norm` | the `RMSNorm` module; with a gate `natsl.ops.norms.gated_rms_norm` |
| `gated_input_norm` (Mamba2's output: optional + D x, then RMSNorm(y silu(z))) | `natsl.fast.norms.gated_input_rms_norm` | `add_skip`, then `natsl.ops.norms.gated_input_rms_norm` |
| `step_values` (Mamba2's write x dt) | `natsl.fast.gates.step_values` | `natsl.reference.gates.step_values` |
| `add_norm` (residual add + the next norm) | `natsl.fast.norms.add_rms_norm` | `x + residual`, then the module |
| `l2_normalize` | `natsl.fast.norms.l2_normalize` | `natsl.ops.norms.l2_normalize` |
| `short_conv_silu` (a chunk after a cached tail) | `natsl.fast.cached.conv_chunk` (grad-free, no bias) | `natsl.ops.short_conv.compiled_reference` |
| `conv_steps` (a decode token's convs, tails shifted in place) | `natsl.fast.cached.conv_steps` | the compiled conv, then `conv_tail` |
| `gdn_decode_step` (gates, L2 norms, token step, state in place) | `natsl.fast.cached.gdn_decode_step` | `gdn_gates`, `l2_normalize`, `natsl.ops.cached.gdn_token_step` |
| `gla_decode_step` (Mamba2's gates, L2 norms, SSD token step, + D x) | `natsl.fast.cached.gla_decode_step` (switch `fused_gla_decode`, on by default) | its twin `natsl.reference.cached.gla_decode_step` |
| `rope_write_kv` (a decode token's q/k norms, RoPE, K/V write) | `natsl.fast.cached.rope_write_kv` (switch `fused_rope`, on by default) | `natsl.reference.cached.rope_write_kv` |
| `store_blocks` | `natsl.fast.cached.store_blocks` | `natsl.reference.cached.store_blocks` |
| `close_block` (NAtS-L block end) | `natsl.ops.block_end.close_block` (compiled); with a keep budget or a custom override, the reference's | eager bookkeeping, commit on `natsl.ops.cached.commit_state` |

The reference side is what the models ran before the fused kernels existed, moved here step for
step: the compiled pieces on CUDA (as in training), the reference twins elsewhere, and where one
fused kernel replaces several model steps (`gdn_decode_step`, `conv_steps`, `add_norm`, `close_block`),
those steps. Its results are therefore those of the full-sequence forward's pieces; the fused side
agrees to rounding (tests/test_inference.py runs it in Triton's interpreter against the full
forward). `REFERENCE` is the reference set that the full-sequence forward's shared steps (the
norms of `split_heads`, `softmax_views`, the GDN output) take by default.
"""

from __future__ import annotations

import functools

import torch

from natsl import switches
from natsl.ops import block_end, cached, fused, norms, short_conv, twin
from natsl.reference import gates
from natsl.reference.router import KeepFraction


class Reference:
    """The cached paths' steps in PyTorch (see the module's table). `backend`: the layer's, for the
    steps whose reference side still picks a twin by backend (the GDN token step and block commit)."""

    fused = False

    def __init__(self, backend: str | None):
        self.backend = backend

    def norm(self, x: torch.Tensor, norm, gate: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x with `norm`'s weight and eps (an `RMSNorm`: called itself here), times silu(gate)
        when given (gate: x's shape)."""
        if gate is None:
            return norm(x)
        return norms.gated_rms_norm(x, norm.weight, norm.eps, gate)

    def gated_input_norm(self, x: torch.Tensor, norm, gate: torch.Tensor, skip: torch.Tensor | None = None,
                         skip_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Mamba2's output norm RMSNorm(x silu(gate)) with `norm`'s weight and eps; with `skip` first
        x + skip_scale skip per head (x, gate, skip [..., H P]; skip_scale [H]). The reference side is
        the full forward's: `add_skip` eagerly (so that D's gradient reads skip in its own dtype), then
        the compiled norm."""
        if skip is not None:
            x = gates.add_head_skip(x, skip, skip_scale)
        return norms.gated_input_rms_norm(x, norm.weight, norm.eps, gate)

    def step_values(self, v: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """Mamba2's write v dt: v [..., H, P], dt [..., H] fp32, in v's dtype."""
        return gates.step_values(v, dt)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm):
        """(x + residual, norm(x + residual)); residual None: (x, norm(x)). The residual stream of a
        cached call carries each block's last output as `residual` into the next block's first norm."""
        if residual is not None:
            x = x + residual
        return x, norm(x)

    def l2_normalize(self, x: torch.Tensor) -> torch.Tensor:
        return norms.l2_normalize(x)

    def short_conv_silu(self, x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None, *,
                        bias: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
        """`natsl.ops.short_conv.short_conv_silu` (a conv layer's `backend`), whose chunk after a tail
        takes the fused kernel where this set is `Fused`."""
        return short_conv.short_conv_silu(x, weight, tail, bias=bias, backend=backend, fused=self.fused)

    def conv_steps(self, xs, tails, weights) -> list[torch.Tensor]:
        """One token of each short conv + SiLU (x [B, 1, C], tail [B, W, C], weight [C, 1, W+1]; a GDN
        layer's q, k, v): the outputs [B, 1, C], each tail shifted by one with x appended, in place."""
        ys = [short_conv.short_conv_silu(x, weight, tail, backend=self.backend)
              for x, tail, weight in zip(xs, tails, weights)]
        for x, tail in zip(xs, tails):
            tail.copy_(short_conv.conv_tail(x, tail))
        return ys

    def gdn_decode_step(self, q, k, v, a, b, A_log, dt_bias, state):
        """One GDN token from the post-conv projections q, k [B, 1, H*K], v [B, 1, H*V] and the gate
        inputs a, b [B, 1, H]: the gates, L2-normalised q and k, and the delta-rule step of state
        [B, H, K, V] (updated in place). Returns (o [B, H, V] in q's dtype, g [B, H] fp32: the token's
        log decay)."""
        batch, t = q.shape[:2]
        _, heads, k_dim, v_dim = state.shape
        g, beta = cached.gdn_gates(a, b, A_log, dt_bias)
        ql = self.l2_normalize(q.view(batch, t, heads, k_dim))
        kl = self.l2_normalize(k.view(batch, t, heads, k_dim))
        vl = v.view(batch, t, heads, v_dim)
        o, new_state = cached.gdn_token_step(state, ql[:, 0], kl[:, 0], vl[:, 0], g[:, 0], beta[:, 0],
                                             backend=self.backend)
        state.copy_(new_state)
        return o, g[:, 0]

    def gla_decode_step(self, q, k, v, a, A_log, dt_bias, state, *, D=None, scale=None, l2: bool = False):
        """One gated-linear (Mamba2 SSD) token from the post-conv projections q, k [B, 1, G*K] (C and B),
        v [B, 1, H*V] (x) and the dt input a [B, 1, H]: the gates, the write v dt, L2 norms where `l2`,
        the step of state [B, H, K, V] (in place) and + D x where D is given
        (natsl.reference.cached.gla_decode_step). Returns (o [B, H, V] in q's dtype, g [B, H] fp32)."""
        return twin("gla_decode_step", self.gla_decode_fused())(q[:, 0], k[:, 0], v[:, 0], a[:, 0], A_log, dt_bias, state,
                                           D=D, scale=scale, l2=l2)

    def gla_decode_fused(self) -> bool:
        """Whether `gla_decode_step` runs its fused kernel: on the fused set, with the switch
        fused_gla_decode on (NATSL_FUSED_GLA_DECODE)."""
        return self.fused and switches.current().fused_gla_decode

    @staticmethod
    def compiled_block_end(route_override, keep_budget: bool) -> bool:
        """Whether the fused set's `close_block` runs the compiled block end (natsl.ops.block_end): not
        with the keep budget (`keep_budget`: the cache has keep_gaps, model.router_keep_budget) unless an
        override wins over it, nor with an override other than a fixed keep fraction; those keep the
        eager bookkeeping."""
        budget = route_override is None and keep_budget
        return not (budget or (route_override is not None and not isinstance(route_override, KeepFraction)))

    def rope_write_kv(self, q, k, v, positions, inv_freq, k_buf, v_buf, slots, norms=None):
        """A decode token's softmax heads: q, k [B, heads, Dk] normed by `norms` (the layer's (q_norm,
        k_norm) RMSNorm modules, or None), rotated at positions [B] with inv_freq [Dk / 2] (None: no RoPE),
        K and V [B, heads, Dv] written to k_buf, v_buf [B, heads, L, D] at slots [B, heads]. Returns q."""
        q_weight, k_weight, eps = (None, None, 1e-6) if norms is None else (norms[0].weight, norms[1].weight,
                                                                             norms[0].eps)
        assert norms is None or norms[0].eps == norms[1].eps
        # the kernel reads unit-stride rows; the switch fused_rope (NATSL_FUSED_ROPE=0) keeps the twin
        fused = self.fused and switches.current().fused_rope and all(t.stride(-1) == 1 for t in (q, k, v))
        return twin("rope_write_kv", fused)(q, k, v, positions, inv_freq, k_buf, v_buf, slots,
                                            q_weight=q_weight, k_weight=k_weight, eps=eps)

    def store_blocks(self, src, mem, valid, before, kept0, n: int, block_size: int) -> None:
        """A prefill chunk's K or V into a NAtS-L cache's compacted memory (natsl.reference.cached.store_blocks)."""
        twin("store_blocks", self.fused)(src, mem, valid, before, kept0, n, block_size)

    def close_block(self, cache, x, pos, router_weight, route_override, route, block_size: int,
                    decay_skipped_blocks: bool, g_token=None, router_bias=None) -> None:
        """A NAtS-L decode token's block end, in place on `cache` (its x_sum, decay_sum, state_start,
        state_run and kept_len): add the token x [B, d] (and its log decay g_token [B, H], when given)
        to its block's sums; where it ends its block (pos % C == C-1), route the block with `route`
        (the layer's `decide_routes`, which applies `route_override`, and with a keep budget reads and
        records the cache's `keep_gaps`), commit the state, add C to the kept length of kept groups and
        reset the block's sums. `router_weight`, `route_override` and `router_bias` (the layer's keep
        bias [H] or None, which `route` applies itself) serve the compiled form (`Fused`)."""
        C = block_size
        if g_token is not None:
            cache.decay_sum.add_(g_token)
        cache.x_sum.add_(x.to(cache.x_sum.dtype))
        done = pos % C == C - 1
        keep, write = route(cache.x_sum[:, None], C, (pos // C)[:, None], cache)
        keep, write = keep[:, 0], write[:, 0]
        committed = cached.commit_state(cache.state_start, cache.state_run, cache.decay_sum, write,
                                        decay_skipped_blocks, backend=self.backend)
        at_end = done[:, None, None, None]
        cache.state_start.copy_(torch.where(at_end, committed, cache.state_start))
        cache.state_run.copy_(torch.where(at_end, committed, cache.state_run))
        cache.kept_len.add_(C * keep.long() * done[:, None])
        cache.decay_sum.masked_fill_(done[:, None], 0)
        cache.x_sum.masked_fill_(done[:, None], 0)


class Fused(Reference):
    """The cached paths on the fused Triton kernels (see the module's table)."""

    fused = True

    def norm(self, x, norm, gate=None):
        return twin("rms_norm", True)(x, norm.weight, norm.eps, gate)

    def gated_input_norm(self, x, norm, gate, skip=None, skip_scale=None):
        return twin("gated_input_rms_norm", True)(x, norm.weight, norm.eps, gate, skip, skip_scale)

    def step_values(self, v, dt):
        return twin("step_values", True)(v, dt)

    def add_norm(self, x, residual, norm):
        if residual is None:
            return x, twin("rms_norm", True)(x, norm.weight, norm.eps)
        if residual.dtype == x.dtype:  # one kernel
            return twin("add_rms_norm", True)(x, residual, norm.weight, norm.eps)
        x = x + residual  # the plain sum would promote: keep its dtype
        return x, twin("rms_norm", True)(x, norm.weight, norm.eps)

    def l2_normalize(self, x):
        return twin("l2_normalize", True)(x)

    def conv_steps(self, xs, tails, weights):
        return twin("conv_steps", True)(xs, tails, weights)

    def gdn_decode_step(self, q, k, v, a, b, A_log, dt_bias, state):
        return twin("gdn_decode_step", True)(q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], A_log, dt_bias, state)

    def close_block(self, cache, x, pos, router_weight, route_override, route, block_size, decay_skipped_blocks,
                    g_token=None, router_bias=None):
        # The compiled form knows the router (with its keep bias) and the fixed keep fraction's hash; any
        # other override (a callable a user sets) keeps the eager bookkeeping, which calls it. So does the
        # keep budget (a cache with keep_gaps, and no override to win over it): its rank reads the gaps of
        # every earlier block, which the compiled form does not carry. The cost: the eager bookkeeping's
        # few dozen small kernels on every decode token (natsl.ops.block_end says why that matters).
        if not self.compiled_block_end(route_override, cache.keep_gaps is not None):
            return super().close_block(cache, x, pos, router_weight, route_override, route, block_size,
                                       decay_skipped_blocks, g_token, router_bias)
        block_end.close_block(cache.x_sum, x, pos, router_weight, cache.state_start, cache.state_run,
                              cache.decay_sum, cache.kept_len, block_size, decay_skipped_blocks,
                              None if route_override is None else route_override.fraction,
                              0 if route_override is None else route_override.seed, g_token,
                              None if route_override is not None else router_bias)


# The full-sequence forward's shared steps (natsl.models.gated_deltanet, natsl_layer) take this set.
REFERENCE = Reference("reference")


def pick(backend: str | None, device: torch.device, state_dtype: torch.dtype | None = None) -> Reference:
    """The kernel set of a cached call of a layer on `backend` with tensors on `device` and its
    recurrent state (if any) in `state_dtype`: `Fused` where `natsl.ops.fused.enabled` and the state
    is fp32, else `Reference`."""
    return _kernel_set(fused.enabled(backend, device) and state_dtype in (None, torch.float32), backend)


def pick_full_forward(backend: str | None, device: torch.device) -> Reference:
    """The kernel set of a full-sequence forward (no cache): `pick`'s where nothing is differentiated
    and no model is being compiled (evaluation's windows: the fused kernels have no backward), else
    `REFERENCE`, the compiled formulas that training's backward and a compiled model trace."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return REFERENCE
    return pick(backend, device)


@functools.lru_cache(maxsize=None)
def _kernel_set(on: bool, backend: str | None) -> Reference:
    """The sets hold nothing but their backend: one of each per backend, not one per call (several
    calls a layer and token on a decode path)."""
    return Fused(backend) if on else Reference(backend)
