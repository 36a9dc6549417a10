"""The op's custom-op pair with its autograd formula, and the public entry point with the reference's exact signature.

Forward: prepare (gc, T, W, U per chunk) -> state recurrence (h, R, final state) -> output.
Backward: local dR -> reverse state pass (dh, dR, d initial state) -> grad_qk -> grad_wy; the route
gradient dL/dwrite_b = <dL/dS_start(b+1), S_end(b) - c S_start(b)> is p1 + (Gamma_b - c) p2.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from natsl.block_size import DEFAULT_BLOCK_SIZE, FAST_BLOCK_SIZES, gpu_problem
from natsl.errors import NatslError
from natsl.fast import eager
from natsl.fast.gated_delta import config
from natsl.fast.gated_delta.common import EMPTY, MAX_K, chunk_gamma, fp32_precision
from natsl.fast.gated_delta.grad_qk import grad_qk
from natsl.fast.gated_delta.grad_wy import grad_wy
from natsl.fast.gated_delta.output import chunk_output, local_dr
from natsl.fast.gated_delta.prepare import _prepare_kernel, prepare_chunks
from natsl.fast.gated_delta.spans import chunk_log_decay, chunking, span_grads, span_routes
from natsl.fast.gated_delta.state import state_backward, state_forward
from natsl.reference.gated_delta import validate_layouts
from natsl.reference.route_grad import chosen, check_route_grad

# Routing blocks up to LARGEST_CHUNK tokens are the kernels' chunk (C is a tl.constexpr of every kernel,
# so each size compiles its own kernels and the 64-token chunk's stay as they were; prepare.py pads
# 16- and 32-token chunks to its 16-row sub-blocks); larger ones span whole 64-token chunks that share
# the route (spans.py: the [C, C] tiles of the backward at C = 128 need more shared memory than Hopper
# has, and only the two sequential kernels need to know the block).
BLOCK_SIZES = FAST_BLOCK_SIZES
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The op is a pair of torch.library custom ops (forward, backward) joined by register_autograd, not a
# bare autograd.Function: torch.compile then sees each as one opaque node (with shapes from the fake
# implementations) instead of tracing into Triton's launcher, so a whole model compiles around it.
# A custom op cannot return None, so an absent output is an empty tensor (common.EMPTY).


def _forward_impl(q, k, v, g, beta, write, initial_state, scale: float, output_final_state: bool, block_size: int,
                  decay_skipped_blocks: bool, route_grad: str, fp32_intermediates: bool):
    """(o, final state or empty, and what the backward reads: write as fp32, gc, T rows, W, h, R)."""
    B, T, H, _ = q.shape
    NB = triton.cdiv(T, block_size)
    C, M = chunking(block_size)
    prec = fp32_precision(q.dtype)
    wdt = torch.float32 if fp32_intermediates else q.dtype  # see config.INTERMEDIATE
    # a copy even when write is fp32 already (a custom op may not return an alias of its input), and
    # contiguous: the kernels index it as [B, NB, H], and .to() would keep a transposed view's strides
    w32 = (q.new_ones(B, NB, H, dtype=torch.float32) if write is None
           else write.to(torch.float32, memory_format=torch.contiguous_format, copy=True))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    gc, ai, w, u = prepare_chunks(k, v, g, beta, C, config.PREPARE, wdt)
    write_c, span = w32, None
    if M > 1:  # a block of M chunks (spans.py): the kernels read each chunk's write and end-of-block term
        write_c, e, _ = span_routes(w32, gc, C, M, decay_skipped_blocks)
        span = (M, e)
    h, r, final = state_forward(w, u, k, gc, write_c, h0, output_final_state, C, decay_skipped_blocks,
                                prec, config.STATE_FWD, span)
    o = chunk_output(q, k, gc, h, r, scale, C, prec, config.OUTPUT)
    return o, (final if final is not None else q.new_empty(EMPTY, dtype=torch.float32)), w32, gc, ai, w, h, r


@torch.library.custom_op("natsl::gated_delta_forward", mutates_args=())
def gated_delta_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    write: Optional[torch.Tensor], initial_state: Optional[torch.Tensor], scale: float, output_final_state: bool,
    block_size: int, decay_skipped_blocks: bool, route_grad: str, fp32_intermediates: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    return _forward_impl(q, k, v, g, beta, write, initial_state, scale, output_final_state, block_size,
                         decay_skipped_blocks, route_grad, fp32_intermediates)


@gated_delta_forward.register_fake
def _(q, k, v, g, beta, write, initial_state, scale, output_final_state, block_size, decay_skipped_blocks,
      route_grad, fp32_intermediates):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NB = triton.cdiv(T, block_size)
    C = chunking(block_size)[0]
    wdt = torch.float32 if fp32_intermediates else q.dtype
    f32 = dict(dtype=torch.float32)
    return (q.new_empty(B, T, H, V), q.new_empty((B, H, K, V) if output_final_state else EMPTY, **f32),
            q.new_empty(B, NB, H, **f32), q.new_empty(B, T, H, **f32), q.new_empty(B, T, H, C, **f32),
            q.new_empty(B, T, H, K, dtype=wdt), q.new_empty(B, triton.cdiv(T, C), H, K, V, dtype=k.dtype),
            q.new_empty(B, T, H, V, dtype=wdt))


def _backward_impl(q, k, v, beta, w32, gc, ai, w, h, r, do, d_final, scale: float, block_size: int,
                   decay_skipped_blocks: bool, route_grad: str, want_dh0: bool, want_dwrite: bool):
    """(dq, dk, dv, dg fp32, dbeta fp32, dwrite fp32 or empty, d initial state fp32 or empty)."""
    C, M = chunking(block_size)
    prec = fp32_precision(q.dtype)
    do = do.to(q.dtype).contiguous()
    d_final = None if d_final is None else d_final.float().contiguous()
    write_c, span = w32, None
    if M > 1:
        write_c, e, c_b = span_routes(w32, gc, C, M, decay_skipped_blocks)
        span = (M, e)
    drl = local_dr(q, k, gc, do, scale, C, prec, config.LOCAL_DR, w.dtype)
    dh, dr, dh0 = state_backward(q, k, w, gc, write_c, do, drl, d_final, want_dh0, scale, C, decay_skipped_blocks,
                                 prec, config.STATE_BWD, span)
    dq, dkp, dw, dgp, p1, p2 = grad_qk(q, k, gc, write_c, h, dh, r, dr, do, scale, C, prec, config.GRAD_QK)
    p1, p2 = p1.sum(0), p2.sum(0)
    if M > 1:
        d_write, dg_last = span_grads(w32, c_b, chunk_log_decay(gc, C), h, dh, p1, p2, M, decay_skipped_blocks)
    else:
        gamma = chunk_gamma(gc, C)
        # G_last enters through the commit's a = Gamma (or 1 - write + write Gamma): da/dG_last.
        dg_last = gamma * p2 if decay_skipped_blocks else gamma * p2 * w32
    dk, dv, dbeta, dg = grad_wy(k, v, beta, gc, ai, dr, dw, dkp, dgp, dg_last.contiguous(), C, prec, config.GRAD_WY)
    dwrite = q.new_empty(EMPTY, dtype=torch.float32)  # (returns may not alias one another)
    if want_dwrite:
        if M > 1:
            dwrite = d_write
        else:
            dwrite = p1 if decay_skipped_blocks else p1 + (gamma - 1.0) * p2
        if route_grad == "active":
            dwrite = dwrite * chosen(w32).to(dwrite.dtype)
    return dq, dk, dv, dg, dbeta, dwrite, (dh0 if dh0 is not None else q.new_empty(EMPTY, dtype=torch.float32))


@torch.library.custom_op("natsl::gated_delta_backward", mutates_args=())
def gated_delta_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, w32: torch.Tensor, gc: torch.Tensor,
    ai: torch.Tensor, w: torch.Tensor, h: torch.Tensor, r: torch.Tensor, do: torch.Tensor,
    d_final: Optional[torch.Tensor], scale: float, block_size: int, decay_skipped_blocks: bool, route_grad: str,
    want_dh0: bool, want_dwrite: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(q, k, v, beta, w32, gc, ai, w, h, r, do, d_final, scale, block_size, decay_skipped_blocks,
                          route_grad, want_dh0, want_dwrite)


@gated_delta_backward.register_fake
def _(q, k, v, beta, w32, gc, ai, w, h, r, do, d_final, scale, block_size, decay_skipped_blocks, route_grad,
      want_dh0, want_dwrite):
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = dict(dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(B, T, H, **f32),
            q.new_empty(B, T, H, **f32), q.new_empty(w32.shape if want_dwrite else EMPTY, **f32),
            q.new_empty((B, H, K, V) if want_dh0 else EMPTY, **f32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, write, initial_state, scale, _, block_size, decay_skipped_blocks, route_grad, _ = inputs
    _, _, w32, gc, ai, w, h, r = output
    ctx.save_for_backward(q, k, v, beta, w32, gc, ai, w, h, r)
    ctx.mark_non_differentiable(w32, gc, ai, w, h, r)
    ctx.set_materialize_grads(False)  # no zero gradient for an unused final state
    ctx.meta = (scale, block_size, decay_skipped_blocks, route_grad, g.dtype, beta.dtype,
                None if write is None else write.dtype, None if initial_state is None else initial_state.dtype)


def _backward(ctx, do, d_final, *_, backward_op=gated_delta_backward):
    q, k, v, beta, w32, gc, ai, w, h, r = ctx.saved_tensors
    scale, C, decay_skipped_blocks, route_grad, g_dtype, beta_dtype, write_dtype, h0_dtype = ctx.meta
    want_dwrite = write_dtype is not None and ctx.needs_input_grad[5]
    want_dh0 = h0_dtype is not None and ctx.needs_input_grad[6]
    if do is None:
        do = torch.zeros_like(v)
    if d_final is not None and d_final.numel() == 0:
        d_final = None
    dq, dk, dv, dg, dbeta, dwrite, dh0 = backward_op(
        q, k, v, beta, w32, gc, ai, w, h, r, do, d_final, scale, C, decay_skipped_blocks, route_grad, want_dh0,
        want_dwrite)
    return (dq, dk, dv, dg.to(g_dtype), dbeta.to(beta_dtype), dwrite.to(write_dtype) if want_dwrite else None,
            dh0.to(h0_dtype) if want_dh0 else None, None, None, None, None, None, None)


gated_delta_forward.register_autograd(_backward, setup_context=_setup_context)


# Eager calls skip the dispatcher (natsl/fast/eager.py).
_EagerGatedDelta = eager.twin(_forward_impl, _setup_context, _backward, _backward_impl)


def _run_forward(*inputs):
    return eager.run(gated_delta_forward, _EagerGatedDelta, _forward_impl, *inputs)


def block_size_problem(op: str, block_size: int, fallback: str, on_gpu: bool = False) -> str | None:
    """Why the fast state rule `op` refuses `block_size`, or None where it takes it (BLOCK_SIZES, forward
    and backward, in the interpreter; on a GPU the sizes natsl.block_size.gpu_problem allows). Shared by
    gated_delta_rule and gated_linear_rule, and read by natsl.inference.kernel_table.

    Args:
        op: the op's name, for the message.
        block_size: the routing block size.
        fallback: the backend the message suggests.
        on_gpu: whether the call runs on a GPU.

    Returns:
        The one-line error, or None.
    """
    if block_size not in BLOCK_SIZES:
        allowed = ", ".join(map(str, BLOCK_SIZES))
        return f"the fast {op} supports block_size {allowed}, got {block_size}; use backend='{fallback}'"
    return gpu_problem(op, block_size) if on_gpu else None


def _validate(q, k, v, g, beta, write, initial_state, block_size: int) -> None:
    """The reference's layout checks (docs/spec.md section 5), plus the fast path's own limits."""
    _, _, _, K, _ = validate_layouts(q, k, v, g, beta, write, initial_state, block_size)
    problem = block_size_problem("gated_delta_rule", block_size, "chunked", on_gpu=q.device.type == "cuda")
    if problem:
        raise NatslError(problem)
    if K > MAX_K:
        raise NatslError(f"the fast gated_delta_rule supports K <= {MAX_K}, got {K}; use backend='reference'")
    if q.dtype not in DTYPES:
        raise NatslError(f"the fast gated_delta_rule supports fp32, bf16 and fp16 inputs, got {q.dtype}; "
                         "use backend='reference'")
    if q.device.type != "cuda" and type(_prepare_kernel).__name__ != "InterpretedFunction":
        raise NatslError("the fast gated_delta_rule on a CPU tensor needs TRITON_INTERPRET=1 set before "
                         "natsl.fast is imported")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    write: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    decay_skipped_blocks: bool = True,
    route_grad: str = "active",
    intra_block: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet whose block content writes are committed only where `write` is 1 (Triton).

    q, k [B,T,H,K] (already normalised); v [B,T,H,V]; g (log decay), beta [B,T,H] (any float
    dtype); write [B,NB,H] (None = all ones), any float values; initial_state [B,H,K,V].
    Returns o [B,T,H,V] in q's dtype (k, v compute in q's dtype) and, if `output_final_state`,
    S_start(NB) [B,H,K,V] in fp32. Chunk size = block_size (BLOCK_SIZES). `intra_block=False` (the
    Table 4 ablation, a research switch with no kernel of its own) runs the reference, so that both
    twins take the same arguments.
    """
    if not intra_block:
        from natsl.reference.gated_delta import gated_delta_rule as reference

        return reference(q, k, v, g, beta, write, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, block_size=block_size,
                         decay_skipped_blocks=decay_skipped_blocks, route_grad=route_grad, intra_block=False)
    check_route_grad(route_grad)
    _validate(q, k, v, g, beta, write, initial_state, block_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    if T == 0:  # nothing to read; the state passes through untouched
        final = None
        if output_final_state:
            final = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
        return q.new_zeros(B, 0, H, V), final
    k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o, final, *_ = _run_forward(q, k, v, g, beta, write, initial_state, scale, output_final_state, block_size,
                                decay_skipped_blocks, route_grad, config.INTERMEDIATE == "fp32")
    return o, (final if output_final_state else None)
