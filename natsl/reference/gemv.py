"""Decode-step matrix-vector products in PyTorch: the reference twin of `natsl.fast.gemv.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.reference.norms import up as _up


def linear(x: torch.Tensor, weight: torch.Tensor, *, up: torch.Tensor | None = None, block_n: int | None = None,
           block_k: int | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] -> x @ weight.T [..., N] in x's dtype. With `up` (x's shape) the
    input is SwiGLU's silu(x) * up, in fp32 rounded once to x's dtype (as the fast kernel and the
    compiled SwiGLU form it). `block_n`, `block_k`: the fast kernel's tiles, ignored here."""
    if up is not None:
        x = (F.silu(_up(x)) * _up(up)).to(x.dtype)
    return F.linear(x, weight)
