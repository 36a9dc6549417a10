"""Decode-step matrix-vector products: the door from `natsl.models.linear` to `natsl.fast.gemv`.

`enabled(x)`: CUDA tensors (or the Triton interpreter when FORCE is set, for tests), unless
NATSL_DECODE_GEMV=0; `linear(x, weight, up=...)` is the kernel's launcher (its reference twin is
`F.linear`, with `up`: `F.linear(silu(x) * up, weight)`).
"""

from __future__ import annotations

import os

import torch

from natsl.fast.gemv import MAX_ROWS, linear  # noqa: F401
from natsl.ops import fused

# Tests set this to True / False to force the choice; None = as natsl.ops.fused.FORCE where
# that is set, else CUDA tensors unless NATSL_DECODE_GEMV=0.
FORCE: bool | None = None


def enabled(x: torch.Tensor) -> bool:
    force = FORCE if FORCE is not None else fused.FORCE  # the fused-kernel tests force both
    if force is not None:
        return force and fused.triton_available()
    return x.is_cuda and os.environ.get("NATSL_DECODE_GEMV", "1") != "0" and fused.triton_available()
