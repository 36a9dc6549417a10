"""KV eviction at inference time on natsl's own caches: SnapKV, PyramidKV and AdaKV.

The softmax-attention layers of a Transformer or a GDN Hybrid keep every token's K and V. A press
drops entries to a budget after a prefill, from scores of the prefill's last queries:

- SnapKV (Li et al. 2024): the last `window` queries of the prefill (the observation window) attend
  to every held key; each key's score is its attention summed over those queries, smoothed by an
  average pool of width `kernel` along the keys. Each head keeps the observation window's own keys
  and the top-scoring others, `ceil(budget x tokens seen)` entries per head.
- PyramidKV (Cai et al. 2024): SnapKV's scores, with the budget spread over the attention layers in
  a line from the first to the last (the first gets `2 - 1/beta` times the mean, the last `1/beta`
  times; beta = 20 as the paper; less spread where the first would pass 1), the mean over layers
  being the budget.
- AdaKV (Feng et al. 2024): SnapKV's scores, with one layer's budget (heads x per-head budget)
  shared out by a top-k over all heads' scores together, each head guaranteed `alpha` (0.2) of
  its even share; heads then hold different numbers of entries.

After a press, each head's kept entries sit at the front of its cache rows, in their original
order, with `kv_len [B, heads]` per head (natsl.models.cache.AttentionCache); later tokens are
appended after them (prefill and decode both read `kv_len`). RoPE was applied when the keys were
written, so the kept keys keep their positions.

Why not kvpress (NVIDIA's library of these presses for Hugging Face models): its release pins
transformers < 5.3 (installing it would downgrade the transformers that natsl's Hugging Face export
and tests run on), and it hooks Hugging Face attention modules and their DynamicCache, which only
the Llama export of the Transformer uses: a GDN Hybrid runs natsl's own cache (natsl.hf), and
natsl's latency and KV-bytes measurements run natsl's cached paths. So the three presses are here,
written on natsl's caches, in a few tensor operations each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from natsl.errors import NatslError
from natsl.models.attention import SoftmaxAttention
from natsl.models.cache import AttentionCache

METHODS = ("snapkv", "pyramidkv", "adakv")
PYRAMID_BETA = 20
ADA_FLOOR = 0.2


@dataclass
class Press:
    """A KV-eviction press: `method` (snapkv, pyramidkv, adakv) keeping `budget` of the tokens seen
    (a fraction in (0, 1]) per attention layer and head, on average."""

    method: str
    budget: float
    window: int = 32  # observation window: the prefill's last queries that score the keys
    kernel: int = 5  # average-pool width along the keys (SnapKV's default)

    def __post_init__(self):
        if self.method not in METHODS:
            raise NatslError(f"unknown KV-eviction method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 0.0 < self.budget <= 1.0:
            raise NatslError(f"a KV-eviction budget must lie in (0, 1] (the fraction of tokens kept), got {self.budget}")
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise NatslError(f"a press needs window >= 1 and an odd kernel >= 1, got {self.window} and {self.kernel}")


def attention_layers(model) -> list[int]:
    return [i for i, block in enumerate(model.layers) if isinstance(block.mixer, SoftmaxAttention)]


def observe(model, press: Press | None) -> None:
    """Make every softmax-attention layer keep its prefill's last `press.window` queries (None: stop)."""
    layers = attention_layers(model)
    if press is not None and not layers:
        raise NatslError("KV eviction needs softmax-attention layers (a Transformer or a GDN Hybrid); this model has none")
    for i in layers:
        model.layers[i].mixer.observe = 0 if press is None else press.window
        model.layers[i].mixer.observed_q = None


def layer_budgets(press: Press, layers: int) -> list[float]:
    """Fraction of tokens kept by each attention layer, in order (their mean is the budget)."""
    if press.method != "pyramidkv" or layers == 1:
        return [press.budget] * layers
    # the spread is cut where the first layer would pass 1 (at budget 1 every layer keeps all)
    spread = min(press.budget * (1 - 1 / PYRAMID_BETA), 1 - press.budget)
    return [press.budget + spread * (1 - 2 * r / (layers - 1)) for r in range(layers)]


@torch.no_grad()
def evict(model, cache, press: Press) -> None:
    """Apply `press` to every attention layer's cache of `model` after a prefill into `cache`
    (which ran with `observe(model, press)`)."""
    layers = attention_layers(model)
    seen = cache.positions.lengths.to(cache.positions.pos.device)  # [B] tokens each sequence has read
    for index, fraction in zip(layers, layer_budgets(press, len(layers))):
        layer, layer_cache = model.layers[index].mixer, cache.layers[index]
        if not isinstance(layer_cache, AttentionCache) or layer_cache.window:
            raise NatslError("KV eviction works on full-attention caches; a sliding-window layer keeps its window")
        if layer.observed_q is None:
            raise NatslError("KV eviction follows a prefill made with natsl.inference.evict.observe(model, press)")
        compact(layer_cache, layer.observed_q, fraction, press, seen)


def held_lengths(cache: AttentionCache) -> torch.Tensor:
    """[B, heads] entries each head holds now."""
    if cache.kv_len is not None:
        return cache.kv_len
    lengths = cache.positions.lengths.to(cache.k.device)
    return lengths[:, None].expand(cache.k.shape[0], cache.k.shape[1])


def key_scores(cache: AttentionCache, q: torch.Tensor, kernel: int) -> torch.Tensor:
    """[B, heads, S] SnapKV scores of the held keys (S: the longest row; -inf past a row's end), the
    observation window's own keys scored +inf, the later of them higher (kept first)."""
    held = held_lengths(cache)
    size = int(held.max())
    keys = cache.k[:, :, :size].float()
    w = q.shape[2]
    slot = torch.arange(size, device=keys.device)
    # query i of the window stands at slot held - w + i of its row and sees the slots up to it
    query_slot = held[..., None] - w + torch.arange(w, device=keys.device)  # [B, heads, w]
    visible = slot[None, None, None, :] <= query_slot[..., None]
    logits = (q.float() @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    scores = F.avg_pool1d(probs.sum(2), kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    in_window = slot >= (held[..., None] - w)
    scores = torch.where(in_window, 1e4 + slot.float(), scores)
    return scores.masked_fill(slot >= held[..., None], float("-inf"))


def compact(cache: AttentionCache, q: torch.Tensor, fraction: float, press: Press, seen: torch.Tensor) -> None:
    """Keep `ceil(fraction x seen)` entries per head (AdaKV: per layer) and move them to the front."""
    held = held_lengths(cache)
    scores = key_scores(cache, q, press.kernel)
    b, heads, size = scores.shape
    keep = torch.clamp(torch.ceil(fraction * seen.double()).long()[:, None].expand(b, heads), min=1)
    keep = torch.minimum(keep, held)
    rank = scores.argsort(dim=-1, descending=True).argsort(dim=-1)  # 0 = best of its row
    if press.method == "adakv":
        # each head's best `floor` entries first, then the best of all heads for the rest of the layer's budget
        floor = torch.minimum((ADA_FLOOR * keep).long(), held)
        boosted = torch.where(rank < floor[..., None], scores + 1e8, scores)
        flat = boosted.reshape(b, heads * size)
        flat_rank = flat.argsort(dim=-1, descending=True).argsort(dim=-1).view(b, heads, size)
        selected = (flat_rank < keep.sum(1)[:, None, None]) & (scores > float("-inf"))
    else:
        selected = rank < keep[..., None]
    slot = torch.arange(size, device=scores.device)
    order = torch.where(selected, slot, size + slot).argsort(dim=-1)  # kept slots first, in their order
    for buffer in (cache.k, cache.v):
        index = order[..., None].expand(-1, -1, -1, buffer.shape[3])
        buffer[:, :, :size] = buffer[:, :, :size].gather(2, index)
    counts = selected.sum(-1)
    if cache.kv_len is None:
        cache.kv_len = counts
    else:
        cache.kv_len.copy_(counts)


class EvictingLM:
    """A CausalLM whose full-sequence forward reads the tokens through its cache `chunk` at a time,
    pressing the cache after each chunk: what the model predicts when its KV was evicted to the
    budget all along. It stands in for the model in natsl's evaluations (eval-ppl's and
    eval-recall's functions call `model(ids)`, swap `lm_head` and ask for `natsl_layers()`).
    `room`: tokens the cache (kept as `last_cache`) holds beyond the input, to decode after it."""

    def __init__(self, model, press: Press, chunk: int = 64, room: int = 0):
        if chunk < 1:
            raise NatslError(f"the eviction chunk must be at least 1 token, got {chunk}")
        self.model, self.press, self.chunk, self.room = model, press, chunk, room
        self.config = model.config

    @property
    def lm_head(self):
        return self.model.lm_head

    @lm_head.setter
    def lm_head(self, head):
        self.model.lm_head = head

    def natsl_layers(self):
        return self.model.natsl_layers()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        cache = self.model.new_cache(batch, max_len=length + self.room)
        observe(self.model, self.press)
        try:
            outputs = []
            for start in range(0, length, self.chunk):
                outputs.append(self.model.forward_cached(input_ids[:, start:start + self.chunk], cache))
                evict(self.model, cache, self.press)
        finally:
            observe(self.model, None)
        self.last_cache = cache
        return torch.cat(outputs, dim=1)


def kept_entries(cache) -> int:
    """K/V entries the attention caches hold (summed over layers, heads and sequences)."""
    return sum(int(held_lengths(c).sum()) if not c.window else int(c.positions.lengths.clamp(max=c.window).sum()) * c.k.shape[1]
               for c in cache.layers if isinstance(c, AttentionCache))


def budget_entries(seen: int, heads: int, layers: int, press: Press) -> int:
    """Entries a press at `press.budget` leaves after reading `seen` tokens (one sequence)."""
    return sum(min(seen, max(1, math.ceil(f * seen))) * heads for f in layer_budgets(press, layers))
