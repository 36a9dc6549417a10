"""The NAtS-L read of its two memories: the door from `natsl.models.natsl_layer` to the fused kernel
`natsl.fast.mix` (the reference twin is `natsl.reference.mix.mix_branches`, natsl.ops.TWINS). The Triton module
is imported on first use."""

from __future__ import annotations

_NAMES = ("mix_branches", "supports")


def __getattr__(name):
    if name in _NAMES:
        from natsl.fast import mix

        return getattr(mix, name)
    raise AttributeError(f"module 'natsl.ops.mix' has no attribute {name!r}")
