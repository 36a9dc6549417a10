"""Decode-step matrix-vector products: the door from `natsl.models.linear` to `natsl.fast.gemv`.

`enabled(x)`: CUDA tensors (or the Triton interpreter when the switch force_decode_gemv or
force_fused_inference is set, for tests), unless the switch decode_gemv is off (NATSL_DECODE_GEMV=0); `linear(x, weight, up=...)` is the kernel's launcher (its reference twin is
`natsl.reference.gemv.linear`: `F.linear(x, weight)`, with `up`: `F.linear(silu(x) * up, weight)`).
"""

from __future__ import annotations

import torch

from natsl.fast.gemv import MAX_ROWS, linear  # noqa: F401
from natsl import switches
from natsl.ops import fused


def enabled(x: torch.Tensor) -> bool:
    s = switches.current()
    # the fused-kernel tests force both
    force = s.force_decode_gemv if s.force_decode_gemv is not None else s.force_fused_inference
    if force is not None:
        return force and fused.triton_available()
    return x.is_cuda and s.decode_gemv and fused.triton_available()
