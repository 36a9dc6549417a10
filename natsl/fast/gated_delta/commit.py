"""The route commit at a block boundary (plain torch; used by incremental inference)."""

from __future__ import annotations

import torch


def commit_block(
    state_start: torch.Tensor,
    state_end: torch.Tensor,
    gamma: torch.Tensor,
    write: torch.Tensor | float,
    decay_skipped_blocks: bool = True,
) -> torch.Tensor:
    """S_start(b+1) = c S_start(b) + write (S_end(b) - c S_start(b)), c = Gamma_b (or 1 for the ablation).

    state_start, state_end [B,H,K,V]; gamma = exp(sum of g over the block) and write broadcast
    against [B,H] (e.g. [B,H] or a float). Computes in the states' dtype (fp32 in the cache).
    """
    dtype = state_start.dtype
    write = torch.as_tensor(write, dtype=dtype, device=state_start.device)
    if write.dim() >= 2:
        write = write[..., None, None]
    if decay_skipped_blocks:
        gamma = torch.as_tensor(gamma, dtype=dtype, device=state_start.device)
        base = (gamma[..., None, None] if gamma.dim() >= 2 else gamma) * state_start
    else:
        base = state_start
    return base + write * (state_end.to(dtype) - base)
