"""A bound, not a model: the NAtS-L layers' routed attention replaced by an op that costs nothing.

`bench_training.py --free-attention` installs this in its worker before the model is built, so that
the hybrid trains with every other piece as it is (projections, GDN branch, router, the read, the
loss) while its softmax branch outputs zeros and passes no gradient back. Its tokens/s are the most
any routed-attention kernel could give the hybrid at that shape: what is left of the gap to the
Transformer there belongs to the rest of the model. The losses are not a NAtS-L model's losses.
"""

from __future__ import annotations

import torch

import natsl.ops


@torch.library.custom_op("natsl_bench::free_attention", mutates_args=())
def free_attention(v: torch.Tensor) -> torch.Tensor:
    """Zeros shaped as the attention's output [B, T, H, Dv] (one write of that size, no reads)."""
    return v.new_zeros(v.shape)


@free_attention.register_fake
def _(v: torch.Tensor) -> torch.Tensor:
    return v.new_empty(v.shape)


def _backward(ctx, grad):
    return None  # the softmax branch passes nothing back: its q, k, v and keep get no gradient from it


free_attention.register_autograd(_backward)


def routed_attention_for_free(q, k, v, keep, **_options):
    """natsl.ops.routed_attention's signature; q, k and keep are not read."""
    return free_attention(v)


def install() -> None:
    """From here on every NAtS-L layer's forward runs the free op (the layer looks the function up at each call)."""
    natsl.ops.routed_attention = routed_attention_for_free
