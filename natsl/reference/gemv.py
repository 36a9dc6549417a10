"""Decode-step matrix-vector products in PyTorch: the reference twin of `natsl.fast.gemv.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.reference.cached import conv_step
from natsl.reference.norms import add_rms_norm, gated_input_rms_norm, rms_norm
from natsl.reference.precision import up as _up


def linear(x: torch.Tensor, weight: torch.Tensor, *, up: torch.Tensor | None = None,
           norm: tuple[torch.Tensor, float] | None = None, conv=None, block_n: int | None = None,
           block_k: int | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] -> x @ weight.T [..., N] in x's dtype. With `up` (x's shape) the
    input is SwiGLU's silu(x) * up, in fp32 rounded once to x's dtype (as the fast kernel and the
    compiled SwiGLU form it). With `norm` = (norm_weight [D], eps) and `up`, the input is instead
    rms_norm(x per head of D columns, norm_weight, eps, gate=up) (a GDN layer's gated output norm).
    `conv` = (start, weights, tails): `conv_columns` on the product. `block_n`, `block_k`: the fast kernel's
    tiles, ignored here."""
    if norm is not None:
        head = norm[0].numel()
        heads = x.shape[:-1] + (x.shape[-1] // head, head)
        x = rms_norm(x.reshape(heads), norm[0], norm[1], gate=up.reshape(heads)).reshape(x.shape)
    elif up is not None:
        x = (F.silu(_up(x)) * _up(up)).to(x.dtype)
    return conv_columns(F.linear(x, weight), conv)


def conv_columns(y: torch.Tensor, conv) -> torch.Tensor:
    """y [..., N] (one token per row) with its columns start .. start + sum(C) replaced by the steps of up
    to three short convs + SiLU (`conv_step`, their tails [rows, W, C] shifted in place) of those columns,
    for conv = (start, weights [C, 1, W + 1], tails); y itself where conv is None."""
    if conv is None:
        return y
    start, weights, tails = conv
    rows = y.reshape(-1, 1, y.shape[-1])
    out = rows.clone()
    for weight, tail in zip(weights, tails):
        width = weight.shape[0]
        out[:, :, start:start + width] = conv_step(rows[:, :, start:start + width], tail, weight)
        start += width
    return out.view(y.shape)


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, *, conv=None, block_n: int | None = None,
                    block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual, norm_weight, eps) @ weight.T): `add_rms_norm` (the sum
    rounded to x's dtype, normalised from it, rounded once), then the product; residual None: (x, the
    product of x's norm); `conv`: as `linear`'s. `block_n`, `block_k`: the fast kernel's tiles, ignored here."""
    if residual is None:
        total, normed = x, rms_norm(x, norm_weight, eps)
    else:
        total, normed = add_rms_norm(x, residual, norm_weight, eps)
    return total, conv_columns(F.linear(normed, weight), conv)


def gated_input_norm_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, *, block_n: int | None = None,
                            block_k: int | None = None) -> torch.Tensor:
    """gated_input_rms_norm(x, norm_weight, eps, gate) @ weight.T: Mamba2's output norm (RMSNorm of
    x * silu(gate), fp32, one rounding), then the product. `block_n`, `block_k`: the fast kernel's tiles,
    ignored here."""
    return F.linear(gated_input_rms_norm(x, norm_weight, eps, gate), weight)
