"""The error metric the kernel tests share (as flash-linear-attention measures it)."""

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of `a` against the reference `b`, in fp64; a non-finite `a` fails outright."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()
