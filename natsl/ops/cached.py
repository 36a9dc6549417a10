"""The cached paths' small ops (one GDN token step, one gated-linear (Mamba2) token step, the block
commit, cached attention, K/V writes), each on its reference twin (`natsl.reference.cached`) or its
fast twin (`natsl.fast.gated_delta`, `natsl.fast.decode_attention`, `natsl.fast.cached`), chosen here.
"""

from __future__ import annotations

import functools

import torch

from natsl.fast import decode_attention as _decode_attention
from natsl.ops import fused, resolve_backend
from natsl.reference import cached as _reference
from natsl.reference.cached import (  # noqa: F401
    attend_one,
    gla_token_step,
    masked_attention,
    read_state,
    write_token,
)


@functools.lru_cache(maxsize=None)
def _fast_gated_delta():
    """(gated_delta_step, commit_block) from natsl.fast, or None where that package lacks them."""
    try:
        from natsl.fast.gated_delta import commit_block, gated_delta_step
    except ImportError:
        return None
    return gated_delta_step, commit_block


def use_fast(backend: str | None, device: torch.device) -> bool:
    """Whether a layer on `backend` should use the fast decode pieces on `device` (CUDA + fast only)."""
    return device.type == "cuda" and resolve_backend(backend, device) == "fast" and _fast_gated_delta() is not None


def gdn_token_step(state, q, k, v, g, beta, *, scale=None, fast=False):
    """`natsl.reference.cached.gdn_token_step`; `fast`: on the Triton decode step where the key dim allows."""
    if fast and q.shape[-1] <= 256:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        o, new_state = _fast_gated_delta()[0](q, k, v, g.float(), beta, state, scale=scale)
        return o, new_state.to(state.dtype)
    return _reference.gdn_token_step(state, q, k, v, g, beta, scale=scale)


def commit_state(start, end, decay_sum, write, decay_skipped_blocks: bool = True, *, fast=False):
    """`natsl.reference.cached.commit_state`; `fast`: on the Triton block commit."""
    if fast:
        gamma = decay_sum.to(start.dtype).exp()
        return _fast_gated_delta()[1](start, end, gamma, write.to(start.dtype), decay_skipped_blocks)
    return _reference.commit_state(start, end, decay_sum, write, decay_skipped_blocks)


def write_kv(k_buf, v_buf, slots, k, v, *, fused: bool = False) -> None:
    """`write_token` of a decode token's K and V; `fused`: both in one Triton launch (natsl.fast.cached.write_kv)."""
    if fused and k.stride(-1) == 1 and v.stride(-1) == 1:
        _fused_write_kv(k_buf, v_buf, slots, k, v)
    else:
        write_token(k_buf, slots, k)
        write_token(v_buf, slots, v)


_fused_write_kv = fused.write_kv


def attend_cached(q, keys, values, visible, *, backend=None):
    """`attend_one` for a decode step: on the split-K Triton kernel (natsl.fast.decode_attention)
    where the fused inference kernels are on (CUDA + fast backend), else `attend_one` itself."""
    if fused.decode_attention_enabled(backend, q.device):
        return _decode_attention.decode_attention(q, keys, values, visible)
    return attend_one(q, keys, values, visible)
