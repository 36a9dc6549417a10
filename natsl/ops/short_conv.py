"""The GDN projections' causal short conv + SiLU: the door from `natsl.models.conv` to its twins,
`natsl.fast.short_conv` (with `natsl.fast.cached.conv_chunk` for a cached chunk) and
`natsl.reference.short_conv` (natsl.ops.TWINS), which it runs compiled on CUDA (`compiled_reference`),
and `conv_tail`, the inputs a cached conv keeps for the next tokens. A layer's cached path reaches
it through its kernel set (natsl.ops.kernel_set), which says whether a cached chunk takes the fused
kernel. The Triton module is imported on first use, so building a model on a machine without a GPU
never loads it."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from natsl import switches
from natsl.ops import resolve_backend, twin
from natsl.ops.compiled import pointwise
from natsl.reference import short_conv as reference

# The reference twin through torch.compile on CUDA tensors (natsl.ops.compiled): the models' conv
# wherever the fast twin does not run; natsl.models.pointwise.conv_silu is this object.
compiled_reference = pointwise(reference.short_conv_silu)
# With a bias (Mamba2's conv with mamba2_conv_bias): no twin, the reference formula compiled likewise.
compiled_biased = pointwise(reference.short_conv_bias_silu)


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None, *,
                    bias: Optional[torch.Tensor] = None, backend: str | None = None,
                    fused: bool = False) -> torch.Tensor:
    """SiLU(causal depthwise conv(x) + bias): x [B, T, C], weight [C, 1, W], tail [B, W-1, C] (the inputs
    before x) or None (zeros), bias [C] or None (none) -> [B, T, C] in x's dtype.

    With a bias on `compiled_biased` on every backend and path (the Triton kernels take none). Without:
    without a tail (the full sequence) on the fast twin where `backend` resolves to fast, forward and
    backward; with a tail (a cached chunk) on its forward kernel (`conv_chunk`) where `fused`
    (the fused kernel set's choice, natsl.ops.kernel_set) and no gradient is wanted; elsewhere on
    `compiled_reference`."""
    if bias is not None:
        if tail is None:
            tail = x.new_zeros(x.shape[0], weight.shape[-1] - 1, x.shape[2])
        return compiled_biased(x, weight, bias, tail)
    if tail is None:
        if resolve_backend(backend, x.device) == "fast":
            import natsl.fast.short_conv  # noqa: F401  (an import statement: see `twin`)

            return twin("short_conv_silu", True)(x, weight)
        return compiled_reference(x, weight, x.new_zeros(x.shape[0], weight.shape[-1] - 1, x.shape[2]))
    if fused and not torch.is_grad_enabled():
        return twin("conv_chunk", True)(x, tail, weight)
    return compiled_reference(x, weight, tail)


def conv_tail(x: torch.Tensor, tail: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The last W-1 inputs after x: the tail [B, W-1, C] that the conv of the next tokens needs.
    Eager and small: only the last W-1 rows of x are read. `valid` ([1] int64 on the device, a
    padded prefill call's prompt length): the W-1 inputs before token `valid` instead, gathered
    on the device (no host read, so a CUDA graph serves every valid)."""
    width = tail.shape[1] + 1
    if valid is not None:
        recent = torch.cat([tail.to(x.dtype), x], dim=1)  # token t of x is row t + W-1
        return recent.index_select(1, valid + torch.arange(width - 1, device=x.device))
    recent = torch.cat([tail.to(x.dtype), x[:, max(x.shape[1] - (width - 1), 0):]], dim=1)
    return recent[:, recent.shape[1] - (width - 1):]


def split_applies(sizes: Sequence[int], width: int, *, backend: str | None, device: torch.device) -> bool:
    """Whether `short_conv_silu_split` takes convs of these channel counts and kernel width on inputs on
    `device`: the fast backend, the switch joined_conv on (NATSL_JOINED_CONV), and group edges that
    fit the fast twin's tiles."""
    if not switches.current().joined_conv or resolve_backend(backend, device) != "fast":
        return False
    from natsl.fast.short_conv import split_fits

    return split_fits(sizes, width)


def short_conv_silu_split(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The short conv + SiLU of x's consecutive channel groups (one per weight), no tails, as one fast
    op where `split_applies` (callers ask first)."""
    import natsl.fast.short_conv  # noqa: F401  (an import statement: see `twin`)

    return twin("short_conv_silu_split", True)(x, weights)
