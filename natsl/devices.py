"""Cached facts about a device for launch decisions (a query per launch costs host time)."""

from __future__ import annotations

import functools
import os

import torch


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels on the CPU interpreter: TRITON_INTERPRET read as Triton's own knob
    reads it (1, true, yes, on or y, in any case), so that natsl's checks and Triton never disagree."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y")


_TRITON: bool | None = None


def triton_available() -> bool:
    """Whether Triton imports. It is optional (`pip install 'natsl[fast]'`): only the fast backend and the
    fused inference kernels need it; the reference and chunked backends run on PyTorch alone. Cached in a
    module global rather than by functools.lru_cache, which torch.compile traces through with a warning."""
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; on the CPU (Triton's interpreter) a nominal 4, so that small test shapes
    still take the multi-program paths that launch settings derive from it."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability (major, minor) of a CUDA device."""
    return torch.cuda.get_device_capability(device)
