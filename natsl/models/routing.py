"""A router override for measurements: keep a chosen fraction of blocks, at random but reproducibly.

An untrained router keeps all or nothing depending on its random weights, which says nothing about
the cost of a trained model. `force_keep_fraction(model, 0.5, seed)` makes every NAtS-L layer's
incremental path (prefill and decode) keep each (block, routing group) with probability 0.5, by a
hash of (seed, layer, block index, group): the same block gets the same route whether it is
prefilled or decoded, and the hash is plain integer tensor arithmetic, so it runs inside a CUDA
graph. The full-sequence forward applies the same rule to all its blocks (`NAtSL.route`), so a forced
budget gives the same outputs on either path (evaluations by full forward, such as eval-ppl and
eval-recall, and those that decode, such as eval-ruler); it carries no gradient, so never train with it.
"""

from __future__ import annotations

import torch

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


def force_keep_fraction(model, fraction: float | None, seed: int = 0) -> None:
    """Make every NAtS-L layer of `model` keep `fraction` of its blocks (None restores the router)."""
    for index, layer in model.natsl_layers().items():
        layer.route_override = None if fraction is None else KeepFraction(fraction, seed * 1000 + index)
