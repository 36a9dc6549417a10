"""The elementwise pieces of the layers, as pure functions that torch.compile fuses on the GPU.

Eager PyTorch runs an fp32 RMSNorm as about nine kernels, a short conv + SiLU as a copy, two
transposes, a depthwise convolution and an activation, and their backward passes as many again;
at the 800M shapes these memory passes cost more than the GDN op of the layer they sit in. Each
function here is written so that Inductor turns it into one or two kernels forward and backward.

`pointwise(fn)` (natsl.ops.compiled) keeps fn's eager behaviour on the CPU (tests, the quick start:
compiling needs a C++ toolchain there and buys little) and calls `torch.compile(fn)` on CUDA tensors. The compiled
and eager forms compute the same formula (fp32 inside, one rounding to the activation dtype at the
end); tests/test_pointwise.py holds the formulas against plain PyTorch on the CPU and the compiled
forms against the eager ones (on the GPU, and on the CPU with NATSL_COMPILE_POINTWISE=all).
`NATSL_COMPILE_POINTWISE=0` turns compilation off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.ops.compiled import compile_dynamic, compile_for, pointwise, RECOMPILE_LIMIT  # noqa: F401
from natsl.ops.mix import compiled_reference as mix_read  # noqa: F401
from natsl.ops.short_conv import compiled_reference as conv_silu  # noqa: F401
from natsl.reference import norms


@pointwise
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None):
    """RMSNorm over the last dim in fp32, times `weight` when given, in `out_dtype` (default x's dtype)."""
    return norms.normed(x, weight, eps).to(out_dtype or x.dtype)


@pointwise
def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate), all in fp32, one rounding to x's dtype (gate broadcasts as x)."""
    return norms.rms_norm(x, weight, eps, gate)


l2_normalize = pointwise(norms.l2_normalize)
# conv_silu, SiLU(causal depthwise conv): (x [B, T, C], weight [C, 1, W], tail [B, W-1, C] or None) ->
# [B, T, C], and mix_read, the NAtS-L read of its two memories (every variant of the layer), are the
# compiled reference twins of natsl.ops.short_conv and natsl.ops.mix (the same objects), named here too.


def conv_tail(x: torch.Tensor, tail: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The last W-1 inputs after x: the tail [B, W-1, C] that the conv of the next tokens needs.
    Eager and small: only the last W-1 rows of x are read. `valid` ([1] int64 on the device, a
    padded prefill call's prompt length): the W-1 inputs before token `valid` instead, gathered
    on the device (no host read, so a CUDA graph serves every valid)."""
    width = tail.shape[1] + 1
    if valid is not None:
        recent = torch.cat([tail.to(x.dtype), x], dim=1)  # token t of x is row t + W-1
        return recent.index_select(1, valid + torch.arange(width - 1, device=x.device))
    recent = torch.cat([tail.to(x.dtype), x[:, max(x.shape[1] - (width - 1), 0):]], dim=1)
    return recent[:, recent.shape[1] - (width - 1):]


def _decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(log decay g = -exp(A_log) dt, step dt = softplus(a + dt_bias)), both fp32 [B, T, H]."""
    dt = F.softplus(norms.up(a) + norms.up(dt_bias))
    return -norms.up(A_log).exp() * dt, dt


@pointwise
def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Gated DeltaNet's gates from the a and b projections [B, T, H]: log decay
    g = -exp(A_log) softplus(a + dt_bias) in fp32, and write strength beta = sigmoid(b) in b's dtype."""
    return _decay(a, A_log, dt_bias)[0], torch.sigmoid(norms.up(b)).to(b.dtype)


@pointwise
def mamba2_gates(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Mamba2's discretisation from the dt projection a [B, T, H]: g = A dt with A = -exp(A_log) and
    dt = softplus(a + dt_bias), both fp32 (the decay is the GDN's; dt also scales the write)."""
    return _decay(a, A_log, dt_bias)


@pointwise
def gated_input_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x * silu(gate)) * weight over the last dim, fp32 inside, in x's dtype: Mamba2's gated
    norm (norm_before_gate=False), where gated_rms_norm gates after the norm."""
    y = norms.normalize(norms.up(x) * F.silu(norms.up(gate)), eps, mean=True) * norms.up(weight)
    return y.to(x.dtype)


@pointwise
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up

