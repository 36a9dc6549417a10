"""The same gated_linear_rule in chunk-parallel form, pure PyTorch.

The recurrent reference (`gated_linear.py`) is the definition; this form computes the same function
with one sequential step per block instead of per token, so training and evaluation on a CPU run
at a usable speed (`backend="chunked"`). Autograd provides the backward. Tests pin it to the
recurrent reference, forward and every gradient.

Within a block, with G_t = sum_{s<=t} g_s and S the block's start state (no delta erase, so no
triangular solve, unlike gated_delta_chunked):

    o_t     = scale * (exp(G_t) q_t S + sum_{j<=t} exp(G_t - G_j) (q_t.k_j) v_j^T)
    DeltaS  = sum_j exp(G_L - G_j) k_j v_j^T,   S_end = exp(G_L) S + DeltaS,

and the route commits S_start(b+1) = Gamma S + write * DeltaS (Gamma = exp(G_L); with
decay_skipped_blocks=False, S + write * (S_end - S)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.block_size import DEFAULT_BLOCK_SIZE
from natsl.reference.gated_delta import validate_layouts
from natsl.reference.gated_delta_chunked import block_decay, block_writes, commit, to_blocks
from natsl.reference.gated_linear import expand_groups
from natsl.reference.route_grad import check_route_grad, compute_dtype, num_blocks


def chunk_cumsum(g: torch.Tensor, block_size: int) -> torch.Tensor:
    """gc [B,T,H] fp32: G above in g's own [B,T,H] layout, the cumulative sum of g inside each chunk of
    `block_size` tokens (the last chunk may be partial), summed in fp32. The twin of the fast op's
    first kernel (natsl.fast.gated_linear.cumsum.chunk_cumsum)."""
    B, T, H = g.shape
    NB = num_blocks(T, block_size)
    padded = F.pad(g.float(), (0, 0, 0, NB * block_size - T))  # a padded token adds 0
    return padded.view(B, NB, block_size, H).cumsum(2).view(B, NB * block_size, H)[:, :T].contiguous()


def gated_linear_rule(
    q, k, v, g, write=None, *, scale=None, initial_state=None, output_final_state=False,
    block_size=DEFAULT_BLOCK_SIZE, decay_skipped_blocks=True, route_grad="active", intra_block=True,
):
    """Same arguments and results as `natsl.reference.gated_linear.gated_linear_rule`."""
    check_route_grad(route_grad)
    B, T, H, K, V = validate_layouts(q, k, v, g, None, write, initial_state, block_size, grouped_qk=True)
    q, k = expand_groups(q, k, H)
    dt = compute_dtype(q, k, v, g, write, initial_state)
    scale = K**-0.5 if scale is None else scale
    C, NB = block_size, num_blocks(T, block_size)
    write = block_writes(write, B, NB, H, dt, q.device, route_grad)
    qb, kb, vb = (to_blocks(x, NB, C, dt) for x in (q, k, v))
    G, decay = block_decay(to_blocks(g, NB, C, dt))  # G [B, H, NB, C]
    # Everything that does not depend on the start state, for all blocks at once.
    intra = ((qb @ kb.transpose(-1, -2)) * decay) @ vb if intra_block else torch.zeros_like(qb[..., :1])
    delta_states = kb.transpose(-1, -2) @ ((G[..., -1:] - G).exp()[..., None] * vb)  # [B, H, NB, K, V]
    gamma = G[..., -1].exp()  # [B, H, NB]
    q_decayed = G.exp()[..., None] * qb

    S = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    if NB == 0:  # T == 0: nothing to read, the state passes through untouched
        return q.new_zeros(B, 0, H, V), (S if output_final_state else None)
    outputs = []
    for b in range(NB):
        outputs.append(scale * (q_decayed[:, :, b] @ S + intra[:, :, b]))
        S = commit(S, gamma[:, :, b], delta_states[:, :, b], write[:, b], decay_skipped_blocks)
    o = torch.stack(outputs, dim=2).reshape(B, H, NB * C, V)[:, :, :T].transpose(1, 2)
    return o.to(q.dtype), (S if output_final_state else None)
