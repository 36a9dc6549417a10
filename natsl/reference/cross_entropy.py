"""The chunked LM loss's softmax work on one chunk of logits, in PyTorch ops: the reference twin of
`natsl.fast.cross_entropy.softmax_cross_entropy_` (same signature), and the eager path of
`natsl.training.loss` (the CPU, fp64, and NATSL_FUSED_LOSS=0)."""

from __future__ import annotations

from typing import Optional

import torch


def softmax_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor,
                           row_scale: Optional[torch.Tensor] = None, *, block_v: Optional[int] = None) -> torch.Tensor:
    """Per-row cross-entropy of `logits` [rows, vocab] against `targets` [rows], in fp32 (fp64 for fp64
    logits); a target outside [0, vocab) gives its row a NaN loss. With `row_scale` [rows] the logits
    are overwritten with the loss's gradient, (softmax - onehot) * row_scale, in their own dtype;
    without it they are left as they are. `block_v`: the fast kernel's tile width, ignored here.

    The work runs in place on one [rows, vocab] buffer in fp32 (the logits themselves when they are
    fp32 already and are to be overwritten)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    work = logits.to(acc)
    if work is logits and row_scale is None:
        work = logits.clone()
    vocab = logits.shape[1]
    inside = (targets >= 0) & (targets < vocab)
    index = torch.where(inside, targets, 0)[:, None]
    picked = torch.where(inside, work.gather(1, index).squeeze(1), float("nan"))
    # log-sum-exp in place (no second [rows, vocab] buffer): work -> exp(work - max)
    top = work.amax(dim=-1, keepdim=True)
    exp = work.sub_(top).exp_()
    sums = exp.sum(dim=-1, keepdim=True)
    loss = (top + sums.log()).squeeze(1) - picked
    if row_scale is not None:
        grad = exp.div_(sums)  # the softmax
        grad.scatter_add_(1, index, -torch.ones_like(grad[:, :1]))
        grad.mul_(row_scale.to(acc)[:, None])
        if grad is not logits:
            logits.copy_(grad)
    return loss
