"""The precision of the reference's arithmetic: 16-bit tensors are computed in fp32, wider ones as they are."""

from __future__ import annotations

import torch


def up(t: torch.Tensor) -> torch.Tensor:
    """16-bit tensors to fp32 for the arithmetic; fp32 and fp64 stay as they are."""
    return t.float() if t.element_size() < 4 else t
