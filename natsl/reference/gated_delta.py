"""Reference Gated DeltaNet with a per-block write mask (docs/spec.md section 3).

Token by token, written to be read rather than to be fast. The state S is [K, V] per (batch, head):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

Inside block b the recurrence starts from the committed state S_start(b) and ends at S_end(b);
then the block's route is committed, with Gamma_b = exp(sum of g over block b):

    S_start(b+1) = Gamma_b S_start(b) + write_b * (S_end(b) - Gamma_b S_start(b))
"""

from __future__ import annotations

import torch

from natsl.block_size import DEFAULT_BLOCK_SIZE
from natsl.reference.router import commit_block
from natsl.reference.route_grad import (
    apply_route_grad_policy,
    check_block_size,
    check_route_grad,
    compute_dtype,
    expect_floating,
    expect_shape,
    num_blocks,
)


def validate_layouts(q, k, v, g, beta, write, initial_state, block_size, *,
                     grouped_qk: bool = False) -> tuple[int, int, int, int, int]:
    """Check every layout of docs/spec.md section 5; return (B, T, H, K, V). `beta=None` checks the
    gated linear rule's arguments (natsl.reference.gated_linear), which have no beta. `grouped_qk`
    (the gated linear rule's) lets q and k have Hk heads with H % Hk == 0 (H = v's heads)."""
    check_block_size(block_size)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    if v.dim() != 4:
        raise ValueError(f"v must be [B, T, H, V], got shape {tuple(v.shape)}")
    B, T, Hk, K = q.shape
    H, V = (v.shape[2], v.shape[3]) if grouped_qk else (Hk, v.shape[-1])
    expect_shape("k", k, (B, T, Hk, K), "[B, T, Hk, K] (as q)" if grouped_qk else "[B, T, H, K] (as q)")
    if grouped_qk and (Hk == 0 or H % Hk != 0):
        raise ValueError(f"q and k have {Hk} heads, which do not divide v's {H}: give q and k H heads, or Hk "
                         f"heads with H % Hk == 0 (head h of v reads q/k head h // (H // Hk))")
    expect_shape("v", v, (B, T, H, V), "[B, T, H, V]")
    expect_shape("g", g, (B, T, H), "[B, T, H]")
    if beta is not None:
        expect_shape("beta", beta, (B, T, H), "[B, T, H]")
    if write is not None:
        expect_shape("write", write, (B, num_blocks(T, block_size), H), "[B, NB, H]")
    if initial_state is not None:
        expect_shape("initial_state", initial_state, (B, H, K, V), "[B, H, K, V]")
    named = dict(q=q, k=k, v=v, g=g, beta=beta, write=write, initial_state=initial_state)
    for name, t in named.items():
        if t is not None:
            expect_floating(name, t)
    return B, T, H, K, V


def _token_step(state, k_t, v_t, g_t, beta_t):
    """One delta-rule step: S <- alpha (I - beta k k^T) S + beta k v^T. state [B,H,K,V]; k [B,H,K]."""
    k_state = torch.einsum("bhk,bhkv->bhv", k_t, state)
    erased = state - beta_t[..., None, None] * k_t[..., :, None] * k_state[..., None, :]
    written = beta_t[..., None, None] * k_t[..., :, None] * v_t[..., None, :]
    return g_t.exp()[..., None, None] * erased + written


def read_query(state, q_t, scale):
    """o = scale * S^T q for state [B,H,K,V] and q [B,H,K] -> [B,H,V]."""
    return scale * torch.einsum("bhkv,bhk->bhv", state, q_t)


def _run_block(start, q, k, v, g, beta, tokens: range, scale: float, intra_block: bool):
    """Run one block's tokens from S_start; return (outputs [B,len,H,V], S_end [B,H,K,V])."""
    state = start
    log_decay = torch.zeros_like(g[:, tokens.start])  # log prod alpha_s over the block so far
    outputs = []
    for t in tokens:
        state = _token_step(state, k[:, t], v[:, t], g[:, t], beta[:, t])
        if intra_block:
            outputs.append(read_query(state, q[:, t], scale))
        else:
            # Ablation: the query sees only the committed state, decayed to its position.
            log_decay = log_decay + g[:, t]
            outputs.append(log_decay.exp()[..., None] * read_query(start, q[:, t], scale))
    return torch.stack(outputs, dim=1), state


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
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
    """Gated DeltaNet whose block content writes are committed only where `write` is 1.

    q, k [B,T,H,K] (already normalised); v [B,T,H,V]; g (log decay), beta [B,T,H];
    write [B,NB,H] with NB = ceil(T / block_size), None = all ones (plain Gated DeltaNet);
    initial_state [B,H,K,V]. Returns o [B,T,H,V] in q's dtype and, if `output_final_state`,
    S_start(NB) [B,H,K,V] in fp32 (float64 for float64 inputs); otherwise None.
    """
    check_route_grad(route_grad)
    B, T, H, K, V = validate_layouts(q, k, v, g, beta, write, initial_state, block_size)
    dt = compute_dtype(q, k, v, g, beta, write, initial_state)
    scale = K**-0.5 if scale is None else scale
    NB = num_blocks(T, block_size)

    if write is None:
        write = torch.ones(B, NB, H, dtype=dt, device=q.device)
    else:
        write = apply_route_grad_policy(write, route_grad).to(dt)
    qc, kc, vc, gc, bc = (x.to(dt) for x in (q, k, v, g, beta))
    if initial_state is None:
        state = torch.zeros(B, H, K, V, dtype=dt, device=q.device)
    else:
        state = initial_state.to(dt)

    outputs = []
    for b in range(NB):
        tokens = range(b * block_size, min((b + 1) * block_size, T))
        block_out, end = _run_block(state, qc, kc, vc, gc, bc, tokens, scale, intra_block)
        outputs.append(block_out)
        state = commit_block(state, end, gc[:, tokens.start : tokens.stop].sum(1).exp(), write[:, b],
                             decay_skipped_blocks)

    if outputs:
        o = torch.cat(outputs, dim=1)
    else:  # T == 0: nothing to read, the state passes through untouched
        o = torch.zeros(B, 0, H, V, dtype=dt, device=q.device)
    return o.to(q.dtype), (state if output_final_state else None)
