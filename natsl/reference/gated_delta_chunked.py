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

from natsl.block_size import DEFAULT_BLOCK_SIZE
from natsl.reference.gated_delta import validate_layouts
from natsl.reference.router import commit_block
from natsl.reference.route_grad import apply_route_grad_policy, check_route_grad, compute_dtype, num_blocks



def block_writes(write, B: int, NB: int, H: int, dt, device, route_grad: str):
    """The write mask [B, NB, H] in dtype `dt`: all ones for None, else under the route-gradient policy."""
    if write is None:
        return torch.ones(B, NB, H, dtype=dt, device=device)
    return apply_route_grad_policy(write, route_grad).to(dt)


def to_blocks(x, NB: int, C: int, dt):
    """[B, T, H, ...] -> [B, H, NB, C, ...] in `dt`, the time dim zero-padded to NB * C (a padded token
    has g = 0: no decay; and writes nothing: beta = 0 or k = v = 0)."""
    B, T, H = x.shape[:3]
    x = F.pad(x.to(dt), (0, 0) * (x.dim() - 2) + (0, NB * C - T))  # pads the time dim only
    return x.transpose(1, 2).reshape(B, H, NB, C, *x.shape[3:])


def block_decay(gb):
    """G (the cumulative log decay within each block, [..., C]) and exp(G_t - G_j) on and below the
    diagonal (each factor <= 1), 0 above it ([..., C, C])."""
    C = gb.shape[-1]
    G = gb.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=gb.device).tril()
    return G, (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()


def commit(S, gamma, delta_state, w, decay_skipped_blocks: bool):
    """The route commit of one block (`natsl.reference.router.commit_block`, the one rule) from the chunked form's
    block content: S_end(b) = gamma S + delta_state. S = S_start(b) [B, H, K, V], gamma and w [B, H]."""
    return commit_block(S, gamma[..., None, None] * S + delta_state, gamma, w, decay_skipped_blocks)


def gated_delta_rule(
    q, k, v, g, beta, write=None, *, scale=None, initial_state=None, output_final_state=False,
    block_size=DEFAULT_BLOCK_SIZE, decay_skipped_blocks=True, route_grad="active", intra_block=True,
):
    """Same arguments and results as `natsl.reference.gated_delta.gated_delta_rule`."""
    check_route_grad(route_grad)
    B, T, H, K, V = validate_layouts(q, k, v, g, beta, write, initial_state, block_size)
    dt = compute_dtype(q, k, v, g, beta, write, initial_state)
    scale = K**-0.5 if scale is None else scale
    C, NB = block_size, num_blocks(T, block_size)
    write = block_writes(write, B, NB, H, dt, q.device, route_grad)
    qb, kb, vb = (to_blocks(x, NB, C, dt) for x in (q, k, v))
    bb = to_blocks(beta, NB, C, dt)  # [B, H, NB, C]
    G, decay = block_decay(to_blocks(g, NB, C, dt))
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
        S = commit(S, gamma[:, :, b], delta_state, write[:, b], decay_skipped_blocks)
    o = torch.stack(outputs, dim=2).reshape(B, H, NB * C, V)[:, :, :T].transpose(1, 2)
    return o.to(q.dtype), (S if output_final_state else None)
