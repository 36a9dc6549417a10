"""What a layer's linear memory costs per token: shared by the training FLOPs estimate
(natsl.training.flops) and the latency benchmark's prefill floor (natsl.inference.bench); each layer
kind's formula is its registry entry's (natsl.models.registry: LayerKind.state_flops)."""

from __future__ import annotations

from natsl.config import ModelConfig
from natsl.models.registry import kind_of


def state_flops_per_token(config: ModelConfig, layer: str, chunk: float | None = None) -> float:
    """Forward FLOPs per token of a layer's linear memory in chunk-parallel form (chunks of block_size):
    a GDN state (about 6 K V per head: read, delta, write) or a Mamba2 state (about 4 N P: read, write),
    plus the intra-chunk products 2 C (K + V); 0 for a layer without one.

    Args:
        config: the model config.
        layer: a layer-type name of `config.layer_types()` (a NAtS-L layer's is its natsl_state's memory).
        chunk: C (default block_size).

    Returns:
        FLOPs per token.
    """
    c = config.block_size if chunk is None else chunk
    return kind_of(config, layer).state_flops(config, c)
