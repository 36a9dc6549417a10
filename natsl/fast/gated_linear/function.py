"""The op's custom-op pair with its autograd formula, and the public entry point with the reference's exact signature.

Forward: gc (in-chunk cumulative log decay) and write as fp32 (one kernel) -> state recurrence (h, final
state) -> output.
Backward: intra-chunk dV -> reverse state pass (dh, dV, d initial state) -> grad_qk (dq, dk, dg terms,
route products). The gated-delta kernels do the chunk-parallel work with the pseudo values R = V
(natsl/fast/gated_delta: output.chunk_output, output.local_dr, grad_qk.grad_qk); the route gradient is
p1 + (Gamma_b - c) p2 as there.

Grouped q, k (Mamba2's B and C: [B,T,Hk,K] with H % Hk == 0) enter the ops and are saved for the
backward as they are; the kernels read them in place on their Hk heads (head h reads group
h // (H // Hk)), each op making them contiguous first (a copy only of a strided view, Hk heads wide), and
the backward sums the per-head dq, dk over each group's heads (in fp32) to Hk heads.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from natsl.block_size import DEFAULT_BLOCK_SIZE
from natsl.errors import NatslError
from natsl.fast import eager
from natsl.fast.gated_delta.common import EMPTY, MAX_K, chunk_gamma, fp32_precision
from natsl.fast.gated_delta.function import DTYPES, block_size_problem
from natsl.fast.gated_delta.grad_qk import grad_qk
from natsl.fast.gated_delta.output import chunk_output, local_dr
from natsl.fast.gated_linear import config
from natsl.fast.gated_delta.spans import chunk_log_decay, chunking, span_grads, span_routes
from natsl.fast.gated_linear.cumsum import chunk_cumsum, chunk_cumsum_and_write
from natsl.fast.gated_linear.state import _state_fwd_kernel, state_backward, state_forward
from natsl.reference.gated_delta import validate_layouts
from natsl.reference.route_grad import check_route_grad, chosen


def _group_sum(d: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-head gradient [B,T,H,K] of a grouped q or k -> [B,T,groups,K] in `dtype`: each group's heads
    summed in fp32 (head h belongs to group h // (H // groups))."""
    B, T, H, K = d.shape
    return d.view(B, T, groups, H // groups, K).sum(3, dtype=torch.float32).to(dtype)


def _forward_impl(q, k, v, g, write, initial_state, scale: float, output_final_state: bool, block_size: int,
                  decay_skipped_blocks: bool, route_grad: str):
    """(o, final state or empty, and what the backward reads: write as fp32, gc, h). q, k may hold
    Hk heads of v's H (the kernels read each group's in place)."""
    q, k = q.contiguous(), k.contiguous()
    prec = fp32_precision(q.dtype)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    C, M = chunking(block_size)
    write_c, span = None, None
    if M > 1:  # a block of M chunks (gated_delta/spans.py): each chunk's write and end-of-block term
        B, T, H = g.shape
        gc = chunk_cumsum(g, C)
        w32 = (g.new_ones(B, triton.cdiv(T, block_size), H, dtype=torch.float32) if write is None
               else write.to(torch.float32, memory_format=torch.contiguous_format, copy=True))
        write_c, e, _ = span_routes(w32, gc, C, M, decay_skipped_blocks)
        span = (M, e)
    else:
        # w32 is a new tensor even for an fp32 write: a custom op may not return (an alias of) its input
        gc, w32 = chunk_cumsum_and_write(g, write, block_size, config.CUMSUM)
    h, final = state_forward(k, v, gc, w32 if write_c is None else write_c, h0, output_final_state, C,
                             decay_skipped_blocks, prec, config.STATE_FWD, span)
    o = chunk_output(q, k, gc, h, v, scale, C, prec, config.OUTPUT)
    return o, (final if final is not None else q.new_empty(EMPTY, dtype=torch.float32)), w32, gc, h


@torch.library.custom_op("natsl::gated_linear_forward", mutates_args=())
def gated_linear_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, write: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor], scale: float, output_final_state: bool, block_size: int,
    decay_skipped_blocks: bool, route_grad: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, g, write, initial_state, scale, output_final_state, block_size,
                         decay_skipped_blocks, route_grad)


@gated_linear_forward.register_fake
def _(q, k, v, g, write, initial_state, scale, output_final_state, block_size, decay_skipped_blocks, route_grad):
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    NB = triton.cdiv(T, block_size)
    NC = triton.cdiv(T, chunking(block_size)[0])
    f32 = dict(dtype=torch.float32)
    return (q.new_empty(B, T, H, V), q.new_empty((B, H, K, V) if output_final_state else EMPTY, **f32),
            q.new_empty(B, NB, H, **f32), q.new_empty(B, T, H, **f32), q.new_empty(B, NC, H, K, V, dtype=k.dtype))


def _backward_impl(q, k, v, w32, gc, h, do, d_final, scale: float, block_size: int, decay_skipped_blocks: bool,
                   route_grad: str, want_dh0: bool, want_dwrite: bool):
    """(dq, dk, dv, dg fp32, dwrite fp32 or empty, d initial state fp32 or empty); dq, dk on q's and k's
    heads (Hk of H: each group's heads summed)."""
    C, M = chunking(block_size)
    T, groups = q.shape[1], q.shape[2]
    q_dtype, k_dtype = q.dtype, k.dtype
    q, k = q.contiguous(), k.contiguous()
    prec = fp32_precision(q.dtype)
    do = do.to(q.dtype).contiguous()
    d_final = None if d_final is None else d_final.float().contiguous()
    write_c, span = w32, None
    if M > 1:
        write_c, e, c_b = span_routes(w32, gc, C, M, decay_skipped_blocks)
        span = (M, e)
    dh, dh0 = state_backward(q, gc, write_c, do, d_final, want_dh0, scale, C, decay_skipped_blocks, prec,
                             config.STATE_BWD, span)
    # dV chunk-parallel from dh: the intra-chunk transpose product plus the commit's term, in one kernel
    # (with blocks of M chunks each chunk's write; its decay term `a` is not read there)
    dv = local_dr(q, k, gc, do, scale, C, prec, config.DV, q.dtype, write=write_c, dh=dh,
                  decay_skipped_blocks=decay_skipped_blocks)
    # grad_qk's R is V and its dR is dV; its dW (-dR S^T, a delta-rule term) is skipped. dq, dk per head of H.
    # dk straight in k's dtype unless each group's heads are summed first (in fp32, as dq's are from q's dtype)
    grouped = groups != v.shape[2]
    dq, dk, _, dgp, p1, p2 = grad_qk(q, k, gc, write_c, h, dh, v, dv, do, scale, C, prec, config.GRAD_QK,
                                     store_dw=False, dk_dtype=torch.float32 if grouped else k_dtype)
    p1, p2 = p1.sum(0), p2.sum(0)
    if M > 1:
        d_write, dg_last = span_grads(w32, c_b, chunk_log_decay(gc, C), h, dh, p1, p2, M, decay_skipped_blocks)
    else:
        gamma = chunk_gamma(gc, C)
        # G_last enters through the commit's a = Gamma (or 1 - write + write Gamma): da/dG_last, and
        # G_last is the sum of every g of the chunk.
        dg_last = gamma * p2 if decay_skipped_blocks else gamma * p2 * w32
    dg = dgp.sum(0) + dg_last.repeat_interleave(C, dim=1)[:, :T]
    dwrite = q.new_empty(EMPTY, dtype=torch.float32)  # (returns may not alias one another)
    if want_dwrite:
        if M > 1:
            dwrite = d_write
        else:
            dwrite = p1 if decay_skipped_blocks else p1 + (gamma - 1.0) * p2
        if route_grad == "active":
            dwrite = dwrite * chosen(w32).to(dwrite.dtype)
    if grouped:  # dq in q's dtype, dk fp32, each summed per group in fp32
        dq, dk = _group_sum(dq, groups, q_dtype), _group_sum(dk, groups, k_dtype)
    return (dq, dk, dv, dg, dwrite,
            dh0 if dh0 is not None else q.new_empty(EMPTY, dtype=torch.float32))


@torch.library.custom_op("natsl::gated_linear_backward", mutates_args=())
def gated_linear_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w32: torch.Tensor, gc: torch.Tensor, h: torch.Tensor,
    do: torch.Tensor, d_final: Optional[torch.Tensor], scale: float, block_size: int, decay_skipped_blocks: bool,
    route_grad: str, want_dh0: bool, want_dwrite: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(q, k, v, w32, gc, h, do, d_final, scale, block_size, decay_skipped_blocks, route_grad,
                          want_dh0, want_dwrite)


@gated_linear_backward.register_fake
def _(q, k, v, w32, gc, h, do, d_final, scale, block_size, decay_skipped_blocks, route_grad, want_dh0, want_dwrite):
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    f32 = dict(dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(B, T, H, **f32),
            q.new_empty(w32.shape if want_dwrite else EMPTY, **f32),
            q.new_empty((B, H, K, V) if want_dh0 else EMPTY, **f32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, write, initial_state, scale, _, block_size, decay_skipped_blocks, route_grad = inputs
    _, _, w32, gc, h = output
    ctx.save_for_backward(q, k, v, w32, gc, h)
    ctx.mark_non_differentiable(w32, gc, h)
    ctx.set_materialize_grads(False)  # no zero gradient for an unused final state
    ctx.meta = (scale, block_size, decay_skipped_blocks, route_grad, g.dtype,
                None if write is None else write.dtype, None if initial_state is None else initial_state.dtype)


def _backward(ctx, do, d_final, *_, backward_op=gated_linear_backward):
    q, k, v, w32, gc, h = ctx.saved_tensors
    scale, C, decay_skipped_blocks, route_grad, g_dtype, write_dtype, h0_dtype = ctx.meta
    want_dwrite = write_dtype is not None and ctx.needs_input_grad[4]
    want_dh0 = h0_dtype is not None and ctx.needs_input_grad[5]
    if do is None:
        do = torch.zeros_like(v)
    if d_final is not None and d_final.numel() == 0:
        d_final = None
    dq, dk, dv, dg, dwrite, dh0 = backward_op(q, k, v, w32, gc, h, do, d_final, scale, C, decay_skipped_blocks,
                                              route_grad, want_dh0, want_dwrite)
    return (dq, dk, dv, dg.to(g_dtype), dwrite.to(write_dtype) if want_dwrite else None,
            dh0.to(h0_dtype) if want_dh0 else None, None, None, None, None, None)


gated_linear_forward.register_autograd(_backward, setup_context=_setup_context)


# Eager calls skip the dispatcher (natsl/fast/eager.py).
_EagerGatedLinear = eager.twin(_forward_impl, _setup_context, _backward, _backward_impl)


def _run_forward(*inputs):
    return eager.run(gated_linear_forward, _EagerGatedLinear, _forward_impl, *inputs)


def _validate(q, k, v, g, write, initial_state, block_size: int) -> None:
    """The reference's layout checks (docs/spec.md section 5), plus the fast path's own limits."""
    _, _, _, K, _ = validate_layouts(q, k, v, g, None, write, initial_state, block_size, grouped_qk=True)
    problem = block_size_problem("gated_linear_rule", block_size, "chunked", on_gpu=q.device.type == "cuda")
    if problem:
        raise NatslError(problem)
    if K > MAX_K:
        raise NatslError(f"the fast gated_linear_rule supports K <= {MAX_K}, got {K}; use backend='chunked'")
    if q.dtype not in DTYPES:
        raise NatslError(f"the fast gated_linear_rule supports fp32, bf16 and fp16 inputs, got {q.dtype}; "
                         "use backend='chunked'")
    if q.device.type != "cuda" and type(_state_fwd_kernel).__name__ != "InterpretedFunction":
        raise NatslError("the fast gated_linear_rule on a CPU tensor needs TRITON_INTERPRET=1 set before "
                         "natsl.fast is imported")


def gated_linear_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
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
    """Gated linear attention (Mamba2's SSD) whose block writes are committed only where `write` is 1 (Triton).

    q, k [B,T,Hk,K] with H % Hk == 0 (Hk = H, or Mamba2's groups: head h of v reads q/k head
    h // (H // Hk); grouped q, k are saved for the backward as they are and read in place by the kernels,
    never expanded to H heads, and dq, dk come back [B,T,Hk,K]); v [B,T,H,V]; g (log decay)
    [B,T,H] (any float dtype); write [B,NB,H] (None = all ones), any float values; initial_state
    [B,H,K,V]. Returns o [B,T,H,V] in q's dtype (k, v compute in q's dtype) and, if
    `output_final_state`, S_start(NB) [B,H,K,V] in fp32. Chunk size = block_size (gated_delta's BLOCK_SIZES). `intra_block=False` (the Table 4 ablation, with no kernel of its own) runs the
    chunked reference, so that both twins take the same arguments.
    """
    if not intra_block:
        from natsl.reference.gated_linear_chunked import gated_linear_rule as reference

        return reference(q, k, v, g, write, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, block_size=block_size,
                         decay_skipped_blocks=decay_skipped_blocks, route_grad=route_grad, intra_block=False)
    check_route_grad(route_grad)
    _validate(q, k, v, g, write, initial_state, block_size)
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else float(scale)
    if T == 0:  # nothing to read; the state passes through untouched
        final = None
        if output_final_state:
            final = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
        return q.new_zeros(B, 0, H, V), final
    k, v = k.to(q.dtype), v.to(q.dtype)
    v, g = v.contiguous(), g.contiguous()
    if q.shape[2] == H:
        q, k = q.contiguous(), k.contiguous()
    # else grouped: the ops save them as they come (Mamba2's B and C are views of the conv's output, whose
    # storage the layer's backward keeps anyway) and make Hk-head contiguous copies only transiently
    o, final, *_ = _run_forward(q, k, v, g, write, initial_state, scale, output_final_state, block_size,
                                decay_skipped_blocks, route_grad)
    return o, (final if output_final_state else None)
