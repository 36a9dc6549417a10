"""The LM loss's softmax work on one chunk of logits as one Triton kernel (the fast twin of
natsl.reference.cross_entropy, which natsl.training.loss runs on the CPU and with NATSL_FUSED_LOSS=0):

    loss[r] = logsumexp(logits[r]) - logits[r, t_r]
    logits[r] <- (softmax(logits[r]) - onehot(t_r)) * row_scale[r]      (in place, in logits' dtype)

Eagerly the chunk's bf16 logits went through about ten full passes over a [rows, vocab] fp32 buffer
(cast, max, subtract, exp, sum, divide, scatter, scale, cast back). Here each row is read twice (an
online max / sum of exponentials, then the gradient) and written once, in its own dtype
(docs/performance.md has the timings). One program per row; the vocabulary is walked in BLOCK_V-wide tiles.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from natsl.errors import NatslError
# x.to(dtype) rounding to nearest even also in Triton's interpreter (whose fp32 -> bf16 cast truncates)
from natsl.fast.block_sparse.forward import cast_to

MAX_BLOCK_V = 4096
NUM_WARPS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _softmax_xent_kernel(logits_ptr, targets_ptr, scale_ptr, loss_ptr, V, stride,
                         WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK_V)
    # pass 1: the running max and the sum of exponentials below it (one scalar pair per row)
    top = float("-inf")
    total = 0.0
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))  # finite: every tile holds at least one column
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    # log-sum-exp = top + log_total, kept apart: at |logits| ~ 1e4 their fp32 sum would lose ~1e-3
    log_total = tl.log(total)
    target = tl.load(targets_ptr + row).to(tl.int64)
    # an id outside [0, V) reads nothing and makes the row's loss NaN (the trainer's non-finite check)
    picked = tl.load(base + target, mask=(target >= 0) & (target < V), other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, (top - picked) + log_total)
    if WRITE_GRAD:
        # pass 2: d(loss_r)/d(logits_r) = softmax - onehot, scaled (0 for a row that does not count)
        scale = tl.load(scale_ptr + row)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
            grad = (tl.exp((x - top) - log_total) - tl.where(offs == target, 1.0, 0.0)) * scale
            tl.store(base + offs, cast_to(grad, logits_ptr.dtype.element_ty), mask=mask)


def supports(logits: torch.Tensor) -> bool:
    """Whether the kernel takes this chunk: a [rows, vocab] matrix of bf16, fp16 or fp32 with unit column stride."""
    return logits.dim() == 2 and logits.dtype in DTYPES and logits.stride(1) == 1 and logits.shape[1] > 0


def softmax_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor,
                           row_scale: Optional[torch.Tensor] = None, *, block_v: Optional[int] = None) -> torch.Tensor:
    """Per-row cross-entropy of `logits` [rows, vocab] against `targets` [rows], in fp32 [rows]; a
    target outside [0, vocab) gives its row a NaN loss (checking on the host would wait for the GPU). With
    `row_scale` (fp32 [rows]) the logits are overwritten with the loss's gradient, (softmax - onehot)
    * row_scale, in their own dtype; without it they are left as they are. `block_v`: the tile width
    over the vocabulary (a power of two; default the vocabulary's next power of two, at most 4096)."""
    if not supports(logits):
        raise NatslError(f"the fused cross-entropy wants [rows, vocab] logits of {DTYPES} with unit column "
                         f"stride, got {tuple(logits.shape)} {logits.dtype} strides {logits.stride()}; "
                         f"use the eager loss (NATSL_FUSED_LOSS=0)")
    rows, vocab = logits.shape
    if targets.shape != (rows,):
        raise NatslError(f"targets {tuple(targets.shape)} do not match logits {tuple(logits.shape)}")
    if row_scale is not None and (row_scale.shape != (rows,) or row_scale.dtype != torch.float32):
        raise NatslError(f"row_scale must be fp32 [{rows}], got {row_scale.dtype} {tuple(row_scale.shape)}")
    block = block_v or min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    if block & (block - 1):
        raise NatslError(f"block_v must be a power of two, got {block}")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        write = row_scale is not None
        # targets and row_scale contiguous: the kernel reads them at `row`, so a strided view (a slice) would be
        # read at the wrong rows; the logits go by their row stride
        scale = row_scale.contiguous() if write else loss
        _softmax_xent_kernel[(rows,)](logits, targets.contiguous(), scale, loss, vocab,
                                      logits.stride(0), WRITE_GRAD=write, BLOCK_V=block, num_warps=NUM_WARPS)
    return loss
