"""The chunked LM loss's softmax work on one chunk of logits: the door from `natsl.training.loss` to
`natsl.fast.cross_entropy` (its kernel) and `natsl.reference.cross_entropy` (its PyTorch twin)."""

from __future__ import annotations

from typing import Optional

import torch

from natsl.ops import twin


def softmax_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                           *, fused: bool) -> torch.Tensor:
    """`natsl.reference.cross_entropy.softmax_cross_entropy_` (what it computes); `fused`: on the kernel."""
    return twin("cross_entropy", fused)(logits, targets, row_scale)
