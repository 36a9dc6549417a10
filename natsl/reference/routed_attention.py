"""Reference routed softmax attention with a per-block keep mask (docs/spec.md section 3).

Dense and explicit: for query i in block a and key j in block c the mask is
M_ij = [j <= i] if c == a, keep_c (of the query head's routing group) if c < a, 0 if c > a, and

    O_i = sum_j exp(A_ij) M_ij v_j / sum_j exp(A_ij) M_ij,   A_ij = scale q_i . k_j

M multiplies the exponentials as a float, so autograd reaches `keep` (the continuous-mask gradient).
"""

from __future__ import annotations

import torch

from natsl.block_size import DEFAULT_BLOCK_SIZE
from natsl.reference.route_grad import (
    apply_route_grad_policy,
    check_block_size,
    check_route_grad,
    compute_dtype,
    expect_floating,
    expect_shape,
    num_blocks,
)


def validate_layouts(q, k, v, keep, block_size) -> tuple[int, int, int, int]:
    """Check the layouts of docs/spec.md section 5; return (B, T, Hs, G)."""
    check_block_size(block_size)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, Hs, Dk], got shape {tuple(q.shape)}")
    if v.dim() != 4:
        raise ValueError(f"v must be [B, T, Hs, Dv], got shape {tuple(v.shape)}")
    B, T, Hs, Dk = q.shape
    expect_shape("k", k, (B, T, Hs, Dk), "[B, T, Hs, Dk] (as q)")
    expect_shape("v", v, (B, T, Hs, v.shape[-1]), "[B, T, Hs, Dv]")
    for name, t in (("q", q), ("k", k), ("v", v), ("keep", keep)):
        if t is not None:
            expect_floating(name, t)
    if keep is None:
        return B, T, Hs, 1
    NB = num_blocks(T, block_size)
    if keep.dim() != 3 or keep.shape[:2] != (B, NB):
        raise ValueError(f"keep must be [B, NB, G] = ({B}, {NB}, G), got shape {tuple(keep.shape)}")
    G = keep.shape[2]
    if G < 1 or Hs % G:
        raise ValueError(f"keep has {G} routing groups, which must divide the {Hs} softmax heads")
    return B, T, Hs, G


def block_mask(keep: torch.Tensor, seq_len: int, block_size: int, num_heads: int, intra_block: bool = True):
    """The explicit mask of docs/spec.md section 3 and where it can be nonzero.

    keep [B, NB, G] -> (M [B, Hs, T, T] float in keep's dtype, reachable [T, T] bool).
    `reachable` marks the (i, j) pairs M may cover at all: earlier blocks (any keep value) and,
    with intra_block, the causal part of the own block.
    """
    pos = torch.arange(seq_len, device=keep.device)
    blk = pos // block_size
    earlier = blk[None, :] < blk[:, None]  # key j's block precedes query i's block
    # Softmax head j belongs to routing group j // (Hs // G): repeat each group's route.
    keep_heads = keep.repeat_interleave(num_heads // keep.shape[2], dim=2)  # [B, NB, Hs]
    keep_keys = keep_heads[:, blk].transpose(1, 2)[:, :, None, :]  # [B, Hs, 1, T]: key j's route
    mask = earlier.to(keep.dtype) * keep_keys
    reachable = earlier
    if intra_block:
        own_causal = (blk[None, :] == blk[:, None]) & (pos[None, :] <= pos[:, None])
        mask = mask + own_causal.to(keep.dtype)
        reachable = reachable | own_causal
    return mask, reachable


def routed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    *,
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    route_grad: str = "active",
    intra_block: bool = True,
) -> torch.Tensor:
    """Causal softmax attention in which earlier blocks are visible only where `keep` is 1.

    q, k [B,T,Hs,Dk]; v [B,T,Hs,Dv]; keep [B,NB,G] with Hs % G == 0 (None = all ones, i.e.
    plain causal attention). `intra_block=False` hides the query's own block; a row that then
    sees nothing outputs zeros. Returns o [B,T,Hs,Dv] in q's dtype.
    """
    check_route_grad(route_grad)
    B, T, Hs, G = validate_layouts(q, k, v, keep, block_size)
    dt = compute_dtype(q, k, v, keep)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if keep is None:
        keep = torch.ones(B, num_blocks(T, block_size), 1, dtype=dt, device=q.device)
    else:
        keep = apply_route_grad_policy(keep, route_grad).to(dt)

    if T == 0:
        return q.new_zeros(B, 0, Hs, v.shape[-1])

    mask, reachable = block_mask(keep, T, block_size, Hs, intra_block)
    qh, kh, vh = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # [B, Hs, T, D]
    # Unreachable logits become -inf *before* exp, so neither exp nor its gradient can overflow.
    logits = (scale * qh @ kh.transpose(-1, -2)).masked_fill(~reachable, float("-inf"))
    # Max over reachable keys (kept or not): exp(.) <= 1 everywhere. A row with nothing reachable
    # (intra_block=False, block 0) has max -inf; use 0 there so it stays exp(-inf) = 0.
    row_max = logits.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max) * mask
    z = weights.sum(-1, keepdim=True)
    # z == 0 only when nothing is visible: divide by 1 there, so the row is 0 with finite gradients.
    o = (weights @ vh) / torch.where(z > 0, z, torch.ones_like(z))
    return o.transpose(1, 2).to(q.dtype)
