"""The same gated_delta_rule in chunk-parallel (WY / UT-transform) form, pure PyTorch.

The recurrent reference (`gated_delta.py`) is the definition; this form computes the same function
with one sequential step per block instead of per token, so training and evaluation on a CPU run
at a usable speed (`backend="chunked"`). Autograd provides the backward. Tests pin it to the
recurrent reference, forward and every gradient.

Within a block, with G_t = sum_{s<=t} g_s (so alpha_s products are exp of differences) and S the
block's start state, the delta rule's corrections d_t = beta_t (v_t - alpha_t S_{t-1}^T k_t) solve

    (I + A) d = beta * (v - exp(G) * K S),   A_tj = beta_t exp(G_t - G_j) k_t.k_j  (j < t),

so d = U - W S with U = (I+A)^-1 (beta v) and W = (I+A)^-1 (beta exp(G) k). Then

    o_t     = scale * (exp(G_t) q_t S + sum_{j<=t} exp(G_t - G_j) (q_t.k_j) d_j)
    DeltaS  = sum_j exp(G_L - G_j) k_j d_j^T,   S_end = exp(G_L) S + DeltaS,

and the route commits S_start(b+1) = Gamma S + write * DeltaS (Gamma = exp(G_L); with
decay_skipped_blocks=False, S + write * (S_end - S)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.reference.gated_delta import validate_layouts
from natsl.reference.route_grad import apply_route_grad_policy, check_route_grad, compute_dtype, num_blocks


def gated_delta_rule(
    q, k, v, g, beta, write=None, *, scale=None, initial_state=None, output_final_state=False,
    block_size=64, decay_skipped_blocks=True, route_grad="active", intra_block=True,
):
    """Same arguments and results as `natsl.reference.gated_delta.gated_delta_rule`."""
    check_route_grad(route_grad)
    B, T, H, K, V = validate_layouts(q, k, v, g, beta, write, initial_state, block_size)
    dt = compute_dtype(q, k, v, g, beta, write, initial_state)
    scale = K**-0.5 if scale is None else scale
    C, NB = block_size, num_blocks(T, block_size)
    if write is None:
        write = torch.ones(B, NB, H, dtype=dt, device=q.device)
    else:
        write = apply_route_grad_policy(write, route_grad).to(dt)

    # [B, T, H, D] -> [B, H, NB, C, D], zero-padded: padded tokens have g = 0 (no decay) and
    # beta = 0 (no write), so they change nothing, and their outputs are cut off at the end.
    pad = NB * C - T

    def blocks(x):
        x = F.pad(x.to(dt), (0, 0) * (x.dim() - 2) + (0, pad))  # pads the time dim only
        return x.transpose(1, 2).reshape(B, H, NB, C, *x.shape[3:])

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    gb, bb = blocks(g), blocks(beta)  # [B, H, NB, C]
    G = gb.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_j) on and below the diagonal (each factor <= 1), 0 above it.
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = (bb[..., :, None] * decay * (kb @ kb.transpose(-1, -2))).tril(-1)
    eye = torch.eye(C, dtype=dt, device=q.device)
    U = torch.linalg.solve_triangular(eye + A, bb[..., None] * vb, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(eye + A, (bb * G.exp())[..., None] * kb, upper=False, unitriangular=True)
    attn = (qb @ kb.transpose(-1, -2)) * decay  # [B, H, NB, C, C]
    tail_decay = (G[..., -1:] - G).exp()  # exp(G_L - G_j)
    gamma = G[..., -1].exp()  # [B, H, NB]

    S = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    outputs = []
    for b in range(NB):
        corrections = U[:, :, b] - W[:, :, b] @ S  # d = U - W S, [B, H, C, V]
        o = (G[:, :, b].exp()[..., None] * qb[:, :, b]) @ S
        if intra_block:
            o = o + attn[:, :, b] @ corrections
        outputs.append(scale * o)
        delta_state = kb[:, :, b].transpose(-1, -2) @ (tail_decay[:, :, b, :, None] * corrections)
        w = write[:, b][..., None, None]
        if decay_skipped_blocks:
            S = gamma[:, :, b, None, None] * S + w * delta_state
        else:
            end = gamma[:, :, b, None, None] * S + delta_state
            S = S + w * (end - S)
    o = torch.stack(outputs, dim=2).reshape(B, H, NB * C, V)[:, :, :T].transpose(1, 2)
    return o.to(q.dtype), (S if output_final_state else None)
