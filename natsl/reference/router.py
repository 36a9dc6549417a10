"""The NAtS-L router (docs/spec.md section 2, step 4): one hard route per (block, GDN head).

`xbar_b` is the mean of the block's hidden states (a partial last block averages what it has),
`s_b = W_r xbar_b` gives two scores per head, `p = softmax(s_b)` and the route is the one-hot
argmax with a straight-through gradient: `m = onehot(argmax p) + (p - stopgrad(p))`. The value of
`m` is exactly 0/1 (the bracket is exactly zero), its gradient is that of `p`.
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


def router_scores(xbar: torch.Tensor, weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Block means [..., d], weight [2H, d] -> the two scores per head [..., H, 2] (index 0: keep)."""
    return F.linear(xbar, weight).view(*xbar.shape[:-1], num_heads, 2)


def route_blocks(x: torch.Tensor, weight: torch.Tensor, num_heads: int, block_size: int):
    """x [B, T, d], weight [2H, d] -> (keep [B, NB, H], write [B, NB, H], probs [B, NB, H, 2])."""
    xbar = block_mean(x, block_size)
    m, probs = straight_through_route(router_scores(xbar, weight, num_heads))
    return m[..., 0], m[..., 1], probs
