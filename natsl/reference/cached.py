"""Small tensor functions the layers' cache paths share: one GDN token step, one gated-linear (Mamba2)
token step, the route commit, and softmax attention over cached keys with per-row lengths or an
explicit mask.

Everything here works on any device and is the reference twin of the fast decode pieces
(`natsl.fast.gated_delta.gated_delta_step` and `commit_block`, `natsl.fast.decode_attention`);
`natsl.ops.cached` picks between them. Nothing here reads a device value on the host, so a decode
step built from these functions can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_token_step(state, q, k, v, g, beta, *, scale=None):
    """One delta-rule token: state [B,H,K,V]; q, k [B,H,K]; v [B,H,V]; g, beta [B,H].

    S' = alpha (I - beta k k^T) S + beta k v^T,  o = scale S'^T q. Returns (o [B,H,V] in q's dtype,
    S' in the state's dtype); the input state is not modified.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt, out_dtype = state.dtype, q.dtype
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    k_state = torch.einsum("bhk,bhkv->bhv", k, state)
    # alpha (S - beta k (k^T S)) + beta k v^T = alpha S + k (beta (v - alpha k^T S))^T
    alpha = g.exp()
    correction = beta[..., None] * (v - alpha[..., None] * k_state)
    new_state = alpha[..., None, None] * state + k[..., :, None] * correction[..., None, :]
    o = scale * torch.einsum("bhkv,bhk->bhv", new_state, q)
    return o.to(out_dtype), new_state


def gla_token_step(state, q, k, v, g, *, scale=None):
    """One gated-linear token (Mamba2's SSD): state [B,H,K,V]; q, k [B,H,K]; v [B,H,V]; g [B,H].

    S' = exp(g) S + k v^T,  o = scale S'^T q. Returns (o [B,H,V] in q's dtype, S' in the state's
    dtype); the input state is not modified.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt, out_dtype = state.dtype, q.dtype
    q, k, v, g = (t.to(dt) for t in (q, k, v, g))
    new_state = g.exp()[..., None, None] * state + k[..., :, None] * v[..., None, :]
    o = scale * torch.einsum("bhkv,bhk->bhv", new_state, q)
    return o.to(out_dtype), new_state


def read_state(state, q, *, scale=None):
    """scale * S^T q for state [B,H,K,V] and q [B,T,H,K] -> [B,T,H,V] in the state's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return scale * torch.einsum("bhkv,bthk->bthv", state, q.to(state.dtype))


def commit_state(start, end, decay_sum, write, decay_skipped_blocks: bool = True):
    """S_start(b+1) = c S_start(b) + write (S_end(b) - c S_start(b)), c = exp(decay_sum) or 1.

    start, end [B,H,K,V]; decay_sum (the block's sum of g) and write [B,H]. Returns a new tensor.
    """
    gamma = decay_sum.to(start.dtype).exp()
    write = write.to(start.dtype)
    base = gamma[..., None, None] * start if decay_skipped_blocks else start
    return base + write[..., None, None] * (end.to(start.dtype) - base)


def write_token(buffer, slots, values) -> None:
    """buffer [B, heads, L, D]; slots [B, heads] (int64); values [B, heads, D]: buffer[b, h, slots[b, h]] = values[b, h]."""
    index = slots[:, :, None, None].expand(-1, -1, 1, buffer.shape[-1])
    buffer.scatter_(2, index, values[:, :, None, :].to(buffer.dtype))


def attend_one(q, keys, values, visible, *, scale=None):
    """One query per sequence over cached keys, each row seeing its first `visible` slots.

    q [B,1,heads,Dk]; keys [B,heads,L,Dk]; values [B,heads,L,Dv]; visible [B,heads] (int64).
    Returns [B,1,heads,Dv] in q's dtype; a row that sees nothing gives zeros.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2)).float() * scale  # [B, heads, 1, L]
    slots = torch.arange(keys.shape[2], device=q.device)
    seen = slots < visible[..., None, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    probs = torch.where(visible[..., None, None] > 0, probs, torch.zeros_like(probs))
    out = torch.matmul(probs.to(values.dtype), values)  # [B, heads, 1, Dv]
    return out.transpose(1, 2).to(q.dtype)


def masked_attention(q, keys, values, mask, *, scale=None):
    """q [B,T,heads,Dk] over keys [B,heads,L,Dk] where `mask` [B|1, heads|1, T, L] (bool) allows.

    Returns [B,T,heads,Dv] in q's dtype; a row whose mask is all False gives zeros.
    """
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                         attn_mask=mask, scale=scale)
    out = torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out))
    return out.transpose(1, 2)
