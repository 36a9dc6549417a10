"""The chunked LM loss's softmax work on one chunk of logits: the door from `natsl.training.loss` to
`natsl.fast.cross_entropy` (its kernel) and `natsl.reference.cross_entropy` (its PyTorch twin)."""

from __future__ import annotations

from typing import Optional

import torch

from natsl import switches
from natsl.devices import triton_available
from natsl.ops import twin


def fused_default_why(device: torch.device) -> tuple[bool, str]:
    """Whether the LM loss's softmax work runs on the Triton kernel when its caller does not say
    (natsl.training.loss.linear_cross_entropy's `fused=None`), and the rule that decided it.

    Args:
        device: the device of the hidden states.

    Returns:
        (fused, why): why a constant string naming the switch or condition.
    """
    if device.type != "cuda":
        return False, "not CUDA: the loss kernel runs on CUDA"
    if not switches.current().fused_loss:
        return False, "NATSL_FUSED_LOSS=0"
    return triton_available(), "CUDA, NATSL_FUSED_LOSS on, Triton installed"


def softmax_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                           *, fused: bool) -> torch.Tensor:
    """`natsl.reference.cross_entropy.softmax_cross_entropy_` (what it computes); `fused`: on the kernel."""
    return twin("cross_entropy", fused)(logits, targets, row_scale)
