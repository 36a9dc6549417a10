"""The cached paths' small ops (one GDN token step, one gated-linear (Mamba2) token step, the block
commit, cached attention), each on its reference twin (`natsl.reference.cached`) or its
fast twin (`natsl.fast.gated_delta`, `natsl.fast.decode_attention`, `natsl.fast.cached`), both named in
`natsl.ops.TWINS` and chosen here from the layer's backend; and the GDN gates compiled on CUDA
(`gdn_gates`, the layers' and the reference GDN decode step's). A layer's cached call reaches the
fused kernels through its kernel set (natsl.ops.kernel_set), which calls these.
"""

from __future__ import annotations

import functools

import torch

from natsl.fast import decode_attention as _decode_attention  # noqa: F401  (imported for `twin` under torch.compile)
from natsl.ops import fused, resolve_backend, twin
from natsl.ops.compiled import pointwise
from natsl.reference import gates
from natsl.reference.cached import attend_one, gla_token_step, masked_attention, read_state, write_token  # noqa: F401

# Gated DeltaNet's log decay and write strength from the a and b projections, compiled on CUDA:
# natsl.models.pointwise.gdn_gates is this object.
gdn_gates = pointwise(gates.gdn_gates)


@functools.lru_cache(maxsize=None)
def _fast_gated_delta() -> bool:
    """Whether natsl.fast has the decode step and the block commit (it imports them: see `twin`)."""
    try:
        import natsl.fast.gated_delta  # noqa: F401
    except ImportError:
        return False
    return True


def use_fast_why(backend: str | None, device: torch.device) -> tuple[bool, str]:
    """`use_fast` and the rule that decided it (natsl.inference.kernel_table prints it).

    Args:
        backend: the layer's backend.
        device: the device of the layer's tensors.

    Returns:
        (on, why): why a constant string naming the condition.
    """
    if backend == "reference":
        return False, "backend reference"
    if device.type != "cuda":
        return False, "not CUDA: the fast decode step runs on CUDA only"
    if resolve_backend(backend, device) != "fast":
        return False, "CUDA: on with the fast backend"
    return _fast_gated_delta(), "CUDA with the fast backend (natsl.fast.gated_delta imports)"


def use_fast(backend: str | None, device: torch.device) -> bool:
    """Whether a layer on `backend` uses the fast decode step and block commit on `device` (CUDA + fast
    only). "reference" decides without reading anything (the compiled block end names it)."""
    return use_fast_why(backend, device)[0]


def gdn_token_step(state, q, k, v, g, beta, *, scale=None, backend: str | None = "reference"):
    """`natsl.reference.cached.gated_delta_step`; on a layer's `backend` where `use_fast`, on the Triton
    decode step where the key dim allows."""
    if use_fast(backend, q.device) and q.shape[-1] <= 256:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        o, new_state = twin("gated_delta_step", True)(q, k, v, g.float(), beta, state, scale=scale)
        return o, new_state.to(state.dtype)
    return twin("gated_delta_step", False)(q, k, v, g, beta, state, scale=scale)


def commit_state(start, end, decay_sum, write, decay_skipped_blocks: bool = True, *,
                 backend: str | None = "reference"):
    """`natsl.reference.router.commit_block` with gamma = exp(decay_sum) (the block's sum of g); on a
    layer's `backend` where `use_fast`, on its fast twin."""
    gamma = decay_sum.to(start.dtype).exp()
    return twin("commit_block", use_fast(backend, start.device))(start, end, gamma, write.to(start.dtype),
                                                                 decay_skipped_blocks)


def attend_cached(q, keys, values, visible, *, backend=None):
    """`attend_one` for a decode step: on the split-K Triton kernel (natsl.fast.decode_attention)
    where the fused inference kernels are on (CUDA + fast backend), else `attend_one` itself."""
    return twin("decode_attention", fused.decode_attention_enabled(backend, q.device))(q, keys, values, visible)
