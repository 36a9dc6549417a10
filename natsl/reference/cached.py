"""Small tensor functions the layers' cache paths share: one GDN token step, one gated-linear (Mamba2)
token step, and softmax attention over cached keys with per-row lengths or an explicit mask. (The route
commit, the rule of every path, is `natsl.reference.router.commit_block`, the reference twin of
`natsl.fast.gated_delta.commit_block`.)

Everything here works on any device. `gated_delta_step`, `attend_one` and `write_kv` are the reference
twins (same signatures) of the fast decode pieces `natsl.fast.gated_delta.gated_delta_step`,
`natsl.fast.decode_attention.decode_attention` and `natsl.fast.cached.write_kv`;
`conv_step`, `conv_steps`, `conv_chunk`, `gdn_decode_step`, `gla_decode_step`, `rope_write_kv` and `store_blocks` those of the rest of
`natsl.fast.cached` (natsl.ops.TWINS); `natsl.ops.cached` and `natsl.ops.kernel_set` pick between them. Nothing here but
`store_blocks` reads a device value on the host, so a decode step built from these functions can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.reference.gates import add_skip, decay, gdn_gates, step_values
from natsl.reference.norms import l2_normalize, rms_norm
from natsl.reference.rope import angles, rotate
from natsl.reference.short_conv import short_conv_silu


def gated_delta_step(q, k, v, g, beta, state, *, scale=None):
    """One delta-rule token: q, k [B,H,K]; v [B,H,V]; g, beta [B,H]; state [B,H,K,V].

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


def write_token(buffer, slots, values) -> None:
    """buffer [B, heads, L, D]; slots [B, heads] (int64); values [B, heads, D]: buffer[b, h, slots[b, h]] = values[b, h]."""
    index = slots[:, :, None, None].expand(-1, -1, 1, buffer.shape[-1])
    buffer.scatter_(2, index, values[:, :, None, :].to(buffer.dtype))


def write_kv(k_buf, v_buf, slots, k, v) -> None:
    """A decode token's K and V into their caches: `write_token` of each."""
    write_token(k_buf, slots, k)
    write_token(v_buf, slots, v)


def rope_write_kv(q, k, v, positions, inv_freq, k_buf, v_buf, slots, *, q_weight=None, k_weight=None,
                  eps: float = 1e-6):
    """A decode token's softmax heads before the attention read: q and k RMS-normed per head when their
    weight is given (each rounded to its dtype, as the layer's norm modules do), rotated by RoPE, K and V
    written to their caches.

    q, k [B, heads, Dk]; v [B, heads, Dv]; positions [B] (int64, the token's position); inv_freq [Dk / 2]
    fp32 (natsl.reference.rope.inverse_frequencies; None: no rotation); k_buf, v_buf [B, heads, L, D];
    slots [B, heads] (int64); q_weight, k_weight [Dk] or None; eps the norms'. Returns q, normed and
    rotated, [B, heads, Dk] in q's dtype; k_buf[b, h, slots[b, h]] and v_buf's are written."""
    if q_weight is not None:
        q = rms_norm(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm(k, k_weight, eps)
    if inv_freq is not None:
        cos, sin = angles(positions[:, None], inv_freq)  # [B, 1, Dk]: one angle set per sequence
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    write_kv(k_buf, v_buf, slots, k, v)
    return q


def attend_one(q, keys, values, visible, *, scale=None, num_splits=None, block_n=None, num_warps=4,
               num_stages=None, slot_stats=True, programs_per_sm=None):
    """One query per sequence over cached keys, each row seeing its first `visible` slots.

    q [B,1,heads,Dk]; keys [B,heads,L,Dk]; values [B,heads,L,Dv]; visible [B,heads] (int64).
    Returns [B,1,heads,Dv] in q's dtype; a row that sees nothing gives zeros. The arguments after
    `scale` are the fast twin's launch settings (natsl.fast.decode_attention), ignored here.
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


def conv_chunk(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The short conv + SiLU of many tokens after a cached tail: x [B, T, C], tail [B, W, C] (the W
    inputs before x, read only), weight [C, 1, W+1] -> y [B, T, C] in x's dtype (`short_conv_silu`)."""
    return short_conv_silu(x, weight, tail)


def conv_step(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token of the short conv + SiLU: x [B, 1, C], tail [B, W, C] (updated in place: shifted by
    one, x appended), weight [C, 1, W+1] -> y [B, 1, C] in x's dtype."""
    y = short_conv_silu(x, weight, tail)
    tail.copy_(torch.cat([tail[:, 1:], x.to(tail.dtype)], dim=1))
    return y


def conv_steps(xs, tails, weights) -> list[torch.Tensor]:
    """`conv_step` of each (x, tail, weight) triple (a GDN layer's q, k, v)."""
    return [conv_step(x, tail, weight) for x, tail, weight in zip(xs, tails, weights)]


def gdn_decode_step(q, k, v, a, b, A_log, dt_bias, state, *, scale=None):
    """One GDN token from the raw post-conv projections, the state updated in place.

    q, k [B, H*K]; v [B, H*V] (post conv + SiLU, before the L2 norm); a, b [B, H] (the a and b
    projections); state [B, H, K, V] (updated in place). The layer's gates -- log decay
    g = -exp(A_log) softplus(a + dt_bias) in fp32, beta = sigmoid(b) in b's dtype -- and
    `gated_delta_step` on L2-normalised q, k. Returns (o [B, H, V] in q's dtype, g [B, H] fp32).
    """
    B, H, K, V = state.shape
    q, k = (l2_normalize(t.reshape(B, H, K)) for t in (q, k))
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, new_state = gated_delta_step(q, k, v.reshape(B, H, V), g, beta, state, scale=scale)
    state.copy_(new_state)
    return o, g


def gla_decode_step(q, k, v, a, A_log, dt_bias, state, *, D=None, scale=None, l2=False):
    """One gated-linear token (Mamba2's SSD) from the raw post-conv projections, the state updated in place.

    q, k [B, G*K] (Mamba2's C and B: G groups of K, head h reads group h // (H/G)); v [B, H*V] (x);
    a [B, H] (the dt projection); A_log, dt_bias [H]; state [B, H, K, V] (updated in place); D [H] or
    None. The layer's gates -- step dt = softplus(a + dt_bias) and log decay g = -exp(A_log) dt, in
    fp32 -- then `gla_token_step` with the write v dt (rounded to v's dtype) on q, k (L2-normalised
    first where `l2`), and where D is given the skip + D v (fp32, rounded to the output's dtype).
    Returns (o [B, H, V] in q's dtype, g [B, H] fp32).
    """
    B, H, K, V = state.shape
    G = q.shape[-1] // K
    q, k = q.reshape(B, G, K), k.reshape(B, G, K)
    if l2:
        q, k = l2_normalize(q), l2_normalize(k)
    if G != H:
        q, k = (t.repeat_interleave(H // G, dim=1) for t in (q, k))
    g, dt = decay(a, A_log, dt_bias)
    x = v.reshape(B, H, V)
    o, new_state = gla_token_step(state, q, k, step_values(x, dt), g, scale=scale)
    if D is not None:
        o = add_skip(o, x, D)
    state.copy_(new_state)
    return o, g


def store_blocks(src: torch.Tensor, mem: torch.Tensor, valid: torch.Tensor, before: torch.Tensor,
                 kept0: torch.Tensor, n: int, block_size: int) -> None:
    """A prefill chunk's K or V into a NAtS-L cache's compacted memory, block by block.

    src [B, T, heads, D] (the chunk; its token 0 sits at offset n of relative block 0); mem
    [B, heads, L, D]; valid [B, R, heads] (bool: the relative block is kept, or unfinished);
    before [B, R, heads] (int64: kept blocks before it); kept0 [B, heads] (int64: slots already
    used). Token t of relative block r = (n + t) // block_size goes to
    kept0 + block_size * before[r] + its offset in the block where valid[r]; tokens past block R-1
    are not stored. Reads the valid tokens' indices on the host (nonzero)."""
    T = src.shape[1]
    R = valid.shape[1]
    if T == 0 or R == 0:
        return
    position = n + torch.arange(T, device=src.device)
    rel, offset = position // block_size, position % block_size
    inside = rel < R
    rel = rel.clamp(max=max(R - 1, 0))
    dest = kept0[:, None, :] + block_size * before[:, rel] + offset[None, :, None]  # [B, T, heads]
    bi, ti, hi = (valid[:, rel].bool() & inside[None, :, None]).nonzero(as_tuple=True)
    mem[bi, hi, dest[bi, ti, hi]] = src[bi, ti, hi].to(mem.dtype)
