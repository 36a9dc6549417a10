"""`Linear`: nn.Linear whose grad-free products of a few rows (decode steps) run on a GEMV kernel.

Same parameters, names and checkpoint layout as nn.Linear (it is one); only the kernel behind a
decode-sized, grad-free call changes (`natsl.fast.gemv`, where that says it is enabled).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from natsl.ops import gemv


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether a product of x with weight goes to the GEMV kernel: grad-free, at most gemv.MAX_ROWS
    rows, no bias, same dtype, and the kernel enabled for x's device."""
    return (bias is None and not torch.is_grad_enabled() and 0 < x.numel() <= gemv.MAX_ROWS * x.shape[-1]
            and x.dtype == weight.dtype and gemv.enabled(x))


def decode_sized(x: torch.Tensor, layer: nn.Linear) -> bool:
    """`gemv_applies` for an input of `layer`."""
    return gemv_applies(x, layer.weight, layer.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on the GEMV kernel where `gemv_applies`."""
    if gemv_applies(x, weight, bias):
        return gemv.linear(x, weight)
    return F.linear(x, weight, bias)


# cuBLAS wants 16-byte-aligned output rows for its fast Hopper kernels: a 36-wide bf16 product (the
# NAtS-L mixing weights W_m) falls back to Ampere-era cutlass kernels; padded with zero rows to 40 it
# takes the Hopper kernels.
ALIGN_ROWS = 8


def _has_aligned_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda  # cuBLAS on a GPU; the CPU gains nothing from the padding


def aligned_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x), with the weight's rows padded by zeros to a multiple of ALIGN_ROWS for many-row CUDA
    inputs (training, prefill); the result is then a strided view of the first out_features columns."""
    weight, bias = layer.weight, layer.bias
    pad = -weight.shape[0] % ALIGN_ROWS
    if not pad or not _has_aligned_kernels(x) or gemv_applies(x, weight, bias):
        return layer(x)
    y = F.linear(x, F.pad(weight, (0, 0, 0, pad)), None if bias is None else F.pad(bias, (0, pad)))
    return y[..., :weight.shape[0]]


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
