"""Causal depthwise short convolution (kernel 4, no bias but in Mamba2 with mamba2_conv_bias) followed by
SiLU, as in Gated DeltaNet.

The layer takes an optional `tail`, the last `kernel - 1` inputs before `x`, so that prefill and
token-by-token decoding compute exactly what the full-sequence forward computes. On the fast
backend the full-sequence forward (training) runs the Triton op natsl.fast.short_conv, forward and
backward; elsewhere its reference twin natsl.reference.short_conv (compiled on CUDA). The choice is
made in the door natsl.ops.short_conv; on a cached path the layer's kernel set (natsl.ops.kernel_set)
tells it whether a chunk after a tail takes the fused kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from natsl.ops import short_conv


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int = 4, device=None, backend: str | None = None,
                 bias: bool = False):
        super().__init__()
        self.kernel_size = kernel_size
        self.backend = backend  # the model's set_backend sets it with the layers' ops
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device))
        # Only Mamba2's conv may have a bias (mamba2_conv_bias); a biased conv runs the reference formula
        # on every path (natsl.ops.short_conv), never the Triton kernels.
        self.bias = nn.Parameter(torch.empty(channels, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        # Normal(0, std), as the authors' code and flash-linear-attention initialise their short convs
        # (FLA's models put every nn.Linear and nn.Conv1d, ShortConvolution included, through
        # normal_(0, initializer_range)); natsl used PyTorch's Conv1d default (kaiming-uniform over a
        # fan-in of kernel_size, ~10x wider) before, which is not what the paper trained.
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:  # zeros, as flash-linear-attention's _init_weights sets a Conv1d's bias
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, *, kernels=None):
        """x [B, T, C], tail [B, kernel-1, C] or None (zeros) -> (SiLU(conv(x)) [B, T, C], new tail).
        The new tail is None where no tail was given (the full-sequence forward keeps none).
        `kernels` (a cached path): the layer's kernel set (natsl.ops.kernel_set), which runs a chunk
        after a tail on the fused kernel or the compiled reference (without one: the compiled reference).
        `valid`: a padded prefill call's prompt length (the new tail ends there;
        natsl.ops.short_conv.conv_tail)."""
        if kernels is not None:
            y = kernels.short_conv_silu(x, self.weight, tail, bias=self.bias, backend=self.backend)
        else:
            y = short_conv.short_conv_silu(x, self.weight, tail, bias=self.bias, backend=self.backend)
        return y, None if tail is None else short_conv.conv_tail(x, tail, valid)


# Whether the q, k and v convs of a GDN projection run as one fast op over the joined q|k|v product
# (natsl.fast.short_conv.short_conv_silu_split) where the shapes allow it; NATSL_JOINED_CONV=0 runs
# one op per conv on column slices (benchmarks compare the two); the switch joined_conv (natsl.switches).


def joined_conv_fits(convs: list[ShortConv], device: torch.device) -> bool:
    """Whether `joined_conv_silu` can take these convs (no tails) on inputs on `device`."""
    widths = {conv.kernel_size for conv in convs}
    return len(widths) == 1 and short_conv.split_applies([conv.weight.shape[0] for conv in convs], widths.pop(),
                                                         backend=convs[0].backend, device=device)


def joined_conv_silu(convs: list[ShortConv], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each conv's SiLU(conv) of its consecutive channel slice of x [B, T, sum C_i], no tails, as one
    fast op (see joined_conv_fits): the outputs come back contiguous and the gradient of x as one
    tensor, where per-conv ops on column slices leave autograd a concatenation to copy."""
    return short_conv.short_conv_silu_split(x, [conv.weight for conv in convs])
