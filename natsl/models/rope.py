"""Rotary position embedding (rotate-half form), applied at absolute positions (the formulas:
natsl.reference.rope)."""

from __future__ import annotations

import torch

from natsl.reference.rope import angles, inverse_frequencies, rotate


def rope_angles(positions: torch.Tensor, dim: int, theta: float):
    """positions [T] or [B, T] (int) -> (cos, sin) of shape [T, dim] or [B, T, dim], fp32."""
    return angles(positions, inverse_frequencies(dim, theta, positions.device))


_DECODE_FREQUENCIES: dict = {}


def decode_frequencies(dim: int, theta: float, device) -> torch.Tensor:
    """inv_freq [dim / 2] fp32 for a decode step's RoPE (natsl.ops.kernel_set `rope_write_kv`), made once per
    (dim, theta, device): a decode step captured in a CUDA graph reads the same tensor at every replay rather
    than recomputing it. Made during a capture it would hold nothing until the first replay, so the step's
    first, eager call must make it (natsl.inference.decode runs one before capturing)."""
    key = (dim, float(theta), torch.device(device))
    if key not in _DECODE_FREQUENCIES:
        if key[2].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("RoPE frequencies first asked for inside a CUDA graph capture: run the step once "
                               "eagerly before capturing it")
        _DECODE_FREQUENCIES[key] = inverse_frequencies(dim, float(theta), key[2])
    return _DECODE_FREQUENCIES[key]


class RopeTable:
    """(cos, sin) of positions 0 .. length-1 for each given head dim, made once for one
    full-sequence forward and shared by every layer that rotates.

    Why: under torch.compile a layer that computes its own angles gets them recomputed inside its
    rotation kernels, for every head and batch row, a visible share of the 800M Transformer's
    compiled training step on the H200. Inductor also inlines a table made
    inside the compiled graph into each consumer, so the table only helps when it is made outside
    it: `natsl train` (natsl.training.trainer.LanguageModelLoss) makes it eagerly and hands it to
    the compiled hidden states, whose rotations then only read it."""

    def __init__(self, length: int, theta: float, device, dims):
        positions = torch.arange(length, device=device)
        self._angles = {dim: rope_angles(positions, dim, theta) for dim in dims}

    def angles(self, dim: int):
        """(cos, sin) [length, dim] fp32."""
        return self._angles[dim]


def apply_rope(x: torch.Tensor, positions: torch.Tensor | None, theta: float,
               table: RopeTable | None = None) -> torch.Tensor:
    """x [B, T, heads, D] rotated by the angles of `positions`: [T] shared by the batch, or [B, T]
    (one row per sequence, as in batched decoding where each sequence is at its own position); or,
    with `table` (positions None), at positions 0 .. T-1 from the shared table."""
    if table is not None:
        cos, sin = table.angles(x.shape[-1])  # [T, D]: the table is made for this forward's length
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = rope_angles(positions, x.shape[-1], theta)
        if positions.dim() == 1:
            cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        else:
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return rotate(x, cos, sin)
