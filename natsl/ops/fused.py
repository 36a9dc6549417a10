"""When the fused Triton kernels of the layers' cached paths (prefill and decode) run; the layers reach
them through their kernel set (natsl.ops.kernel_set), which asks `enabled`.

The kernels live in `natsl.fast.norms` (norms), `natsl.fast.cached` (short-conv steps, K/V writes,
the GDN and gated-linear decode steps, block stores), `natsl.fast.decode_attention` and `natsl.fast.gemv`; they import Triton only when they
launch, so re-exporting them here costs nothing at import. This module decides when they run:

- `enabled(backend, device)`: the cached paths of a layer on `backend` use the fused kernels:
  CUDA with the fast backend (or the Triton interpreter with backend fast on the CPU), unless
  the switch `fused_inference` is off (NATSL_FUSED_INFERENCE=0);
- `decode_attention_enabled(backend, device)`: as `enabled`, unless `decode_attention` is off.

The switches `force_fused_inference` and `force_decode_attention` (natsl.switches, set by tests
with `override`) force the choice; None decides by device and backend.
"""

from __future__ import annotations

import torch

from natsl.devices import triton_available, triton_interpreted  # noqa: F401  (triton_available: ops.gemv's)
from natsl.fast.cached import (conv_chunk, conv_step, conv_steps, gdn_decode_step, gla_decode_step,  # noqa: F401
                               rope_write_kv, store_blocks, write_kv)
from natsl.fast.norms import add_rms_norm, l2_normalize, rms_norm  # noqa: F401
from natsl import switches
from natsl.ops import resolve_backend


def enabled_why(backend: str | None, device: torch.device) -> tuple[bool, str]:
    """`enabled` and the rule that decided it (natsl.inference.kernel_table prints it).

    Args:
        backend: the layer's backend ("reference", "chunked", "fast" or None).
        device: the device of the layer's tensors.

    Returns:
        (on, why): why names the switch or condition that decided, a constant string.
    """
    s = switches.current()
    if s.force_fused_inference is not None:
        return s.force_fused_inference and triton_available(), "switch force_fused_inference (override only)"
    if not s.fused_inference:
        return False, "NATSL_FUSED_INFERENCE=0"
    if not triton_available():
        return False, "Triton not installed"
    if device.type == "cuda":
        return resolve_backend(backend, device) == "fast", "CUDA: on with the fast backend"
    return backend == "fast" and triton_interpreted(), "CPU: only backend fast under TRITON_INTERPRET=1"


def enabled(backend: str | None, device: torch.device) -> bool:
    """Whether the cached paths of a layer on `backend` use the fused kernels on `device`."""
    return enabled_why(backend, device)[0]


def decode_attention_enabled_why(backend: str | None, device: torch.device) -> tuple[bool, str]:
    """`decode_attention_enabled` and the rule that decided it.

    Args:
        backend: the layer's backend.
        device: the device of the layer's tensors.

    Returns:
        (on, why), as `enabled_why`.
    """
    s = switches.current()
    if s.force_decode_attention is not None:
        return s.force_decode_attention and triton_available(), "switch force_decode_attention (override only)"
    if not s.decode_attention:
        return False, "NATSL_DECODE_ATTENTION=0"
    return enabled_why(backend, device)


def decode_attention_enabled(backend: str | None, device: torch.device) -> bool:
    """Whether the decode step of a layer on `backend` uses the split-K decode attention on `device`:
    as the other fused inference kernels, unless the switch decode_attention is off."""
    return decode_attention_enabled_why(backend, device)[0]
