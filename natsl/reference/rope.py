"""Rotary position embedding (rotate-half form) in fp32: the one definition of its formulas, which the
models' full-sequence forward (natsl.models.rope) and the decode step's twins (natsl.reference.cached
`rope_write_kv`, natsl.fast.cached) compute."""

from __future__ import annotations

import torch


def inverse_frequencies(dim: int, theta: float, device) -> torch.Tensor:
    """[dim / 2] fp32: theta ** (-2i / dim), the angle per position of each rotated pair."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def angles(positions: torch.Tensor, inv_freq: torch.Tensor):
    """positions [...] (int) and inv_freq [D/2] -> (cos, sin) [..., D], fp32 (each pair's angle twice)."""
    freqs = positions.float()[..., None] * inv_freq
    both = torch.cat([freqs, freqs], dim=-1)
    return both.cos(), both.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by (cos, sin) broadcast to it: x cos + rotate_half(x) sin in fp32, rounded
    once to x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
