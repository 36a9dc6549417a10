"""The NAtS-L router (docs/spec.md section 2, step 4): one hard route per (block, GDN head).

`xbar_b` is the mean of the block's hidden states (a partial last block averages what it has),
`s_b = W_r xbar_b` gives two scores per head, `p = softmax(s_b)` and the route is the one-hot
argmax with a straight-through gradient: `m = onehot(argmax p) + (p - stopgrad(p))`. The value of
`m` is exactly 0/1 (the bracket is exactly zero), its gradient is that of `p`.

With `model.router_keep_target` set (docs/recall.md, "Routing over training") the layer holds a bias
per head, float32 [H], added to the keep score (index 0) before the softmax: `s_b[h, 0] += bias[h]`.
Every route of the layer (full-sequence forward, cached prefill, decode block end) passes it to
`router_scores`, so all paths decide alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_mean(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, T, d] -> [B, NB, d]: mean of each block of `block_size` tokens."""
    batch, length, width = x.shape
    num_blocks = -(-length // block_size)
    padded = F.pad(x, (0, 0, 0, num_blocks * block_size - length))
    sums = padded.view(batch, num_blocks, block_size, width).sum(dim=2)
    counts = torch.full((num_blocks,), block_size, dtype=x.dtype, device=x.device)
    counts[-1] = length - (num_blocks - 1) * block_size
    return sums / counts[None, :, None]


def straight_through_route(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., 2] -> (m [..., 2] one-hot valued with softmax gradient, p [..., 2]).

    Index 0 is softmax KV memory (`keep`), index 1 the GDN state (`write`); ties go to index 0.
    """
    probs = torch.softmax(scores.float(), dim=-1)
    hard = F.one_hot(probs.argmax(dim=-1), num_classes=2).to(probs.dtype)
    return hard + (probs - probs.detach()), probs


def router_scores(xbar: torch.Tensor, weight: torch.Tensor, num_heads: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Block means [..., d], weight [2H, d] -> the two scores per head [..., H, 2] (index 0: keep).
    `bias` [H] (float32), when given, is added to each head's keep score (the scores then come in
    float32: the dtype the route's softmax takes anyway)."""
    scores = F.linear(xbar, weight).view(*xbar.shape[:-1], num_heads, 2)
    if bias is None:
        return scores
    return scores + F.pad(bias[:, None], (0, 1))  # [H, 2]: (bias, 0) per head


def route_blocks(x: torch.Tensor, weight: torch.Tensor, num_heads: int, block_size: int,
                 bias: torch.Tensor | None = None):
    """x [B, T, d], weight [2H, d] (and the keep bias [H] or None) ->
    (keep [B, NB, H], write [B, NB, H], probs [B, NB, H, 2])."""
    xbar = block_mean(x, block_size)
    m, probs = straight_through_route(router_scores(xbar, weight, num_heads, bias))
    return m[..., 0], m[..., 1], probs


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
