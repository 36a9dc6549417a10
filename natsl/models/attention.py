"""Plain causal softmax attention (Transformer and GDN Hybrid layers), RoPE optional, optionally
sliding-window (`attn_window`: the query at position p sees keys p - window + 1 .. p).

Caches (natsl.models.cache.AttentionCache) come in three kinds: K/V at their absolute positions
(the default); a ring buffer of the last `window` tokens (sliding window: slot = position mod
window); and, once a KV-eviction press has compacted it (natsl.inference.evict), per-head lengths
`kv_len` (each head keeps its own number of entries, new tokens are appended after them).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from natsl.models.linear import Linear
from natsl.models.merged import merged_weight, shared_linear
from natsl.models.rope import RopeTable, apply_rope, decode_frequencies
from natsl.ops import gemv, kernel_set
from natsl.ops.cached import attend_cached

if TYPE_CHECKING:
    from natsl.config import ModelConfig


class SoftmaxAttention(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        d, nh, hd = config.hidden_size, config.attn_num_heads, config.attn_head_dim
        self.num_heads, self.head_dim = nh, hd
        self.backend = config.backend  # picks the decode kernels (set_backend changes it)
        self.q_proj = Linear(d, nh * hd, bias=False, device=device)
        self.k_proj = Linear(d, nh * hd, bias=False, device=device)
        self.v_proj = Linear(d, nh * hd, bias=False, device=device)
        self.o_proj = Linear(nh * hd, d, bias=False, device=device)

    merge_groups = {"qkv": ("q_proj", "k_proj", "v_proj")}  # run as one product by natsl.models.merged

    def heads(self, x: torch.Tensor):
        """x [B,T,d] -> q, k, v [B,T,heads,head_dim], before RoPE."""
        b, t, _ = x.shape
        return tuple(y.view(b, t, self.num_heads, self.head_dim)
                     for y in shared_linear(self, "qkv", x, label="attn_qkv"))

    def project(self, x: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None,
                rope: RopeTable | None = None):
        """x [B,T,d] -> q, k, v [B,T,heads,head_dim], RoPE applied at positions start..start+T-1
        (or at `positions` [B, T], one row per sequence; or from `rope`, positions 0..T-1)."""
        q, k, v = self.heads(x)
        if self.config.attn_rope:
            if positions is None and rope is None:
                positions = torch.arange(start, start + x.shape[1], device=x.device)
            q = apply_rope(q, positions, self.config.rope_theta, rope)
            k = apply_rope(k, positions, self.config.rope_theta, rope)
        return q, k, v

    def forward(self, x: torch.Tensor, cache=None, rope: RopeTable | None = None) -> torch.Tensor:
        """`rope`: the forward's shared angle table (natsl.models.rope.RopeTable), full sequences only."""
        if cache is not None:
            return self.forward_cached(x, cache)
        b, t, _ = x.shape
        q, k, v = self.project(x, rope=rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        window = self.config.attn_window
        if window and window < t:
            o = sliding_window_attention(q, k, v, window, flex=x.device.type == "cuda")
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward_cached(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Tokens that follow those in `cache` (an AttentionCache, K/V stored at absolute positions)."""
        b, t, _ = x.shape
        start = cache.positions.start
        if start is None:  # decode: one token per sequence, each at its own position
            return self.decode(*self.heads(x), cache)
        if self.observe:  # a KV-eviction press scores the keys with the last queries (natsl.inference.evict)
            self.observed_q = None
        if cache.window:
            o = self.prefill_window(x, cache, start)
        elif cache.kv_len is not None:
            o = self.prefill_compacted(x, cache, start)
        else:  # prefill: every sequence starts at `start`
            q, k, v = self.project(x, start)
            cache.k[:, :, start:start + t].copy_(k.transpose(1, 2))
            cache.v[:, :, start:start + t].copy_(v.transpose(1, 2))
            if start == 0:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True).transpose(1, 2)
            else:
                keys, values = cache.k[:, :, :start + t], cache.v[:, :, :start + t]
                key_pos = torch.arange(start + t, device=x.device)
                causal = key_pos[None, :] <= key_pos[start:, None]  # query i at start + i
                o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=causal).transpose(1, 2)
            self.keep_queries(q)
        return self.o_proj(o.reshape(b, t, -1))

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache) -> torch.Tensor:
        """One decode token per sequence from its projections q, k, v [B, 1, heads, head_dim] (before RoPE):
        RoPE, the K/V write at each sequence's position, the cached attention and o_proj -> [B, 1, d]."""
        b = q.shape[0]
        pos = cache.positions.pos
        if self.observe:  # a press reads the last queries of a prefill, none of a decode step
            self.observed_q = None
        n = min(cache.positions.attn_read, cache.k.shape[2])
        if cache.window:  # ring buffer: the token goes to slot pos mod window
            slots = (pos % cache.window)[:, None].expand(b, self.num_heads)
            visible = torch.clamp(pos + 1, max=cache.window)[:, None].expand(b, self.num_heads)
        else:  # absolute positions, or after eviction the end of each head's entries
            slots = pos[:, None].expand(b, self.num_heads) if cache.kv_len is None else cache.kv_len
            visible = slots + 1
        # RoPE on q and k, then K/V into the cache: one kernel on the fused set
        rope = self.config.attn_rope
        inv_freq = decode_frequencies(self.head_dim, self.config.rope_theta, q.device) if rope else None
        kernels = kernel_set.pick(self.backend, q.device)
        q = kernels.rope_write_kv(q[:, 0], k[:, 0], v[:, 0], pos, inv_freq, cache.k, cache.v, slots)[:, None]
        o = attend_cached(q, cache.k[:, :, :n], cache.v[:, :, :n], visible, backend=self.backend)
        if cache.kv_len is not None:
            cache.kv_len.add_(1)
        return self.o_proj(o.reshape(b, 1, -1))

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm, cache, kernels):
        """A block's cached call: (x + residual, self(norm(x + residual), cache)). On a decode step where
        natsl.ops.gemv.add_norm_linear runs (the switch fused_add_norm), the add and the norm are formed
        inside the merged q/k/v GEMV; else `kernels.add_norm` (natsl.ops.kernel_set), then this layer."""
        if cache.positions.start is None:
            fused = gemv.add_norm_linear(x, residual, norm.weight, norm.eps, merged_weight(self, "qkv", x))
            if fused is not None:
                x, qkv = fused
                b, t = qkv.shape[:2]
                q, k, v = (y.view(b, t, self.num_heads, self.head_dim) for y in qkv.chunk(3, dim=-1))
                return x, self.decode(q, k, v, cache)
        x, normed = kernels.add_norm(x, residual, norm)
        return x, self(normed, cache=cache)

    observe = 0  # how many of a prefill's last queries to keep for a KV-eviction press (0: none)
    observed_q = None

    def keep_queries(self, q: torch.Tensor) -> None:
        if self.observe:
            self.observed_q = q[:, -self.observe:].transpose(1, 2)  # [B, heads, w, D], RoPE applied

    def prefill_window(self, x: torch.Tensor, cache, start: int) -> torch.Tensor:
        """A prefill into a ring buffer of the last `window` tokens: the earlier tokens still in view
        are read from the ring in position order, then the last `window` new ones overwrite it."""
        t, window = x.shape[1], cache.window
        q, k, v = self.project(x, start)
        old = torch.arange(max(0, start - window + 1), start, device=x.device)
        keys = torch.cat([cache.k[:, :, old % window], k.transpose(1, 2).to(cache.k.dtype)], dim=2)
        values = torch.cat([cache.v[:, :, old % window], v.transpose(1, 2).to(cache.v.dtype)], dim=2)
        key_pos = torch.cat([old, torch.arange(start, start + t, device=x.device)])
        o = banded_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), key_pos, window)
        last = key_pos[-min(t, window):]
        cache.k.index_copy_(2, last % window, keys[:, :, -len(last):])
        cache.v.index_copy_(2, last % window, values[:, :, -len(last):])
        self.keep_queries(q)
        return o.transpose(1, 2)

    def prefill_compacted(self, x: torch.Tensor, cache, start: int) -> torch.Tensor:
        """A prefill after eviction: head h of sequence b holds its first kv_len[b, h] slots (any
        positions, RoPE applied); the new tokens see those and each other causally, then are appended."""
        b, t, _ = x.shape
        q, k, v = self.project(x, start)
        held = int(cache.kv_len.max())
        slots = torch.arange(held + t, device=x.device)
        old_seen = slots[:held] < cache.kv_len[..., None, None]  # [B, heads, 1, held]
        new_seen = slots[:t, None] >= slots[None, :t]  # [t, t] causal
        mask = torch.cat([old_seen.expand(b, self.num_heads, t, held),
                          new_seen.expand(b, self.num_heads, t, t)], dim=-1)
        keys = torch.cat([cache.k[:, :, :held].to(q.dtype), k.transpose(1, 2)], dim=2)
        values = torch.cat([cache.v[:, :, :held].to(q.dtype), v.transpose(1, 2)], dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        index = (cache.kv_len[..., None] + slots[:t])[..., None]  # [B, heads, t, 1]
        cache.k.scatter_(2, index.expand(-1, -1, -1, cache.k.shape[3]), k.transpose(1, 2).to(cache.k.dtype))
        cache.v.scatter_(2, index.expand(-1, -1, -1, cache.v.shape[3]), v.transpose(1, 2).to(cache.v.dtype))
        cache.kv_len.add_(t)
        self.keep_queries(q)
        return o.transpose(1, 2)


def band_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Tq, Tk] bool: key j is visible to query i when 0 <= pos_i - pos_j < window."""
    gap = query_pos[:, None] - key_pos[None, :]
    return (gap >= 0) & (gap < window)


def banded_attention(q, keys, values, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """q [B, heads, t, D] for the last t of `key_pos` (consecutive positions of keys / values
    [B, heads, n, D]) -> [B, heads, t, D], each query reading the keys of its window.

    Queries go in chunks of `window`, each with only the keys its band can reach (< 2 x window), so a
    long prefill holds an O(window^2) mask and O(t x window) scores instead of a [t, n] mask and all
    t x n scores (at 128K tokens the single masked call needs a 16 GiB mask). Inference only, no compile
    (a flex_attention block mask would recompile for every prompt length)."""
    t, first = q.shape[2], keys.shape[2] - q.shape[2]
    out = []
    for a in range(0, t, window):
        b = min(a + window, t)
        lo = max(0, first + a - window + 1)
        mask = band_mask(key_pos[first + a:first + b], key_pos[lo:first + b], window)
        out.append(F.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, lo:first + b],
                                                  values[:, :, lo:first + b], attn_mask=mask))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def sliding_window_attention(q, k, v, window: int, *, flex: bool = False) -> torch.Tensor:
    """Causal attention within a window, q, k, v [B, heads, T, D] -> [B, heads, T, D].

    `flex`: through torch's flex_attention with a block mask of the band (compiled), which skips the
    key blocks outside the window, forward and backward, so a layer costs O(T * window); SDPA with a
    mask would compute all T^2 scores (its flash kernels take no mask). Otherwise (CPU) the ring
    prefill's `banded_attention` with no earlier keys: SDPA with the band as a boolean mask, per chunk
    of `window` queries, the readable form."""
    t = q.shape[2]
    if not flex:
        return banded_attention(q, k, v, torch.arange(t, device=q.device), window)
    return _compiled_flex()(q, k, v, block_mask=_window_block_mask(t, window, str(q.device)))


@functools.lru_cache(maxsize=32)
def _window_block_mask(t: int, window: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def inside(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return create_block_mask(inside, None, None, t, t, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
