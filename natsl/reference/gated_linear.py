"""Reference gated linear attention (scalar decay per head) with a per-block write mask (docs/spec.md
section 3, "gated_linear_rule").

Token by token, written to be read rather than to be fast. The state S is [K, V] per (batch, head):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   o_t = scale * S_t^T q_t

This is Mamba2's SSD (q = C, k = B, v = x * dt, g = A * dt, scale = 1) and gated_delta_rule without
the delta erase and without beta. Inside block b the recurrence starts from the committed state
S_start(b) and ends at S_end(b); then the block's route is committed exactly as for gated_delta_rule,
with Gamma_b = exp(sum of g over block b):

    S_start(b+1) = Gamma_b S_start(b) + write_b * (S_end(b) - Gamma_b S_start(b))
"""

from __future__ import annotations

import torch

from natsl.block_size import DEFAULT_BLOCK_SIZE
from natsl.reference.gated_delta import read_query, validate_layouts
from natsl.reference.router import commit_block
from natsl.reference.route_grad import apply_route_grad_policy, check_route_grad, compute_dtype, num_blocks


def expand_groups(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B,T,Hk,K] -> [B,T,heads,K]: head h reads head h // (heads // Hk) (repeat_interleave on
    dim 2, Mamba2's groups -> heads). Hk == heads returns q and k themselves (no copy)."""
    if q.shape[2] == heads:
        return q, k
    per_group = heads // q.shape[2]
    return q.repeat_interleave(per_group, dim=2), k.repeat_interleave(per_group, dim=2)


def _token_step(state, k_t, v_t, g_t):
    """S <- exp(g) S + k v^T. state [B,H,K,V]; k [B,H,K]; v [B,H,V]; g [B,H]."""
    return g_t.exp()[..., None, None] * state + k_t[..., :, None] * v_t[..., None, :]


def _run_block(start, q, k, v, g, tokens: range, scale: float, intra_block: bool):
    """Run one block's tokens from S_start; return (outputs [B,len,H,V], S_end [B,H,K,V])."""
    state = start
    log_decay = torch.zeros_like(g[:, tokens.start])  # sum of g over the block so far
    outputs = []
    for t in tokens:
        state = _token_step(state, k[:, t], v[:, t], g[:, t])
        if intra_block:
            outputs.append(read_query(state, q[:, t], scale))
        else:
            # Ablation: the query sees only the committed state, decayed to its position.
            log_decay = log_decay + g[:, t]
            outputs.append(log_decay.exp()[..., None] * read_query(start, q[:, t], scale))
    return torch.stack(outputs, dim=1), state


def gated_linear_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    write: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    decay_skipped_blocks: bool = True,
    route_grad: str = "active",
    intra_block: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention whose block content writes are committed only where `write` is 1.

    q, k [B,T,Hk,K] with H % Hk == 0 (Hk = H, or Mamba2's groups: head h of v reads q/k head
    h // (H // Hk), as repeat_interleave(H // Hk, dim=2)); v [B,T,H,V]; g (log decay, <= 0) [B,T,H];
    write [B,NB,H] with NB = ceil(T / block_size), None = all ones (plain gated linear attention /
    Mamba2 SSD); initial_state [B,H,K,V]. Returns o [B,T,H,V] in q's dtype and, if
    `output_final_state`, S_start(NB) [B,H,K,V] in fp32 (float64 for float64 inputs); otherwise None.
    """
    check_route_grad(route_grad)
    B, T, H, K, V = validate_layouts(q, k, v, g, None, write, initial_state, block_size, grouped_qk=True)
    q, k = expand_groups(q, k, H)  # autograd sums each group's gradient
    dt = compute_dtype(q, k, v, g, write, initial_state)
    scale = K**-0.5 if scale is None else scale
    NB = num_blocks(T, block_size)

    if write is None:
        write = torch.ones(B, NB, H, dtype=dt, device=q.device)
    else:
        write = apply_route_grad_policy(write, route_grad).to(dt)
    qc, kc, vc, gc = (x.to(dt) for x in (q, k, v, g))
    state = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)

    outputs = []
    for b in range(NB):
        tokens = range(b * block_size, min((b + 1) * block_size, T))
        block_out, end = _run_block(state, qc, kc, vc, gc, tokens, scale, intra_block)
        outputs.append(block_out)
        state = commit_block(state, end, gc[:, tokens.start : tokens.stop].sum(1).exp(), write[:, b],
                             decay_skipped_blocks)

    if outputs:
        o = torch.cat(outputs, dim=1)
    else:  # T == 0: nothing to read, the state passes through untouched
        o = torch.zeros(B, 0, H, V, dtype=dt, device=q.device)
    return o.to(q.dtype), (state if output_final_state else None)
