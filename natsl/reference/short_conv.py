"""Causal depthwise short convolution + SiLU (Gated DeltaNet's q/k/v conv): the reference twin of
`natsl.fast.short_conv` (same signatures) and the formula `natsl.models.pointwise.conv_silu` compiles;
with a bias (Mamba2's conv), `short_conv_bias_silu`, which has no twin."""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from natsl.reference.precision import up


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SiLU(causal depthwise conv(x)): x [B, T, C], weight [C, 1, W], tail [B, W-1, C] (the inputs
    before x; None: zeros) -> [B, T, C] in x's dtype (the fp32 sum of `causal_conv`, one rounding)."""
    return F.silu(causal_conv(x, weight, tail)).to(x.dtype)


def short_conv_bias_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SiLU(causal depthwise conv(x) + bias), bias [C] (Mamba2's conv with `mamba2_conv_bias`), otherwise as
    `short_conv_silu`. Not a twin: no fast kernel takes a bias, so natsl.ops.short_conv runs this one,
    compiled on CUDA, wherever a bias is given."""
    return F.silu(causal_conv(x, weight, tail) + up(bias)).to(x.dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The causal depthwise conv of `short_conv_silu` before its SiLU, in fp32 [B, T, C].

    Written as W shifted multiply-adds in fp32 (what F.conv1d computes: y_t = sum_j w_j x_{t-W+1+j})
    so that the whole of it, and its backward, is a single fused kernel under torch.compile. Input
    t-W+1+j of output t comes from x where t-W+1+j >= 0 and from the tail before that; each shift is
    a pair of pads (masked loads) rather than slices of one concatenation, which Inductor would write
    to memory in full ([B, T+W-1, C]: a copy kernel beside the conv in a prefill profile).
    """
    width = weight.shape[-1]
    length = x.shape[1]
    tail = x.new_zeros(x.shape[0], width - 1, x.shape[2]) if tail is None else tail.to(x.dtype)
    w = up(weight[:, 0, :])
    y = None
    for j in range(width):
        back = width - 1 - j  # how far output t reaches back for this tap
        from_x = F.pad(x, (0, 0, back, 0))[:, :length]  # x[t - back], zero for t < back
        from_tail = F.pad(tail[:, j:], (0, 0, 0, length - back))  # tail[t + j] for t < back, then zeros
        term = (up(from_x) + up(from_tail)) * w[:, j]
        y = term if y is None else y + term
    return y


def short_conv_silu_split(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """short_conv_silu of x's consecutive channel groups (one per weight [C_i, 1, W]), no tail."""
    edges = [0] + list(itertools.accumulate(w.shape[0] for w in weights))
    return tuple(short_conv_silu(x[..., a:b], w) for a, b, w in zip(edges, edges[1:], weights))
