"""The NAtS-L decode step's bookkeeping as two compiled functions (few kernels, CUDA-graph safe).

Each decode token of a NAtS-L layer has to (1) find the slots its K/V go to and how many slots its
query sees, and (2) at a block end, route the block on its mean, commit the GDN state and keep or
drop the block's KV. In eager PyTorch that is ~40 tiny kernels per layer and token (the route alone
is a matmul, a softmax, an argmax and a one-hot; a fixed keep fraction's hash is ~15 integer ops),
which together take longer in a CUDA-graph replay than reading the layer's weights.
The same formulas, wrapped by `natsl.ops.compiled.pointwise`, compile to a handful of kernels
on CUDA and run eagerly elsewhere. `decode_slots` runs on every decode step; `close_block` is the
block end of the fused kernel set (natsl.ops.kernel_set.Fused.close_block), whose reference is the
eager bookkeeping of `natsl.ops.kernel_set.Reference.close_block`.

The route is `natsl.reference.router.route_means`, the rule that `CachedNAtSL.decide_routes`
(natsl/models/natsl_cached.py) and the full forward call too (router on the block mean, plus the layer's
keep bias when it has one, ties to keep; or the layer's KeepFraction hash), and the commit as
`natsl.ops.cached.commit_state` on the reference. The keep budget (model.router_keep_budget) is not here: its
rank reads every earlier block's gap, so the fused set keeps the eager block end for it.
"""

from __future__ import annotations

import functools

import torch

from natsl.ops.cached import commit_state
from natsl.ops.compiled import pointwise
from natsl.reference.router import keep_hash, route_means


@pointwise
def decode_slots(kept_len: torch.Tensor, pos: torch.Tensor, groups: int, block_size: int, own_block: bool):
    """kept_len [B, G], pos [B] -> (slots [B, heads] this token's K/V go to, visible [B, heads] slots
    its query reads): after its group's kept blocks and its block's earlier tokens; `own_block`
    False ("gdn" intra-block output) reads the kept blocks only."""
    kept = kept_len.repeat_interleave(groups, dim=1)
    slots = kept + (pos % block_size)[:, None]
    return slots, (slots + 1 if own_block else kept)


@pointwise
def close_block(x_sum: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, router_weight: torch.Tensor,
                state_start: torch.Tensor, state_run: torch.Tensor, decay_sum: torch.Tensor,
                kept_len: torch.Tensor, block_size: int, decay_skipped_blocks: bool,
                fraction: float | None, seed: int, g_token: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> None:
    """Add the token x [B, d] to the block's running sum (and its log decay g_token [B, H], when
    given, to the block's decay sum); where it ends its block (pos % C == C-1), route the block,
    commit the state (both states become the committed one), add C to the kept length of kept
    groups and reset the block's sums. All in place; rows not at a block end keep their states.
    `bias` [H]: the layer's keep bias on the router's keep score (None: none). `fraction` not None:
    the KeepFraction(fraction, seed) route instead of the router."""
    C = block_size
    G = kept_len.shape[1]
    x_sum.add_(x.to(x_sum.dtype))
    if g_token is not None:
        decay_sum.add_(g_token.to(decay_sum.dtype))
    done = (pos % C) == C - 1
    override = None if fraction is None else functools.partial(keep_hash, seed=seed, fraction=fraction)
    keep = route_means(x_sum.to(router_weight.dtype) / C, router_weight, G, bias, override=override,
                       block_index=pos // C)[0]
    committed = commit_state(state_start, state_run, decay_sum, 1 - keep, decay_skipped_blocks)
    at_end = done[:, None, None, None]
    state_start.copy_(torch.where(at_end, committed, state_start))
    state_run.copy_(torch.where(at_end, committed.to(state_run.dtype), state_run))
    kept_len.add_(C * (keep > 0.5).long() * done[:, None].long())
    decay_sum.masked_fill_(done[:, None], 0)
    x_sum.masked_fill_(done[:, None], 0)
