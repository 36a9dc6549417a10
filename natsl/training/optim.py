"""AdamW with the paper's parameter groups, and the token-based learning-rate schedule.

No weight decay on parameters marked `_no_weight_decay` (norm weights, `A_log`, `dt_bias`) nor on
biases; everything else (linear maps, embeddings, conv filters) decays by `optim.weight_decay`.
"""

from __future__ import annotations

import math
import torch

from natsl import switches
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
                    plain_names: set[str] | None = None, sharded: bool = False,
                    fused: bool | None = None) -> torch.optim.AdamW:
    # The fused kernel for plain CUDA parameters by default; FSDP's sharded ones take the foreach path.
    fused = device.type == "cuda" and not sharded if fused is None else fused
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay, plain_names), lr=cfg.min_lr,
                             betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)


def fold_clip_requested(device: torch.device) -> bool:
    """Clip and check the gradients inside the fused AdamW step (fused_step_with_clip)? The switch
    fold_clip (NATSL_FOLD_CLIP=1 or 0) decides; unset, on CUDA devices (the fused kernel's home), where it saves the separate
    clipping and finite-check passes over every gradient."""
    setting = switches.current().fold_clip
    return setting if setting is not None else torch.device(device).type == "cuda"


def total_grad_norm(parameters) -> torch.Tensor:
    """The 2-norm over all gradients (what clip_grad_norm_ returns), without clipping them."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)


def fused_step_with_clip(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, max_norm: float,
                         loss: torch.Tensor) -> None:
    """A fused AdamW step that clips the gradients to a total norm of `max_norm` (<= 0: no clipping)
    and is skipped when the loss or the norm is not finite, decided on the device: the kernel divides
    the gradients by its `grad_scale`, here max(1, norm / max_norm) (clip_grad_norm_ multiplies them
    by the inverse), and skips the step (its step count too) when `found_inf` is 1 -- the attributes
    torch's GradScaler sets on fused optimizers. Saves clip_grad_norm_'s read and write of every
    gradient, and the host's wait for the loss between backward and step."""
    if not optimizer.defaults.get("fused"):
        raise ValueError("fused_step_with_clip needs an optimizer built with fused=True")
    finite = torch.isfinite(grad_norm) & torch.isfinite(loss)
    optimizer.found_inf = (~finite).to(torch.float32)
    optimizer.grad_scale = (torch.clamp((grad_norm.float() + 1e-6) / max_norm, min=1.0) if max_norm > 0
                            else None)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale


def clip_and_step(optimizer: torch.optim.Optimizer, parameters, max_norm: float, loss: torch.Tensor, fold: bool,
                  full_tensor=lambda t: t) -> torch.Tensor:
    """After the backward: clip the gradients to a total norm of `max_norm` (<= 0: no clipping) and take
    the optimizer step unless the loss or the norm is not finite; returns the norm before clipping.
    `fold`: inside the fused step (fused_step_with_clip), nothing waits for the GPU; else
    clip_grad_norm_'s norm, a host check (`full_tensor` gathers an FSDP-sharded norm) and its clip.
    Either way a skipped step leaves the gradients untouched."""
    parameters = list(parameters)
    if fold:
        grad_norm = total_grad_norm(parameters)
        fused_step_with_clip(optimizer, grad_norm, max_norm, loss)
        return grad_norm
    # clip_grad_norm_'s two halves, so that a non-finite norm leaves the gradients as the backward made
    # them (clipping would multiply every one by NaN) for the trainer to name the non-finite ones.
    norm = total_grad_norm(parameters)
    grad_norm = full_tensor(norm)
    if math.isfinite(loss.item()) and math.isfinite(grad_norm.item()):
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        optimizer.step()
    return grad_norm


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
