"""AdamW with the paper's parameter groups, and the token-based learning-rate schedule.

No weight decay on parameters marked `_no_weight_decay` (norm weights, `A_log`, `dt_bias`) nor on
biases; everything else (linear maps, embeddings, conv filters) decays by `optim.weight_decay`.
"""

from __future__ import annotations

import math

import torch

from natsl.config import OptimConfig


def no_decay(name: str, param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, "_no_weight_decay", False)) or name.endswith(".bias") or name == "bias"


def no_decay_names(model: torch.nn.Module) -> set[str]:
    """Names of the parameters without weight decay (read before FSDP, whose sharded parameters are
    new objects without the `_no_weight_decay` mark)."""
    return {name for name, param in model.named_parameters() if no_decay(name, param)}


def param_groups(model: torch.nn.Module, weight_decay: float, plain_names: set[str] | None = None) -> list[dict]:
    plain_names = no_decay_names(model) if plain_names is None else plain_names
    decay, plain = [], []
    seen = set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (plain if name in plain_names else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": plain, "weight_decay": 0.0, "name": "no_decay"}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device: torch.device,
                    plain_names: set[str] | None = None, sharded: bool = False) -> torch.optim.AdamW:
    # The fused CUDA kernel for plain parameters; FSDP's sharded ones take the default (foreach) path.
    fused = device.type == "cuda" and not sharded
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay, plain_names), lr=cfg.min_lr,
                             betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)


def lr_at(tokens: int, cfg: OptimConfig, total_tokens: int) -> float:
    """Linear warmup from min_lr to lr over warmup_tokens, then cosine down to min_lr at total_tokens."""
    if tokens < cfg.warmup_tokens:
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * tokens / cfg.warmup_tokens
    span = max(total_tokens - cfg.warmup_tokens, 1)
    progress = min(max((tokens - cfg.warmup_tokens) / span, 0.0), 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
