"""The op's custom-op pair with its autograd formula, and the public entry point with the reference's exact signature."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton

from natsl.block_size import DEFAULT_BLOCK_SIZE
from natsl.errors import NatslError
from natsl.fast import eager
from natsl.fast.block_sparse.backward import attention_backward
from natsl.fast.block_sparse.blocks import BlockLists, build_block_lists
from natsl.fast.block_sparse.forward import _forward_kernel, attention_forward, ceil_div, next_pow2
from natsl.reference.route_grad import check_route_grad
from natsl.reference.routed_attention import validate_layouts

MIN_DIM = 16  # tl.dot needs at least 16 along every dimension


# A pair of torch.library custom ops (forward, backward) joined by register_autograd rather than a
# bare autograd.Function: torch.compile sees each as one opaque node (shapes from the fake
# implementations) and compiles a whole model around it instead of tracing into Triton's launcher.


def _forward_impl(q, k, v, keep, scale: float, block_size: int, route_grad: str):
    """(o, log-sum-exp [B,H,T] fp32, and the kept-block lists flags, before, blocks [B*G, NB] int32)."""
    B, T, H, _ = q.shape
    n_groups = 1 if keep is None else keep.shape[2]
    lists = build_block_lists(keep, B, ceil_div(T, block_size), n_groups, q.device)
    o, lse = attention_forward(q, k, v, lists, scale, block_size, n_groups)
    return (o, lse, *lists)


def _backward_impl(q, k, v, o, lse, flags, before, blocks, do, scale: float, block_size: int, n_groups: int,
                   full: bool):
    """(dq, dk, dv, dkeep per head [B, H, NB] fp32); `full` also visits dropped blocks for dkeep."""
    do = do.to(q.dtype).contiguous()
    return attention_backward(q, k, v, o, lse, do, BlockLists(flags, before, blocks), scale, block_size, n_groups,
                              full)


@torch.library.custom_op("natsl::routed_attention_forward", mutates_args=())
def routed_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Optional[torch.Tensor], scale: float, block_size: int,
    route_grad: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, keep, scale, block_size, route_grad)


@routed_attention_forward.register_fake
def _(q, k, v, keep, scale, block_size, route_grad):
    B, T, H, _ = q.shape
    n_groups = 1 if keep is None else keep.shape[2]
    lists = [q.new_empty(B * n_groups, triton.cdiv(T, block_size), dtype=torch.int32) for _ in range(3)]
    return (q.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, H, T, dtype=torch.float32), *lists)


@torch.library.custom_op("natsl::routed_attention_backward", mutates_args=())
def routed_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, flags: torch.Tensor,
    before: torch.Tensor, blocks: torch.Tensor, do: torch.Tensor, scale: float, block_size: int, n_groups: int,
    full: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(q, k, v, o, lse, flags, before, blocks, do, scale, block_size, n_groups, full)


@routed_attention_backward.register_fake
def _(q, k, v, o, lse, flags, before, blocks, do, scale, block_size, n_groups, full):
    B, T, H, _ = q.shape
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(B, H, triton.cdiv(T, block_size), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, keep, scale, block_size, route_grad = inputs
    o, lse, *lists = output
    ctx.save_for_backward(q, k, v, o, lse, *lists)
    ctx.mark_non_differentiable(lse, *lists)
    n_groups = 1 if keep is None else keep.shape[2]
    ctx.meta = (scale, block_size, n_groups, route_grad, None if keep is None else keep.dtype)


def _backward(ctx, do, *_, backward_op=routed_attention_backward):
    q, k, v, o, lse, *lists = ctx.saved_tensors
    scale, block_size, n_groups, route_grad, keep_dtype = ctx.meta
    want_keep = keep_dtype is not None and ctx.needs_input_grad[3]
    # "full" costs extra visits of dropped blocks: pay them only when dkeep is wanted.
    full = want_keep and route_grad == "full"
    dq, dk, dv, dkeep_heads = backward_op(q, k, v, o, lse, *lists, do, scale, block_size, n_groups, full)
    dkeep = None
    if want_keep:
        B, H, NB = dkeep_heads.shape
        dkeep = dkeep_heads.view(B, n_groups, H // n_groups, NB).sum(2).transpose(1, 2).to(keep_dtype)
    return dq, dk, dv, dkeep, None, None, None


routed_attention_forward.register_autograd(_backward, setup_context=_setup_context)


# Eager calls skip the dispatcher (natsl/fast/eager.py).
_EagerRoutedAttention = eager.twin(_forward_impl, _setup_context, _backward, _backward_impl)


def _run_forward(q, k, v, keep, scale: float, block_size: int, route_grad: str):
    return eager.run(routed_attention_forward, _EagerRoutedAttention, _forward_impl, q, k, v, keep, scale, block_size,
                     route_grad)


def _validate(q, k, v, keep, block_size: int) -> None:
    """The reference's layout checks (docs/spec.md section 5), plus the fast path's own limits."""
    validate_layouts(q, k, v, keep, block_size)
    if block_size < MIN_DIM or block_size & (block_size - 1) or block_size > 256:
        raise NatslError(
            f"the fast routed_attention needs block_size a power of two in [16, 256], got {block_size}; "
            "use backend='reference'"
        )
    if q.device.type != "cuda" and not _interpreting():
        raise NatslError(
            "fast routed_attention on a CPU tensor needs TRITON_INTERPRET=1 set before natsl.fast is imported"
        )


def _interpreting() -> bool:
    return type(_forward_kernel).__name__ == "InterpretedFunction"


def _pad_dim(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad the head dim to a power of two >= 16 (zeros change no dot product)."""
    d = x.shape[-1]
    target = max(MIN_DIM, next_pow2(d))
    x = F.pad(x, (0, target - d)) if target != d else x
    return x if x.stride(-1) == 1 else x.contiguous()


def routed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    *,
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    route_grad: str = "active",
    intra_block: bool = True,
) -> torch.Tensor:
    """Causal softmax attention in which earlier blocks are visible only where `keep` is 1.

    q, k [B,T,Hs,Dk]; v [B,T,Hs,Dv]; keep [B,NB,G] with Hs % G == 0 (None = all kept); softmax
    head j is in routing group j // (Hs // G). Returns o [B,T,Hs,Dv] in q's dtype.
    The fast path reads keep as binary: block c is visible iff keep_c > 0.5 (routes are exactly
    0/1 in the model). dkeep is docs/spec.md section 3's continuous-mask gradient at that binary mask;
    "active" leaves it zero on dropped blocks, "full" also visits them for it. `intra_block=False`
    (the Table 4 ablation, a research switch with no kernel of its own) runs the reference, so that
    both twins take the same arguments.
    """
    if not intra_block:
        from natsl.reference.routed_attention import routed_attention as reference

        return reference(q, k, v, keep, scale=scale, block_size=block_size, route_grad=route_grad, intra_block=False)
    check_route_grad(route_grad)
    _validate(q, k, v, keep, block_size)
    B, T, Hs, Dk = q.shape
    Dv = v.shape[-1]
    scale = Dk**-0.5 if scale is None else float(scale)
    if T == 0:
        return q.new_zeros(B, 0, Hs, Dv)
    k, v = k.to(q.dtype), v.to(q.dtype)
    o = _run_forward(_pad_dim(q), _pad_dim(k), _pad_dim(v), keep, scale, block_size, route_grad)[0]
    return o[..., :Dv] if o.shape[-1] != Dv else o
