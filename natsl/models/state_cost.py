"""What a layer's linear memory costs per token: shared by the training FLOPs estimate
(natsl.training.flops) and the latency benchmark's prefill floor (natsl.inference.bench)."""

from __future__ import annotations

from natsl.config import ModelConfig


def state_flops_per_token(config: ModelConfig, layer: str, chunk: float | None = None) -> float:
    """Forward FLOPs per token of a layer's linear memory in chunk-parallel form (chunks of block_size):
    a GDN state (about 6 K V per head: read, delta, write) or a Mamba2 state (about 4 N P: read, write),
    plus the intra-chunk products 2 C (K + V). `layer`: "gdn", "mamba2" or "natsl" (its natsl_state);
    `chunk`: C (default block_size)."""
    c = config.block_size if chunk is None else chunk
    if layer == "natsl":
        layer = config.natsl_state
        if layer == "mamba2":  # the NAtS-L layer's heads, on a Mamba2 state
            return config.num_heads * (4.0 * config.head_k_dim * config.head_v_dim
                                       + 2.0 * c * (config.head_k_dim + config.head_v_dim))
    if layer == "mamba2":
        n, p = config.mamba2_state_size, config.mamba2_head_dim
        heads = config.mamba2_expand * config.hidden_size // p
        return heads * (4.0 * n * p + 2.0 * c * (n + p))
    h, k, v = config.num_heads, config.head_k_dim, config.head_v_dim
    return h * (6.0 * k * v + 2.0 * c * (k + v))
