"""The NAtS-L read of its two memories as one Triton kernel each way (the fast twin of
natsl.reference.mix.mix_branches: separate branch norms and softmax mixing weights):

    out = (w_la RMSNorm_1(o_la) + w_nla RMSNorm_2(o_nla)) * silu(gate),   (w_nla, w_la) = softmax(logits)

Rows are (token, softmax head) pairs of D = Dv channels. Compiled, Inductor cut this read into
several kernels around the routed-attention backward and kept fp32 intermediates of [rows, D] in
memory between them; here the forward reads o_la, o_nla, gate and writes out once, and the backward
reads those and dout and writes their gradients once. The norm weights' gradients are summed per
program into an fp32 [programs, 2, D] buffer that torch reduces (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.devices import sm_count
from natsl.errors import NatslError
from natsl.fast import eager
# x.to(dtype) rounding to nearest even also in Triton's interpreter (whose fp32 -> bf16 cast truncates)
from natsl.fast.block_sparse.forward import cast_to

BLOCK_ROWS = 32
NUM_WARPS = 4
# The backward's launch: rows per tile, warps, software-pipelining stages (None: Triton's default) and
# programs per SM (a grid-stride loop over row tiles keeps the weight-gradient buffer small).
# `python -m benchmarks.ops --op mix --sweep` times other settings in place. Small programs won at the 800M
# training shape (8 x 4096 x 18 heads x 128): one warp on 8 rows beat 4 warps on 32 and every 64-row
# setting, since many small programs hide the rows' load latency (per-row gradients bitwise equal
# across settings).
BACKWARD = {"BLOCK_ROWS": 8, "num_warps": 1, "num_stages": None, "PROGRAMS_PER_SM": 8}


@triton.jit
def _load_row_tile(la_ptr, nla_ptr, logit_ptr, gate_ptr, rows, cols, mask, D: tl.constexpr, eps):
    """The fp32 pieces of a tile of rows: normalised branches, their reciprocal RMS, weights, gate."""
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    la = tl.load(la_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
    nla = tl.load(nla_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
    r_la = tl.rsqrt(tl.sum(la * la, axis=1) / D + eps)
    r_nla = tl.rsqrt(tl.sum(nla * nla, axis=1) / D + eps)
    l_nla = tl.load(logit_ptr + rows.to(tl.int64) * 2, mask=mask, other=0.0).to(tl.float32)
    l_la = tl.load(logit_ptr + rows.to(tl.int64) * 2 + 1, mask=mask, other=0.0).to(tl.float32)
    top = tl.maximum(l_nla, l_la)
    e_nla = tl.exp(l_nla - top)
    e_la = tl.exp(l_la - top)
    w_nla = e_nla / (e_nla + e_la)
    w_la = e_la / (e_nla + e_la)
    return la * r_la[:, None], nla * r_nla[:, None], r_la, r_nla, w_la, w_nla, gate, offs


@triton.jit
def rms_norm_backward(dy, y, r, D: tl.constexpr):
    """dx of y = x * r (r = 1 / RMS(x), per row) for dy: r (dy - y mean(dy y)); padded columns,
    where y = 0, add nothing to the mean."""
    return r[:, None] * (dy - y * (tl.sum(dy * y, axis=1) / D)[:, None])


@triton.jit
def _mix_fwd_kernel(la_ptr, nla_ptr, logit_ptr, gate_ptr, w1_ptr, w2_ptr, out_ptr, n_rows, eps,
                    D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    mask = rows < n_rows
    y_la, y_nla, r_la, r_nla, w_la, w_nla, gate, offs = _load_row_tile(
        la_ptr, nla_ptr, logit_ptr, gate_ptr, rows, cols, mask, D, eps)
    w1 = tl.load(w1_ptr + cols).to(tl.float32)
    w2 = tl.load(w2_ptr + cols).to(tl.float32)
    mixed = w_la[:, None] * y_la * w1[None, :] + w_nla[:, None] * y_nla * w2[None, :]
    out = mixed * (gate * tl.sigmoid(gate))
    tl.store(out_ptr + offs, cast_to(out, out_ptr.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _mix_bwd_kernel(la_ptr, nla_ptr, logit_ptr, gate_ptr, w1_ptr, w2_ptr, dout_ptr,
                    dla_ptr, dnla_ptr, dlogit_ptr, dgate_ptr, dw_part_ptr, n_rows, n_tiles, eps,
                    D: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, D)
    w1 = tl.load(w1_ptr + cols).to(tl.float32)
    w2 = tl.load(w2_ptr + cols).to(tl.float32)
    dw1 = tl.zeros([D], dtype=tl.float32)
    dw2 = tl.zeros([D], dtype=tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = rows < n_rows
        y_la, y_nla, r_la, r_nla, w_la, w_nla, gate, offs = _load_row_tile(
            la_ptr, nla_ptr, logit_ptr, gate_ptr, rows, cols, mask, D, eps)
        dout = tl.load(dout_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        dm = dout * gate * sig  # d(mixed)
        n_la = y_la * w1[None, :]  # the weighted normalised branches
        n_nla = y_nla * w2[None, :]
        mixed = w_la[:, None] * n_la + w_nla[:, None] * n_nla
        dgate = dout * mixed * sig * (1.0 + gate * (1.0 - sig))
        dw1 += tl.sum(dm * w_la[:, None] * y_la, axis=0)
        dw2 += tl.sum(dm * w_nla[:, None] * y_nla, axis=0)
        # mixing weights, then the softmax over the two logits
        dw_la = tl.sum(dm * n_la, axis=1)
        dw_nla = tl.sum(dm * n_nla, axis=1)
        inner = w_la * dw_la + w_nla * dw_nla
        dl_la = w_la * (dw_la - inner)
        dl_nla = w_nla * (dw_nla - inner)
        dla = rms_norm_backward(dm * w_la[:, None] * w1[None, :], y_la, r_la, D)
        dnla = rms_norm_backward(dm * w_nla[:, None] * w2[None, :], y_nla, r_nla, D)
        tl.store(dla_ptr + offs, cast_to(dla, dla_ptr.dtype.element_ty), mask=mask[:, None])
        tl.store(dnla_ptr + offs, cast_to(dnla, dnla_ptr.dtype.element_ty), mask=mask[:, None])
        tl.store(dgate_ptr + offs, cast_to(dgate, dgate_ptr.dtype.element_ty), mask=mask[:, None])
        lrows = rows.to(tl.int64) * 2
        tl.store(dlogit_ptr + lrows, cast_to(dl_nla, dlogit_ptr.dtype.element_ty), mask=mask)
        tl.store(dlogit_ptr + lrows + 1, cast_to(dl_la, dlogit_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + pid * 2 * D + cols, dw1)
    tl.store(dw_part_ptr + pid * 2 * D + D + cols, dw2)


def forward(o_la, o_nla, logits, gate, la_weight, nla_weight, eps: float) -> torch.Tensor:
    """out [B, T, heads * D] in o_nla's dtype (inputs as mix_branches takes them, all contiguous)."""
    d = o_nla.shape[-1]
    n = o_nla.numel() // d
    out = torch.empty(gate.shape, dtype=o_nla.dtype, device=o_nla.device)
    if n:
        _mix_fwd_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
            o_la, o_nla, logits, gate, la_weight, nla_weight, out, n, eps, D=d, BLOCK_R=BLOCK_ROWS,
            num_warps=NUM_WARPS)
    return out


def backward(o_la, o_nla, logits, gate, la_weight, nla_weight, eps: float, dout):
    """(d o_la, d o_nla, d logits, d gate, d la_weight, d nla_weight), each in its input's dtype."""
    d = o_nla.shape[-1]
    n = o_nla.numel() // d
    block_rows = BACKWARD["BLOCK_ROWS"]
    n_tiles = triton.cdiv(n, block_rows)
    programs = max(1, min(n_tiles, BACKWARD["PROGRAMS_PER_SM"] * sm_count(o_nla.device)))
    launch = {"num_warps": BACKWARD["num_warps"]}
    if BACKWARD["num_stages"] is not None:
        launch["num_stages"] = BACKWARD["num_stages"]
    dla, dnla, dlogits, dgate = (torch.empty_like(t) for t in (o_la, o_nla, logits, gate))
    parts = torch.empty(programs, 2, d, dtype=torch.float32, device=o_nla.device)
    if n:
        _mix_bwd_kernel[(programs,)](
            o_la, o_nla, logits, gate, la_weight, nla_weight, dout, dla, dnla, dlogits, dgate, parts,
            n, n_tiles, eps, D=d, BLOCK_R=block_rows, **launch)
    else:
        parts.zero_()
    # two separate sums: the custom op's outputs may not be views of one tensor
    return (dla, dnla, dlogits, dgate, parts[:, 0].sum(0).to(la_weight.dtype),
            parts[:, 1].sum(0).to(nla_weight.dtype))


# The custom-op pair (opaque to torch.compile) and its eager twin, as the other fast ops (eager.py).
@torch.library.custom_op("natsl::mix_forward", mutates_args=())
def mix_forward(o_la: torch.Tensor, o_nla: torch.Tensor, logits: torch.Tensor, gate: torch.Tensor,
                la_weight: torch.Tensor, nla_weight: torch.Tensor, eps: float) -> torch.Tensor:
    return forward(o_la, o_nla, logits, gate, la_weight, nla_weight, eps)


@mix_forward.register_fake
def _(o_la, o_nla, logits, gate, la_weight, nla_weight, eps):
    return gate.new_empty(gate.shape, dtype=o_nla.dtype)


@torch.library.custom_op("natsl::mix_backward", mutates_args=())
def mix_backward(o_la: torch.Tensor, o_nla: torch.Tensor, logits: torch.Tensor, gate: torch.Tensor,
                 la_weight: torch.Tensor, nla_weight: torch.Tensor, eps: float, dout: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(o_la, o_nla, logits, gate, la_weight, nla_weight, eps, dout)


@mix_backward.register_fake
def _(o_la, o_nla, logits, gate, la_weight, nla_weight, eps, dout):
    return tuple(torch.empty_like(t) for t in (o_la, o_nla, logits, gate, la_weight, nla_weight))


def _setup_context(ctx, inputs, output):
    o_la, o_nla, logits, gate, la_weight, nla_weight, eps = inputs
    ctx.save_for_backward(o_la, o_nla, logits, gate, la_weight, nla_weight)
    ctx.eps = eps


def _backward(ctx, dout, backward_op=mix_backward):
    grads = backward_op(*ctx.saved_tensors, ctx.eps, dout.contiguous())
    return (*grads, None)


mix_forward.register_autograd(_backward, setup_context=_setup_context)
_EagerMix = eager.twin(forward, _setup_context, _backward, backward)


def supports(o_nla: torch.Tensor) -> bool:
    """Whether the kernels take these rows: D a power of two in [16, 256]."""
    d = o_nla.shape[-1]
    return 16 <= d <= 256 and d & (d - 1) == 0


def mix_branches(o_la: torch.Tensor, o_nla: torch.Tensor, logits: torch.Tensor, gate: torch.Tensor,
                 la_weight: torch.Tensor, nla_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """natsl.reference.mix.mix_branches (softmax weights, separate norms) on the kernels: o_la, o_nla
    [B, T, heads, D], logits [B, T, heads, 2] (index 0 the softmax memory, 1 the GDN state), gate
    [B, T, heads * D] -> [B, T, heads * D] in o_nla's dtype.
    Differentiable in every tensor argument."""
    if not supports(o_nla):
        raise NatslError(f"the fused mix wants a head dim that is a power of two in [16, 256], got "
                         f"{o_nla.shape[-1]}; use natsl.reference.mix.mix_branches")
    heads_d = o_nla.shape[-2] * o_nla.shape[-1]
    if o_la.shape != o_nla.shape or logits.shape != (*o_nla.shape[:-1], 2) or gate.shape != (*o_nla.shape[:-2], heads_d):
        raise NatslError(f"mix_branches: o_la {tuple(o_la.shape)}, o_nla {tuple(o_nla.shape)}, logits "
                         f"{tuple(logits.shape)}, gate {tuple(gate.shape)} do not fit [B, T, heads, D] / "
                         f"[B, T, heads, 2] / [B, T, heads * D]")
    inputs = [t.contiguous() for t in (o_la, o_nla, logits, gate, la_weight, nla_weight)]
    return eager.run(mix_forward, _EagerMix, forward, *inputs, float(eps))
