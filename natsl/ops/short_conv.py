"""The GDN projections' causal short conv + SiLU: the door from `natsl.models.conv` to its fast twin
`natsl.fast.short_conv` (the reference twin is `natsl.reference.short_conv`, natsl.ops.TWINS). The Triton
module is imported on first use, so building a model on a machine without a GPU never loads it."""

from __future__ import annotations

_NAMES = ("short_conv_silu", "short_conv_silu_split", "split_fits")


def __getattr__(name):
    if name in _NAMES:
        from natsl.fast import short_conv

        return getattr(short_conv, name)
    raise AttributeError(f"module 'natsl.ops.short_conv' has no attribute {name!r}")
