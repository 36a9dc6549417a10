"""The LM loss without the full logits: cross-entropy of `hidden @ weight.T` computed by chunks of rows.

`linear_cross_entropy(hidden, weight, targets)` equals
`F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), targets.flatten())` (the head's
matmul in `compute_dtype`, as under bf16 autocast; log-sum-exp and softmax in fp32, or fp64 for
fp64 inputs), but it never holds the [N, vocab] logits nor their gradient: the forward pass takes
`chunk_size` rows at a time, and, when a gradient is wanted, turns each chunk's logits into its
gradient at once (softmax minus one-hot, scaled) and folds it into the gradients of `hidden` and
`weight`, which are kept for the backward pass (which only scales them by the incoming gradient).
Per chunk it holds the [chunk, vocab] logits in `compute_dtype` and, on the eager path, one fp32
[chunk, vocab] buffer (log-sum-exp and softmax in place); beyond that only grad(hidden) [N, d] and grad(weight) [vocab, d] (fp32).
No logits are recomputed, so the head costs the same FLOPs as the plain formula.

On CUDA the softmax work of each chunk (log-sum-exp, softmax minus one-hot, scaling, the cast back)
runs as one Triton kernel in place on the chunk's logits (natsl.fast.cross_entropy: two reads and one
write of the chunk instead of about ten passes over an fp32 copy); `fused=False` or NATSL_FUSED_LOSS=0
keeps the eager ops, `fused=True` asks for the kernel (on a CPU tensor under TRITON_INTERPRET=1, for
tests). The kernel takes bf16, fp16 and fp32 logits; fp64 always runs eagerly.

Not twice differentiable. `chunk_size` 0 (or None) runs the plain formula instead (for checks).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from natsl.ops.cross_entropy import fused_default_why, softmax_cross_entropy_

DEFAULT_CHUNK = 4096


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor, compute_dtype: Optional[torch.dtype]) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_size: Optional[int] = DEFAULT_CHUNK, ignore_index: int = -100,
                         reduction: str = "mean", compute_dtype: Optional[torch.dtype] = None,
                         fused: Optional[bool] = None) -> torch.Tensor:
    """Cross-entropy of the logits `hidden @ weight.T` against `targets`, by chunks of `chunk_size` rows.

    hidden [..., d] (the final-normed hidden states), weight [vocab, d] (the head), targets [...]
    (token ids; `ignore_index` rows count for nothing). `reduction`: "mean" over the counted rows
    (NaN when there are none, as in `F.cross_entropy`) or "sum". `compute_dtype`: the dtype of the
    head's matmul (default: the autocast dtype inside autocast, else that of the inputs); the loss
    is in fp32 (fp64 for fp64 inputs). `fused`: the chunks' softmax work on the Triton kernel (default:
    on CUDA unless NATSL_FUSED_LOSS=0; not for fp64). Returns a scalar.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    d = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {d}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}")
    cdtype = _compute_dtype(hidden, weight, compute_dtype)
    h, t = hidden.reshape(-1, d), targets.reshape(-1)
    if not chunk_size:
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.to(cdtype), weight.to(cdtype))
            return F.cross_entropy(logits.to(_acc_dtype(cdtype)), t, ignore_index=ignore_index, reduction=reduction)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive (or 0 for the plain formula), got {chunk_size}")
    if fused is None:
        fused = fused_default_why(h.device)[0]
    args = (int(chunk_size), int(ignore_index), reduction == "sum", cdtype, bool(fused) and cdtype != torch.float64)
    if not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
        return _chunked(h, weight, t, *args, need_h=False, need_w=False)[0]  # no gradient work (evaluation)
    return _ChunkedLinearCrossEntropy.apply(h, weight, t, *args)


def _acc_dtype(cdtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(cdtype, torch.float32)


def _chunked(h, weight, targets, chunk, ignore_index, summed, cdtype, fused, *, need_h, need_w):
    """(loss, grad of loss w.r.t. h or None, w.r.t. weight or None), `chunk` rows of logits at a time;
    `fused`: each chunk's softmax work on natsl.fast.cross_entropy's kernel (else on its reference twin,
    natsl.reference.cross_entropy)."""
    n = h.shape[0]
    acc = _acc_dtype(cdtype)
    with torch.autocast(h.device.type, enabled=False):
        w = weight.to(cdtype)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        count = valid.sum()
        # d(loss)/d(logits) = (softmax - onehot) * scale on counted rows, 0 on ignored ones
        scale = torch.ones((), dtype=acc, device=h.device) if summed else 1.0 / count.clamp(min=1).to(acc)
        total = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, acc), device=weight.device) \
            if need_w else None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            hc = h[start:end].to(cdtype)
            logits = hc @ w.t()
            grad = _chunk_loss(logits, safe[start:end], valid[start:end], scale, need_h or need_w, total, fused)
            if grad is None:  # the loss only
                continue
            if need_h:
                grad_h[start:end] = grad @ w
            if need_w:
                grad_w += grad.t() @ hc
            del logits, grad
        loss = total if summed else total / count.to(acc)
    return loss, grad_h, grad_w


def _chunk_loss(logits, targets, valid, scale, need_grad, total, fused):
    """One chunk: adds the counted rows' losses to `total`; returns the gradient (the logits,
    overwritten) or None. `fused`: on natsl.fast.cross_entropy's kernel, else its reference twin."""
    row_scale = valid.to(scale.dtype) * scale if need_grad else None
    rows = softmax_cross_entropy_(logits, targets, row_scale, fused=fused)
    total += torch.where(valid, rows, 0).sum()
    return logits if need_grad else None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk, ignore_index, summed, cdtype, fused):
        loss, grad_h, grad_w = _chunked(h, weight, targets, chunk, ignore_index, summed, cdtype, fused,
                                        need_h=ctx.needs_input_grad[0], need_w=ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * grad_loss.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_loss.to(grad_w.dtype)).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None
