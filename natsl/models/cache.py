"""The caches of incremental inference (docs/spec.md section 4): one object per layer, one per model.

Every tensor is allocated once, at `CausalLM.new_cache(batch_size, max_len)`, and updated in place,
so a decode step never reallocates, a CUDA graph can replay over the same addresses, and a slot view
(`cache.slot(i)`, the tensors of sequence i) writes straight into the batch.

Per layer type:
- GDN: the three conv tails and the recurrent state `S` (fp32; float64 for a float64 model).
- Mamba2: a GDNCache too, with one conv tail (of the joined x|B|C channels) and the SSD state
  `[B, heads, N, P]`.
- softmax attention: K and V `[B, heads, max_len, D]` (RoPE already applied at absolute positions);
  with a sliding window W, `[B, heads, min(W, max_len), D]`, a ring buffer (position p in slot
  p mod W); after a KV-eviction press (natsl.inference.evict), `kv_len [B, heads]`: head h of
  sequence b holds its first kv_len[b, h] slots, and new tokens are appended after them.
- NAtS-L: conv tails; `state_start` (the committed GDN or Mamba2 state S_start of the current block);
  `state_run` (the state after the current block's tokens so far); `decay_sum` (the block's sum of
  g, for Gamma); `x_sum` (the block's running sum of x, for the router); and the softmax memory
  `k_mem`, `v_mem` `[B, heads, max_len, D]` with `kept_len [B, groups]`: per routing group, slots
  `0 .. kept_len-1` hold the kept blocks, compacted in order, and the current block's tokens follow
  at `kept_len + (position % block_size)`. When a block completes and is dropped, `kept_len` does
  not move and the next block overwrites it; when it is kept, `kept_len` grows by one block.
  With `model.router_keep_budget`, also `keep_gaps [B, groups, ceil(max_len / block_size)]` (fp32):
  the router's keep gap of every completed block, by block index, which the budget's rank reads;
  the budget's kept count is `kept_len // block_size`. Allocated once for the cache's max length, so
  a CUDA graph replays over it; without the budget it is None.

Positions are per sequence (`Positions.pos` on the device, `Positions.lengths` mirrored on the host),
so sequences of different lengths decode side by side with their own block boundaries; there is no
padding anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from natsl.errors import NatslError


def ssd_state(batch: int, config, device=None, dtype=torch.float32) -> torch.Tensor:
    """An empty Mamba2 layer state [B, H, N, P]."""
    heads = config.mamba2_expand * config.hidden_size // config.mamba2_head_dim
    return torch.zeros(batch, heads, config.mamba2_state_size, config.mamba2_head_dim, dtype=dtype, device=device)


def read_length(needed: int, capacity: int) -> int:
    """How many key slots a decode step reads when `needed` may be valid.

    Rounded up to a multiple of 1/16..1/8 of its power of two (at least 64), so that one captured
    CUDA graph serves many steps while reading at most ~12% more than needed; never above capacity.
    """
    quantum = max(64, 1 << max(0, needed.bit_length() - 4))
    return min(capacity, -(-needed // quantum) * quantum)


@dataclass
class Positions:
    """Where each sequence of a cache stands; shared by the layer caches of one model cache."""

    pos: torch.Tensor  # [B] int64 on the model's device: tokens consumed so far, per sequence
    lengths: torch.Tensor  # [B] int64 on the CPU: the same numbers, readable without a device sync
    capacity: int  # tokens each sequence can hold
    block_size: int
    shared: dict  # {"version": int}, bumped whenever a NAtS-L kept length may have changed
    start: int | None = None  # during a prefill call: the position of its first token (all equal)
    attn_read: int = 0  # key slots a softmax-attention decode step reads (see `read_length`)
    natsl_read: int = 0  # key slots a NAtS-L decode step reads
    # A padded prefill call (CausalLM.prefill_padded, the CUDA-graphed prefill of natsl.inference.prefill_graph):
    # its first `valid` tokens ([1] int64 on the device) are the prompt, the rest pads that must leave no
    # trace in the cache; `partial_last`: the call's last block holds pads, so it stays unfinished.
    valid: torch.Tensor | None = None
    partial_last: bool = False

    def narrow(self, index: int) -> "Positions":
        return dataclasses.replace(self, pos=self.pos[index:index + 1], lengths=self.lengths[index:index + 1])


def real_tokens(positions: Positions, length: int, device) -> torch.Tensor | None:
    """[1, length, 1] bool: which tokens of a padded prefill call are the prompt's (None: all of them)."""
    if positions.valid is None:
        return None
    return (torch.arange(length, device=device) < positions.valid)[None, :, None]


def drop_pad_gates(g: torch.Tensor, beta: torch.Tensor, positions: Positions):
    """The GDN gates of a padded prefill call with g = 0 and beta = 0 at the pads: such a token leaves
    the state as it was (S exp(0) (I - 0 k k^T) + 0 v k^T = S), so the state after the call is the
    state after the prompt."""
    real = real_tokens(positions, g.shape[1], g.device)
    if real is None:
        return g, beta
    return g.masked_fill(~real, 0), beta.masked_fill(~real, 0)


@dataclass
class LayerCache:
    """Fields common to the layer caches: tensors whose first dim is the batch."""

    positions: Positions

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value
            elif isinstance(value, list):
                out.update({f"{f.name}.{i}": t for i, t in enumerate(value)})
        return out

    def narrow(self, index: int, positions: Positions) -> "LayerCache":
        changes = {"positions": positions}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = value[index:index + 1]
            elif isinstance(value, list):
                changes[f.name] = [t[index:index + 1] for t in value]
        return dataclasses.replace(self, **changes)

    def store_conv(self, tails) -> None:
        for dst, src in zip(self.conv, tails):
            dst.copy_(src)

    def reset(self) -> None:
        """Zero the running values (the KV buffers are masked by length, so they are left alone)."""
        for name, t in self.tensors().items():
            if name not in ("k", "v", "k_mem", "v_mem"):
                t.zero_()

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass
class GDNCache(LayerCache):
    conv: list[torch.Tensor] = field(default_factory=list)  # q, k, v tails [B, conv_size-1, channels] (Mamba2: x|B|C)
    state: torch.Tensor | None = None  # [B, H, K, V] (Mamba2: [B, heads, N, P])

    def live_bytes(self) -> int:
        return self.allocated_bytes()

    def kv_bytes(self) -> int:
        return 0


@dataclass
class AttentionCache(LayerCache):
    k: torch.Tensor | None = None  # [B, heads, capacity (or window), head_dim]
    v: torch.Tensor | None = None
    window: int = 0  # > 0: a ring buffer of the last `window` tokens
    kv_len: torch.Tensor | None = None  # [B, heads] int64 once evicted: entries each head holds

    def reset(self) -> None:
        super().reset()
        self.kv_len = None  # empty again: the next prefill writes at absolute positions

    def live_bytes(self) -> int:
        return self.kv_bytes()

    def kv_bytes(self) -> int:
        """Bytes of the K/V entries held: every token so far, the last `window`, or `kv_len` per head."""
        per_entry = self.k.shape[3] * self.k.element_size() + self.v.shape[3] * self.v.element_size()
        if self.kv_len is not None:
            return int(self.kv_len.sum()) * per_entry
        return int(self.positions.lengths.clamp(max=self.k.shape[2]).sum()) * self.k.shape[1] * per_entry


@dataclass
class NAtSLCache(LayerCache):
    conv: list[torch.Tensor] = field(default_factory=list)
    state_start: torch.Tensor | None = None  # [B, H, K, V]: S_start of the current block
    state_run: torch.Tensor | None = None  # [B, H, K, V]: after the current block's tokens so far
    decay_sum: torch.Tensor | None = None  # [B, H]: sum of g over the current block so far
    x_sum: torch.Tensor | None = None  # [B, d]: sum of x over the current block so far
    k_mem: torch.Tensor | None = None  # [B, heads, capacity, K/R]: kept blocks, then the current block
    v_mem: torch.Tensor | None = None  # [B, heads, capacity, V/R]
    kept_len: torch.Tensor | None = None  # [B, groups] int64: tokens of kept blocks per routing group
    keep_gaps: torch.Tensor | None = None  # [B, groups, max blocks] fp32 (router_keep_budget only): gaps by block

    def live_bytes(self) -> int:
        """Bytes this layer holds for its sequences: states, sums, tails, kept blocks and the current block."""
        fixed = self.allocated_bytes() - self.k_mem.numel() * self.k_mem.element_size() \
            - self.v_mem.numel() * self.v_mem.element_size()
        return fixed + self.kv_bytes()

    def kv_bytes(self) -> int:
        """Bytes of the softmax memory held: the kept blocks and the current block's tokens."""
        heads_per_group = self.k_mem.shape[1] // self.kept_len.shape[1]
        per_token = heads_per_group * (self.k_mem.shape[3] * self.k_mem.element_size()
                                       + self.v_mem.shape[3] * self.v_mem.element_size())
        in_block = (self.positions.lengths % self.positions.block_size).sum() * self.kept_len.shape[1]
        return (int(self.kept_len.sum()) + int(in_block)) * per_token


class ModelCache:
    """The caches of every layer of a `CausalLM`, in layer order, with their shared `Positions`."""

    def __init__(self, layers: list[LayerCache], positions: Positions):
        self.layers = layers
        self.positions = positions
        self._kept_version = -1
        self._max_kept = 0

    @property
    def batch_size(self) -> int:
        return self.positions.pos.shape[0]

    @property
    def capacity(self) -> int:
        return self.positions.capacity

    def natsl_caches(self) -> list[NAtSLCache]:
        return [c for c in self.layers if isinstance(c, NAtSLCache)]

    def slot(self, index: int) -> "ModelCache":
        """A view of sequence `index`: prefilling through it fills that row of this cache."""
        if not 0 <= index < self.batch_size:
            raise IndexError(f"slot {index} of a cache for {self.batch_size} sequences")
        positions = self.positions.narrow(index)
        return ModelCache([c.narrow(index, positions) for c in self.layers], positions)

    def reset(self) -> None:
        """Empty every sequence (in place: the tensors keep their addresses)."""
        self.positions.pos.zero_()
        self.positions.lengths.zero_()
        for c in self.layers:
            c.reset()
        self.positions.shared["version"] += 1

    def check_room(self, tokens: int) -> None:
        longest = int(self.positions.lengths.max())
        if longest + tokens > self.capacity:
            raise NatslError(f"the cache holds {self.capacity} tokens per sequence and has {longest}; "
                             f"{tokens} more do not fit: make it with a larger max_len")

    def uniform(self) -> bool:
        lengths = self.positions.lengths
        return bool((lengths == lengths[0]).all())

    def advance(self, tokens: int) -> None:
        """Host-side bookkeeping after a call consumed `tokens` per sequence (the device `pos` moves in the model)."""
        lengths = self.positions.lengths
        lengths += tokens
        if tokens > 1 or bool((lengths % self.positions.block_size == 0).any()):
            self.positions.shared["version"] += 1  # a block may have completed: kept lengths may have moved

    def max_kept(self) -> int:
        """The largest kept length of any NAtS-L layer and sequence (synchronises only when it may have moved)."""
        version = self.positions.shared["version"]
        if version != self._kept_version:
            natsl = self.natsl_caches()
            self._max_kept = int(torch.stack([c.kept_len.max() for c in natsl]).max()) if natsl else 0
            self._kept_version = version
        return self._max_kept

    def prepare_decode(self) -> tuple[int, int]:
        """Set how many key slots the next decode step reads; returns (attention, NAtS-L) read lengths."""
        p = self.positions
        has_attention = any(isinstance(c, AttentionCache) for c in self.layers)
        p.attn_read = read_length(int(p.lengths.max()) + 1, p.capacity) if has_attention else 0
        p.natsl_read = read_length(self.max_kept() + p.block_size, p.capacity) if self.natsl_caches() else 0
        return p.attn_read, p.natsl_read

    def allocated_bytes(self) -> int:
        return sum(c.allocated_bytes() for c in self.layers)

    def live_bytes(self) -> int:
        """Bytes of content held for the tokens so far (KV of valid tokens, kept blocks, states, tails)."""
        return sum(c.live_bytes() for c in self.layers)

    def kv_bytes(self) -> int:
        """Bytes of softmax K/V held (attention entries, NAtS-L softmax memory); no states or tails."""
        return sum(c.kv_bytes() for c in self.layers)

    def kept_fraction(self) -> float | None:
        """Fraction of completed blocks kept in softmax memory, over NAtS-L layers, groups and sequences."""
        natsl = self.natsl_caches()
        blocks = (self.positions.lengths // self.positions.block_size).sum()
        if not natsl or int(blocks) == 0:
            return None
        kept = sum(int(c.kept_len.sum()) for c in natsl)
        total = int(blocks) * self.positions.block_size * sum(c.kept_len.shape[1] for c in natsl)
        return kept / total


@dataclass
class CacheSpace:
    """Where a model cache's layers allocate (natsl.models.registry's LayerKind.new_cache): the shared
    positions, `batch` sequences of up to `capacity` tokens, the device, the activation dtype of K/V and
    conv tails and the recurrent states' dtype (fp32; float64 for a float64 model)."""

    positions: Positions
    batch: int
    capacity: int
    device: torch.device
    dtype: torch.dtype
    state_dtype: torch.dtype

    def zeros(self, *shape: int, dt: torch.dtype | None = None) -> torch.Tensor:
        """A zero tensor of `shape` on the cache's device, in `dt` (default: the activation dtype)."""
        return torch.zeros(*shape, dtype=self.dtype if dt is None else dt, device=self.device)

    def conv_tails(self, config) -> list[torch.Tensor]:
        """The q, k and v conv tails of a GDN head set [B, conv_size - 1, channels]."""
        h, k, v, w = config.num_heads, config.head_k_dim, config.head_v_dim, config.conv_size - 1
        return [self.zeros(self.batch, w, h * k), self.zeros(self.batch, w, h * k), self.zeros(self.batch, w, h * v)]


def new_model_cache(model, batch_size: int, max_len: int | None = None, device=None, dtype=None) -> ModelCache:
    """An empty cache for `model` (a CausalLM): `batch_size` sequences of up to `max_len` tokens.

    `max_len` defaults to the config's `max_seq_len`; `device` and `dtype` default to the model's.
    Recurrent states are fp32 (float64 for a float64 model), as the ops keep them. Each layer's cache
    is its registry entry's (natsl.models.registry: LayerKind.new_cache).
    """
    config = model.config
    if batch_size < 1:
        raise NatslError(f"a cache needs at least one sequence, got batch_size {batch_size}")
    max_len = config.max_seq_len if max_len is None else max_len
    if max_len < 1:
        raise NatslError(f"max_len must be at least 1, got {max_len}")
    weight = model.embed.weight
    device = weight.device if device is None else torch.device(device)
    dtype = weight.dtype if dtype is None else dtype
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    positions = Positions(pos=torch.zeros(batch_size, dtype=torch.long, device=device),
                          lengths=torch.zeros(batch_size, dtype=torch.long), capacity=max_len,
                          block_size=config.block_size, shared={"version": 0})
    space = CacheSpace(positions, batch_size, max_len, device, dtype, state_dtype)
    layers: list[LayerCache] = [block.kind.new_cache(config, space) for block in model.layers]
    return ModelCache(layers, positions)
