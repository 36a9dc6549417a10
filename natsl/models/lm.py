"""The causal language model: embeddings, pre-RMSNorm blocks (mixer + SwiGLU, or the mixer alone where
intermediate_size is 0 and in Mamba2 blocks unless mamba2_mlp, as Mamba2's stack), final norm, head."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from natsl.config import ModelConfig
from natsl import ops
from natsl.ops import compiled
from natsl.ops import kernel_set
from natsl.models.conv import ShortConv
from natsl.models.linear import Linear
from natsl.models.mlp import SwiGLU
from natsl.models.natsl_layer import NAtSL
from natsl.models.norms import RMSNorm
from natsl.models.registry import kind_of, present
from natsl.models.rope import RopeTable


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, device=None):
        super().__init__()
        self.layer_type = layer_type
        self.kind = kind_of(config, layer_type)  # natsl.models.registry: what builds, caches and costs it
        # The pre-norms feed only Linears: under autocast they hand them bf16 once (norms.autocast_dtype).
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps, device=device, autocast_output=True)
        self.mixer = self.kind.build(config, device=device)
        self.mlp_norm = self.mlp = None
        if has_mlp(config, layer_type):
            self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps, device=device, autocast_output=True)
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, device=device)

    def forward(self, x: torch.Tensor, cache=None, rope: RopeTable | None = None) -> torch.Tensor:
        """`rope`: the forward's shared RoPE table (full sequences; the cached paths use positions)."""
        if cache is not None:
            x, pending = self.forward_cached(x, None, cache)
            return x + pending
        x = x + self.mixer(self.mixer_norm(x), cache=cache, rope=rope)
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))

    def kernels(self, device: torch.device) -> kernel_set.Reference:
        """The kernel set of this block's cached calls (natsl.ops.kernel_set, by its mixer's backend)."""
        return kernel_set.pick(getattr(self.mixer, "backend", None), device)

    def forward_cached(self, x: torch.Tensor, pending, cache):
        """The cached paths, with residual adds deferred into the next norm: (x, pending) stands for
        the residual stream x + pending (pending None: x). Returns the same kind of pair. On the fused
        kernel set every RMSNorm is one kernel and each add runs in the next norm's kernel; on the
        reference set the add and the norm module are the full forward's."""
        kernels = self.kernels(x.device)
        # a mixer with `after_norm` (attention, Mamba2) may form the add and norm inside its first product
        if hasattr(self.mixer, "after_norm"):
            x, mixed = self.mixer.after_norm(x, pending, self.mixer_norm, cache, kernels)
        else:
            x, normed = kernels.add_norm(x, pending, self.mixer_norm)
            mixed = self.mixer(normed, cache=cache)
        if self.mlp is None:
            return x, mixed
        return self.mlp.after_norm(x, mixed, self.mlp_norm, kernels)


def has_mlp(config: ModelConfig, layer_type: str) -> bool:
    """Whether a block of `layer_type` carries the SwiGLU: every block where intermediate_size > 0, but a
    Mamba2 block only with mamba2_mlp (Mamba2's stack and the authors' NAtS-L Mamba2 model have none);
    its registry entry says (natsl.models.registry: LayerKind.has_mlp)."""
    return kind_of(config, layer_type).has_mlp(config)


def last_token(x: torch.Tensor, cache) -> torch.Tensor:
    """x [B, T, ...] -> [B, 1, ...]: the call's last token, or in a padded call the prompt's last."""
    valid = cache.positions.valid
    return x[:, -1:] if valid is None else x.index_select(1, valid - 1)


def rope_table_for(c: ModelConfig, length: int, device) -> RopeTable | None:
    """The RoPE angles that every rotating layer of a model of config `c` shares in one full-sequence
    forward, for each rotating head dim (None: no layer rotates). See RopeTable: a compiled model gains
    only from a table made outside it."""
    dims = [dim for kind in present(c) for dim in kind.rope_dims(c)]
    return RopeTable(length, c.rope_theta, device, dims) if dims else None


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.layers = nn.ModuleList(Block(config, t, device=device) for t in config.layer_types())
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, device=device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.activation_checkpointing = False
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) for every linear map, short conv and the embeddings; layers reset their
        own extras."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, ShortConv):
                module.reset_parameters(std)
            elif module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def set_backend(self, backend: str | None) -> None:
        """Run every NAtS-L / GDN op on `backend` ("reference", "fast" or None for auto)."""
        ops.preload(backend)
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = backend

    def natsl_layers(self) -> dict[int, NAtSL]:
        return {i: blk.mixer for i, blk in enumerate(self.layers) if isinstance(blk.mixer, NAtSL)}

    def forward(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab].

        With `cache` (from `new_cache`), the tokens follow those already in it and the cache
        advances in place: many tokens are a prefill, one token per sequence a decode step.
        """
        if cache is not None:
            return self.forward_cached(input_ids, cache)
        return self.lm_head(self.hidden_states(input_ids))

    def hidden_states(self, input_ids: torch.Tensor, rope: RopeTable | None = None) -> torch.Tensor:
        """input_ids [B, T] -> the final-normed hidden states [B, T, d]: `forward` without the head.

        `lm_head(hidden_states(ids))` is `forward(ids)`; training feeds these states and
        `lm_head.weight` to `natsl.training.loss.linear_cross_entropy`, which never holds the full logits.
        `rope`: RoPE's angles for this length (`rope_table(T, device)`), made by the
        caller outside a compiled model; None makes them here.
        """
        x = self.embed(input_ids)
        if rope is None:
            rope = self.rope_table(input_ids.shape[1], x.device)
        for block in self.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, rope=rope, use_reentrant=False)
            else:
                x = block(x, rope=rope)
        return self.norm(x)

    def rope_table(self, length: int, device) -> RopeTable | None:
        """The RoPE angles every rotating layer of one full-sequence forward shares (rope_table_for)."""
        return rope_table_for(self.config, length, device)

    # -- incremental inference (docs/spec.md section 4; natsl/inference, docs/inference.md) -------

    def new_cache(self, batch_size: int, max_len: int | None = None, *, device=None, dtype=None):
        """An empty `ModelCache` for `batch_size` sequences of up to `max_len` tokens (default: the
        config's max_seq_len); all of it is allocated now, so decoding never reallocates."""
        from natsl.models.cache import new_model_cache

        return new_model_cache(self, batch_size, max_len, device=device, dtype=dtype)

    def forward_cached(self, input_ids: torch.Tensor, cache, *, last_only: bool = False) -> torch.Tensor:
        """`forward(input_ids, cache)`; `last_only` returns the logits of the last token only [B, 1, vocab].

        All sequences must stand at the same position for a many-token call (a chunk-mode prefill);
        where they do not, the tokens are fed one at a time (each sequence then keeps its own
        position). To prefill prompts of different lengths, prefill each into `cache.slot(i)`.
        """
        batch, length = input_ids.shape
        if batch != cache.batch_size:
            raise ValueError(f"input_ids has {batch} sequences, the cache {cache.batch_size}")
        if length == 0:
            raise ValueError("input_ids has no tokens")
        cache.check_room(length)
        if length == 1:
            cache.prepare_decode()
            logits = self.decode_step(input_ids, cache)
            cache.advance(1)
            return logits
        if not cache.uniform():
            steps = [self.forward_cached(input_ids[:, i:i + 1], cache) for i in range(length)]
            return steps[-1] if last_only else torch.cat(steps, dim=1)
        positions = cache.positions
        positions.start = int(positions.lengths[0])
        try:
            logits = self._cached_layers(input_ids, cache, last_only)
        finally:
            positions.start = None
        positions.pos.add_(length)
        cache.advance(length)
        return logits

    def prefill_padded(self, input_ids: torch.Tensor, cache, valid: torch.Tensor, partial_last: bool) -> torch.Tensor:
        """Prefill an emptied `cache` with input_ids [B, n]: its first `valid` tokens ([1] int64 on the
        device) are the prompt, the rest pads; logits of the last prompt token [B, 1, vocab].

        Device work only, with every shape fixed by n, so one CUDA graph serves every prompt length
        up to n (natsl.inference.prefill_graph). The cache ends as a prefill of the prompt alone
        leaves it, except that its positions stay at 0 (the caller moves them) and that K/V slots
        past the prompt's may hold the pads' (every read masks them; they are overwritten before
        they are read). Pads leave no trace in the states: their GDN gates are zero, the conv tails
        end at the prompt, the NAtS-L router's running sum skips them, and with `partial_last` (the
        prompt ends inside the call's last routing block) that block stays unfinished, as the
        prompt's. With NAtS-L layers every pad must sit in the routing block of the prompt's last
        token ((valid - 1) // block_size == (n - 1) // block_size).
        """
        cache.reset()
        positions = cache.positions
        positions.start, positions.valid, positions.partial_last = 0, valid, partial_last
        try:
            return self._cached_layers(input_ids, cache, last_only=True)
        finally:
            positions.start, positions.valid, positions.partial_last = None, None, False

    def decode_step(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        """One token per sequence [B, 1] -> logits [B, 1, vocab], each sequence at its own position.

        Device work only (it never reads a device value on the host), so it can be captured in a
        CUDA graph: it advances `cache.positions.pos` but not the host-side lengths, and it reads
        as many key slots as `cache.prepare_decode()` set. Callers use `forward` or `DecodeRunner`.
        """
        with compiled.decode_step_scope():  # its pointwise pieces compile: natsl.ops.compiled.compile_for
            logits = self._cached_layers(input_ids, cache)
        cache.positions.pos.add_(1)
        return logits

    def _cached_layers(self, input_ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """Embedding, every layer on its cache, final norm and head. Each residual add goes into the
        next norm (Block.forward_cached: one kernel on the fused kernel set); the final norm takes the
        last, on the last block's kernel set (every block has the model's backend: set_backend)."""
        x = self.embed(input_ids)
        pending = None
        for block, layer_cache in zip(self.layers, cache.layers):
            x, pending = block.forward_cached(x, pending, layer_cache)
        if last_only:
            x, pending = last_token(x, cache), (None if pending is None else last_token(pending, cache))
        return self.lm_head(self.layers[-1].kernels(x.device).add_norm(x, pending, self.norm)[1])

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
