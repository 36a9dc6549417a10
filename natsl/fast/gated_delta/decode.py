"""One-token decode step of Gated DeltaNet with a running fp32 state (incremental inference).

    S' = alpha (S - beta k (k^T S)) + beta k v^T = alpha S + k r^T,  r = beta (v - alpha S^T k),
    o  = scale S'^T q.
One program per (V slice, batch * head); K is one masked register tile (K <= 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.fast.gated_delta import config
from natsl.fast.gated_delta.common import MAX_K, dim_tile


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, ns_ptr,
    scale,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    iv = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = iv * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    q = tl.load(q_ptr + bh * K + rk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + bh * K + rk, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + bh * V + rv, mask=mv, other=0.0).to(tl.float32)
    alpha = tl.exp(tl.load(g_ptr + bh).to(tl.float32))
    beta = tl.load(beta_ptr + bh).to(tl.float32)
    offs = bh * K * V + rk[:, None] * V + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptr + offs, mask=mask, other=0.0)
    r = beta * (v - alpha * tl.sum(k[:, None] * s, 0))
    s = alpha * s + k[:, None] * r[None, :]
    tl.store(ns_ptr + offs, s, mask=mask)
    o = scale * tl.sum(q[:, None] * s, 0)
    tl.store(o_ptr + bh * V + rv, o.to(o_ptr.dtype.element_ty), mask=mv)


def gated_delta_step(q, k, v, g, beta, state, *, scale=None):
    """One token: q, k [B,H,K]; v [B,H,V]; g, beta [B,H]; state [B,H,K,V] fp32 -> (o [B,H,V], new state).

    o is in q's dtype; the new state is a fresh fp32 tensor (the input state is left untouched).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    if K > MAX_K:
        raise ValueError(f"gated_delta_step supports K <= {MAX_K}, got {K}")
    if tuple(state.shape) != (B, H, K, V):
        raise ValueError(f"state must be [B, H, K, V] = {(B, H, K, V)}, got {tuple(state.shape)}")
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    state = state.to(torch.float32).contiguous()
    o = torch.empty(B, H, V, device=q.device, dtype=q.dtype)
    new_state = torch.empty_like(state)
    BV = min(config.DECODE["BV"], dim_tile(V))
    grid = (triton.cdiv(V, BV), B * H)
    _decode_kernel[grid](
        q, k, v, g, beta, state, o, new_state, scale,
        K=K, V=V, BK=max(16, triton.next_power_of_2(K)), BV=BV, num_warps=config.DECODE["num_warps"],
    )
    return o, new_state
