"""Rotary position embedding (rotate-half form), applied at absolute positions."""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, dim: int, theta: float):
    """positions [T] or [B, T] (int) -> (cos, sin) of shape [T, dim] or [B, T, dim], fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, T, heads, D] rotated by the angles of `positions`: [T] shared by the batch, or [B, T]
    (one row per sequence, as in batched decoding where each sequence is at its own position)."""
    cos, sin = rope_angles(positions, x.shape[-1], theta)
    if positions.dim() == 1:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
