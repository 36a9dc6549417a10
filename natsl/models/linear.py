"""`Linear`: nn.Linear whose products go through the door `natsl.ops.gemv.linear` (grad-free products
of a few rows, decode steps, run on its GEMV kernel).

Same parameters, names and checkpoint layout as nn.Linear (it is one); only the kernel behind a
decode-sized, grad-free call changes, and natsl.ops.gemv decides when.
"""

from __future__ import annotations

import torch
from torch import nn

from natsl.ops import gemv

# cuBLAS wants 16-byte-aligned output rows for its fast Hopper kernels: a 36-wide bf16 product (the
# NAtS-L mixing weights W_m) falls back to Ampere-era cutlass kernels; padded with zero rows to 40 it
# takes the Hopper kernels.
ALIGN_ROWS = 8


def _has_aligned_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda  # cuBLAS on a GPU; the CPU gains nothing from the padding


def aligned_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x), with the weight's rows padded by zeros to a multiple of ALIGN_ROWS for CUDA inputs
    that cuBLAS takes (training, prefill; natsl.ops.gemv.linear's `pad`); the result is then a strided
    view of the first out_features columns."""
    pad = -layer.weight.shape[0] % ALIGN_ROWS
    if not pad or not _has_aligned_kernels(x):
        return layer(x)
    return gemv.linear(x, layer.weight, layer.bias, pad=pad)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.linear(x, self.weight, self.bias)
