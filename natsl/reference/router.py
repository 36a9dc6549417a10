"""The NAtS-L router (docs/spec.md section 2, step 4): one hard route per (block, GDN head).

`xbar_b` is the mean of the block's hidden states (a partial last block averages what it has),
`s_b = W_r xbar_b` gives two scores per head, `p = softmax(s_b)` and the route is the one-hot
argmax with a straight-through gradient: `m = onehot(argmax p) + (p - stopgrad(p))`. The value of
`m` is exactly 0/1 (the bracket is exactly zero), its gradient is that of `p`.

With `model.router_keep_target` set (docs/recall.md, "Routing over training") the layer holds a bias
per head, float32 [H], added to the keep score (index 0) before the softmax: `s_b[h, 0] += bias[h]`.
Every route of the layer (full-sequence forward, cached prefill, decode block end) passes it to
`router_scores`, so all paths decide alike.

With `model.router_keep_budget` set, the hard route is not the argmax but `budget_keep`: a causal
rule on the keep gaps (`s_b[h, 0] - s_b[h, 1]`, after the bias) that keeps at most a fraction F of
every prefix of a group's blocks (docs/recall.md, "Routing over training"). The gradient is the
same straight-through one, `m = hard + (p - stopgrad(p))`.

`commit_block` is the route's consequence for the GDN (or Mamba2) state, the one commit rule of every path:
the reference training kernels (naive and chunked), the cached prefill, the decode block end and the fused
one (on its fast twin, `natsl.fast.gated_delta.commit`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def commit_block(state_start, state_end, gamma, write, decay_skipped_blocks: bool = True):
    """S_start(b+1) = c S_start(b) + write (S_end(b) - c S_start(b)), c = gamma or 1 for the ablation.

    A kept block (write 0) leaves the state as it was before the block, decayed by the block's gates (its
    clock runs) but with none of its content; a written block (write 1) takes S_end(b). Computes in the start
    state's dtype; returns a new tensor.

    Args:
        state_start: S_start(b), the committed state before the block, [B, H, K, V].
        state_end: S_end(b), the state after the block's tokens, [B, H, K, V].
        gamma: the block's decay, exp of its sum of g, [B, H].
        write: the route, 1 = write to the state, 0 = keep in KV memory, [B, H] (straight-through valued).
        decay_skipped_blocks: False: the ablation in which a kept block's clock does not run (c = 1).
    Returns:
        S_start(b+1), [B, H, K, V].
    """
    dtype = state_start.dtype
    write = write.to(dtype)
    base = gamma.to(dtype)[..., None, None] * state_start if decay_skipped_blocks else state_start
    return base + write[..., None, None] * (state_end.to(dtype) - base)


def block_mean(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, T, d] -> [B, NB, d]: mean of each block of `block_size` tokens."""
    batch, length, width = x.shape
    num_blocks = -(-length // block_size)
    padded = F.pad(x, (0, 0, 0, num_blocks * block_size - length))
    sums = padded.view(batch, num_blocks, block_size, width).sum(dim=2)
    counts = torch.full((num_blocks,), block_size, dtype=x.dtype, device=x.device)
    counts[-1] = length - (num_blocks - 1) * block_size
    return sums / counts[None, :, None]


def straight_through_route(scores: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., 2] -> (m [..., 2] one-hot valued with softmax gradient, p [..., 2]).

    Index 0 is softmax KV memory (`keep`), index 1 the GDN state (`write`); ties go to index 0.
    `keep` [...] (0/1, from `budget_keep`), when given, is the hard route instead of the argmax.
    """
    probs = torch.softmax(scores.float(), dim=-1)
    if keep is None:
        hard = F.one_hot(probs.argmax(dim=-1), num_classes=2).to(probs.dtype)
    else:
        hard = torch.stack([keep, 1 - keep], dim=-1).to(probs.dtype)
    return hard + (probs - probs.detach()), probs


def keep_gaps(scores: torch.Tensor) -> torch.Tensor:
    """scores [..., 2] -> the keep gap s_keep - s_write [...] in float32 (the dtype of the route's
    softmax), the quantity `budget_keep` ranks; every path computes it alike so that they rank alike."""
    scores = scores.float()
    return scores[..., 0] - scores[..., 1]


def budget_keep(gaps: torch.Tensor, fraction: float, first: int | torch.Tensor = 0,
                earlier: torch.Tensor | None = None, kept: torch.Tensor | None = None, sink: int = 0) -> torch.Tensor:
    """The budgeted hard route (model.router_keep_budget = F): gaps [B, N, H] of the blocks
    first .. first+N-1 of each sequence -> keep [B, N, H] float32 0/1.

    Per sequence and group, block i (absolute index) is kept when

        #{ j < i : d_j >= d_i } < F (i + 1)     (rank: its gap is in the top F of the blocks so far)
        and  kept_{<i} + 1 <= ceil(F (i + 1))    (cap: the running kept count stays within the budget)

    with both products in float64. Ties count against the later block. The cap means that among the
    first n blocks of a group at most ceil(F n) are kept: the kept fraction of every prefix is at
    most F plus under one block (F exactly where F n is whole). Rounding up rather than down lets the
    first block be kept (rank 0 < F, cap 1 <= ceil(F)): a sequence's opening block (a prompt's start,
    MQAR's first key-value pairs) can stay in exact memory, as an attention sink would. Only earlier
    blocks are read, so a block's route is final at its end.

    `first`: the absolute index of the first new block, an int (prefill) or [B] int64 (decode:
    each sequence at its own block); `earlier` [B, H, M]: the gaps of earlier blocks by absolute
    index (slots >= first are not read); `kept` [B, H] int64: blocks kept before `first`.

    `sink` (model.router_keep_budget_sink): blocks 0 .. sink-1 are always kept and lie outside the
    budget: for i >= sink the rule above reads i - sink for i, and only blocks >= sink for j and for
    the kept count. So routing blocks sink, sink+1, ... equals routing them alone with no sink.
    """
    batch, n, heads = gaps.shape
    d = gaps.float().transpose(1, 2)  # [B, H, N]
    device = d.device
    if isinstance(first, int):
        first = torch.full((1,), first, dtype=torch.long, device=device)
    index = first[:, None] + torch.arange(n, device=device)  # [B|1, N]: absolute block index
    budgeted = index >= sink  # [B|1, N]: blocks under the budget (the sink's are kept outright)
    # rank: earlier new blocks (j < i within this call, both past the sink) whose gap is at least block i's
    before = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)  # [i, j]: j < i
    before = before & budgeted[:, None, :]  # [B|1, i, j]
    count = ((d[..., None, :] >= d[..., :, None]) & before[:, None]).sum(-1)  # [B, H, N]
    if earlier is not None:  # and the blocks of earlier calls (decode: one row per sequence)
        slots = torch.arange(earlier.shape[-1], device=device)
        readable = (slots < first[:, None]) & (slots >= sink)  # [B|1, M]
        ahead = (earlier[:, :, None, :] >= d[..., None]) & readable[:, None, None, :]
        count = count + ahead.sum(-1)
    # F (i - sink + 1), 0 inside the sink (no candidate there, cap 0: the budget's count stays 0)
    limit = ((index - sink + 1).clamp(min=0).double() * fraction)[:, None, :]  # [B|1, 1, N]
    candidate = (count.double() < limit).long()
    # cap: kept_{i+1} = kept_i + candidate_i if that is <= cap_i = ceil(F (i + 1)), else kept_i. As
    # cap_i never falls and kept_i <= cap_{i-1}, that is kept_{i+1} = min(kept_i + candidate_i, cap_i),
    # whose closed form (a clamped running sum) is R_{i+1} + min(kept_0, min_{m<=i} cap_m - R_{m+1})
    # with R the running sum of candidates: no loop over blocks.
    cap = limit.ceil().long()
    running = candidate.cumsum(-1)
    kept0 = torch.zeros(batch, heads, 1, dtype=torch.long, device=device) if kept is None else kept[..., None]
    if sink:  # the budget's own count: the sink's blocks before `first` were all kept
        kept0 = kept0 - first.clamp(max=sink).view(-1, 1, 1)
    kept_after = running + torch.minimum(kept0, (cap - running).cummin(-1).values)  # [B, H, N]
    kept_before = torch.cat([kept0, kept_after[..., :-1]], dim=-1)
    keep = kept_after - kept_before
    if sink:
        keep = torch.where(budgeted[:, None, :], keep, 1)
    return keep.float().transpose(1, 2)


def router_scores(xbar: torch.Tensor, weight: torch.Tensor, num_heads: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Block means [..., d], weight [2H, d] -> the two scores per head [..., H, 2] (index 0: keep).
    `bias` [H] (float32), when given, is added to each head's keep score (the scores then come in
    float32: the dtype the route's softmax takes anyway)."""
    scores = F.linear(xbar, weight).view(*xbar.shape[:-1], num_heads, 2)
    if bias is None:
        return scores
    return scores + F.pad(bias[:, None], (0, 1))  # [H, 2]: (bias, 0) per head


def route_means(xbar: torch.Tensor | None, weight: torch.Tensor, num_heads: int, bias: torch.Tensor | None = None, *,
                override=None, block_index: torch.Tensor | None = None, budget=None, noise: float = 0.0):
    """The route of blocks from their mean inputs: the one rule that every path of the NAtS-L layer
    calls (the full-sequence forward via `route_blocks`, the cached prefill and the decode block end
    via the layer's `decide_routes`, the compiled decode block end `natsl.ops.block_end.close_block`).

    Args:
        xbar: the blocks' mean inputs [..., d] (each path forms its mean in its own dtype: see the
            callers); not read with `override` (None will do).
        weight: the router's weight [2H, d].
        num_heads: H, the routing groups (GDN heads).
        bias: the layer's keep bias [H] float32 on the keep score, or None.
        override: a route override `(block_index, groups) -> keep [..., groups]` (0/1 float, such as
            `KeepFraction`), or None; it wins over the router, the budget and the noise.
        block_index: the blocks' absolute indices [...] int64 (xbar's leading dims), read by `override`.
        budget: `gaps [..., H] float32 -> keep [..., H]` (0/1), the hard route instead of the argmax
            (model.router_keep_budget: `budget_keep` with the path's earlier blocks), or None.
        noise: the Gumbel noise scale on the scores (model.router_noise, training only; 0: none).

    Returns:
        (keep, write, probs): keep and write [..., H], 0/1 valued with the softmax's straight-through
        gradient (ties to keep), probs [..., H, 2] float32; with `override`: its keep, 1 - keep and None.
    """
    if override is not None:
        keep = override(block_index, num_heads)
        return keep, 1 - keep, None
    scores = router_scores(xbar, weight, num_heads, bias)
    if noise > 0:
        u = torch.rand_like(scores, dtype=torch.float32).clamp_(1e-6, 1 - 1e-6)
        scores = scores.float() - noise * torch.log(-torch.log(u))
    hard = None if budget is None else budget(keep_gaps(scores))
    m, probs = straight_through_route(scores, hard)
    return m[..., 0], m[..., 1], probs


def route_blocks(x: torch.Tensor, weight: torch.Tensor, num_heads: int, block_size: int,
                 bias: torch.Tensor | None = None, budget: float | None = None, sink: int = 0, noise: float = 0.0):
    """x [B, T, d], weight [2H, d] (and the keep bias [H] or None, the keep budget F or None and its
    sink, the Gumbel noise scale) -> (keep [B, NB, H], write [B, NB, H], probs [B, NB, H, 2]): the
    full-sequence forward's `route_means` on the block means of x (in x's dtype)."""
    rule = None if budget is None else functools.partial(budget_keep, fraction=budget, sink=sink)
    return route_means(block_mean(x, block_size), weight, num_heads, bias, budget=rule, noise=noise)


# A router override for measurements (natsl.models.routing.force_keep_fraction): keep each (block,
# routing group) with a fixed probability, by a hash that the compiled decode bookkeeping
# (natsl.ops.block_end) computes too.
_MASK31 = (1 << 31) - 1


class KeepFraction:
    """Callable `(block_index [B, N] int64, groups) -> keep [B, N, groups]` (float 0/1)."""

    def __init__(self, fraction: float, seed: int):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"keep fraction must lie in [0, 1], got {fraction}")
        self.fraction = fraction
        self.seed = seed & _MASK31

    def __call__(self, block_index: torch.Tensor, groups: int) -> torch.Tensor:
        return keep_hash(block_index, groups, self.seed, self.fraction)

    def __repr__(self) -> str:
        return f"KeepFraction({self.fraction}, seed={self.seed})"


def keep_hash(block_index: torch.Tensor, groups: int, seed: int, fraction: float) -> torch.Tensor:
    """KeepFraction's rule as a plain function (the compiled decode step calls it):
    block_index [B, N] int64 -> keep [B, N, groups] (float 0/1)."""
    group = torch.arange(groups, device=block_index.device)
    h = (block_index[..., None] * 1103515245 + group * 12345 + seed * 69069 + 1) & _MASK31
    for _ in range(3):  # a few rounds of an LCG with xor-shift, all products stay below 2^62
        h = (h * 1103515245 + 12345) & _MASK31
        h = h ^ (h >> 13)
    u = h.double() / float(1 << 31)
    return (u < fraction).float()
