"""Model FLOPs per trained token and MFU (model FLOPs utilisation).

Per token, training costs 3x the forward (forward + two backward matmuls):
- dense: 6 x (parameters outside the embedding table) (every linear map, the LM head included);
- softmax attention (causal, average context T/2): 3 x T x heads x (d_k + d_v);
- GDN, per head (chunk-parallel form with chunks of C tokens): the state read, delta and write
  (about 6 K V) plus the intra-chunk products (about 2 C (K + V)), times 3;
- Mamba2 (and the Mamba2 state of a NAtS-L layer), per head: the state read and write (about 4 N P,
  no delta) plus the intra-chunk products (about 2 C (N + P)), times 3;
- NAtS-L: its GDN (or Mamba2-state) part as above, plus the routed softmax branch whose average context is the own
  block (C/2) plus the kept fraction f of the earlier tokens ((T - C)/2 x f): 3 x 2 x context x
  heads x (d_k + d_v). The trainer passes the measured keep fraction.
- NSA: softmax over an average context of the compressed blocks ((T/2) / block size), the selected
  blocks (counts x block size, at most T/2) and the window (at most T/2): 3 x 2 x context x heads x 2 d.
This is an estimate of the work the model needs, not a count of what the kernels execute. Each layer
kind's term is its registry entry's (natsl.models.registry: LayerKind.train_flops).
"""

from __future__ import annotations

import os

from natsl.config import ModelConfig
from natsl.models.registry import kinds_of

# Dense bf16 tensor-core peaks (FLOP/s) by the name CUDA reports; the first match wins.
PEAK_BF16 = (
    ("GH200", 989e12), ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("H20", 148e12),
    ("B200", 2250e12), ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
    ("L40", 181e12), ("L4", 121e12), ("A10", 125e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12),
)


def flops_per_token(config: ModelConfig, seq_len: int, keep_fraction: float = 1.0, n_params: int | None = None) -> float:
    if n_params is None:
        from natsl.models import build_model

        n_params = build_model(config, device="meta").num_parameters()
    dense_params = n_params - config.vocab_size * config.hidden_size * (0 if config.tie_embeddings else 1)
    total = 6.0 * dense_params
    t, c = float(seq_len), float(min(config.block_size, seq_len))
    for kind in kinds_of(config):
        total += kind.train_flops(config, t, c, keep_fraction)
    return total


def peak_flops(device) -> float | None:
    """Peak bf16 FLOP/s of one device (None on the CPU or an unknown GPU); NATSL_PEAK_FLOPS overrides."""
    if os.environ.get("NATSL_PEAK_FLOPS"):
        return float(os.environ["NATSL_PEAK_FLOPS"])
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16:
        if key in name:
            return peak
    return None
