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

from natsl.reference.gated_delta import validate_layouts
from natsl.reference.route_grad import apply_route_grad_policy, check_route_grad, compute_dtype, num_blocks


def gated_linear_rule(
    q, k, v, g, write=None, *, scale=None, initial_state=None, output_final_state=False,
    block_size=64, decay_skipped_blocks=True, route_grad="active", intra_block=True,
):
    """Same arguments and results as `natsl.reference.gated_linear.gated_linear_rule`."""
    check_route_grad(route_grad)
    B, T, H, K, V = validate_layouts(q, k, v, g, None, write, initial_state, block_size)
    dt = compute_dtype(q, k, v, g, write, initial_state)
    scale = K**-0.5 if scale is None else scale
    C, NB = block_size, num_blocks(T, block_size)
    if write is None:
        write = torch.ones(B, NB, H, dtype=dt, device=q.device)
    else:
        write = apply_route_grad_policy(write, route_grad).to(dt)

    # [B, T, H, D] -> [B, H, NB, C, D], zero-padded: padded tokens have g = 0 (no decay) and k = v = 0
    # (no write), so they change nothing, and their outputs are cut off at the end.
    pad = NB * C - T

    def blocks(x):
        x = F.pad(x.to(dt), (0, 0) * (x.dim() - 2) + (0, pad))  # pads the time dim only
        return x.transpose(1, 2).reshape(B, H, NB, C, *x.shape[3:])

    qb, kb, vb, gb = blocks(q), blocks(k), blocks(v), blocks(g)
    G = gb.cumsum(-1)  # [B, H, NB, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_j) on and below the diagonal (each factor <= 1), 0 above it.
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
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
        w = write[:, b][..., None, None]
        if decay_skipped_blocks:
            S = gamma[:, :, b, None, None] * S + w * delta_states[:, :, b]
        else:
            end = gamma[:, :, b, None, None] * S + delta_states[:, :, b]
            S = S + w * (end - S)
    o = torch.stack(outputs, dim=2).reshape(B, H, NB * C, V)[:, :, :T].transpose(1, 2)
    return o.to(q.dtype), (S if output_final_state else None)
